"""Hashes of the plans every strategy makes on the planner benchmark's grid.

A refactor of the planner must not change a plan: record the hashes before, check them after.

    python scripts/plan_hashes.py --write tests/data/plan_hashes.json  # record
    python scripts/plan_hashes.py --check tests/data/plan_hashes.json  # compare; 1 on a change

A plan's hash covers everything that decides what runs (shards, waves, offload, barriers, sync,
K/V block size, capacity, K/V exchange); not ``predicted``, which holds timings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np
from bench_planner import bench_strategy

from hdp import ClusterSpec, Plan, model_preset
from hdp.planner import StepPricing, plan_step
from hdp.workloads import get_workload, workload_names

STRATEGIES = ("static", "hybridcp", "bytescale", "hdp", "hdp-megatron")


def plan_hash(plan: Plan) -> str:
    """sha256 of the parts of ``plan`` that decide what runs."""
    h = hashlib.sha256()
    for a in (plan.seq_lens, plan.rank, plan.wave, plan.seq, plan.start, plan.end):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(plan.offload, dtype=np.float64).tobytes())
    meta = [
        plan.num_ranks,
        plan.num_waves,
        plan.sync,
        list(plan.barriers),
        plan.kv_block_tokens,
        plan.capacity,
    ]
    if plan.kv_exchange != "rank":  # rank-exchange plans keep the hashes recorded before it
        meta.append(plan.kv_exchange)
    h.update(json.dumps(meta).encode())
    return h.hexdigest()[:16]


def grid_hashes(models, gpus, workloads, strategies, seed=0) -> dict[str, str]:
    out = {}
    for model_name in models:
        model = model_preset(model_name)
        for wl in workloads:
            lens = get_workload(wl).sample_batch(np.random.default_rng(seed))
            for n in gpus:
                cluster = ClusterSpec.preset("h100", n)
                pricing = StepPricing.build(model, cluster)
                for strategy in strategies:
                    name, kw = bench_strategy(strategy)
                    key = f"{model_name}/{wl}/{n}/{strategy}"
                    t0 = time.perf_counter()
                    try:
                        out[key] = plan_hash(plan_step(lens, pricing, name, **kw))
                    except Exception as e:  # noqa: BLE001 - a baseline that cannot plan here
                        out[key] = f"error: {type(e).__name__}"
                    print(f"{key:45s} {out[key]}  {time.perf_counter() - t0:6.2f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="llama-7b,llama-70b")
    ap.add_argument("--gpus", default="64,256,1024")
    ap.add_argument("--workloads", default=",".join(workload_names()))
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="JSON", help="record the hashes in this file")
    mode.add_argument("--check", metavar="JSON", help="compare with the hashes in this file")
    args = ap.parse_args()
    got = grid_hashes(
        args.models.split(","),
        [int(g) for g in args.gpus.split(",")],
        args.workloads.split(","),
        args.strategies.split(","),
    )
    if args.write:
        with open(args.write, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {len(got)} hashes to {args.write}")
        return
    with open(args.check) as f:
        want = json.load(f)
    changed = [k for k in got if k in want and want[k] != got[k]]
    missing = [k for k in got if k not in want]
    for k in changed:
        print(f"changed: {k}: {want[k]} -> {got[k]}")
    for k in missing:
        print(f"not recorded: {k}")
    print(f"{len(got) - len(changed) - len(missing)} of {len(got)} plans identical")
    sys.exit(1 if changed or missing else 0)


if __name__ == "__main__":
    main()
