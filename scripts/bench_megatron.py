"""Our Megatron scheduler (``hdp.dataloader.megatron.HDPScheduler``) against megatron-core's own
``BalancedCPScheduler``, side by side on the same global batches.

For each standard workload and cluster size: both schedules priced by the one cost model as
Megatron executes them (``megatron_plan``: one sub-sample per micro-batch, CP partners in lock
step, barriers between groups), each step time over the simple lower bound (``LB``) and over the
planner's bound for any plan (``bound``), and the wall time each scheduler took (one core).
Batches hold 64K tokens per rank; ``max_seqlen_per_dp_cp_rank`` is the capacity the cost model
derives from memory.

    python scripts/bench_megatron.py --gpus 64,256,1024 --out docs/figures
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np

from hdp import ClusterSpec, gpu_preset, model_preset
from hdp.dataloader.megatron import HDPScheduler, megatron_plan
from hdp.planner import StepPricing
from hdp.planner.degrees import step_bound
from hdp.planner.hybridcp import GroupOfSize
from hdp.workloads import get_workload, workload_names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="64,256,1024", help="comma-separated DPxCP sizes")
    p.add_argument("--workloads", default=",".join(workload_names()))
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--tokens-per-rank", type=int, default=64 * 1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write bench_megatron.json and bench_megatron.png here",
    )
    args = p.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    rows = []
    print(
        f"{'workload':15s} {'GPUs':>5s} {'cap':>6s} | "
        f"{'ours s':>8s} {'xLB':>5s} {'xbound':>6s} {'sched s':>7s} | "
        f"{'Megatron s':>10s} {'xLB':>5s} {'xbound':>6s} {'sched s':>7s} | {'speed-up':>8s}",
        flush=True,
    )
    for wl in args.workloads.split(","):
        w = get_workload(wl)
        for n in [int(x) for x in args.gpus.split(",")]:
            cluster = ClusterSpec(n, min(8, n), gpu_preset("h100"))
            pricing = StepPricing.build(model_preset(args.model), cluster)
            cap = pricing.cost.capacity("peer")  # from memory
            ours = HDPScheduler(cap, GroupOfSize(n), model=args.model)
            lens = w.sample_batch(
                np.random.default_rng(args.seed), n * args.tokens_per_rank, min(w.max_seq, n * cap)
            )
            items = list(enumerate(int(x) for x in lens))
            _, our_groups = ours.get_groups_and_subsamples(items, None)
            t_ours_sched = ours.last_schedule_s
            t0 = time.perf_counter()
            _, their_groups = BalancedCPScheduler(cap, GroupOfSize(n)).get_groups_and_subsamples(
                items, None
            )
            t_their_sched = time.perf_counter() - t0
            mine, theirs = ours.executed_plan(), megatron_plan(ours.cost, items, their_groups)
            bound = float(step_bound(ours.cost, lens, mine.sync, cap))
            row = {
                "workload": wl,
                "gpus": n,
                "capacity": cap,
                "sequences": int(lens.size),
                "bound_s": bound,
                "ours": {
                    "step_s": mine.predicted["step_time_s"],
                    "lb_s": mine.predicted["lower_bound_s"],
                    "schedule_s": t_ours_sched,
                    "groups": len(our_groups),
                },
                "megatron": {
                    "step_s": theirs.predicted["step_time_s"],
                    "lb_s": theirs.predicted["lower_bound_s"],
                    "schedule_s": t_their_sched,
                    "groups": len(their_groups),
                },
            }
            rows.append(row)
            o, m = row["ours"], row["megatron"]
            print(
                f"{wl:15s} {n:5d} {cap:6d} | "
                f"{o['step_s']:8.2f} {o['step_s'] / o['lb_s']:5.2f} {o['step_s'] / bound:6.3f} "
                f"{o['schedule_s']:7.2f} | "
                f"{m['step_s']:10.2f} {m['step_s'] / m['lb_s']:5.2f} {m['step_s'] / bound:6.3f} "
                f"{m['schedule_s']:7.2f} | {m['step_s'] / o['step_s']:7.2f}x",
                flush=True,
            )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_megatron.json").write_text(json.dumps(rows, indent=1))
        plot(rows, args.out / "bench_megatron.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.2), sharey=True)
    for ax, wl in zip(np.atleast_1d(axes), workloads):
        sub = [r for r in rows if r["workload"] == wl]
        x = np.arange(len(sub))
        ax.bar(
            x - 0.2,
            [r["megatron"]["step_s"] / r["bound_s"] for r in sub],
            0.4,
            label="BalancedCPScheduler",
        )
        ax.bar(
            x + 0.2, [r["ours"]["step_s"] / r["bound_s"] for r in sub], 0.4, label="HDPScheduler"
        )
        ax.set_xticks(x, [str(r["gpus"]) for r in sub])
        ax.set_title(wl)
        ax.set_xlabel("GPUs")
        ax.axhline(1.0, color="k", lw=0.8)
    np.atleast_1d(axes)[0].set_ylabel("step time / bound")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
