"""Run a function on N gloo ranks in fresh processes (CPU), with a deadline instead of a hang.

Deadlines are patient on a busy host: they count seconds of a fair share of the machine, so a
suite run beside another CPU-bound job waits longer instead of failing, while ranks that are
truly stuck (blocked, using no CPU) are caught at the nominal time.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import shutil
import signal
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def warm_up_exp() -> None:
    """Call ``torch.exp`` once per dtype before anything else in a process. Measured with torch
    2.13 (CPU): when a process's first ``exp`` follows its first matmul (as in attention), its
    result differs from every later call on the same input by up to 3e-9 in ~1 of 4 processes
    (10 of 40; 0 of 40 after this warm-up) -- enough to fail float64 comparisons at 1e-10, and
    why ``test_dist_attn`` failed about once in ten runs."""
    import torch

    for dtype in (torch.float64, torch.float32):
        torch.exp(torch.zeros(8, dtype=dtype))


def load_factor() -> float:
    """How many times slower than on an idle machine work runs now: the 1-minute load average
    over the cores, at least 1."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def patient(seconds: float) -> float:
    """A subprocess timeout of ``seconds`` on an idle machine, stretched by the load now."""
    return seconds * load_factor()


def _entry(rank: int, fn, world: int, rendezvous: str, stacks: str, args: tuple) -> None:
    faulthandler.enable(all_threads=True)  # a rank that crashes prints where each thread was
    # At the deadline the parent sends SIGUSR2 and reads where each rank waits (not SIGUSR1:
    # training stops on that one, Note [Stopping on a signal]).
    global _stack_file
    _stack_file = open(os.path.join(stacks, f"rank{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR2, file=_stack_file, all_threads=True)
    warm_up_exp()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A file, not a TCP port, for the rendezvous: a port picked free by the parent may be taken
    # by another test worker before rank 0 binds it.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    from hdp.launch.runtime import exit_without_teardown

    try:
        fn(rank, world, *args)
        # Leave together: a rank that tears down its sockets while a peer still reads from them
        # makes that peer fail ("Connection closed by peer").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)  # as launch/pretrain.py does; why: its docstring


_stack_file = None


def _where_ranks_wait(ctx, stacks: str) -> str:
    """Each live rank's Python stacks, innermost frames first, as faulthandler writes them."""
    alive = [(rank, p) for rank, p in enumerate(ctx.processes) if p.is_alive()]
    for _, p in alive:
        os.kill(p.pid, signal.SIGUSR2)
    time.sleep(2.0)
    parts = []
    for rank, _ in alive:
        path = os.path.join(stacks, f"rank{rank}.txt")
        text = open(path).read() if os.path.exists(path) else ""
        threads = [t for t in text.split("\n\n") if t.strip()]
        current = [t for t in threads if t.startswith("Current thread")] or threads
        frames = "\n".join(current[0].splitlines()[:12]) if current else "(no stack written)"
        parts.append(f"-- rank {rank} waits in:\n{frames}")
    return "\n".join(parts)


def run_ranks(fn, world: int, *args, timeout: float = 300.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes. Raises if any fails, or if they run
    longer than ``timeout`` seconds of a fair share of the machine (see the module's note)."""
    stacks = tempfile.mkdtemp(prefix="hdp-ranks-")
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, os.path.join(stacks, "rendezvous"), stacks, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    # The ranks themselves load the machine: only load beyond them stretches the deadline.
    own = min(world, os.cpu_count() or 1)
    budget, last = timeout, time.monotonic()
    try:
        # A grace period lets the other ranks write their errors too: the first rank noticed is
        # often a peer that lost its connection, not the one that failed.
        while not ctx.join(timeout=min(5.0, max(0.1, budget)), grace_period=10.0):
            now = time.monotonic()
            others = max(0.0, os.getloadavg()[0] - own)
            budget -= (now - last) / max(1.0, 1.0 + others / (os.cpu_count() or 1))
            last = now
            if budget <= 0:
                where = _where_ranks_wait(ctx, stacks)
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(
                    f"{world} ranks still running after {timeout:.0f} s of a fair share of this "
                    f"machine (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):\n{where}"
                )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as first:
        errors = []
        for rank, path in enumerate(ctx.error_files):
            if os.path.exists(path) and os.path.getsize(path):
                with open(path, "rb") as fh:
                    errors.append(f"-- rank {rank}:\n{pickle.load(fh)}")
        if len(errors) <= 1:
            raise
        raise AssertionError(f"{len(errors)} ranks failed:\n\n" + "\n".join(errors)) from first
    finally:
        shutil.rmtree(stacks, ignore_errors=True)
