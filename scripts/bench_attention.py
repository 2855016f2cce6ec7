#!/usr/bin/env python3
"""dist_attn measurements for docs/benchmarks.md.

CPU (any machine): forward + backward of ``dist_attn`` on N gloo ranks against the same tokens
attended on one process (the overhead ratio), the bytes the ranks actually sent against the plan's
prediction, and the K/V volume of our P2P against ring attention over each sequence's ranks for
planner-made plans of the standard workloads.
GPU (``--gpu``): block-sharded varlen attention of one rank's blocks against one monolithic varlen
FlashAttention call on the same tokens, and TFLOP/s by block size.
GPU (``--backends``): every attention backend available here (cuDNN, ``flash_attn``, PyTorch's
FlashAttention) side by side, forward and backward TFLOP/s, on the shard shapes dist_attn runs:
512-8K query tokens against 8K-262K earlier keys (full blocks) and causal diagonal blocks, alone
and packed many to a call; plus the first call of a new shape (cuDNN builds a graph per shape).

    python scripts/bench_attention.py --ranks 4 --tokens 16384
    python scripts/bench_attention.py --gpu
    python scripts/bench_attention.py --backends --head-dim 64
    python scripts/bench_attention.py --cpu-blocks

CPU (``--cpu-blocks``): the reference backend's forward + backward on one causal document with the
blocks it uses on a CPU against the GPU-sized ones (Note [Reference attention blocks on a CPU]),
side by side: wall and kernel (system) seconds, page faults, and the speed-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _plan(ranks: int, tokens: int, seed: int):
    """A wlb-128k-like batch of ``tokens`` tokens planned by hdp for ``ranks`` CPU ranks."""
    from hdp import ClusterSpec, model_preset
    from hdp.planner import plan_step
    from hdp.workloads import get_workload

    w = get_workload("wlb-128k")
    lens = w.sample_batch(np.random.default_rng(seed), tokens, tokens // 2)
    cap = max(int(lens.max()) // ranks + 256, tokens // ranks + 512)
    return plan_step(
        lens,
        ClusterSpec.preset("cpu", ranks, 2),
        model_preset("tiny"),
        "hdp",
        capacity=cap,
        sync="wave",
    )


def _time_rank(
    rank: int, world: int, plan_json: dict, H: int, Hk: int, d: int, reps: int, out_path: str
) -> None:
    import torch.distributed as dist

    from hdp import Plan
    from hdp.attention import COMM, dist_attn

    torch.set_num_threads(1)
    plan = Plan.from_json(plan_json)
    g = torch.Generator().manual_seed(rank)
    times, sent = [], 0
    for w in range(plan.num_waves):
        T = sum(b - a for _, a, b in plan.shards(rank, w))
        q = torch.randn(T, H, d, generator=g, requires_grad=True)
        k = torch.randn(T, Hk, d, generator=g, requires_grad=True)
        v = torch.randn(T, Hk, d, generator=g, requires_grad=True)
        for _ in range(reps):
            dist.barrier()
            COMM.reset()
            t0 = time.perf_counter()
            dist_attn(q, k, v, plan, w).sum().backward()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        sent += COMM.fwd_bytes_sent
    t = torch.tensor([sum(times) / reps, float(sent)])
    dist.all_reduce(t[1:])  # total bytes
    dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out_path).write_text(f"{t[0].item()} {t[1].item()}\n")


def cpu_overhead(ranks: int, tokens: int, H: int, Hk: int, d: int, reps: int) -> None:
    from hdp import Plan
    from hdp.attention import dist_attn
    from hdp.testing.ranks import run_ranks

    plan = _plan(ranks, tokens, 0)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_attention_{os.getpid()}.txt"
    run_ranks(_time_rank, ranks, plan.to_json(), H, Hk, d, reps, str(out), timeout=1800)
    dist_time, dist_bytes = (float(x) for x in out.read_text().split())
    out.unlink()
    # The same tokens on one process: every sequence whole, one wave.
    single = Plan.from_shards(
        plan.seq_lens.tolist(), 1, [[[(s, 0, int(L)) for s, L in enumerate(plan.seq_lens) if L]]]
    )
    torch.set_num_threads(1)
    T = int(plan.seq_lens.sum())
    q = torch.randn(T, H, d, requires_grad=True)
    k = torch.randn(T, Hk, d, requires_grad=True)
    v = torch.randn(T, Hk, d, requires_grad=True)
    t_single = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dist_attn(q, k, v, single, 0).sum().backward()
        t_single.append(time.perf_counter() - t0)
    one = sum(t_single) / reps
    kvb = 2 * Hk * d * 4
    predicted = sum(int(plan.kv_tokens_sent(w).sum()) for w in range(plan.num_waves)) * kvb
    print(
        f"CPU, {ranks} gloo ranks x 1 thread, {T} tokens ({plan.seq_lens.size} sequences, longest "
        f"{int(plan.seq_lens.max())}), H={H} H_kv={Hk} d={d}, fp32, forward+backward, "
        f"mean of {reps}:"
    )
    print(f"  one process, all tokens:      {one:8.3f} s")
    print(
        f"  dist_attn, slowest rank:      {dist_time:8.3f} s   "
        f"({dist_time / one:.2f}x the single process, ideal {1 / ranks:.2f}x; "
        f"{os.cpu_count()} cores for {ranks} processes)"
    )
    print(
        f"  K/V bytes sent (forward):     {dist_bytes:,.0f} measured, "
        f"{predicted:,.0f} predicted by the plan"
    )


def p2p_vs_ring(workloads: list[tuple[str, int]]) -> None:
    """K/V tokens moved per layer (forward): ours (exact prefixes) against ring attention over each
    multi-rank sequence's ranks (every rank's share visits every other rank)."""
    from hdp import ClusterSpec, model_preset
    from hdp.planner import STRATEGIES, PlanningError, StepPricing, plan_and_evaluate
    from hdp.workloads import get_workload

    model = model_preset("llama-7b")
    print("K/V tokens moved per layer, forward: our P2P vs ring attention over the same placement")
    print(
        f"  {'workload':<15} {'GPUs':>5} {'strategy':<10} {'ours':>14} {'ring':>14} "
        f"{'ours/ring':>9}"
    )
    for name, n in workloads:
        w = get_workload(name)
        lens = w.sample_batch(np.random.default_rng(0))
        cluster = ClusterSpec.preset("h100", n)
        pricing = StepPricing.build(model, cluster)
        cost = pricing.cost
        for s in STRATEGIES:
            try:
                plan, _ = plan_and_evaluate(
                    lens, pricing, s, max_seq=w.max_seq, hybridcp_impl="ours"
                )
            except PlanningError:
                continue
            ours = float(cost.kv_traffic(plan).sent.sum())
            holders = np.bincount(np.unique(plan.seq * n + plan.rank) // n, minlength=lens.size)
            ring = float(((holders - 1).clip(min=0) * plan.seq_lens).sum())
            print(
                f"  {name:<15} {n:>5} {s:<10} {ours:>14,.0f} {ring:>14,.0f} "
                f"{ours / ring if ring else 0:>9.2f}"
            )


def gpu_blocks(block_sizes: list[int], tokens: int, H: int, Hk: int, d: int) -> None:
    """One rank's 2M-context blocks: sharded varlen calls against one monolithic call."""
    from hdp.attention import select_backend

    be = select_backend(torch.device("cuda"), torch.bfloat16)
    print(
        f"GPU {torch.cuda.get_device_name()}, backend {be.name}, bf16, {tokens} query tokens, "
        f"H={H} H_kv={Hk} d={d}"
    )

    def bench(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    q = torch.randn(tokens, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, Hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    mono = bench(lambda: be.forward(q, k, v, cu, cu, tokens, tokens, True, d**-0.5))
    flops = 4 * tokens * (tokens + 1) / 2 * H * d
    print(f"  monolithic causal call: {mono * 1e3:.2f} ms, {flops / mono / 1e12:.1f} TFLOP/s")
    for b in block_sizes:
        t = bench(_block_sharded(be, q, k, v, b))
        print(
            f"  {b:>6}-token blocks: {t * 1e3:.2f} ms, {flops / t / 1e12:.1f} TFLOP/s, "
            f"{mono / t:.2f}x the monolithic throughput"
        )


def _block_sharded(be, q, k, v, b: int):
    """The calls of a block-sharded rank: every query block of ``b`` tokens against its diagonal
    block (causal) and all earlier keys (full)."""
    d = q.shape[-1]
    n = q.shape[0] // b
    cu_b = torch.arange(0, n + 1, device="cuda", dtype=torch.int32) * b
    starts = torch.arange(n, device="cuda") * b
    kv_rows = torch.cat([torch.arange(0, int(s), device="cuda") for s in starts[1:]])
    q_full = torch.cat([torch.arange(int(s), int(s) + b, device="cuda") for s in starts[1:]])
    cu_fq = torch.arange(0, n, device="cuda", dtype=torch.int32) * b
    cu_fk = torch.tensor(
        [0, *torch.cumsum(starts[1:], 0).tolist()], device="cuda", dtype=torch.int32
    )
    qf, kf, vf = q[q_full], k[kv_rows], v[kv_rows]

    def sharded():
        be.forward(q, k, v, cu_b, cu_b, b, b, True, d**-0.5)
        be.forward(qf, kf, vf, cu_fq, cu_fk, b, int(starts[-1]), False, d**-0.5)

    return sharded


CUDA = torch.device("cuda")
# (query tokens, key tokens, causal, segments per call): one rank's calls in dist_attn.
SHARD_SHAPES = [
    (512, 8192, False, 1),
    (512, 262144, False, 1),
    (2048, 65536, False, 1),
    (8192, 131072, False, 1),
    (2048, 2048, True, 1),
    (8192, 8192, True, 1),
    (2048, 2048, True, 16),
    (512, 512, True, 64),
    (512, 8192, False, 8),
]


def _time(fn, reps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def _shape_calls(be, shape, H: int, Hk: int, d: int, device: torch.device, dtype: torch.dtype):
    """(forward, backward, forward FLOPs) of one backend on one shard shape."""
    lq, lk, causal, n = shape
    q = torch.randn(n * lq, H, d, device=device, dtype=dtype)
    k = torch.randn(n * lk, Hk, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    cu_q = torch.arange(n + 1, device=device, dtype=torch.int32) * lq
    cu_k = torch.arange(n + 1, device=device, dtype=torch.int32) * lk
    args = (cu_q, cu_k, lq, lk, causal, d**-0.5)
    out, lse = be.forward(q, k, v, *args)
    do = torch.randn_like(q)
    pairs = lq * (lq + 1) / 2 if causal else lq * lk
    return (
        lambda: be.forward(q, k, v, *args),
        lambda: be.backward(do, q, k, v, out, lse, *args),
        4.0 * n * pairs * H * d,
    )


def compare_backends(
    H: int,
    Hk: int,
    d: int,
    reps: int = 10,
    shapes=SHARD_SHAPES,
    names=("cudnn", "flash_attn", "torch_flash", "flash_attn_4"),
    device: torch.device = CUDA,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Each available backend's forward and backward TFLOP/s on the shard shapes, side by side."""
    from hdp.attention import BackendUnavailable, get_backend

    backends = []
    for name in names:
        try:
            backends.append(get_backend(name))
        except BackendUnavailable as e:
            print(f"  {name}: {e}")
    if any(be.name == "cudnn" for be in backends):
        # The loop over segments that grouping equal (bucketed) shapes is measured against.
        from hdp.attention.cudnn import CudnnBackend

        loop = CudnnBackend(grouping=False)
        loop.name = "cudnn_loop"
        backends.insert(1, loop)
    where = torch.cuda.get_device_name() if device.type == "cuda" else device.type
    print(
        f"{where}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, H={H} "
        f"H_kv={Hk} d={d}; TFLOP/s forward / backward (backward: 2.5x the forward's FLOPs), "
        f"mean of {reps}"
    )
    head = "".join(f"{be.name:>22}" for be in backends)
    print(f"  {'q x k tokens':>17} {'mask':>6} {'segs':>4}{head}")
    for shape in shapes:
        cells = []
        for be in backends:
            try:
                fwd, bwd, flops = _shape_calls(be, shape, H, Hk, d, device, dtype)
                tf, tb = _time(fwd, reps, device), _time(bwd, reps, device)
                cells.append(f"{flops / tf / 1e12:>12.1f} / {2.5 * flops / tb / 1e12:<7.1f}")
            except (RuntimeError, ValueError) as e:  # out of memory, unsupported shape
                cells.append(f"{'failed: ' + type(e).__name__:>22}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        lq, lk, causal, n = shape
        print(f"  {lq:>7} x {lk:<7} {'causal' if causal else 'full':>6} {n:>4}" + "".join(cells))
    print("  first call of a shape not run before (cuDNN builds a graph per shape), then steady:")
    for i, be in enumerate(backends):
        fresh = (1000 + 8 * i, 1000 + 8 * i, True, 3)
        t0 = time.perf_counter()
        fwd, bwd, _ = _shape_calls(be, fresh, H, Hk, d, device, dtype)
        bwd()
        if device.type == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        steady = _time(fwd, reps, device) + _time(bwd, reps, device)
        print(
            f"    {be.name:>12}: forward + backward {first * 1e3:.1f} ms first, "
            f"{steady * 1e3:.2f} ms after"
        )
    packed_steps(backends, H, Hk, d, device, dtype)


def packed_steps(backends, H: int, Hk: int, d: int, device, dtype, steps: int = 8) -> None:
    """Causal attention of packed wlb-128k batches (64K tokens, documents up to 32K), new lengths
    every step as in training: the steps after the first two show whether shape changes (cuDNN
    graph builds) still cost once the buckets are warm."""
    from hdp.workloads import get_workload

    w = get_workload("wlb-128k")
    batches = [w.sample_batch(np.random.default_rng(s), 65536, 32768) for s in range(steps)]
    print(f"  packed wlb-128k batches, 64K tokens, new lengths each of {steps} steps (causal):")
    for be in backends:
        times, flops = [], []
        for lens in batches:
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
            T, m = int(lens.sum()), int(lens.max())
            q = torch.randn(T, H, d, device=device, dtype=dtype)
            k, v = (torch.randn(T, Hk, d, device=device, dtype=dtype) for _ in range(2))
            args = (cu.to(device), cu.to(device), m, m, True, d**-0.5)
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            be.backward(q, q, k, v, *be.forward(q, k, v, *args), *args)  # dout: q, any tensor
            sync()
            t = time.perf_counter() - t0
            times.append(t)
            flops.append(3.5 * 4.0 * float((lens * (lens + 1) / 2).sum()) * H * d)
        late = slice(2, None) if steps > 2 else slice(None)
        rate = sum(flops[late]) / sum(times[late]) / 1e12
        print(
            f"    {be.name:>12}: steps 1-2 {sum(times[:2]) * 1e3:.0f} ms, then "
            f"{1e3 * sum(times[late]) / len(times[late]):.1f} ms a step, {rate:.0f} TFLOP/s "
            "forward + backward"
        )


def _time_reference(be, shape: tuple[int, int, int, int], reps: int) -> tuple[float, float, int]:
    """Median wall seconds of the reference backend's forward + backward on one causal document
    of ``shape`` (tokens, heads, kv_heads, head_dim); system seconds and page faults per call."""
    import resource
    import statistics

    T, H, hk, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (H, hk, hk))
    cu = torch.tensor([0, T], dtype=torch.int32)

    def call() -> None:
        out, lse = be.forward(q, k, v, cu, cu, T, T, True, d**-0.5)
        be.backward(torch.ones_like(out), q, k, v, out, lse, cu, cu, T, T, True, d**-0.5)

    call()  # warm-up
    r0, times = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    faults = (r1.ru_minflt - r0.ru_minflt) // reps
    return statistics.median(times), (r1.ru_stime - r0.ru_stime) / reps, faults


def cpu_blocks(shapes: list[tuple[int, int, int, int]], reps: int) -> None:
    """Reference attention, forward + backward of one causal document per ``(tokens, heads,
    kv_heads, head_dim)``, in fp32 on one thread: GPU-sized blocks, then the CPU's."""
    from hdp.attention import kernels

    torch.set_num_threads(1)
    be = kernels.ReferenceBackend()
    cpu_budget = kernels.CPU_BLOCK_SCORES
    print(f"reference attention, one CPU thread, causal document, forward + backward, {reps} reps")
    for shape in shapes:
        T, H, hk, d = shape
        seconds = {}
        for label, budget in (("gpu-sized", 1 << 62), ("cpu", cpu_budget)):
            kernels.CPU_BLOCK_SCORES = budget
            qc, kc = kernels.chunks(H, torch.device("cpu"))
            seconds[label], system, faults = _time_reference(be, shape, reps)
            print(
                f"  T {T} H {H}/{hk} d {d}, {label:>9} blocks {qc} x {kc}: {seconds[label]:.3f} s, "
                f"system {system:.3f} s, page faults {faults}"
            )
        kernels.CPU_BLOCK_SCORES = cpu_budget
        print(f"  T {T} H {H}/{hk} d {d}: speed-up {seconds['gpu-sized'] / seconds['cpu']:.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--gpu", action="store_true", help="run the GPU block-size benchmark instead")
    p.add_argument(
        "--backends", action="store_true", help="compare the GPU attention backends instead"
    )
    p.add_argument("--head-dim", type=int, default=128, help="head_dim of --backends")
    p.add_argument(
        "--cpu-blocks",
        action="store_true",
        help="time the reference backend's CPU blocks against GPU-sized ones instead",
    )
    args = p.parse_args()
    if args.cpu_blocks:
        cpu_blocks([(4096, 4, 2, 16), (2048, 32, 8, 64)], max(3, args.reps))
        return 0
    if args.backends:
        if not torch.cuda.is_available():
            print("no CUDA GPU: nothing to measure", file=sys.stderr)
            return 1
        compare_backends(32, 8, args.head_dim)
        return 0
    if args.gpu:
        if not torch.cuda.is_available():
            print("no CUDA GPU: nothing to measure", file=sys.stderr)
            return 1
        gpu_blocks([512, 1024, 2048, 4096, 8192], 65536, 32, 8, 128)
        return 0
    cpu_overhead(args.ranks, args.tokens, 4, 2, 32, args.reps)
    p2p_vs_ring([("wlb-128k", 64), ("byted-2m", 256)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
