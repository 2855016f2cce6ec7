#!/usr/bin/env python3
"""Pretrain a Llama-style model with hybrid data parallelism: ``torchrun ... launch/pretrain.py``.

    torchrun --nproc-per-node 4 launch/pretrain.py --model tiny --workload wlb-128k \\
        --tokens-per-step 64K --max-seq 16K --steps 20 --metrics out/metrics.jsonl

The program is :mod:`launch.cli` (also installed as ``hdp-train``); ``--help`` lists every flag.
It needs hdp installed (``bash scripts/setup_venv.sh``, or ``pip install -e .``).
"""

try:
    from launch.cli import main
    from launch.runtime import exit_without_teardown
except ModuleNotFoundError as e:
    if e.name != "launch":
        raise
    import sys

    print(
        "pretrain.py: error: the hdp package is not importable: install it (pip install -e . in "
        "the repository, or bash scripts/setup_venv.sh) and run with that Python",
        file=sys.stderr,
    )
    sys.exit(2)

if __name__ == "__main__":
    exit_without_teardown(main())
