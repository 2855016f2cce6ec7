#!/usr/bin/env python3
"""hdp's margins over the baselines tuned as their authors would run them, at the settings a
user runs (``hdp-sim``'s defaults: llama-7b, 64-1,024 GPUs, the standard workloads).

    python scripts/tuned_baselines.py                       # h100 and a100-80g, ~15 minutes
    python scripts/tuned_baselines.py --gpus 64 --workloads wlb-128k --devices h100

Each row is ``hdp-sim`` on the same seeded global batches: every strategy's mean step, its
ratio to the static mesh, the value each baseline's knobs were tuned to (Note [Tuning the
baselines] in ``hdp.planner.tuning``), the dominant cost of its slowest rank, and hdp's margin
over the static mesh and over the fastest tuned baseline. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time

from hdp import ClusterSpec, gpu_preset, model_preset
from hdp.planner import StepPricing, get_strategy
from hdp.planner.sim import simulate
from hdp.workloads import get_workload

BASELINES = ("static", "ulysses", "hybridcp", "bytescale", "flexsp")


def row(workload: str, device: str, gpus: int, model: str, steps: int, seed: int) -> str:
    pricing = StepPricing.build(model_preset(model), ClusterSpec(gpus, 8, gpu_preset(device)))
    sim = simulate(get_workload(workload), pricing, [*BASELINES, "hdp"], steps=steps, seed=seed)
    step = {n: r.mean()["step_time_s"] for n, r in sim.results.items() if r.error is None}
    cells = []
    for name in BASELINES:
        r = sim.results[name]
        if r.error is not None:
            cells.append("fails")
            continue
        knob = get_strategy(name).knob(r.tuned.options) if r.tuned else None
        tuned = f", {knob[0]} {knob[1]}" if knob else ""
        dominant = r.slowest_mean().dominant if r.slowest else "-"
        cells.append(f"{step[name]:.1f} s ({step['static'] / step[name]:.2f}x{tuned}; {dominant})")
    best = min((step[n], n) for n in BASELINES if n in step)
    hdp = step["hdp"]
    return (
        f"| {workload} | {device} | {gpus} | "
        + " | ".join(cells)
        + f" | {hdp:.1f} s | {step['static'] / hdp:.2f}x | {best[0] / hdp:.2f}x ({best[1]}) |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="byted-2m,github-2m,wlb-128k")
    p.add_argument("--devices", default="h100,a100-80g")
    p.add_argument("--gpus", default="64,256,1024")
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    head = ["workload", "GPU", "GPUs", *BASELINES, "hdp", "hdp vs static", "hdp vs best baseline"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for device in args.devices.split(","):
        for workload in args.workloads.split(","):
            for gpus in (int(g) for g in args.gpus.split(",")):
                print(row(workload, device, gpus, args.model, args.steps, args.seed), flush=True)
    print(f"\n{args.model}, {args.steps} steps, seed {args.seed}, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
