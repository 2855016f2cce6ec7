"""One run per checkpoint directory (Note [The checkpoint directory's lock]): a second run is
refused with one line naming the holder, a stale lock is taken over with a warning, and two
training processes on one directory never both write it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hdp.launch import lock as lock_module
from hdp.launch.lock import LOCK_NAME, STALE_S, DirectoryLock, LockHeld
from hdp.testing.ranks import patient

ROOT = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    return int(done.stdout)


def _write(path: Path, **holder) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / LOCK_NAME).write_text(json.dumps(holder))


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    with DirectoryLock(tmp_path):
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(LockHeld, match=f"in use by another run .*pid {os.getpid()}"):
            DirectoryLock(tmp_path).__enter__()
    assert not (tmp_path / LOCK_NAME).exists()  # released
    with DirectoryLock(tmp_path):
        pass


def test_a_dead_holder_on_this_host_is_taken_over_with_a_warning(tmp_path):
    pid = _dead_pid()
    _write(tmp_path, host=socket.gethostname(), pid=pid, started="then")
    lines = []
    with DirectoryLock(tmp_path, lines.append):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert lines == [
        f"warning: took over the lock of --checkpoint-dir {tmp_path}: host "
        f"{socket.gethostname()}, pid {pid}, started then is no longer running"
    ]
    assert sorted(os.listdir(tmp_path)) == []  # nothing of the old lock is left


def test_another_hosts_lock_is_stale_only_once_its_heartbeat_stops(tmp_path):
    _write(tmp_path, host="elsewhere", pid=1, started="then")
    with pytest.raises(LockHeld, match="host elsewhere, pid 1"):
        DirectoryLock(tmp_path).__enter__()
    old = time.time() - STALE_S - 60
    os.utime(tmp_path / LOCK_NAME, (old, old))
    lines = []
    with DirectoryLock(tmp_path, lines.append):
        pass
    assert "has not refreshed it for 11 minutes" in lines[0]


def test_the_holder_refreshes_its_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)
    with DirectoryLock(tmp_path):
        path = tmp_path / LOCK_NAME
        os.utime(path, (0, 0))
        deadline = time.monotonic() + patient(10)
        while path.stat().st_mtime == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.stat().st_mtime > 0


def _train(ckpt: Path, steps: int, *extra: str) -> list[str]:
    flags = ["--device", "cpu", "--model", "tiny", "--tokens-per-step", "2K", "--max-seq", "1K"]
    flags += ["--synthetic-docs", "200", "--steps", str(steps), "--checkpoint-dir", str(ckpt)]
    return [sys.executable, str(ROOT / "launch" / "pretrain.py"), *flags, *extra]


def test_two_runs_on_one_directory_one_trains_the_other_is_refused(tmp_path):
    """Run A holds the directory; run B, the same command, stops before reading or writing a
    checkpoint, with one line naming A; after A's clean stop the directory is free again."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ckpt = tmp_path / "ck"
    a = subprocess.Popen(
        _train(ckpt, 10_000, "--save-every", "1"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + patient(120)
        while not any(ckpt.glob("step_*")) and time.monotonic() < deadline:
            assert a.poll() is None, a.stdout.read()
            time.sleep(0.2)
        assert any(ckpt.glob("step_*")), "run A saved nothing"
        b = subprocess.run(
            _train(ckpt, 3), env=env, capture_output=True, text=True, timeout=patient(120)
        )
        assert b.returncode == 2, b.stderr + b.stdout
        err = b.stderr.strip().splitlines() + b.stdout.strip().splitlines()
        refusals = [line for line in err if "is in use by another run" in line]
        assert len(refusals) == 1 and f"pid {a.pid}" in refusals[0], err
        assert not any(line.startswith("step ") for line in err), err  # it trained nothing
    finally:
        a.send_signal(signal.SIGTERM)
        out, _ = a.communicate(timeout=patient(120))
    assert a.returncode == 0, out
    assert not (ckpt / LOCK_NAME).exists()
    with DirectoryLock(ckpt):  # free again
        pass
