"""Run a function on N gloo ranks in fresh processes (CPU), with a deadline instead of a hang."""

from __future__ import annotations

import os
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world: int, store_path: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 300.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes; raises if any fails or the deadline passes."""
    # A file rendezvous, not a TCP port: a port picked free here can be taken by a parallel test
    # (pytest -n) before the ranks bind it.
    with tempfile.TemporaryDirectory(prefix="hdp-rdzv-") as tmp:
        _run(fn, world, os.path.join(tmp, "store"), args, timeout)


def _run(fn, world: int, store_path: str, args: tuple, timeout: float) -> None:
    ctx = mp.start_processes(_entry, args=(fn, world, store_path, args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"ranks still running after {timeout} s (deadlock?)")
