"""The ``hdp`` search: the relaxation, its rounding, and one local search under a time budget.

Note [One search]
-----------------
A plan gives every sequence a degree (how many ranks split it) and a place (ranks and a wave).

1. *Relaxation* (:func:`hdp.planner.degrees.relaxation_bound`): every sequence that may split
   gets a menu of degrees priced by the cost model (:mod:`hdp.planner.menus`); the sweep finds
   the height ``M`` that minimises ``max(M, area / ranks)`` when each sequence takes its
   smallest-area degree no taller than ``M``. Where lengths repeat, the MILP over the same
   menus (:mod:`.milp`) chooses how many of a length take each degree.
2. *Rounding*: the relaxation's degrees at a few heights around ``M`` (:func:`rounding_heights`)
   are each placed by the list scheduler of the sync mode (:mod:`.place`), and priced by the
   cost model; the fastest is kept.
3. *Local search* on the kept plan, each move priced by the cost model and kept where the step
   falls (:class:`Search`):

   - *widen*: the sequence that sets the step (the busiest of the cells that end it) steps up
     its menu, one degree at a time, and the degrees are placed again;
   - *join* (``peer`` sync): each rank's first cell after its last multi-rank job joins that
     job's cell, so the rank pays a micro-batch's fixed cost once;
   - *move* (:mod:`.local`): whole sequences leave the cells that end the step for the cells
     where they raise it least.

   It stops where the step is within ``options.gap`` of the bound or the budget is spent.
4. *Group layouts* (:mod:`.groups`, :mod:`.mixed`): where the budget allows, the ranks cut
   into groups that each run their sequences in shared waves. No move of the local search
   reaches such a plan from the relaxation's (a degree at a time never lines many sequences up
   on the same ranks), and on small batches they win where splitting saves work (the CPU's
   reference attention) or sequences share a group's fixed costs.

Example: 8 ranks, ``peer`` sync, one 64K-token sequence and 40 of 1K. The relaxation gives the
long one 5 ranks at ``M`` and the short ones stay whole; rounding at ``M`` places the long one on
ranks 0-4 and the short ones, longest first, on the least-loaded ranks. Ranks 0-4 then run the
long one's shares and, after it, a few short ones in cells of their own: *join* puts those into
the long one's cell, and *move* evens out what is left.

The budget (``options.plan_budget_s``) is charged by an estimate of each placement's work
(:meth:`Budget.placement_s`), not by the clock, so a plan depends only on the batch and the
options.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from hdp import Plan, StepReport, ulysses

from ..common import Context, PlanBuilder, PlanningError
from ..degrees import Jobs, Relaxation, relaxation_bound, step_bound
from ..splits import head_split_times, split_times
from . import milp
from .candidates import Candidate, num_waves_for
from .groups import group_counts, group_plan, group_splits
from .local import improve
from .megatron import plan_megatron_form
from .mixed import mixed_group_plans
from .options import DynamicOptions
from .place import place

NATIVE_SYNC = "peer"

# Seconds of one core per unit of :meth:`Budget.placement_s`'s work estimate (a placement and
# its pricing), fitted on the bench's batches at 64-16,384 ranks.
SECONDS_PER_UNIT = 1e-7


@dataclass
class Budget:
    """What the search may still spend (s), charged by estimates, not by the clock."""

    left_s: float

    def placement_s(self, ctx: Context, jobs: int, shards: int = 0) -> float:
        """Estimated seconds of one placement and its pricing: the sequences once per wave,
        every rank for each multi-rank job, and the shards the cost model prices."""
        waves = num_waves_for(ctx)
        units = ctx.seq_lens.size * (waves + 4) + ctx.num_ranks * (jobs + waves) + 10 * shards
        return units * SECONDS_PER_UNIT

    def spend(self, seconds: float) -> None:
        self.left_s -= seconds

    def affords(self, seconds: float) -> bool:
        return seconds <= self.left_s


class Search:
    """The best plan so far, its report and its degrees, and the moves that improve it."""

    def __init__(self, ctx: Context, options: DynamicOptions, rel: Relaxation, bound_s: float):
        self.ctx, self.options, self.rel, self.bound_s = ctx, options, rel, bound_s
        self.budget = Budget(options.plan_budget_s)
        self.best: tuple[Plan, StepReport, Candidate] | None = None

    @property
    def step_s(self) -> float:
        return self.best[1].step_time_s if self.best else math.inf

    def done(self) -> bool:
        return self.step_s <= self.bound_s * (1 + self.options.gap) or self.budget.left_s <= 0

    def consider(self, plan: Plan, cand: Candidate | None = None) -> bool:
        """Keep ``plan`` where it is faster than the best so far; whether it was."""
        report = self.ctx.cost.evaluate(plan)
        if report.step_time_s >= self.step_s:
            return False
        self.best = (plan, report, cand)
        return True

    def place(self, cand: Candidate) -> bool:
        """Place ``cand``, charge the budget, keep it where faster; whether it was."""
        split = cand.degree > 1
        self.budget.spend(
            self.budget.placement_s(self.ctx, int(split.sum()), int(cand.degree[split].sum()))
        )
        return self.consider(place(self.ctx, num_waves_for(self.ctx), cand), cand)

    def widen(self) -> bool:
        """Step the sequence that sets the step up its menu and place again (Note [One
        search]); whether that was faster."""
        plan, report, cand = self.best
        if cand is None:
            return False
        seq = critical_sequence(self.ctx, plan, report)
        wider = self._wider(cand, seq)
        return wider is not None and self.place(wider)

    def _wider(self, cand: Candidate, seq: int) -> Candidate | None:
        """``cand`` with sequence ``seq`` on its next wider degree (``None``: none is faster)."""
        ctx, d = self.ctx, int(cand.degree[seq])
        length = int(ctx.seq_lens[seq])
        degrees = np.arange(d + 1, min(ctx.num_ranks, max(1, length // 2)) + 1)[:8]
        if degrees.size == 0:
            return None
        times = split_busy(ctx, np.full(degrees.size, length), degrees)
        faster = np.flatnonzero(times < cand.job_time[seq] * (1 - 1e-9))
        if faster.size == 0:
            return None
        k = int(faster[0])
        degree, job_time = cand.degree.copy(), cand.job_time.copy()
        degree[seq], job_time[seq] = degrees[k], times[k]
        return Candidate(degree, job_time)

    def join(self) -> bool:
        """``peer`` sync: every rank's first cell after its last multi-rank job joins that
        job's cell where it has token room; whether that was faster."""
        plan = self.best[0]
        joined = join_tails(self.ctx, plan)
        return joined is not None and self.consider(joined, self.best[2])

    def move(self) -> bool:
        """Whole-sequence moves (:func:`.local.improve`) with what is left of the budget."""
        plan, report, cand = self.best
        per_move = self.budget.placement_s(self.ctx, 0) / 16
        moves = max(1, int(self.budget.left_s / per_move)) if self.budget.left_s > 0 else 1
        self.budget.spend(moves * per_move)
        moved = improve(self.ctx, plan, report, moves)
        return moved is not None and self.consider(moved, cand)

    def local_search(self) -> None:
        """Widen while that helps and the budget lasts, then join and move."""
        while not self.done() and self.widen():
            pass
        if self.ctx.sync == "peer" and not self.done():
            self.join()
        if not self.done():
            self.move()


def critical_sequence(ctx: Context, plan: Plan, report: StepReport) -> int:
    """The sequence with the most work in the busiest cell that ends the step: in ``wave``
    sync the slowest cell of the tallest wave, in ``peer`` sync the busiest cell of the rank
    that finishes last."""
    busy = report.busy_s
    if ctx.sync == "wave":
        w = int(np.argmax(busy.max(axis=1)))
        r = int(np.argmax(busy[w]))
    else:
        finish = np.where(busy > 0, report.start_s + busy, 0.0).max(axis=0)
        r = int(np.argmax(finish))
        w = int(np.argmax(busy[:, r]))
    here = (plan.wave == w) & (plan.rank == r)
    work = ctx.cost.attn_time(plan.start[here], plan.end[here]) + (plan.end - plan.start)[here]
    return int(plan.seq[here][int(np.argmax(work))])


def join_tails(ctx: Context, plan: Plan) -> Plan | None:
    """``plan`` with each rank's first cell after its last multi-rank job merged into that
    job's cell where the two fit the capacity (``None``: no rank has such a cell)."""
    n = plan.num_ranks
    shards = np.bincount(plan.seq, minlength=plan.seq_lens.size)
    in_job = shards[plan.seq] > 1
    last_job = np.full(n, -1, dtype=np.int64)
    np.maximum.at(last_job, plan.rank[in_job], plan.wave[in_job])
    tail = ~in_job & (last_job[plan.rank] >= 0) & (plan.wave > last_job[plan.rank])
    first = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(first, plan.rank[tail], plan.wave[tail])
    chosen = tail & (plan.wave == first[plan.rank])
    tokens = plan.tokens_per_cell()
    r = plan.rank[chosen]
    fits = tokens[last_job[r], r] + tokens[plan.wave[chosen], r] <= ctx.capacity
    rows = np.flatnonzero(chosen)[fits]
    if rows.size == 0:
        return None
    wave = plan.wave.copy()
    wave[rows] = last_job[plan.rank[rows]]
    used = np.unique(wave)
    builder = PlanBuilder(ctx, plan.strategy)
    builder.add(np.searchsorted(used, wave), plan.rank, plan.seq, plan.start, plan.end)
    builder.offload_where_needed()
    builder.info = dict(plan.predicted)
    return builder.build()


def split_busy(ctx: Context, lengths: np.ndarray, degrees: np.ndarray) -> np.ndarray:
    """Busy time (s) of each sequence split over ``degrees`` ranks as hdp splits it (in
    ``ulysses`` exchange by heads, up to one rank a head)."""
    if ctx.cost.kv_exchange == "ulysses":
        ok = degrees <= ulysses.most_members(ctx.cost.model, ctx.num_ranks)
        times = np.full(degrees.size, np.inf)
        if ok.any():
            times[ok] = head_split_times(ctx.cost, lengths[ok], degrees[ok], ctx.sync)[0]
        return times
    aligns = [ctx.split(int(L), int(d)).align for L, d in zip(lengths, degrees)]
    return split_times(ctx.cost, lengths, degrees, ctx.sync, np.asarray(aligns))[0]


def check_fits(ctx: Context) -> None:
    """Raise PlanningError when the longest sequence cannot be held by all ranks together (in
    ``ulysses`` exchange: by as many ranks as the model has heads)."""
    longest = int(ctx.seq_lens.max(initial=0))
    off_cap = ctx.offload_capacity
    if longest > off_cap * ctx.num_ranks:
        raise PlanningError(
            f"hdp: a sequence of {longest} tokens needs {-(-longest // off_cap)} ranks at "
            f"{off_cap} tokens each (with activation offload), but the cluster has "
            f"{ctx.num_ranks}; use more GPUs or a smaller --max-seq"
        )
    m = ctx.cost.model
    most = ulysses.most_members(m, ctx.num_ranks)
    if ctx.cost.kv_exchange == "ulysses" and longest > off_cap * most:
        raise PlanningError(
            f"hdp: a sequence of {longest} tokens needs {-(-longest // off_cap)} ranks at "
            f"{off_cap} tokens each, but a head-parallel group has at most {most} ({m.name} has "
            f"{m.heads} heads); use --kv-exchange rank or node, or a smaller --max-seq"
        )


def plan_dynamic(ctx: Context, options: DynamicOptions | None = None) -> Plan:
    """Plan by Note [One search], in the form ``options.form`` asks; the plan reports its
    bound (:func:`hdp.planner.degrees.step_bound`) in ``predicted["bound_s"]``."""
    options = options or DynamicOptions()
    form = options.form
    if form == "megatron":
        return plan_megatron_form(ctx, options)
    if form not in ("free", "whole"):
        raise ValueError(f"unknown hdp form {form!r}: choose 'free', 'whole' or 'megatron'")
    check_fits(ctx)
    bound_s = float(step_bound(ctx.cost, ctx.seq_lens, ctx.sync, ctx.capacity))
    if form == "whole":
        plan = _plan_whole(ctx)
        plan.predicted["bound_s"] = bound_s
        return plan
    rel = relaxation_bound(ctx.cost, ctx.seq_lens, ctx.sync, ctx.capacity, ctx.num_ranks)
    search = Search(ctx, options, rel, bound_s)
    rounded = [Candidate(*rel.degrees_at(h, ctx.whole_s)) for h in rounding_heights(rel, ctx.sync)]
    info = {}
    if milp.repeats(rel):  # equal lengths: the MILP chooses how many take each degree
        warm = Jobs(rounded[0].degree, rounded[0].job_time)
        choice = milp.solve_degrees(
            rel, ctx.cost, ctx.sync, ctx.num_ranks, warm, time_limit_s=options.plan_budget_s
        )
        info.update(choice.info)
        if choice.degrees is not None:
            rounded.insert(0, Candidate(choice.degrees, choice.job_time))
    for cand in rounded:
        if search.best is not None and search.done():
            break
        search.place(cand)
    for make, jobs, shards in group_layouts(ctx):
        cost_s = search.budget.placement_s(ctx, jobs, shards)
        if search.done() or not search.budget.affords(cost_s):
            break
        search.budget.spend(cost_s)
        for plan in make():
            search.consider(plan)
    search.local_search()
    plan = search.best[0]
    plan.predicted.update(info)
    plan.predicted["bound_s"] = bound_s
    plan.predicted["relaxation_height_s"] = rel.height_s
    return plan


def group_layouts(ctx: Context) -> Iterator[tuple[Callable[[], list[Plan]], int, int]]:
    """Plans on rank groups (Note [One search], item 4), each as (a maker of the plans, the
    multi-rank jobs and the shards they hold at most): equal groups of each size
    :func:`.groups.group_counts` gives, then groups of mixed power-of-two sizes."""
    lens, n = ctx.seq_lens, ctx.num_ranks
    for groups in group_counts(ctx):
        g = n // groups
        for split, exact in group_splits(ctx, g):
            jobs = int((split & (lens >= g)).sum())
            yield (
                (lambda s=split, e=exact, k=groups: _some(group_plan(ctx, k, s, e))),
                jobs,
                jobs * g,
            )
    yield (lambda: mixed_group_plans(ctx)), lens.size, lens.size * n


def _some(plan: Plan | None) -> list[Plan]:
    return [] if plan is None else [plan]


def _plan_whole(ctx: Context) -> Plan:
    """Every sequence on one rank: only the placement balances."""
    longest = int(ctx.seq_lens.max(initial=0))
    if longest > ctx.capacity:
        raise PlanningError(
            f"hdp (whole form): a sequence of {longest} tokens does not fit one rank's "
            f"{ctx.capacity} tokens; raise the capacity or use a form that splits sequences"
        )
    degree = np.ones(ctx.seq_lens.size, dtype=np.int64)
    return place(ctx, num_waves_for(ctx), Candidate(degree, ctx.whole_s))


def rounding_heights(rel: Relaxation, sync: str) -> list[float]:
    """Heights at which the relaxation's degrees are read (Note [One search], item 2): ``M``
    and a little above in ``peer`` sync; in ``wave`` sync a step is the sum of its waves'
    heights, so tall jobs must share waves side by side: from a quarter of the least height
    the tallest job can have up to ``M``."""
    if sync == "peer" or not rel.menus:
        return [rel.height_s * f for f in (1.0, 1.04, 1.12)]
    floor = max(float(mu.height.min()) for mu in rel.menus)
    top = max(floor, rel.height_s)
    ladder = [float(h) for h in np.geomspace(floor, top, 4)] if top > floor * 1.01 else [floor]
    return [top, *ladder[-2::-1], floor * 0.5, floor * 0.25]
