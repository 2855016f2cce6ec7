r"""The planner's targets, measured side by side in one run.

1. Quality: every strategy on the four standard workloads at several cluster sizes, for each
   model: step / simple lower bound, step / the planner's bound (``predicted["bound_s"]``), and
   hdp's speed-up over each baseline.
2. Planning time of hdp on one core as the cluster and the batch grow (llama-7b unless
   ``--planning-model`` says; byted-2m by default, 32K tokens per rank: 1024 ranks = 32M
   tokens, 16,384 ranks = 512M; plus 16,384 ranks at 256M tokens), at each budget asked for.

    python scripts/bench_planner.py --models llama-7b,llama-70b --gpus 64,256,1024 \
        --out docs/figures
    python scripts/bench_planner.py --parts planning --scaling 1024:2M,16384:2M \
        --planning-workloads byted-2m,wikipedia-384k --plan-budgets 0,default,0.2 \
        --planning-repeats 5
    python scripts/bench_planner.py --parts planning --planning-model llama-70b \
        --scaling 64:32M,256:32M --planning-workloads byted-2m,github-2m --plan-budgets 0,0.5,2
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from hdp import ClusterSpec, model_preset
from hdp.planner import StepPricing, plan_and_evaluate
from hdp.planner.dynamic import DynamicOptions
from hdp.planner.menus import clear_menus
from hdp.workloads import get_workload, workload_names

BASELINES = ["static", "hybridcp", "bytescale", "flexsp"]


def bench_strategy(row_name: str) -> tuple[str, dict]:
    """The strategy and ``plan_step`` options of a benchmark row (``hdp-megatron``: hdp's
    Megatron form; ``hybridcp``: our re-implementation, with megatron-core's decisions)."""
    if row_name == "hdp-megatron":
        return "hdp", {"form": "megatron"}
    if row_name == "hybridcp":
        return "hybridcp", {"hybridcp_impl": "ours"}
    return row_name, {}


def quality(models: list[str], gpus: list[int], workloads: list[str], seed: int) -> list[dict]:
    rows = []
    for model_name in models:
        model = model_preset(model_name)
        for wl in workloads:
            lens = get_workload(wl).sample_batch(np.random.default_rng(seed))
            for n in gpus:
                cluster = ClusterSpec.preset("h100", n)
                pricing = StepPricing.build(model, cluster)
                row = {"model": model_name, "workload": wl, "gpus": n}
                for strategy in BASELINES + ["hdp", "hdp-megatron"]:
                    name, kw = bench_strategy(strategy)
                    try:
                        plan, rep = plan_and_evaluate(lens, pricing, name, **kw)
                    except Exception as e:  # a baseline that cannot form its groups here
                        row[strategy] = {"error": str(e)}
                        continue
                    row[strategy] = {
                        "step_s": rep.step_time_s,
                        "lb_s": rep.lower_bound_s,
                        "bound_s": plan.predicted.get("bound_s"),
                        "plan_s": rep.plan_time_s,
                        "sync": plan.sync,
                    }
                rows.append(row)
                h = row["hdp"]
                base = {b: row[b]["step_s"] / h["step_s"] for b in BASELINES if "step_s" in row[b]}
                print(
                    f"{model_name:9s} {wl:15s} {n:5d}  hdp {h['step_s']:9.2f} s  xLB "
                    f"{h['step_s'] / h['lb_s']:5.2f}  "
                    f"xbound {h['step_s'] / h['bound_s']:5.3f}  plan {h['plan_s']:5.2f} s  "
                    + "  ".join(f"vs {b} {v:5.2f}x" for b, v in base.items())
                    + (
                        "  megatron-form xbound "
                        f"{row['hdp-megatron']['step_s'] / row['hdp-megatron']['bound_s']:5.3f}"
                        if "step_s" in row["hdp-megatron"]
                        else ""
                    ),
                    flush=True,
                )
    return rows


def planning_time(
    points: list[tuple[int, int]],
    seeds: list[int],
    workloads: list[str],
    budgets: list[str],
    model_name: str = "llama-7b",
    repeats: int = 1,
) -> list[dict]:
    """hdp's planning time (CPU of one core) on a fresh batch of each workload and seed at each
    (ranks, tokens) point, at each of ``budgets`` (``default`` or seconds), after one warm-up
    plan (imports, kernel tables) that is not counted; the least of ``repeats`` plans, each
    from a cold start (a plan depends only on the batch, so they are the same plan). Where
    ``0`` is among the budgets, each other budget's row says what its search spent past the
    first plan, as a share of it."""
    rows = []
    model = model_preset(model_name)
    if points:  # the warm-up: a batch of a seed not asked for
        warm = get_workload(workloads[0]).sample_batch(
            np.random.default_rng(max(seeds) + 1), tokens_per_step=1 << 22
        )
        plan_and_evaluate(warm, ClusterSpec.preset("h100", points[0][0]), model, "hdp")
    for n, tokens in points:
        cluster = ClusterSpec.preset("h100", n)
        for wl, seed in [(w, s) for w in workloads for s in seeds]:
            lens = get_workload(wl).sample_batch(
                np.random.default_rng(seed), tokens_per_step=tokens
            )
            first_cpu = None
            for budget in budgets:
                given = None if budget == "default" else float(budget)
                total, cpu, plan_s = math.inf, math.inf, math.inf
                for _ in range(repeats):
                    clear_menus()  # each plan from a cold start, as a step's new lengths are
                    t0, c0 = time.perf_counter(), time.process_time()
                    plan, rep = plan_and_evaluate(
                        lens, cluster, model, "hdp",
                        hdp_options=DynamicOptions(plan_budget_s=given), validate=False,
                    )  # fmt: skip
                    total = min(total, time.perf_counter() - t0)
                    cpu = min(cpu, time.process_time() - c0)
                    plan_s = min(plan_s, rep.plan_time_s)
                first_cpu = cpu if given == 0 else first_cpu
                row = {
                    "gpus": n,
                    "tokens": tokens,
                    "workload": wl,
                    "seed": seed,
                    "budget": budget,
                    "sequences": int(lens.size),
                    "plan_s": plan_s,
                    "with_evaluation_s": total,
                    "cpu_s": cpu,
                    "x_bound": rep.step_time_s / plan.predicted["bound_s"],
                }
                rows.append(row)
                spent = (
                    f"  past the first plan {(cpu - first_cpu) / given:4.2f} x its budget"
                    if first_cpu is not None and given
                    else ""
                )
                print(
                    f"planning: {n:6d} ranks  {tokens / 2**20:6.0f}M tokens  {wl:15s} seed "
                    f"{seed:3d}  {lens.size:7d} sequences  budget {budget:>7s}  plan "
                    f"{plan_s:6.3f} s  (CPU in all {cpu:6.3f} s)  step/bound "
                    f"{row['x_bound']:.3f}{spent}",
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="llama-7b,llama-70b")
    ap.add_argument(
        "--planning-model",
        default="llama-7b",
        help="model of the planning-time part (llama-70b plans in wave sync, llama-7b in peer)",
    )
    ap.add_argument("--gpus", default="64,256,1024")
    ap.add_argument("--workloads", default=",".join(workload_names()))
    ap.add_argument(
        "--scaling",
        default="256:8M,1024:32M,4096:128M,16384:256M,16384:512M",
        help="RANKS:TOKENS points for the planning-time curve",
    )
    ap.add_argument(
        "--planning-workloads", default="byted-2m", help="workloads of the planning-time part"
    )
    ap.add_argument(
        "--plan-budgets",
        default="default",
        help="hdp's budgets in the planning-time part, comma-separated: default or seconds "
        "(with 0 among them, each row says what its search spent past the first plan)",
    )
    ap.add_argument("--seed", type=int, default=0, help="batch seed of the quality part")
    ap.add_argument(
        "--planning-seeds",
        default="0",
        help="comma-separated seeds: one fresh batch each at every --scaling point",
    )
    ap.add_argument(
        "--planning-repeats",
        type=int,
        default=1,
        help="plans of each batch and budget in the planning-time part, the least time kept "
        "(timing noise only adds)",
    )
    ap.add_argument(
        "--parts",
        default="quality,planning",
        help="which parts to run: quality, planning or both (comma-separated)",
    )
    ap.add_argument(
        "--out", default=None, help="folder for bench_planner.json and planner_time.png"
    )
    args = ap.parse_args()
    from hdp.specs import parse_size

    parts = set(args.parts.split(","))
    if not parts or parts - {"quality", "planning"}:
        ap.error(f"--parts {args.parts!r}: choose quality, planning or quality,planning")
    q = (
        quality(
            args.models.split(","),
            [int(g) for g in args.gpus.split(",")],
            args.workloads.split(","),
            args.seed,
        )
        if "quality" in parts
        else []
    )
    points = [
        (int(p.split(":")[0]), parse_size(p.split(":")[1])) for p in args.scaling.split(",") if p
    ]
    seeds = [int(x) for x in args.planning_seeds.split(",") if x]
    s = (
        planning_time(
            points,
            seeds,
            args.planning_workloads.split(","),
            args.plan_budgets.split(","),
            args.planning_model,
            args.planning_repeats,
        )
        if "planning" in parts and seeds
        else []
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_planner.json").write_text(json.dumps({"quality": q, "planning": s}, indent=1))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ax[0].loglog([r["gpus"] for r in s], [r["plan_s"] for r in s], "o-")
        ax[0].set_xlabel("ranks")
        ax[0].set_ylabel("hdp planning time per step, s (one core)")
        ax[1].loglog([r["sequences"] for r in s], [r["plan_s"] for r in s], "o-")
        ax[1].set_xlabel("sequences in the global batch")
        for a in ax:
            a.axhline(0.5, ls=":", c="gray")
            a.axhline(5.0, ls=":", c="gray")
            a.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "planner_time.png", dpi=120)
        print(f"wrote {out / 'bench_planner.json'} and {out / 'planner_time.png'}")


if __name__ == "__main__":
    main()
