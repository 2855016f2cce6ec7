"""A measured CPU profile prices real training steps, and every metrics row puts the prediction
beside the measurement.

How close the two are is a benchmark, not a test (a busy host moves it):
``python scripts/bench_fidelity.py cpu-train``, recorded in docs/benchmarks.md. Here: a 2-rank
``tiny`` run with and without activation checkpointing, priced by a profile that
``hdp-calibrate measure --device cpu --quick`` just measured; each rank gets one thread, as
torchrun gives each of several ranks on a node.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hdp.testing.ranks import patient

ROOT = Path(__file__).resolve().parents[1]
# HDP_FORCE_PROFILE: a profile measured beside other tests may be too noisy to plan with, which
# the planner refuses; here what counts is that its prediction sits beside each step.
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HDP_FORCE_PROFILE="1")


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory) -> Path:
    profile = tmp_path_factory.mktemp("profile") / "cpu.json"
    measure = [
        sys.executable,
        "-m",
        "hdp.launch.calibrate",
        "measure",
        "--device",
        "cpu",
        "--quick",
    ]
    done = subprocess.run(
        [*measure, "--out", str(profile)], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return profile


def train(tmp_path: Path, profile: Path, checkpointing: str) -> list[dict]:
    metrics = tmp_path / f"metrics{checkpointing}.jsonl"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        str(ROOT / "launch" / "pretrain.py"),
        *("--model", "tiny", "--tokens-per-step", "16K", "--max-seq", "4K", "--steps", "4"),
        *("--gpu-profile", str(profile), "--metrics", str(metrics), checkpointing),
    ]
    done = subprocess.run(
        cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=patient(600)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def positive(values) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values)


def test_a_measured_cpu_profile_prices_every_step_beside_its_measurement(tmp_path, cpu_profile):
    runs = {
        flag: train(tmp_path, cpu_profile, flag)
        for flag in ("--no-activation-checkpointing", "--activation-checkpointing")
    }
    for rows in runs.values():
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for r in rows:
            assert positive([r["step_time_s"], r["predicted_step_s"]])
            assert len(r["predicted_rank_s"]) == len(r["busy_s"]) == 2
            assert len(r["predicted_mem_bytes"]) == len(r["peak_mem_bytes"]) == 2
            assert positive(r["predicted_rank_s"]) and positive(r["peak_mem_bytes"])
            assert positive(r["predicted_mem_bytes"])
            # A step takes at least its busiest rank's predicted work.
            assert r["predicted_step_s"] >= max(r["predicted_rank_s"]) * (1 - 1e-9)
    # Same data: with checkpointing each layer's forward runs again in backward, and
    # the model prices that recompute while it counts fewer activations.
    plain, recompute = runs.values()
    for a, b in zip(plain, recompute):
        assert b["predicted_step_s"] > a["predicted_step_s"], (a, b)
        assert max(b["predicted_mem_bytes"]) < max(a["predicted_mem_bytes"]), (a, b)
