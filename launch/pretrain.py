#!/usr/bin/env python3
"""Pretrain a Llama-style model with hybrid data parallelism: ``torchrun ... launch/pretrain.py``.

    torchrun --nproc-per-node 4 launch/pretrain.py --model tiny --workload wlb-128k \\
        --tokens-per-step 64K --max-seq 16K --steps 20 --metrics out/metrics.jsonl

The program is :mod:`hdp.launch.cli` (also installed as ``hdp-train``); ``--help`` lists every flag.
It needs hdp installed (``bash scripts/setup_venv.sh``, or ``pip install -e .``).
"""

try:
    from hdp.launch.cli import main
    from hdp.launch.runtime import exit_without_teardown
except ModuleNotFoundError as e:
    if e.name not in ("hdp", "hdp.launch"):  # hdp.launch: another "hdp" package is installed
        raise
    import sys

    print(
        "pretrain.py: error: hdp's training package (hdp.launch) is not importable: install "
        "hdp-llm (pip install -e . in the repository, or bash scripts/setup_venv.sh) and run with "
        "that Python",
        file=sys.stderr,
    )
    sys.exit(2)

if __name__ == "__main__":
    exit_without_teardown(main())
