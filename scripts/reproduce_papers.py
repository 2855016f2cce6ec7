#!/usr/bin/env python3
"""The simulator held to the published tables: each paper's own speed-up, simulated at the
paper's setting, beside hdp's predicted margin over that paper's system.

    python scripts/reproduce_papers.py                # ~20 minutes
    python scripts/reproduce_papers.py --steps 3 --rows 1,9,10 --json out/papers.json

A row's ratio is the mean step time of the paper's baseline over the mean step time of the
paper's system, over 12 seeded global batches (single batches swing 3-15x at 2M context, so only
means compare), or over the paper's own batches where it states them (FlexSP's: its trace in
order); ``--steps`` sets the sampled count and caps the paper's own. The baselines run with
tensor parallelism as the papers ran them (``hdp-sim --tp``); where a paper tuned its mesh per
case, each mesh it names is simulated and the fastest kept. The error is against the published
figure, or against the nearer end of a published range (0 inside it); a row over the 15% goal
says what the simulator lacks. A setting the simulator cannot express prints "not modelled: WHY"
instead of a substitute. Figures and settings are from the papers' text and figures (ByteScale's
Fig. 17, FlexSP's Fig. 4 and Appendix B), FlexSP's released code and ../shared/REFERENCES.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hdp import ClusterSpec, GPUProfile, ModelSpec, gpu_preset, model_preset
from hdp.planner import PlanningError, StepPricing
from hdp.planner.sim import simulate
from hdp.workloads import get_workload

TOLERANCE = 0.15  # the goal: every modelled row within 15% of the paper
SAMPLED_STEPS = 12  # seeded global batches per row where the paper's own are not known


@dataclass(frozen=True)
class Row:
    paper: str
    setting: str
    published: tuple[float, float]  # (low, high); equal for a single figure
    baseline: str = ""  # strategies simulated: the paper's baseline, then its system
    system: str = ""
    model: str | ModelSpec = ""
    workload: str = ""
    gpus: int = 0
    capacity: int | None = None  # tokens per rank the paper's static mesh holds (None: memory)
    max_seq: int | None = None  # None: the workload's
    tokens_per_step: int | None = None
    gpu: str | GPUProfile = "h100"
    # The baseline's meshes tried, as (TP size, tokens per rank; None: ``capacity``): the fastest
    # counts, as the papers tuned their baselines by hand.
    baseline_meshes: tuple[tuple[int, int | None], ...] = ((1, None),)
    baseline_sync: str | None = None  # None: as memory allows
    baseline_dkv_bytes: int = 4  # 2: the baseline's ring returns dK/dV in bf16 (TransformerEngine)
    checkpointing: bool = True
    system_tp: int = 1
    # The paper's own batches, where it states them: (sequences per batch, first batch, batches)
    # taken in order from the workload's trace (:func:`trace_batches`); else seeded samples.
    trace_batches: tuple[int, int, int] | None = None
    not_modelled: str = ""
    gap: str = ""  # what the simulator lacks, printed where the row misses the tolerance


# FlexSP's GPT-7B (Appendix Table 5 and its released configs): 32 layers, hidden 4096, 64 heads
# of 64, GPT-2's vocabulary; a SwiGLU MLP of 11008 channels has the FLOPs of its 4h GELU MLP.
GPT_7B = ModelSpec(
    "gpt-7b", layers=32, hidden=4096, heads=64, kv_heads=64, head_dim=64, ffn=11008, vocab=50257
)
# FlexSP's cluster (Section 6.1): 8 nodes of 8 A100-40GB, "interconnected by 400Gbps
# InfiniBand": two 200 Gb/s NICs a node in its scripts (NCCL_IB_HCA), so 50 Gb/s per GPU where
# the preset has 200; at the presets' 90% of the nominal rate. Its solver's all-to-all
# bandwidths, measured on that cluster ("4k seq, 2 IB": 96.5 GB/s at 8 ranks, 4.87 at 64, each a
# member's share of the tensor over the time), count the bytes a member sends as (g - 1) / g of
# that: 84.4 GB/s on NVLink (35% of the preset's) and, 56 of 63 peers off the node, 4.26 GB/s
# on a NIC (76%; 79% at 32 ranks, 92% at 16).
_A100 = gpu_preset("a100-40g")
_FLEXSP_NIC = 0.9 * 400e9 / 8 / 8
FLEXSP_A100 = replace(
    _A100,
    name="a100-40g-400gbps-node",
    nic_bw=_FLEXSP_NIC,
    alltoall_nic_share=4.87e9 * 63 / 64 * 56 / 63 / _FLEXSP_NIC,
    alltoall_nvlink_share=96.5e9 * 7 / 8 / _A100.nvlink_bw,
)
# ByteScale's 7B runs: 1,024 GPUs, 32M tokens per step, tensor parallelism 2 (1,024 / (2 x CP
# 256) = 2 replicas of 8 micro-batches of 2M), 8K tokens per rank (a 312K sequence spans 39).
_BYTESCALE = dict(
    baseline="static",
    system="bytescale",
    model="llama-7b",
    gpus=1024,
    capacity=8192,
    tokens_per_step=32 << 20,
    baseline_meshes=((2, None),),
    system_tp=2,
)
_FEW_BATCHES = (
    "single 2M batches swing 3-15x, so a mean over few batches does too; the paper's figure is "
    "a mean over 200 steps (12 batches give +14-15%)"
)
# Step times from the throughputs of Fig. 17 (32M tokens over tokens/s) beside ours.
_SHORT_CONTEXT = (
    "below 2M the paper's ByteScale gains less than predicted: its text has balanced HDP lose "
    "1.08x of throughput per doubling of context, the cost model 1.5x; at 256K its ByteScale "
    "steps are 2.4-2.9x the predicted ones (35 s on GitHub, 55 s on Byted, from Fig. 17's "
    "throughput) while its static steps are 1.3-2x, at 2M both 1.0-1.6x: costs of its runtime "
    "at shorter context that the cost model does not price"
)
_FLEXSP = dict(
    system="flexsp",
    model=GPT_7B,
    workload="wikipedia-384k",
    gpus=64,
    # Its released trace in order, 512 sequences a step, the mean of iterations 10-49 ("the
    # average iteration time over 40 iterations after 10-iteration's warm-up").
    trace_batches=(512, 10, 40),
    gpu=FLEXSP_A100,
    checkpointing=False,  # the paper: none needed for 7B on 64 GPUs
)
_FLEXSP_192K = (
    "our steps are Megatron-LM's 10.9 s (the paper's 9.4 s), DeepSpeed's 7.9 s (8.1 s) and "
    "FlexSP's 5.0 s (4.7 s)"
)
# FlexSP's Appendix B: Megatron-LM's best mesh "is usually among TP=8, CP=8, or TP=16, CP=4, or
# TP=8, CP=4, DP=2 with ZeRO-1" (TP 16 spans two nodes, which `--tp` does not express); its
# ring attention is TransformerEngine's, which returns dK/dV in bf16. DeepSpeed's is "among
# SP=64 or SP=32 with ZeRO-3". A mesh is set by its tokens per rank: 384K over 48K-token TP-8
# groups is CP 8, 192K over them CP 4 x DP 2.
_MEGATRON = dict(baseline="static", baseline_sync="peer", baseline_dkv_bytes=2)
_DEEPSPEED = dict(baseline="ulysses", baseline_sync="wave")


def _bytescale_below_2m(data: str, context: str, max_seq: int, published: float) -> Row:
    """A 7B row of ByteScale's Fig. 17 below 2M context, over its static DP x CP mesh."""
    return Row(
        "ByteScale (arXiv 2502.21231)",
        f"Fig. 17: llama-7b, {data} data, {context} context, 1,024 GPUs, over a static DP x CP "
        "mesh",
        (published, published),
        workload=f"{data.lower()}-2m",
        max_seq=max_seq,
        gap=_SHORT_CONTEXT,
        **_BYTESCALE,
    )


ROWS = [
    *(
        _bytescale_below_2m(data, context, max_seq, published)
        for context, max_seq, figures in (
            ("256K", 256 << 10, (1.68, 1.73)),
            ("512K", 512 << 10, (1.98, 2.49)),
            ("1M", 1 << 20, (2.34, 4.56)),
        )
        for data, published in zip(("Byted", "GitHub"), figures)
    ),
    Row(
        "ByteScale (arXiv 2502.21231)",
        "Fig. 17: llama-7b, Byted data, 2M context, 1,024 GPUs, static CP 256 (the case study "
        "setting: one step 3.31x)",
        (4.26, 4.26),
        workload="byted-2m",
        gap=_FEW_BATCHES,
        **_BYTESCALE,
    ),
    Row(
        "ByteScale (arXiv 2502.21231)",
        "Fig. 17: llama-7b, GitHub data, 2M context, 1,024 GPUs, static CP 256",
        (7.89, 7.89),
        workload="github-2m",
        gap=_FEW_BATCHES,
        **_BYTESCALE,
    ),
    Row(
        "FlexSP (arXiv 2412.01523)",
        "Fig. 4: GPT-7B, Wikipedia, 192K context, 64 A100-40GB, over Megatron-LM (the faster "
        "of TP 8 x CP 8 and TP 8 x CP 4 x DP 2)",
        (1.98, 1.98),
        max_seq=192 << 10,
        **_FLEXSP,
        **_MEGATRON,
        gap=_FLEXSP_192K,
        baseline_meshes=((8, 24 << 10), (8, 48 << 10)),
    ),
    Row(
        "FlexSP (arXiv 2412.01523)",
        "Fig. 4: GPT-7B, Wikipedia, 192K context, 64 A100-40GB, over DeepSpeed (the faster "
        "of Ulysses SP 64 and SP 32, ZeRO-3)",
        (1.72, 1.72),
        max_seq=192 << 10,
        **_FLEXSP,
        **_DEEPSPEED,
        gap=_FLEXSP_192K,
        baseline_meshes=((1, 3 << 10), (1, 6 << 10)),
    ),
    Row(
        "FlexSP (arXiv 2412.01523)",
        "Fig. 4: GPT-7B, Wikipedia, 384K context, 64 A100-40GB, over Megatron-LM (TP 8 x CP 8, "
        "of the two meshes the paper names at 384K the one within a node's TP)",
        (1.77, 1.77),
        max_seq=384 << 10,
        **_FLEXSP,
        **_MEGATRON,
        # Without checkpointing our memory model holds 45.7K tokens per TP-8 group; the paper's
        # runs held 48K (its own estimate per token is 5% below ours).
        baseline_meshes=((8, 48 << 10),),
        gap="a TP 8 x CP 8 ring crosses all 8 nodes: on 50 Gb/s a GPU its K/V traffic alone "
        "(forward; K/V and bf16 dK/dV backward) takes 16.6 s a step on these batches, above the "
        "paper's whole 10.1 s Megatron step, so the paper's mesh or network differs from what it "
        "states; no article in its 384K batches is over 179K tokens either (one longer article, "
        "in a warm-up batch, shifts them by one sequence from the 192K ones)",
    ),
    Row(
        "FlexSP (arXiv 2412.01523)",
        "Fig. 4: GPT-7B, Wikipedia, 384K context, 64 A100-40GB, over DeepSpeed (SP 64 as the "
        "paper ran it: 6K tokens per GPU)",
        (1.46, 1.46),
        max_seq=384 << 10,
        **_FLEXSP,
        **_DEEPSPEED,
        gap="our steps are DeepSpeed's 7.6 s (the paper's 8.4 s) and FlexSP's 5.1 s (5.8 s)",
        baseline_meshes=((1, 6 << 10),),  # our memory model holds 5.9K tokens per GPU without it
    ),
    Row(
        "ByteScale (arXiv 2502.21231)",
        "Fig. 17: LLaMA-13B / 30B / 70B on 2K / 4K / 8K GPUs, 2M context, Byted and GitHub",
        (2.84, 6.88),
        not_modelled="the paper does not state the tensor- or pipeline-parallel sizes of these "
        "runs (70B runs with pipeline parallelism, which the simulator lacks), and most of Fig. "
        "17's labels for them cannot be matched to a model and context",
    ),
    Row(
        "WLB-LLM (OSDI'25)",
        "over plain 4D parallelism at 128K context, up to 256 H100",
        (1.23, 1.30),
        not_modelled="no pipeline parallelism in the simulator (its 4D baseline), and its "
        "variable-length packing with outlier queues is not a strategy here",
    ),
    Row(
        "DistCA (arXiv 2510.18121)",
        "up to 512 H200, 512K context",
        (1.35, 1.35),
        not_modelled="core attention moved between GPUs as tasks is not a strategy here",
    ),
]


def error(simulated: float, published: tuple[float, float]) -> float:
    """Relative error against the figure, or against the nearer end of a range (0 inside)."""
    low, high = published
    if low <= simulated <= high:
        return 0.0
    near = low if simulated < low else high
    return simulated / near - 1.0


def trace_batches(row: Row, steps: int) -> list[np.ndarray]:
    """The paper's first ``steps`` global batches from the workload's trace in file order, as
    FlexSP's code forms them (``read_dataset`` and ``get_global_batch`` in
    galvatron/flexsp_solver/solver.py, branch ``flexsp`` of Hetu-Galvatron): each length padded
    to a multiple of 2 x GPUs, a sequence left out where that exceeds ``max_seq - 2 x GPUs``
    (the paper: "sequences exceed the maximum context length limit will be eliminated"), then
    consecutive batches of the stated size."""
    per_batch, first, count = row.trace_batches
    count = min(count, steps)
    workload = get_workload(row.workload)
    if workload.lengths is None:
        raise SystemExit(f"reproduce_papers.py: {row.workload} is not a trace of real lengths")
    quantum = 2 * row.gpus
    limit = (row.max_seq or workload.max_seq) - quantum
    padded = -(-workload.lengths // quantum) * quantum
    kept = padded[padded <= limit]
    if kept.size < (first + count) * per_batch:
        raise SystemExit(f"reproduce_papers.py: {row.workload} holds too few sequences")
    return [kept[(first + k) * per_batch : (first + k + 1) * per_batch] for k in range(count)]


def mean_step(
    row: Row, strategy: str, mesh: tuple[int, int | None], steps: int, seed: int, progress
) -> float:
    """Mean predicted step time of ``strategy`` on ``mesh`` (TP size, tokens per rank) over the
    row's ``steps`` global batches: the paper's own (:func:`trace_batches`) or seeded samples,
    the same for every strategy and mesh."""
    gpu = gpu_preset(row.gpu) if isinstance(row.gpu, str) else row.gpu
    tp, capacity = mesh
    is_baseline = strategy == row.baseline
    sync = row.baseline_sync if is_baseline else None
    model = row.model if isinstance(row.model, ModelSpec) else model_preset(row.model)
    pricing = StepPricing.build(
        model,
        ClusterSpec(row.gpus, 8, gpu),
        capacity=capacity or row.capacity,
        activation_checkpointing=row.checkpointing,
        sync=sync,
        tensor_parallel=tp,
        dkv_bytes=row.baseline_dkv_bytes if is_baseline else 4,
    )
    sim = simulate(
        get_workload(row.workload),
        pricing,
        [strategy],
        steps=steps,
        seed=seed,
        max_seq=row.max_seq,
        tokens_per_step=row.tokens_per_step,
        progress=progress,
        batches=trace_batches(row, steps) if row.trace_batches else None,
    )
    r = sim.results[strategy]
    if r.error is not None:
        raise PlanningError(f"{strategy} on {_mesh_name(mesh)}: {r.error}")
    return r.mean()["step_time_s"]


def _mesh_name(mesh: tuple[int, int | None]) -> str:
    tp, capacity = mesh
    return f"TP {tp}" + (f", {capacity >> 10}K tokens per rank" if capacity else "")


def baseline_step(row: Row, steps: int, seed: int, progress) -> tuple[float, str]:
    """(mean step, mesh) of the row's baseline on the fastest of its meshes, as the papers tuned
    their baselines by hand."""
    base = {}
    for mesh in row.baseline_meshes:
        try:
            base[mesh] = mean_step(row, row.baseline, mesh, steps, seed, progress)
        except PlanningError as e:
            progress(f"{row.baseline} on {_mesh_name(mesh)} does not fit: {e}")
    if not base:
        raise SystemExit(f"reproduce_papers.py: {row.setting}: no mesh fits {row.baseline}")
    mesh = min(base, key=base.get)
    return base[mesh], _mesh_name(mesh)


def run_row(row: Row, steps: int, seed: int, progress) -> dict:
    """The row simulated: the paper's ratio, and hdp's margin over the paper's system."""
    base, mesh = baseline_step(row, steps, seed, progress)
    system = mean_step(row, row.system, (row.system_tp, None), steps, seed, progress)
    hdp = mean_step(row, "hdp", (row.system_tp, None), steps, seed, progress)
    ratio = base / system
    return {
        "simulated": ratio,
        "error": error(ratio, row.published),
        "hdp_over_system": system / hdp,
        "baseline_mesh": mesh,
        "step_s": {row.baseline: base, row.system: system, "hdp": hdp},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="global batches per row: this many sampled, or at most this many of the paper's "
        "own (default: 12 sampled, or all the paper's own)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument(
        "--rows",
        default=None,
        metavar="N,...",
        help=f"only these rows, numbered from 1 (of {len(ROWS)}; default all)",
    )
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    chosen = list(range(1, len(ROWS) + 1))
    if args.rows is not None:
        try:
            chosen = [int(x) for x in args.rows.split(",")]
        except ValueError:
            p.error(f"--rows {args.rows!r}: expected row numbers, e.g. 1,3")
        if not all(1 <= k <= len(ROWS) for k in chosen):
            p.error(f"--rows {args.rows!r}: rows are numbered 1 to {len(ROWS)}")
    t0 = time.perf_counter()
    rows = []
    print("| paper | setting | published | simulated | error | hdp over the paper's system |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in [ROWS[k - 1] for k in chosen]:
        low, high = row.published
        published = f"{low:.2f}x" if low == high else f"{low:.2f}-{high:.2f}x"
        if row.not_modelled:
            print(
                f"| {row.paper} | {row.setting} | {published} "
                f"| not modelled: {row.not_modelled} | | |"
            )
            rows.append(
                {"paper": row.paper, "setting": row.setting, "not_modelled": row.not_modelled}
            )
            continue
        steps = args.steps or SAMPLED_STEPS
        if row.trace_batches:
            steps = min(args.steps or row.trace_batches[2], row.trace_batches[2])
        out = run_row(row, steps, args.seed, lambda m: print(f"  {m}", file=sys.stderr))
        flag = "" if abs(out["error"]) <= TOLERANCE else f" (over 15%: {row.gap or 'unknown'})"
        print(
            f"| {row.paper} | {row.setting} | {published} | {out['simulated']:.2f}x "
            f"| {out['error']:+.0%}{flag} | {out['hdp_over_system']:.2f}x |",
            flush=True,
        )
        rows.append({"paper": row.paper, "setting": row.setting, "batches": steps, **out})
    print(f"\nseed {args.seed}, {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
