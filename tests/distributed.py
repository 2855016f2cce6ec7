"""Run a function on N gloo ranks in fresh processes (CPU), with a deadline instead of a hang."""

from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm_up_exp() -> None:
    """Call ``torch.exp`` once per dtype before anything else in a process. Measured with torch
    2.13 (CPU): when a process's first ``exp`` follows its first matmul (as in attention), its
    result differs from every later call on the same input by up to 3e-9 in ~1 of 4 processes
    (10 of 40; 0 of 40 after this warm-up) -- enough to fail float64 comparisons at 1e-10, and
    why ``test_dist_attn`` failed about once in ten runs."""
    import torch

    for dtype in (torch.float64, torch.float32):
        torch.exp(torch.zeros(8, dtype=dtype))


def _entry(rank: int, fn, world: int, port: int, args: tuple) -> None:
    faulthandler.enable(all_threads=True)  # a rank that crashes prints where each thread was
    warm_up_exp()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from launch.runtime import exit_without_teardown

    try:
        fn(rank, world, *args)
        # Leave together: a rank that tears down its sockets while a peer still reads from them
        # makes that peer fail ("Connection closed by peer").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)  # as launch/pretrain.py does; why: its docstring


def run_ranks(fn, world: int, *args, timeout: float = 300.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes. Raises if any fails or the deadline
    passes."""
    ctx = mp.start_processes(
        _entry, args=(fn, world, free_port(), args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        # A grace period lets the other ranks write their errors too: the first rank noticed is
        # often a peer that lost its connection, not the one that failed.
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic()), grace_period=10.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"ranks still running after {timeout} s (deadlock?)")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as first:
        errors = []
        for rank, path in enumerate(ctx.error_files):
            if os.path.exists(path) and os.path.getsize(path):
                with open(path, "rb") as fh:
                    errors.append(f"-- rank {rank}:\n{pickle.load(fh)}")
        if len(errors) <= 1:
            raise
        raise AssertionError(f"{len(errors)} ranks failed:\n\n" + "\n".join(errors)) from first
