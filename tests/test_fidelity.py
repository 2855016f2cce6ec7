"""The cost model predicts real training steps on this machine (issue #15's CPU fidelity test).

A profile measured here by ``hdp-calibrate measure --device cpu --quick`` prices the steps of a
2-rank ``tiny`` run, with activation checkpointing and without; the median of
|measured / predicted - 1| over steps 3-8 must stay within 25%.
Each rank gets one thread, as torchrun gives each of several ranks on a node, and the profile is
measured with one thread for the same reason.
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory) -> Path:
    profile = tmp_path_factory.mktemp("profile") / "cpu.json"
    measure = [sys.executable, "-m", "launch.calibrate", "measure", "--device", "cpu", "--quick"]
    done = subprocess.run(
        [*measure, "--out", str(profile)], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return profile


# With checkpointing the runtime recomputes each layer's forward in backward, and the model must
# price that recompute too: the flag reaches both.
@pytest.mark.parametrize(
    "checkpointing", ["--no-activation-checkpointing", "--activation-checkpointing"]
)
def test_a_measured_cpu_profile_predicts_training_steps(tmp_path, cpu_profile, checkpointing):
    metrics = tmp_path / "metrics.jsonl"
    train = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        str(ROOT / "launch" / "pretrain.py"),
        *("--model", "tiny", "--tokens-per-step", "16K", "--max-seq", "4K", "--steps", "8"),
        *("--gpu-profile", str(cpu_profile), "--metrics", str(metrics), checkpointing),
    ]
    done = subprocess.run(train, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    ratios = [r["step_time_s"] / r["predicted_step_s"] for r in rows[2:]]
    error = statistics.median(abs(x - 1) for x in ratios)
    assert error <= 0.25, f"measured / predicted over steps 3-8: {[round(x, 2) for x in ratios]}"
    # Every rank's predicted busy time and peak memory are reported beside its measured ones.
    assert all(len(r["predicted_rank_s"]) == len(r["busy_s"]) == 2 for r in rows)
    assert all(len(r["predicted_mem_bytes"]) == len(r["peak_mem_bytes"]) == 2 for r in rows)
    assert all(m > 0 for r in rows for m in r["peak_mem_bytes"])
