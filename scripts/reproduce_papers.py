#!/usr/bin/env python3
"""The simulator held to the published tables: each paper's own speed-up, simulated at the
paper's setting, beside hdp's predicted margin over that paper's system.

    python scripts/reproduce_papers.py                # 12 global batches per row, ~16 minutes
    python scripts/reproduce_papers.py --steps 3 --rows 1,5,6 --json out/papers.json

A row's ratio is the mean step time of the paper's baseline over the mean step time of the
paper's system, over ``--steps`` seeded global batches (single batches swing 3-15x at 2M
context, so only means compare). The baselines run with tensor parallelism as the papers ran
them (``hdp-sim --tp``); where a paper tuned it per case, each TP size listed is simulated and
the fastest kept. The error is against the published figure, or against the nearer end of a
published range (0 inside it); a row over the 15% goal says what the simulator lacks. A setting
the simulator cannot express prints "not modelled: WHY" instead of a substitute. Figures and
settings are from the papers' text and figures (ByteScale's Fig. 17, FlexSP's Fig. 4) and
../shared/REFERENCES.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hdp import ClusterSpec, ModelSpec, gpu_preset, model_preset
from hdp.workloads import get_workload
from planner import PlanningError, StepPricing
from planner.sim import simulate

TOLERANCE = 0.15  # the goal: every modelled row within 15% of the paper


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
    gpu: str = "h100"
    baseline_capacity: int | None = None  # the baseline's own, where the paper states its mesh
    baseline_sync: str | None = None  # None: as memory allows
    checkpointing: bool = True
    baseline_tp: tuple[int, ...] = (1,)  # tensor-parallel sizes tried; the fastest is kept
    system_tp: int = 1
    not_modelled: str = ""
    gap: str = ""  # what the simulator lacks, printed where the row misses the tolerance


# FlexSP's GPT-7B (Appendix Table 5 and its released configs): 32 layers, hidden 4096, 64 heads
# of 64, GPT-2's vocabulary; a SwiGLU MLP of 11008 channels has the FLOPs of its 4h GELU MLP.
GPT_7B = ModelSpec(
    "gpt-7b", layers=32, hidden=4096, heads=64, kv_heads=64, head_dim=64, ffn=11008, vocab=50257
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
    baseline_tp=(2,),
    system_tp=2,
)
_FEW_BATCHES = (
    "single 2M batches swing 3-15x, so a mean over few batches does too; the paper's figure is "
    "a mean over 200 steps (12 batches give +14-15%)"
)
# Step times from the throughputs of Fig. 17 (32M tokens over tokens/s) beside ours.
_SHORT_CONTEXT = (
    "the paper's ByteScale steps at 256K are 2.4-2.9x the predicted ones (35 s on GitHub, 55 s "
    "on Byted, from Fig. 17's throughput) while its static steps are 1.3-2x; at 2M both are "
    "1.0-1.6x: costs of its runtime at short context that the cost model does not price"
)
_FLEXSP = dict(
    system="flexsp",
    model=GPT_7B,
    workload="wikipedia-384k",
    gpus=64,
    tokens_per_step=512 * 1013,  # 512 sequences of the trace's mean length
    gpu="a100-40g",
    checkpointing=False,  # the paper: none needed for 7B on 64 GPUs
    gap="every micro-batch carries 2.4 s of ZeRO-3 parameter traffic on 64 A100s (gathers and "
    "an fp32 gradient reduce-scatter, as hdp's runtime does it): the 2 micro-batches a batch "
    "needs put a 4.8 s floor under flexsp (6.5 s) and ulysses, above the paper's 4.7 s FlexSP step",
)
_MEGATRON = dict(baseline="static", baseline_tp=(2, 4, 8))  # hand-tuned TP x CP: the fastest
_DEEPSPEED = dict(baseline="ulysses", baseline_tp=(1,), baseline_sync="wave")  # SP with ZeRO-3

ROWS = [
    Row(
        "ByteScale (arXiv 2502.21231)",
        "Fig. 17: llama-7b, Byted data, 256K context, 1,024 GPUs, over a static DP x CP mesh",
        (1.68, 1.68),
        workload="byted-2m",
        max_seq=256 << 10,
        gap=_SHORT_CONTEXT,
        **_BYTESCALE,
    ),
    Row(
        "ByteScale (arXiv 2502.21231)",
        "Fig. 17: llama-7b, GitHub data, 256K context, 1,024 GPUs, over a static DP x CP mesh",
        (1.73, 1.73),
        workload="github-2m",
        max_seq=256 << 10,
        gap=_SHORT_CONTEXT,
        **_BYTESCALE,
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
        "Fig. 4: GPT-7B, Wikipedia, 192K context, 64 A100-40GB, over Megatron-LM (TP x CP, "
        "best TP of 2, 4, 8)",
        (1.98, 1.98),
        max_seq=192 << 10,
        **_FLEXSP,
        **_MEGATRON,
    ),
    Row(
        "FlexSP (arXiv 2412.01523)",
        "Fig. 4: GPT-7B, Wikipedia, 192K context, 64 A100-40GB, over DeepSpeed (Ulysses SP)",
        (1.72, 1.72),
        max_seq=192 << 10,
        **_FLEXSP,
        **_DEEPSPEED,
    ),
    Row(
        "FlexSP (arXiv 2412.01523)",
        "Fig. 4: GPT-7B, Wikipedia, 384K context, 64 A100-40GB, over Megatron-LM (TP 8 x CP 8 "
        "as the paper ran it: 48K tokens per TP group)",
        (1.77, 1.77),
        max_seq=384 << 10,
        **_FLEXSP,
        baseline="static",
        baseline_tp=(8,),
        # Without checkpointing our memory model holds 45.7K tokens per TP-8 group; the paper's
        # runs held 48K (its own estimate per token is 5% below ours).
        baseline_capacity=48 << 10,
    ),
    Row(
        "FlexSP (arXiv 2412.01523)",
        "Fig. 4: GPT-7B, Wikipedia, 384K context, 64 A100-40GB, over DeepSpeed (SP 64 as the "
        "paper ran it: 6K tokens per GPU)",
        (1.46, 1.46),
        max_seq=384 << 10,
        **_FLEXSP,
        **_DEEPSPEED,
        baseline_capacity=6 << 10,  # our memory model holds 5.9K tokens per GPU without it
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


def _mean_step(row: Row, strategy: str, tp: int, steps: int, seed: int, progress) -> float:
    """Mean predicted step time of ``strategy`` over the row's seeded global batches (the same
    batches for every strategy and TP size: the sampling depends on the seed alone)."""
    gpu = gpu_preset(row.gpu)
    is_baseline = strategy == row.baseline
    capacity, sync = (row.baseline_capacity, row.baseline_sync) if is_baseline else (None, None)
    model = row.model if isinstance(row.model, ModelSpec) else model_preset(row.model)
    pricing = StepPricing.build(
        model,
        ClusterSpec(row.gpus, 8, gpu),
        capacity=capacity or row.capacity,
        activation_checkpointing=row.checkpointing,
        sync=sync,
        tensor_parallel=tp,
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
    )
    r = sim.results[strategy]
    if r.error is not None:
        raise PlanningError(f"{strategy} at TP {tp}: {r.error}")
    return r.mean()["step_time_s"]


def run_row(row: Row, steps: int, seed: int, progress) -> dict:
    """The row simulated: the paper's ratio, and hdp's margin over the paper's system. The
    baseline runs at each of its TP sizes (as the papers tuned it) and the fastest counts."""
    base = {}
    for tp in row.baseline_tp:
        try:
            base[tp] = _mean_step(row, row.baseline, tp, steps, seed, progress)
        except PlanningError as e:
            progress(f"{row.baseline} at TP {tp} does not fit: {e}")
    if not base:
        raise SystemExit(f"reproduce_papers.py: {row.setting}: no TP size fits {row.baseline}")
    tp = min(base, key=base.get)
    system = _mean_step(row, row.system, row.system_tp, steps, seed, progress)
    hdp = _mean_step(row, "hdp", row.system_tp, steps, seed, progress)
    ratio = base[tp] / system
    return {
        "simulated": ratio,
        "error": error(ratio, row.published),
        "hdp_over_system": system / hdp,
        "baseline_tp": tp,
        "step_s": {row.baseline: base[tp], row.system: system, "hdp": hdp},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=12, help="global batches per row (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument(
        "--rows",
        default=None,
        metavar="N,...",
        help=f"only these rows, numbered from 1 (of {len(ROWS)}; default all)",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
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
        out = run_row(row, args.steps, args.seed, lambda m: print(f"  {m}", file=sys.stderr))
        flag = "" if abs(out["error"]) <= TOLERANCE else f" (over 15%: {row.gap or 'unknown'})"
        print(
            f"| {row.paper} | {row.setting} | {published} | {out['simulated']:.2f}x "
            f"| {out['error']:+.0%}{flag} | {out['hdp_over_system']:.2f}x |",
            flush=True,
        )
        rows.append({"paper": row.paper, "setting": row.setting, **out})
    print(
        f"\n{args.steps} global batches per row, seed {args.seed}, {time.perf_counter() - t0:.0f} s"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
