"""Preemption loses nothing: a signal mid-run saves the step in hand and the resumed run trains
exactly the losses of an uninterrupted one; a disk that fills while saving is one line and leaves
no partial checkpoint behind."""

import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hdp.launch import checkpoint
from hdp.testing.ranks import patient

ROOT = Path(__file__).resolve().parents[1]
# torchrun gives its ranks this long to finish a step and save after a signal (30 s by default).
ENV = dict(
    os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="600"
)
STEPS = 10
# The CPU suite stays on CPU where a GPU is present: runs are compared bit for bit.
COMMON = [
    "--device",
    "cpu",
    *("--model", "tiny", "--workload", "wlb-128k", "--tokens-per-step", "3K", "--max-seq", "1K"),
    *("--synthetic-docs", "400", "--lr", "1e-2", "--warmup", "2", "--lr-decay-steps", "10"),
]


def torchrun(ranks: int, *flags: str) -> list[str]:
    """``pretrain.py`` on ``ranks`` torchrun ranks; ``ranks=0``: one process without torchrun."""
    script = [str(ROOT / "launch" / "pretrain.py"), *COMMON, *flags]
    if ranks == 0:
        return [sys.executable, *script]
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks))
    return [sys.executable, *launcher, *script]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@functools.cache
def straight(ranks: int) -> list[dict]:
    """The metrics rows of an uninterrupted run on ``ranks`` ranks (0: without torchrun)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "straight.jsonl"
        done = subprocess.run(
            torchrun(ranks, "--steps", str(STEPS), "--metrics", str(metrics)),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=patient(300),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return rows(metrics)


# "group": Slurm and a terminal's Ctrl-C signal every process; "torchrun": only the launcher
# gets it and forwards it to its ranks; "process": one rank without torchrun (ranks 0), whose
# exit status is the rank's own (torchrun's is 1 after a signal, whatever its ranks did).
@pytest.mark.parametrize(
    "ranks, to, sig",
    [
        (1, "group", signal.SIGTERM),
        (2, "group", signal.SIGTERM),
        (2, "torchrun", signal.SIGINT),
        (0, "process", signal.SIGUSR1),
    ],
)
def test_a_signal_saves_the_step_in_hand_and_the_resume_is_bit_identical(tmp_path, ranks, to, sig):
    ck, metrics, log = tmp_path / "ck", tmp_path / "run.jsonl", tmp_path / "stopped.txt"
    flags = ("--checkpoint-dir", str(ck), "--metrics", str(metrics))
    with open(log, "w") as out:
        job = subprocess.Popen(
            torchrun(ranks, "--steps", "200", *flags),
            env=ENV,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a Slurm job step has
        )
        deadline = time.monotonic() + patient(300)
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        (os.killpg if to == "group" else os.kill)(job.pid, sig)
        code = job.wait(timeout=patient(300))
    text = log.read_text()
    if to == "process":
        assert code == 0, text
    stopped = re.search(rf"stopped by {sig.name} after step (\d+); checkpoint (\S+) ", text)
    assert stopped, text
    step = int(stopped[1])
    assert 2 <= step < STEPS, text
    assert stopped[2] == f"{ck}/step_{step:08d}"
    assert checkpoint.select(ck).path == ck / f"step_{step:08d}"
    assert "Traceback" not in text.split("stopped by")[0]  # the ranks print none
    assert [r["step"] for r in rows(metrics)] == list(range(1, step + 1))

    resumed = subprocess.run(
        torchrun(ranks, "--steps", str(STEPS), "--resume", *flags),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=patient(300),
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [r["loss"] for r in rows(metrics)] == [r["loss"] for r in straight(ranks)]
    assert rows(metrics)[-1]["trained_tokens"] == straight(ranks)[-1]["trained_tokens"]


SECOND_SIGNAL = """
import os, signal, sys, time, torch
from hdp.launch.stopping import StopOnSignal
with StopOnSignal((signal.SIGTERM, signal.SIGUSR1), rank=0, device=torch.device("cpu")) as stop:
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # at once: the same signal forwarded, not a second one
    time.sleep(0.1)
    print("agreed", stop.agreed().name, flush=True)
    time.sleep(1.1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("still running", flush=True)
"""


def test_a_second_signal_stops_at_once_and_a_forwarded_copy_does_not():
    done = subprocess.run(
        [sys.executable, "-c", SECOND_SIGNAL],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=patient(120),
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert done.stdout == "agreed SIGUSR1\n"
    assert done.stderr.splitlines() == [
        "SIGUSR1 received: finishing the step in hand, then saving (a second signal stops at "
        "once, without saving)",
        "SIGTERM again: stopped at once, without saving; --resume continues from the newest "
        "checkpoint",
    ]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: room for one checkpoint of ``tiny`` and a half (skips where mounting is not
    allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(small_disk):
    ck = small_disk / "ck"
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain.py"), *COMMON, "--steps", "3"]
    done = subprocess.run(
        [*cmd, "--save-every", "1", "--checkpoint-dir", str(ck)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=patient(300),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert f"saved {ck}/step_00000001 (" in out  # each save: where, its size, its seconds
    assert "this save may fail; free space or move old checkpoints away" in out
    assert f"pretrain.py: error: cannot save step 3 to {ck}: no space left on device" in out
    assert "Traceback" not in out
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert checkpoint.select(ck).path == ck / "step_00000002"
