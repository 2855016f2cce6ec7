r"""Random search for batches where hdp's plan trails a baseline's, or a plan beats hdp's bound.

Batches are drawn as ``tests/test_bounds.py`` draws them, only larger: one to three sequences of
half to eight times the capacity and up to ``--shorts`` shorter ones, on a random profile (cpu
with the tiny model, h100 and a100-80g with llama-7b), cluster size, node size, capacity and sync
mode. Every strategy plans each batch under the same pricing; ``flexsp-rank`` is FlexSP's
placement run with the P2P exchange. A line is printed for every violation, then one summary.

    python scripts/search_trails.py --batches 150 --seed 1
    python scripts/search_trails.py --ranks 64,128 --profiles h100 --batches 40 --shorts 300
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from hdp import ClusterSpec, model_preset
from hdp.planner import STRATEGIES, PlanningError, StepPricing, plan_step

MODELS = {"cpu": "tiny", "h100": "llama-7b", "a100-80g": "llama-7b"}


def draw(rng: np.random.Generator, args: argparse.Namespace) -> tuple[StepPricing, np.ndarray, str]:
    """One batch, its pricing, and a line that says how to rebuild both."""
    profile = str(rng.choice(args.profiles))
    n = int(rng.choice(args.ranks))
    per_node = int(rng.choice([2, 4, 8]))
    cap = int(rng.choice([1024, 2048, 4096]))
    sync = str(rng.choice(["peer", "wave"]))
    longs = rng.integers(cap // 2, 8 * cap, int(rng.integers(1, 4)))
    lens = np.concatenate([longs, rng.integers(1, cap, int(rng.integers(0, args.shorts + 1)))])
    cluster = ClusterSpec.preset(profile, n, per_node)
    pricing = StepPricing.build(model_preset(MODELS[profile]), cluster, capacity=cap, sync=sync)
    where = f"{profile} {n} ranks / {per_node} a node, capacity {cap}, {sync}"
    return pricing, lens, where


def plans(lens: np.ndarray, pricing: StepPricing) -> tuple[dict[str, dict], float]:
    """Each strategy's ``predicted`` (those that cannot plan the batch left out), and hdp's
    planning time (s of CPU)."""
    out, hdp_cpu_s = {}, 0.0
    runs = [(name, name, pricing) for name in STRATEGIES]
    runs.append(("flexsp-rank", "flexsp", replace(pricing, kv_exchange="rank")))
    for key, name, priced in runs:
        opts = {"hybridcp_impl": "ours"} if name == "hybridcp" else {}
        t0 = time.process_time()
        try:
            out[key] = plan_step(lens, priced, name, **opts).predicted
        except PlanningError:
            continue
        if key == "hdp":
            hdp_cpu_s = time.process_time() - t0
    return out, hdp_cpu_s


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", type=int, default=100, help="how many batches to draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", default="12,16,24,32,64", help="cluster sizes to draw from")
    ap.add_argument("--profiles", default="cpu,h100,a100-80g", help="GPU profiles to draw from")
    ap.add_argument("--shorts", type=int, default=40, help="most sequences under the capacity")
    args = ap.parse_args()
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.profiles = args.profiles.split(",")
    unknown = sorted(set(args.profiles) - set(MODELS))
    if unknown:
        ap.error(f"--profiles: no model is set for {', '.join(unknown)}; use {', '.join(MODELS)}")
    rng = np.random.default_rng(args.seed)
    trails = under = planned = 0
    worst, hdp_cpu = 1.0, []
    for k in range(args.batches):
        pricing, lens, where = draw(rng, args)
        got, cpu_s = plans(lens, pricing)
        if "hdp" not in got:
            continue
        planned += 1
        hdp_cpu.append(cpu_s)
        hdp = got["hdp"]
        for name, p in got.items():
            if p["step_time_s"] < hdp["bound_s"] * (1 - 1e-9):
                under += 1
                print(f"batch {k}: {name} steps under hdp's bound; {where}; {lens.tolist()}")
            ratio = hdp["step_time_s"] / p["step_time_s"]
            if ratio > 1 + 1e-9:
                trails += 1
                worst = max(worst, ratio)
                print(f"batch {k}: hdp {ratio:.3f}x {name}'s step; {where}; {lens.tolist()}")
    cpu = np.array(hdp_cpu or [0.0])
    print(
        f"{planned} batches planned: hdp behind a baseline {trails} times (worst {worst:.3f}x), "
        f"a plan under hdp's bound {under} times; hdp planning {cpu.mean():.2f} s mean, "
        f"{cpu.max():.2f} s most (CPU)"
    )


if __name__ == "__main__":
    main()
