#!/usr/bin/env python3
"""The simulator grid of docs/benchmarks.md, as a markdown table and a chart.

Every strategy on the four standard workloads at several cluster sizes (each workload's own
max_seq and tokens_per_step).

    python scripts/bench_sim.py --gpus 64,256,1024 --steps 3 --out docs/figures
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hdp import ClusterSpec, gpu_preset, model_preset
from hdp.planner import STRATEGIES, StepPricing
from hdp.planner.sim import simulate
from hdp.workloads import get_workload, workload_names


def _progress(strategy: str, result: dict) -> str:
    """One strategy's step time and its ratio to the lower bound, for the progress line."""
    if "error" in result:
        return f"{strategy} failed"
    step, bound = result["step_time_s"], result["lower_bound_s"]
    return f"{strategy} {step:.2f}s ({step / bound:.2f}x LB)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="64,256,1024", help="comma-separated cluster sizes")
    p.add_argument("--workloads", default=",".join(workload_names()))
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hybridcp-impl", default="auto", choices=("auto", "megatron", "ours"))
    p.add_argument(
        "--out", type=Path, default=Path("docs/figures"), help="folder for the JSON and the PNG"
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_preset(args.model)
    names = list(STRATEGIES)
    rows = []
    for wl in args.workloads.split(","):
        w = get_workload(wl)
        for n in (int(x) for x in args.gpus.split(",")):
            t0 = time.perf_counter()
            hybridcp = STRATEGIES["hybridcp"].options(implementation=args.hybridcp_impl)
            sim = simulate(
                w,
                StepPricing.build(model, ClusterSpec(n, 8, gpu_preset(args.gpu))),
                names,
                steps=args.steps,
                seed=args.seed,
                options={"hybridcp": hybridcp},
            )
            res = sim.to_json()["results"]
            rows.append(
                {
                    "workload": wl,
                    "gpus": n,
                    "results": res,
                    "seconds": time.perf_counter() - t0,
                    "longest_seq_s": longest_sequence_time(
                        w, ClusterSpec(n, 8, gpu_preset(args.gpu)), model, args.steps, args.seed
                    ),
                }
            )
            print(
                f"{wl} {n}: " + ", ".join(_progress(s, res[s]) for s in names),
                file=sys.stderr,
                flush=True,
            )
    (args.out / "sim_grid.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows, names))
    chart(rows, names, args.out / "sim_grid.png")
    return 0


def longest_sequence_time(w, cluster: ClusterSpec, model, steps: int, seed: int) -> float:
    """Mean over the same sampled batches of the fastest the longest sequence runs, zigzag-split
    over any number of ranks (compute plus exposed KV traffic): no plan of that batch made of
    zigzag splits can finish sooner, whatever the lower bound says."""
    import numpy as np

    from hdp.planner.splits import split_times

    cost = StepPricing.build(model, cluster).cost
    cap = cost.capacity("peer")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        L = int(w.sample_batch(rng).max())
        lo = max(1, -(-L // cap))
        ds = sorted(set(np.geomspace(lo, cluster.num_ranks, 48).astype(int).tolist()) | {lo})
        ds = np.asarray([d for d in ds if d <= cluster.num_ranks], dtype=np.int64)
        out.append(float(split_times(cost, np.full(ds.size, L), ds)[0].min()))
    return float(np.mean(out))


def markdown(rows: list[dict], names: list[str]) -> str:
    head = (
        ["workload", "GPUs", "LB s", "longest seq s"]
        + [f"{s} s (xLB)" for s in names]
        + ["hdp vs static", "hdp vs best baseline", "hdp imbalance", "hdp exposed comm s"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        r = row["results"]
        ok = {s: r[s] for s in names if "error" not in r[s]}
        lb = next(iter(ok.values()))["lower_bound_s"]
        cells = [row["workload"], str(row["gpus"]), f"{lb:.2f}", f"{row['longest_seq_s']:.2f}"]
        for s in names:
            cells.append(
                f"{ok[s]['step_time_s']:.2f} ({ok[s]['step_time_s'] / lb:.2f})"
                if s in ok
                else "fails"
            )
        h = ok.get("hdp")
        base = [ok[s]["step_time_s"] for s in ok if s != "hdp"]
        cells.append(
            f"{ok['static']['step_time_s'] / h['step_time_s']:.2f}x"
            if h and "static" in ok
            else "-"
        )
        cells.append(f"{min(base) / h['step_time_s']:.2f}x" if h and base else "-")
        cells.append(f"{h['imbalance']:.2f}" if h else "-")
        cells.append(f"{h['exposed_comm_s']:.2f}" if h else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows: list[dict], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.6), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        sub = [r for r in rows if r["workload"] == wl]
        x = np.arange(len(sub))
        width = 0.8 / len(names)
        for i, s in enumerate(names):
            vals = [
                r["results"][s]["step_time_s"] / r["results"][s]["lower_bound_s"]
                if "error" not in r["results"][s]
                else np.nan
                for r in sub
            ]
            ax.bar(x + i * width, vals, width, label=s)
        ax.set_xticks(x + width * (len(names) - 1) / 2, [str(r["gpus"]) for r in sub])
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(wl, fontsize=10)
        ax.set_xlabel("GPUs")
    axes[0][0].set_ylabel("step time / lower bound (log)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
