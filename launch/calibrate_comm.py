"""The collective table of ``hdp-calibrate measure``: two local processes, gloo on CPU, NCCL on
two GPUs of this machine (one GPU: nothing to measure).

Rows ``[op, ranks, bytes, seconds]`` with ``bytes`` the size of the whole buffer:

* ``all_gather``: the gathered output (each rank contributes half);
* ``reduce_scatter``: the input each rank reduces (each keeps half of the sum);
* ``p2p``: one message from rank 0 to rank 1, timed as half a ping-pong round trip.

After one warm-up call, each row is repeated by the rule of the other tables (Note [Repeating a
row until its spread is small] in :mod:`hdp.profile_quality`), judged on rank 0's times: before
each repeat rank 0 broadcasts whether to go on, which also starts the ranks together. The row's
time is the median of rank 0's fastest repeats; its spread is returned beside it. Buffers are fp32.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hdp.profile_quality import RepeatRule, spread, typical

RANKS = 2
TICK_S = 5.0  # while the ranks measure, the caller hears from us this often
# all_gather_single / reduce_scatter_single are the newer names; older torch releases have only
# the *_tensor ones (same signatures).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _align(device: torch.device) -> None:
    dist.all_reduce(torch.zeros(1, device=device))
    _sync(device)


def _go_on(rank: int, device: torch.device, more: bool) -> bool:
    """Rank 0's ``more``, on every rank (the broadcast starts them together)."""
    flag = torch.tensor([1 if more and rank == 0 else 0], device=device)
    dist.broadcast(flag, src=0)
    _sync(device)
    return bool(flag.item())


def _timed(fn, rank: int, device: torch.device, rule: RepeatRule) -> tuple[float, float]:
    """(seconds, spread) of ``fn`` by ``rule`` on rank 0's times."""
    fn()
    times: list[float] = []
    while _go_on(rank, device, not rule.finished(times)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return typical(times, rule.k), spread(times, rule.k)


def _ping_pong(rank: int, buf: torch.Tensor):
    def call():
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return call


def _measure(rank: int, device: torch.device, sizes, rule: RepeatRule) -> list[list]:
    """Rows ``[op, ranks, bytes, seconds, spread]``."""
    rows = []
    for nbytes in sizes:
        n = max(2, nbytes // 4 // 2 * 2)  # fp32 elements, even so that halves are whole
        full = torch.ones(n, device=device)
        half = torch.ones(n // 2, device=device)
        calls = {
            "all_gather": lambda full=full, half=half: _ALL_GATHER(full, half),
            "reduce_scatter": lambda full=full, half=half: _REDUCE_SCATTER(half, full),
        }
        for op, call in calls.items():
            rows.append([op, RANKS, n * 4, *_timed(call, rank, device, rule)])
        rtt, rtt_spread = _timed(_ping_pong(rank, full), rank, device, rule)
        rows.append(["p2p", RANKS, n * 4, rtt / 2, rtt_spread])
    return rows


def _entry(rank: int, backend: str, port: int, sizes, rule: RepeatRule, out_path: str) -> None:
    """One rank: measure every op and size; rank 0 writes the rows to ``out_path``."""
    from .runtime import exit_without_teardown

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS
    )
    try:
        rows = _measure(rank, device, sizes, rule)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
        _align(device)  # leave together (a rank gone early breaks its peer's last call)
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)  # why: hdp.launch.runtime.exit_without_teardown's docstring


def collective_rows(
    device_type: str,
    sizes,
    rule: RepeatRule,
    timeout: float = 120.0,
    tick: Callable[[], None] = lambda: None,
) -> tuple[list[list], str | None]:
    """Rows ``[op, ranks, bytes, seconds, spread]`` of the collective table, and ``None`` or why
    there are none (one GPU, a failure, a timeout: the measurement goes on without them).
    ``tick`` is called every ``TICK_S`` seconds while the ranks measure."""
    if device_type == "cuda" and torch.cuda.device_count() < RANKS:
        return [], "one GPU on this machine"
    if not dist.is_available():
        return [], "torch.distributed is not available"
    backend = "nccl" if device_type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        args = (backend, _free_port(), tuple(sizes), rule, out_path)
        ctx = mp.start_processes(_entry, args=args, nprocs=RANKS, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=min(TICK_S, max(0.1, deadline - time.monotonic()))):
                tick()
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                            p.join()
                    return [], f"{backend} ranks still running after {timeout:.0f} s"
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            return [], f"{backend} ranks failed: {str(e).strip().splitlines()[-1]}"
        with open(out_path) as f:
            return json.load(f), None
