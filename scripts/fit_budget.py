r"""Fit the planning budget's estimates (``planner/dynamic/budget.py``) to measured CPU time.

hdp's search charges its budget by estimates of each step's work, so that a plan never depends
on the machine's load. This plans a grid of batches (each in the free form and in the Megatron
form), records every placement, group layout (equal and mixed sizes), move search, regroup,
head-parallel first plan and Megatron-form pricing with the work it did and the CPU seconds it
took, and fits seconds per item of work by weighted least squares (coefficients kept
non-negative). It prints the fitted coefficients and, for the ones in the code, how measured
time compares with the estimate (quantiles of measured / estimated).

    python scripts/fit_budget.py            # about 10 minutes on one core
    python scripts/fit_budget.py --models llama-70b --scaling 1024:2,256:32:llama-70b --worst 5
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict

import numpy as np

import hdp.planner as planner
from hdp import ClusterSpec, model_preset
from hdp.planner import PlanningError, StepPricing, plan_and_evaluate
from hdp.planner.dynamic import DynamicOptions, megatron, mixed, search
from hdp.planner.dynamic.budget import Budget
from hdp.planner.dynamic.candidates import num_waves_for
from hdp.planner.menus import clear_menus
from hdp.workloads import get_workload, workload_names

RECORDS: list[dict] = []
CASE = [""]  # the batch being planned, for --worst


def _recorded(kind: str, ctx, t0: float, estimate: float, **work: float) -> None:
    measured = time.process_time() - t0
    RECORDS.append(dict(kind=f"{kind} {ctx.sync}", measured=measured, est=estimate, **work))
    RECORDS[-1]["case"] = CASE[0]


def _instrument() -> None:
    """Wrap the search's steps so that each records its work and CPU time."""
    place, improve = search.place, search.improve
    regroup = search.regroup
    group_plan, plans_at = search.group_plan, mixed.MixedGroupPlans.plans_at

    def timed_place(ctx, waves, cand):
        split = cand.degree > 1
        jobs, shards = int(split.sum()), int(cand.degree[split].sum()) + ctx.seq_lens.size
        guess = num_waves_for(ctx)
        t0 = time.process_time()
        plan = place(ctx, waves, cand)
        ctx.cost.evaluate(plan)
        n, seqs = ctx.num_ranks, ctx.seq_lens.size
        searched = plan.predicted["offload_searches"]
        _recorded("place", ctx, t0, Budget.placement_s(ctx, jobs, shards, guess, searched),
                  one=1, ranks=n, jobs_ranks=jobs * n, seqs=seqs, shards=shards,
                  waves_ranks=guess * n, jobs_waves_ranks=jobs * guess * n,
                  seqs_waves=seqs * guess, searches=searched)  # fmt: skip
        return plan

    def timed_improve(ctx, plan, report, seconds):
        t0 = time.process_time()
        out, work = improve(ctx, plan, report, seconds)
        _recorded("move", ctx, t0, Budget.move_s(ctx, work), one=1, seqs=ctx.seq_lens.size,
                  shards=plan.num_shards, searches=work.searches, tried=work.tried,
                  cells=work.cells)  # fmt: skip
        return out, work

    def timed_regroup(ctx, plan, report, seconds):
        t0 = time.process_time()
        out, spent = regroup(ctx, plan, report, seconds)
        trials = round(spent / Budget.regroup_trial_s(plan))
        cells = plan.num_waves * plan.num_ranks
        _recorded("regroup", ctx, t0, spent, trials=trials, seqs=trials * plan.seq_lens.size,
                  shards=trials * plan.num_shards, cells=trials * cells)  # fmt: skip
        return out, spent

    def timed_equal(ctx, groups, split, exact):
        g = ctx.num_ranks // groups
        shards = int((split & (ctx.seq_lens >= g)).sum()) * g + ctx.seq_lens.size
        t0 = time.process_time()
        plans = group_plan(ctx, groups, split, exact)
        for plan in plans:
            ctx.cost.evaluate(plan)
        seqs = ctx.seq_lens.size
        _recorded("equal", ctx, t0, Budget.layout_s(ctx, shards, groups), one=1, seqs=seqs,
                  shards=shards, seqs_log_groups=seqs * math.log2(groups),
                  ranks=ctx.num_ranks)  # fmt: skip
        return plans

    def timed_mixed(self, factor, way):
        shards = self.shards
        t0 = time.process_time()
        plans = plans_at(self, factor, way)
        for plan in plans:
            self.ctx.cost.evaluate(plan)
        _recorded("mixed", self.ctx, t0, Budget.layout_s(self.ctx, shards), one=1,
                  seqs=self.ctx.seq_lens.size, shards=shards, ranks=self.ctx.num_ranks)  # fmt: skip
        return plans

    rest = planner._rest_of_budget

    def timed_rest(options, plan, heads):
        """Time a head-parallel first plan from cold menus beside the P2P plan it follows."""
        jobs, shards, waves, searches, degrees = Budget.first_plan_work(heads, plan)
        placed = Budget.placement_s(heads, jobs, shards, waves, searches)
        clear_menus()
        t0 = time.process_time()
        try:
            search.plan_dynamic(heads, DynamicOptions(plan_budget_s=0.0))
        except PlanningError:
            return rest(options, plan, heads)
        estimate = Budget.first_plan_s(heads, jobs, shards, waves, searches, degrees)
        _recorded("first", heads, t0, estimate, placement=placed, jobs_degrees=jobs * degrees,
                  seqs=heads.seq_lens.size)  # fmt: skip
        return rest(options, plan, heads)

    price = megatron.price

    def timed_price(ctx, layout, token_multiple=1):
        t0 = time.process_time()
        out = price(ctx, layout, token_multiple)
        _recorded("megatron", ctx, t0, Budget.megatron_pricing_s(ctx, layout.shards), one=1,
                  ranks=ctx.num_ranks, shards=layout.shards)  # fmt: skip
        return out

    megatron.price = timed_price
    search.place, search.improve = timed_place, timed_improve
    search.group_plan, mixed.MixedGroupPlans.plans_at = timed_equal, timed_mixed
    search.regroup = timed_regroup
    planner._rest_of_budget = timed_rest


def _fit(rows: list[dict], features: list[str]) -> np.ndarray:
    """Non-negative least squares of measured seconds on ``features``, each record weighted
    by one over the square root of its seconds: between relative and absolute error, since
    the long steps decide what a large budget spends and the short ones what a small one
    affords."""
    x = np.array([[r[f] for f in features] for r in rows], dtype=np.float64)
    y = np.array([r["measured"] for r in rows])
    w = 1.0 / np.sqrt(np.maximum(y, 1e-4))
    active = list(range(len(features)))
    while True:
        coef = np.zeros(len(features))
        coef[active] = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)[0]
        if (coef[active] >= 0).all():
            return coef
        active = [i for i in active if coef[i] > 0]


FEATURES = {
    "place peer": ["one", "ranks", "jobs_ranks", "seqs", "shards", "waves_ranks"],
    "place wave": ["one", "jobs_waves_ranks", "seqs_waves", "shards", "searches"],
    "equal peer": ["one", "seqs", "shards", "seqs_log_groups", "ranks"],
    "equal wave": ["one", "seqs", "shards", "seqs_log_groups", "ranks"],
    "mixed peer": ["one", "seqs", "shards", "ranks"],
    "mixed wave": ["one", "seqs", "shards", "ranks"],
    "move peer": ["one", "seqs", "shards", "searches", "tried", "cells"],
    "move wave": ["one", "seqs", "shards", "searches", "tried", "cells"],
    "regroup peer": ["trials", "seqs", "shards", "cells"],
    "first peer": ["placement", "jobs_degrees", "seqs"],
    "first wave": ["placement", "jobs_degrees", "seqs"],
    "megatron peer": ["one", "ranks", "shards"],
    "megatron wave": ["one", "shards"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-7b,llama-70b")
    ap.add_argument("--gpus", default="64,256,1024")
    ap.add_argument(
        "--scaling",
        default="1024:2,16384:2,1024:32,4096:128,16384:256",
        help="RANKS:MTOKENS[:MODEL] batches (byted-2m and wikipedia-384k; llama-7b unless MODEL "
        "says) besides the grid",
    )
    ap.add_argument(
        "--worst", type=int, default=0, help="also print each kind's N records furthest over"
    )
    args = ap.parse_args()
    _instrument()
    cases = [
        (m, wl, int(n), None)
        for m in args.models.split(",")
        for wl in workload_names()
        for n in args.gpus.split(",")
    ]
    for point in args.scaling.split(","):
        n, mtok, *named = point.split(":")
        model = named[0] if named else "llama-7b"
        cases += [(model, wl, int(n), int(mtok)) for wl in ("byted-2m", "wikipedia-384k")]
    for model, wl, n, mtok in cases:
        size = {} if mtok is None else {"tokens_per_step": mtok << 20}
        lens = get_workload(wl).sample_batch(np.random.default_rng(0), **size)
        CASE[0] = f"{model} {wl} {n} ranks"
        t0 = time.process_time()
        pricing = StepPricing.build(model_preset(model), ClusterSpec.preset("h100", n))
        plan_and_evaluate(lens, pricing, "hdp", validate=False)
        every = DynamicOptions(form="megatron", plan_budget_s=float("inf"), gap=-1.0)
        plan_and_evaluate(lens, pricing, "hdp", hdp_options=every, validate=False)
        print(f"{model} {wl} {n} ranks, {lens.size} sequences: {time.process_time() - t0:.2f} s")
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for r in RECORDS:
        by_kind[r["kind"]].append(r)
    for kind, rows in sorted(by_kind.items()):
        coef = _fit(rows, FEATURES[kind])
        fitted = ", ".join(f"{f} {c:.3g}" for f, c in zip(FEATURES[kind], coef))
        ratio = np.array([r["measured"] / r["est"] for r in rows if r["est"] > 0])
        p10, p50, p90 = np.percentile(ratio, [10, 50, 90]) if ratio.size else (np.nan,) * 3
        print(
            f"{kind:12s} {len(rows):4d} records; fitted s per item: {fitted}\n"
            f"{'':12s} measured / the code's estimate: p10 {p10:.2f}, median {p50:.2f}, "
            f"p90 {p90:.2f}"
        )
        charged = [r for r in rows if r["est"] > 0]
        for r in sorted(charged, key=lambda r: -r["measured"] / r["est"])[: args.worst]:
            work = ", ".join(f"{f} {r[f]:.3g}" for f in FEATURES[kind])
            print(f"{'':14s}{r['measured'] / r['est']:6.2f}x {r['case']}: {work}")


if __name__ == "__main__":
    main()
