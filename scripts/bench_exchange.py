#!/usr/bin/env python3
"""NIC bytes per rank of the longest sequence, ``rank`` against ``node`` K/V exchange.

Plans one byted-2m global batch for llama-7b on 1024 H100s (8 per node) with hdp, then prices
the same placement in both exchanges: the K/V each rank holding the batch's longest sequence
receives through its NIC per step (forward, and again backward), and the step time.

    python scripts/bench_exchange.py --out docs/figures
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from hdp import ClusterSpec, model_preset
from hdp.planner import StepPricing, plan_and_evaluate
from hdp.workloads import get_workload


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=1024)
    p.add_argument("--workload", default="byted-2m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON and the PNG")
    args = p.parse_args()
    model = model_preset("llama-7b")
    cluster = ClusterSpec.preset("h100", args.gpus)
    pricing = StepPricing.build(model, cluster, kv_exchange="node")
    cost = pricing.cost
    lens = get_workload(args.workload).sample_batch(np.random.default_rng(args.seed))
    plan, _ = plan_and_evaluate(lens, pricing, "hdp")
    longest = int(np.argmax(lens))
    ranks = np.unique(plan.rank[plan.seq == longest])
    wave = int(plan.seq_wave()[longest])
    per_token = model.kv_bytes_per_token * model.layers * 2  # forward, and again backward
    rows = {}
    for exchange in ("rank", "node"):
        priced = plan.with_exchange(exchange)
        nic = cost.kv_traffic(priced).in_inter[wave, ranks] * per_token
        rows[exchange] = {
            "step_s": cost.evaluate(priced).step_time_s,
            "nic_gb_per_rank": (nic / 1e9).tolist(),
        }
        print(
            f"{exchange:>4}: step {rows[exchange]['step_s']:7.2f} s; NIC K/V received by the "
            f"{ranks.size} ranks of the {lens[longest]}-token sequence: mean "
            f"{nic.mean() / 1e9:6.1f} GB, max {nic.max() / 1e9:6.1f} GB per step"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"workload": args.workload, "gpus": args.gpus, "length": int(lens[longest])}
        (args.out / "bench_exchange.json").write_text(json.dumps({**meta, **rows}, indent=1))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        for exchange, r in rows.items():
            ax.plot(r["nic_gb_per_rank"], label=f"{exchange} exchange", lw=1)
        ax.set_xlabel(f"member of the {lens[longest]}-token sequence's group (rank order)")
        ax.set_ylabel("K/V through its NIC, GB/step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "exchange_nic.png", dpi=120)
        print(f"wrote {args.out / 'bench_exchange.json'} and {args.out / 'exchange_nic.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
