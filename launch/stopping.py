"""Stopping a run on a signal with its work saved: Note [Stopping on a signal].

Note [Stopping on a signal]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Slurm sends SIGTERM before it preempts a job or ends it at its time limit (SIGUSR1 with
``--signal=USR1@120``), and a person at a terminal sends SIGINT. torchrun forwards SIGTERM and
SIGINT to its ranks (SIGUSR1 too with ``--signals-to-handle SIGTERM,SIGINT,SIGUSR1``), then kills
them 30 s later; Slurm signals every process itself. Either way some ranks may get the signal
while others do not, or get it one step later, so a rank never acts on its own: its handler only
records the signal, and after every step the ranks take the largest signal any of them recorded
(one all-reduce of one integer). Every rank thus stops after the same step, saves it, and exits 0.

Worked example, 2 ranks, SIGTERM to rank 1 only, during step 7:

* rank 1's handler records SIGTERM; both ranks finish step 7 (a step's collectives need both);
* the all-reduce after step 7 gives SIGTERM on both ranks;
* both save ``step_00000007`` together and log "stopped by SIGTERM after step 7".

A second signal, a second or more after the first, ends the process at once without saving (the
newest checkpoint stays what it was). One within a second is the same signal arriving twice:
when a terminal's Ctrl-C or Slurm reaches the whole process group, torchrun forwards to its ranks
the signal they already received, milliseconds later.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

REPEAT_S = 1.0  # a signal within this long of the first is the first one, forwarded


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``--exit-signal``'s value: comma-separated names (``SIGTERM,SIGUSR1``, ``TERM``), or
    ``none``. Raises ValueError naming the unknown one."""
    if text.strip().lower() == "none":
        return ()
    out = []
    for name in (n.strip().upper() for n in text.split(",") if n.strip()):
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full not in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"):
            raise ValueError(
                f"--exit-signal: {name!r} is not one of SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP "
                "(or none)"
            )
        out.append(signal.Signals[full])
    if not out:
        raise ValueError("--exit-signal: name at least one signal, or none")
    return tuple(dict.fromkeys(out))


def _say(line: str) -> None:
    """One line to stderr from a signal handler: a raw write, as the handler may interrupt the
    main thread inside a write to the same stream, and a closed stderr must not keep a second
    signal from ending the process."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class StopOnSignal:
    """Records the first of ``signals`` a rank receives and, at :meth:`agreed`, tells every rank
    whether any rank received one. Install with ``with``; the previous handlers come back after."""

    def __init__(self, signals: tuple[signal.Signals, ...], *, rank: int, device: torch.device):
        self.signals = signals
        self.rank = rank
        self.device = device
        self.received: signal.Signals | None = None
        self._first_at = 0.0
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopOnSignal:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.received is not None:
            return  # the run is ending: a later copy waits out the teardown, a second one exits
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        sig = signal.Signals(signum)
        if self.received is None:
            self.received, self._first_at = sig, time.monotonic()
            if self.rank == 0:
                _say(
                    f"{sig.name} received: finishing the step in hand, then saving (a second "
                    "signal stops at once, without saving)"
                )
        elif time.monotonic() - self._first_at >= REPEAT_S:
            if self.rank == 0:
                _say(
                    f"{sig.name} again: stopped at once, without saving; --resume continues "
                    "from the newest checkpoint"
                )
            os._exit(128 + signum)

    def agreed(self) -> signal.Signals | None:
        """The signal some rank received, the same on every rank (a collective when there are
        several ranks and any signal is handled), or ``None``."""
        if not self.signals:
            return None
        mine = int(self.received or 0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = int(flag.item())
        return signal.Signals(mine) if mine else None


@dataclass
class Stopped:
    """A run stopped on a signal (Note [Stopping on a signal]) after ``step``: saved there, or
    before training any step (then ``step`` is where it started)."""

    signal: signal.Signals
    step: int
    saved: bool
    before_training: bool = False

    def line(self, folder) -> str:
        name = self.signal.name
        if self.before_training:
            return f"stopped by {name} before step {self.step + 1}: nothing trained, nothing saved"
        if not self.saved:
            return f"stopped by {name} after step {self.step}; nothing saved (no --checkpoint-dir)"
        return (
            f"stopped by {name} after step {self.step}; checkpoint {folder}/step_{self.step:08d} "
            "(continue with --resume)"
        )


def kill_point() -> tuple[int, int]:
    """(rank, step) from ``HDP_KILL_AT=RANK:STEP``, for resilience tests: that rank SIGKILLs
    itself in the middle of that step (after its forward/backward, before the optimizer step).
    Raises ValueError naming the variable when it is not two integers."""
    text = os.environ.get("HDP_KILL_AT", "").strip()
    if not text:
        return -1, -1
    try:
        kill_rank, kill_step = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"HDP_KILL_AT={text!r}: expected RANK:STEP, e.g. 1:5") from None
    return kill_rank, kill_step


__all__ = ["StopOnSignal", "Stopped", "kill_point", "parse_signals"]
