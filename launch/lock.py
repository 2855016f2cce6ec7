"""One run per checkpoint directory: an advisory lock file that names its holder.

Note [The checkpoint directory's lock]
--------------------------------------
Two runs on one ``--checkpoint-dir`` (a requeued job while its old copy still runs, or the same
command started twice) delete and overwrite each other's checkpoints. Rank 0 of a run therefore
creates ``LOCK_NAME`` in the directory before it reads or writes a checkpoint there, holding the
host, the process id, the start time and the command line, and removes it when the run ends. A
second run finds the file and stops with one line naming the holder.

The file is created with ``O_CREAT | O_EXCL``, which local filesystems and NFS v3 and later make
atomic, so of two runs starting together exactly one gets it. A holder that is gone leaves the
file behind (kill -9, a lost node); whether it is gone is decided by a rule that holds on a
shared filesystem too:

* on the same host, by its process id: no such process, the lock is stale;
* on another host, by its heartbeat: the holder touches the file every ``HEARTBEAT_S`` seconds,
  so a file untouched for ``STALE_S`` seconds (its modification time against this host's clock;
  hosts whose clocks NTP keeps within a minute of each other agree) belongs to a run that is gone.

A stale lock is taken over with a warning: the old file is renamed away first (only one of two
runs taking over at once succeeds), then created anew. For example, run A on host n1 (pid 4242)
is killed with SIGKILL; a requeued run on n1 finds ``host n1, pid 4242``, no process 4242, and
takes over; a requeued run on n2 takes over once the file is ``STALE_S`` seconds old and says
so, and refuses before that, naming n1 and pid 4242.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

LOCK_NAME = "hdp.lock"
HEARTBEAT_S = 30.0
STALE_S = 600.0


class LockHeld(RuntimeError):
    """Another run holds the directory; the message says which and what to do."""


class DirectoryLock:
    """The lock of ``directory`` while in a ``with`` block (Note [The checkpoint directory's
    lock]); ``log`` receives the line of a stale lock taken over."""

    def __init__(self, directory: Path, log=print) -> None:
        self.path = Path(directory) / LOCK_NAME
        self.log = log
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> DirectoryLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self._create():
            holder = read_holder(self.path)
            why = stale_reason(holder, self.path)
            if why is None:
                raise LockHeld(
                    f"--checkpoint-dir {self.path.parent} is in use by another run "
                    f"({describe(holder)}; lock file {self.path}): wait for it to end, or give "
                    "another --checkpoint-dir; if that run is gone, remove the lock file"
                )
            self._take_over(why)
        self._beat = threading.Thread(target=self._heartbeat, name="hdp-lock", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        if read_holder(self.path).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        mine = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv),
        }
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _take_over(self, why: str) -> None:
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            pass  # another run took it over first; creating it below decides
        if not self._create():
            raise LockHeld(
                f"--checkpoint-dir {self.path.parent}: another run took over its stale lock "
                f"first ({describe(read_holder(self.path))}); give another --checkpoint-dir"
            )
        aside.unlink(missing_ok=True)
        self.log(f"warning: took over the lock of --checkpoint-dir {self.path.parent}: {why}")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the next beat tries again; a stale-looking lock costs a warning, no data


def read_holder(path: Path) -> dict:
    """The lock file's fields (empty where it is gone or unreadable: a holder mid-write)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def stale_reason(holder: dict, path: Path) -> str | None:
    """Why the lock of ``holder`` is stale, or ``None`` while its run may still be alive."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "its holder removed it"
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        if not _alive(holder["pid"]):
            return f"{describe(holder)} is no longer running"
        return None
    if age > STALE_S:
        return f"{describe(holder)} has not refreshed it for {age / 60:.0f} minutes"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def describe(holder: dict) -> str:
    """``host n1, pid 4242, started 2026-11-27T10:00:00+0000`` (what the file says)."""
    if not holder:
        return "holder unknown: the lock file is empty or unreadable"
    return (
        f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
        f"started {holder.get('started', '?')}"
    )


__all__ = ["HEARTBEAT_S", "LOCK_NAME", "STALE_S", "DirectoryLock", "LockHeld"]
