"""The ``hdp`` search: the relaxation, its rounding, and one local search under a budget.

Note [One search]
-----------------
A plan gives every sequence a degree (how many ranks split it) and a place (ranks and a wave).

1. *Relaxation* (:func:`hdp.planner.degrees.relaxation_bound`): every sequence that may split
   gets a menu of degrees priced by the cost model (:mod:`hdp.planner.menus`); the sweep finds
   the height ``M`` that minimises ``max(M, area / ranks)`` when each sequence takes its
   smallest-area degree no taller than ``M``. Where lengths repeat, the MILP over the same
   menus (:mod:`.milp`) chooses how many of a length take each degree.
2. *Rounding* (:mod:`.rounding`): the relaxation's degrees at a few heights around ``M`` (in
   ``wave`` sync also those of the relaxation over ranks x waves), least work first, are each
   placed by the list scheduler of the sync mode (:mod:`.place`) and priced by the cost model;
   the fastest is kept. The first is the search's first plan and always made.
   The relaxation cuts areas freely, but within a height ``H`` a rank holds at most one job
   (a whole sequence or a member's share) taller than ``H / 2``. In ``wave`` sync with one
   wave, where the degrees at ``M`` leave more such jobs than ranks, a *packed* rounding comes
   first: at a few heights from ``M`` to ``1.2 M``, the tall jobs that free a rank for the
   least extra area split further until they fit, and the height whose degrees promise the
   least step is kept. (Batches of about one sequence a rank need it: ``docs/benchmarks.md``.
   In ``peer`` sync it does not help, since that placer puts every job first and stacks whole
   sequences onto their shares all the same.)
3. *Group layouts* (:mod:`.groups`, :mod:`.mixed`): the ranks cut into groups that each run
   their sequences in shared waves, one layout at a time while the budget lasts (mixed sizes
   at heights rising from the least that fits, then equal sizes, the cheapest first: on a
   small budget, more of them). No move below reaches such a plan from the relaxation's (a
   degree at a time never lines many sequences up on the same ranks), and on small batches
   they win where splitting saves work (the CPU's reference attention) or where sequences
   share a group's fixed costs.
4. *Local search* on the kept plan, each move priced by the cost model and kept only where the
   step falls (:class:`Search`):

   - *widen*: every sequence as tall as the one that sets the step steps up its menu to the
     next faster degree, and the degrees are placed again, while that helps;
   - *unstack* (``wave`` sync): the degrees placed again with no multi-rank job raising a wave
     that already holds work by more than 5% of its time;
   - *jobs first* (``wave`` sync): the degrees placed again with every multi-rank job ahead of
     the whole sequences (the list scheduler takes them all tallest first, so a whole sequence
     taller than a job finds a rank the job has not taken; on some batches layers of jobs that
     the whole sequences then fill are faster);
   - *move* (:mod:`.local`): whole sequences leave the cells that end the step for cells that
     end sooner;
   - *regroup* (:mod:`.regroup`, ``peer`` sync): the plan's ranks seen as groups (ranks
     that share a job are one), a sequence of the group that ends the step moves to another
     group or swaps with a shorter one there, and groups halve or join their neighbour; each
     layout built again and priced in full. The moves above keep every job on its ranks; this
     one reaches the layouts of FlexSP's MILP on small batches. (In ``wave`` sync the waves a
     sequence lands in decide more than its group, and trials there cost several times more.)

Each of these parts is kept because some batches need it: ``scripts/ablate_search.py``
switches one off at a time, and without any of them some batches of the quality grid or of
random small ones step over 1% slower (``docs/benchmarks.md``). The MILP matters only where
lengths repeat, *jobs first* and *unstack* on the fewest batches.

Every step stops where the plan is within ``options.gap`` of the bound or the budget is spent.
The budget (``options.plan_budget_s``; by default a 100th of the first plan's predicted step,
at least 0.05 s) counts what the search does after its first plan. It is charged by estimates
of each placement's, layout's and move's work (:class:`Budget`), not by the clock, so a plan
depends only on the batch and the options. It is spent in levels, each three times as large
as all before it (:func:`level_budgets`: 0.8 s runs levels of 0.05, 0.15 and 0.6 s). At each
level the seeds (the roundings past the first, the MILP, item 3) may spend up to half of the
budget so far; a seed that does not fit waits for a later level. The local search then
spends the rest, from the fastest plan so far (*widen* and the placements again from the
fastest plan with degrees, where that is no slower than every group layout as laid out), and
what it leaves goes to the seeds that wait (the local search again where one was faster).
Moves are deterministic, so one that found nothing is not tried again until a plan changes,
and the search stops after a level that neither spent nor was refused anything (an unlimited
budget, ``math.inf``, searches until then). From 0.05 s on, four times the budget runs the
same levels and one more, so it never plans a slower step (under one K/V exchange: ``auto``'s
head-parallel search has what the P2P one left). Levels each as large as all before them
would make that promise for twice the budget, but they cut budgets of 0.1-0.2 s in two, and
some batches' fastest group layout then fits neither level (``docs/benchmarks.md``).

Constraints belong to the same search: ``options.max_ranks_per_seq`` (carried in the
``Context``) ends every menu, *widen* and group size at it, and a batch whose longest sequence
needs more ranks is refused with what to change.

Example (``tests/test_search.py`` checks it): 8 H100 ranks of one node, llama-7b, ``peer``
sync, ``rank`` exchange; sequences of 32K and 24K tokens, 24 of 2K and 12 of 256. The
relaxation's ``M`` is 2.05 s. Its rounding splits the 32K one over 4 ranks and the 24K one
over 3, the rest whole; the short sequences placed after a rank's share of a long one join the
share's cell (:mod:`.place`), one cell a rank: 2.529 s, against a bound of 2.444 s. No move
finds a faster plan (*widen*'s 5 ranks for the 32K one is slower).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from hdp import Plan, StepReport, ulysses

from ..common import Context, PlanningError
from ..degrees import Jobs, Relaxation, relaxation_bound, step_bound
from . import milp
from .budget import LEAST_S, Budget
from .candidates import Candidate, num_waves_for
from .groups import group_counts, group_plan, group_splits, most_members, split_busy
from .local import Work, improve
from .megatron import plan_megatron_form
from .mixed import MixedGroupPlans
from .options import DynamicOptions
from .place import place
from .regroup import regroup
from .rounding import roundings
from .wave import jobs_first_changes

NATIVE_SYNC = "peer"


class Search:
    """The best plan so far, its report and its degrees (``None``: a group layout's), the
    best of the plans that have degrees, and the moves that improve them."""

    def __init__(self, ctx: Context, options: DynamicOptions, rel: Relaxation, bound_s: float):
        self.ctx, self.options, self.rel, self.bound_s = ctx, options, rel, bound_s
        self.budget = Budget(0.0)  # grown a level at a time by plan_dynamic
        self.best: tuple[Plan, StepReport, Candidate | None] | None = None
        self.placed: tuple[Plan, StepReport, Candidate] | None = None
        self.layout_s = math.inf  # the fastest group layout's step, as laid out
        self.searches = 0.0  # the last placement's offload searches (Budget.placement_s)
        # Moves are deterministic: one that found nothing finds nothing again until a plan
        # changes, so a later level skips it (``version`` counts the changes).
        self.version = 0
        self.settled: dict[str, int] = {}  # a move -> the version at which it found nothing

    @property
    def step_s(self) -> float:
        return self.best[1].step_time_s if self.best else math.inf

    def done(self, gap_only: bool = False) -> bool:
        """Whether the plan is within ``options.gap`` of the bound (or the budget is spent)."""
        close = self.step_s <= self.bound_s * (1 + self.options.gap)
        return close or (not gap_only and self.budget.left_s <= 0)

    def consider(
        self, plan: Plan, cand: Candidate | None = None, report: StepReport | None = None
    ) -> bool:
        """Keep ``plan`` (priced in ``report``, or here) where it is faster than the best so
        far, or with degrees ``cand`` faster than the best that has some (the start of *widen*
        and of the placements again, Note [One search]); whether it was either."""
        report = report or self.ctx.cost.evaluate(plan)
        step_s = report.step_time_s
        placed = cand is not None and (self.placed is None or step_s < self.placed[1].step_time_s)
        faster = step_s < self.step_s
        if placed:
            self.placed = (plan, report, cand)
        if faster:
            self.best = (plan, report, cand)
        if placed or faster:
            self.version += 1
        return placed or faster

    def fresh(self, move: str) -> bool:
        """Whether ``move`` may find something: it has not found nothing since a plan last
        changed."""
        return self.settled.get(move) != self.version

    def settle(self, move: str) -> None:
        """``move`` found nothing on the plans as they are."""
        self.settled[move] = self.version

    def place(self, cand: Candidate, seed: bool = False) -> bool | None:
        """Place ``cand`` where the budget affords it (a ``seed`` within its half), charge the
        budget, keep it where faster; whether it was (``None``: not afforded). The first
        placement is always made and charged to nothing: the budget is what the search spends
        past its first plan, and by default that plan's predicted step sets it
        (:class:`DynamicOptions`)."""
        first = self.best is None
        if not first:
            cost_s = self.placement_s(cand, self.searches)
            if not self.budget.affords(cost_s, seed):
                return None
            self.budget.spend(cost_s, seed)
        plan = place(self.ctx, num_waves_for(self.ctx), cand)
        # Offload searches are charged as counted; the estimate assumed the last placement's.
        self.searches = plan.predicted["offload_searches"]
        if not first:
            self.budget.spend(self.placement_s(cand, self.searches) - cost_s, seed)
        return self.consider(plan, cand)

    def placement_s(self, cand: Candidate, searches: float) -> float:
        """The budget's estimate of placing ``cand`` with ``searches`` offload searches."""
        split = cand.degree > 1
        jobs, shards = int(split.sum()), int(cand.degree[split].sum())
        waves = max(num_waves_for(self.ctx), self.best[0].num_waves if self.best else 0)
        shards += self.ctx.seq_lens.size
        return self.budget.placement_s(self.ctx, jobs, shards, waves, searches)

    def solve_milp(self, warm: Candidate, seed: bool = True) -> dict[str, float] | None:
        """Place the MILP's degrees (:mod:`.milp`, warm-started from ``warm``) where the budget
        affords the solve (:meth:`.budget.Budget.milp_s`; a ``seed`` within the seeds' half);
        what it reports (``None``: not afforded)."""
        ctx, rel = self.ctx, self.rel
        estimate_s = Budget.milp_s(milp.count_variables(rel))
        if not self.budget.affords(estimate_s, seed):
            return None
        self.budget.spend(estimate_s, seed)
        jobs = Jobs(warm.degree, warm.job_time)
        limit_s = max(estimate_s, self.budget.left_s)
        choice = milp.solve_degrees(rel, ctx.cost, ctx.sync, ctx.num_ranks, jobs, limit_s)
        if choice.degrees is not None:
            self.place(Candidate(choice.degrees, choice.job_time), seed)
        return choice.info

    def degrees_lead(self) -> bool:
        """Whether the fastest plan with degrees is no slower than every group layout as laid
        out: then *widen* and the placements again start from it, even where moves have since
        made a layout faster (a later level's rounding competes with the layouts as laid out,
        not with what the local search made of them)."""
        return self.placed[1].step_time_s <= self.layout_s

    def widen(self) -> bool:
        """Step every sequence as tall as the one that sets the step (within 2% of its busy
        time) up its menu and place again (Note [One search]); whether that was faster."""
        if not self.degrees_lead() or not self.fresh("widen"):
            return False
        plan, report, cand = self.placed
        if not self.budget.affords(self.placement_s(cand, self.searches)):
            return False
        seq = critical_sequence(self.ctx, plan, report)
        tall = np.flatnonzero(cand.job_time >= 0.98 * cand.job_time[seq])
        wider = self._wider(cand, tall)
        kept = None if wider is None else self.place(wider)
        if kept is False or wider is None:
            self.settle("widen")
        return bool(kept)

    def _wider(self, cand: Candidate, seqs: np.ndarray) -> Candidate | None:
        """``cand`` with each of ``seqs`` on the next degree that runs it faster, where one of
        the next few does (``None``: none of them has such a degree)."""
        ctx, steps = self.ctx, 8
        lens = ctx.seq_lens[seqs]
        degrees = cand.degree[seqs][:, None] + np.arange(1, steps + 1)[None, :]
        ok = (degrees <= most_members(ctx)) & (degrees <= np.maximum(1, lens // 2)[:, None])
        times = np.full(degrees.shape, np.inf)
        lengths, parts = np.broadcast_to(lens[:, None], ok.shape)[ok], degrees[ok]
        times[ok] = split_busy(ctx, lengths, parts, ctx.splits(lengths, parts)[0])
        faster = times < cand.job_time[seqs][:, None] * (1 - 1e-9)
        has = faster.any(axis=1)
        if not has.any():
            return None
        k = np.argmax(faster, axis=1)[has]
        rows = np.flatnonzero(has)
        degree, job_time = cand.degree.copy(), cand.job_time.copy()
        degree[seqs[has]] = degrees[rows, k]
        job_time[seqs[has]] = times[rows, k]
        return dataclasses.replace(cand, degree=degree, job_time=job_time)

    def place_again(self, **variant: object) -> bool:
        """``wave`` sync: the best degrees placed again as ``variant`` (fields of
        :class:`Candidate`) says, where the best plan was not placed so; whether that was
        faster. *unstack* is ``stack_share=0.05``: no job raises a wave that holds work by more
        than 5% of its time (such jobs open waves of their own, where the whole sequences then
        fill their cells). *jobs first* is ``jobs_first=True``: every multi-rank job placed
        before any whole sequence, in layers the whole sequences then fill (the same list
        where no whole sequence is taller than a job: not placed again)."""
        key = repr(sorted(variant.items()))
        if not self.degrees_lead() or not self.fresh(key):
            return False
        cand = self.placed[2]
        if all(getattr(cand, k) == v for k, v in variant.items()):
            return False
        if variant.get("jobs_first") and not jobs_first_changes(self.ctx, cand):
            return False
        kept = self.place(dataclasses.replace(cand, **variant))
        if kept is False:
            self.settle(key)
        return bool(kept)

    def move(self) -> bool:
        """Whole-sequence moves (:func:`.local.improve`) with what is left of the budget, in
        ``peer`` sync half of it, the other half for *regroup*."""
        plan, report, cand = self.best
        share = 0.5 if self.ctx.sync == "peer" else 1.0
        # (Building the plan's cells and pricing the moved plan is paid before any move.)
        allowed_s = share * self.budget.left_s
        least_s = self.budget.move_s(self.ctx, Work(plan.num_shards)) / share
        if not self.fresh("move") or not self.budget.affords(least_s):
            return False
        moved, work = improve(self.ctx, plan, report, allowed_s)
        spent_s = self.budget.move_s(self.ctx, work)
        self.budget.spend(spent_s)
        if spent_s < allowed_s:  # no move was left, not the budget
            self.settle("move")
        return moved is not None and self.consider(moved[0], cand, moved[1])

    def regroup(self) -> bool:
        """``peer`` sync: moves between rank groups (:func:`.regroup.regroup`) with what is
        left of the budget, or a quarter of it in a P2P search under ``auto`` exchange: the
        head-parallel search that may follow has what this one leaves, and its group layouts
        need it (``docs/benchmarks.md``); whether they were faster."""
        plan, report, _ = self.best
        trial_s = self.budget.regroup_trial_s(plan)
        heads_next = self.ctx.any_exchange and self.ctx.cost.kv_exchange != "ulysses"
        share = 0.25 if heads_next else 1.0
        allowed_s = share * self.budget.left_s
        if not self.fresh("regroup") or not self.budget.affords(2 * trial_s / share):
            return False
        found, spent_s = regroup(self.ctx, plan, report, allowed_s)
        self.budget.spend(spent_s)
        kept = found is not None and self.consider(found[0], report=found[1])
        if spent_s + trial_s <= allowed_s:  # no move was left, not the budget
            self.settle("regroup")
        return kept

    def local_search(self) -> None:
        """Widen while that helps and the budget lasts, then move and regroup."""
        while not self.done() and self.widen():
            pass
        if self.ctx.sync == "wave":
            for variant in ({"stack_share": 0.05}, {"jobs_first": True}):
                if not self.done() and self.place_again(**variant):
                    while not self.done() and self.widen():
                        pass
        if not self.done():
            self.move()
        if self.ctx.sync == "peer" and not self.done():
            self.regroup()


def critical_sequence(ctx: Context, plan: Plan, report: StepReport) -> int:
    """The sequence with the most work in the busiest cell that ends the step: in ``wave``
    sync the slowest cell of the tallest wave, in ``peer`` sync the busiest cell of the rank
    that finishes last."""
    busy = report.busy_s
    if ctx.sync == "wave":
        w = int(np.argmax(busy.max(axis=1)))
        r = int(np.argmax(busy[w]))
    else:
        r = int(np.argmax(report.finish_s))
        w = int(np.argmax(busy[:, r]))
    here = (plan.wave == w) & (plan.rank == r)
    work = ctx.cost.attn_time(plan.start[here], plan.end[here]) + (plan.end - plan.start)[here]
    return int(plan.seq[here][int(np.argmax(work))])


def check_fits(ctx: Context) -> None:
    """Raise PlanningError when the longest sequence cannot be held by all ranks together (in
    ``ulysses`` exchange: by as many ranks as the model has heads; by at most
    ``ctx.max_ranks_per_seq``)."""
    longest = int(ctx.seq_lens.max(initial=0))
    off_cap = ctx.offload_capacity
    limit = ctx.max_ranks_per_seq
    if limit is not None and longest > off_cap * limit:
        raise PlanningError(
            f"hdp: a sequence of {longest} tokens needs {-(-longest // off_cap)} ranks at "
            f"{off_cap} tokens each (with activation offload), but --max-ranks-per-seq is "
            f"{limit}; raise it or use a smaller --max-seq"
        )
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
    if options.max_ranks_per_seq is not None:
        ctx = dataclasses.replace(ctx, max_ranks_per_seq=options.max_ranks_per_seq)
    if form == "megatron":
        return plan_megatron_form(ctx, budget_s=options.plan_budget_s, gap=options.gap)
    if form not in ("free", "whole"):
        raise ValueError(f"unknown hdp form {form!r}: choose 'free', 'whole' or 'megatron'")
    check_fits(ctx)
    bound_s = ctx.bound_s
    if bound_s is None:
        bound_s = float(step_bound(ctx.cost, ctx.seq_lens, ctx.sync, ctx.capacity))
    if form == "whole":
        plan = _plan_whole(ctx)
        plan.predicted["bound_s"] = bound_s
        return plan
    alone = ctx.sync == "peer"
    rel = relaxation_bound(
        ctx.cost,
        ctx.seq_lens,
        ctx.sync,
        ctx.capacity,
        ctx.num_ranks,
        alone=alone,
        most_ranks=ctx.max_ranks_per_seq,
    )
    search = Search(ctx, options, rel, bound_s)
    rounded = roundings(ctx, rel)
    search.place(rounded[0])
    seeds = _Seeds(ctx, search, rounded)
    total_s = Budget.for_step(options.plan_budget_s, search.step_s).total_s
    budget = search.budget
    for level_s in level_budgets(total_s):
        budget.grow(level_s)
        budget.refused, left_s = False, budget.left_s
        seeds.plant()
        search.local_search()
        # What the local search leaves of this level, the seeds that wait may spend.
        while not search.done() and seeds.plant(seed=False):
            search.local_search()
        # A level that spent nothing and was refused nothing leaves nothing to the next.
        if search.done(gap_only=True) or (budget.left_s == left_s and not budget.refused):
            break
    plan = search.best[0]
    plan.predicted.update(seeds.info)
    plan.predicted["bound_s"] = bound_s
    plan.predicted["relaxation_height_s"] = rel.height_s
    search.budget.record(plan, total_s)
    return plan


def level_budgets(total_s: float) -> Iterator[float]:
    """The budget ``total_s`` cut into levels, each three times as large as all before it, the
    first at least :data:`.budget.LEAST_S` where the total allows (Note [One search]); an
    unlimited budget, levels without end from :data:`.budget.LEAST_S` on."""
    if total_s == math.inf:
        level = LEAST_S
        yield level
        while True:
            yield 3 * level
            level *= 4
    cuts = 0  # (dividing by powers of 4 is exact: four times the total, one more cut)
    while total_s / 4 ** (cuts + 1) >= LEAST_S:
        cuts += 1
    yield total_s / 4**cuts
    yield from (3 * total_s / 4**k for k in range(cuts, 0, -1))


class _Seeds:
    """The seeds past the first plan (Note [One search], items 2-3) in their order, each
    planted once: at every level those that the seeds' half of the budget so far affords (a
    family of group layouts up to the first it does not), the rest kept for the next."""

    def __init__(self, ctx: Context, search: Search, rounded: list[Candidate]) -> None:
        self.ctx, self.search = ctx, search
        self.roundings = [
            cand
            for k, cand in enumerate(rounded)
            if k and not any(np.array_equal(cand.degree, c.degree) for c in rounded[:k])
        ]
        self.milp = rounded[0] if milp.repeats(search.rel) else None
        self.info: dict[str, float] = {}
        self.families = [iter(family) for family in group_layouts(ctx)]
        self.next = [next(it, None) for it in self.families]

    def plant(self, seed: bool = True) -> bool:
        """Place what this level affords (with ``seed`` within the seeds' half, else of what
        the local search left), in order; keep the rest. Whether a plan was kept
        (:meth:`Search.consider`)."""
        search, waiting, version = self.search, [], self.search.version
        for cand in self.roundings:
            if search.done(gap_only=True) or search.place(cand, seed) is None:
                waiting.append(cand)
        self.roundings = waiting
        if self.milp is not None and not search.done():
            placed = search.solve_milp(self.milp, seed)
            if placed is not None:
                self.info, self.milp = placed, None
        for k, it in enumerate(self.families):
            while self.next[k] is not None:
                make, cost_s = self.next[k]
                if search.done() or not search.budget.affords(cost_s, seed):
                    break
                search.budget.spend(cost_s, seed)
                for plan in make():
                    report = self.ctx.cost.evaluate(plan)
                    search.layout_s = min(search.layout_s, report.step_time_s)
                    search.consider(plan, report=report)
                self.next[k] = next(it, None)
        return search.version != version


def group_layouts(ctx: Context) -> Iterator[Iterable[tuple[Callable[[], list[Plan]], float]]]:
    """Plans on rank groups (Note [One search], item 3), as families of makers of plans, each
    maker with the budget's estimate of its work (:meth:`.budget.Budget.layout_s`): groups of
    mixed power-of-two sizes (a maker per height, :class:`.mixed.MixedGroupPlans`), then equal
    groups of each size :func:`.groups.group_counts` gives, a maker per split, cheapest
    first (the makers past the first the budget refuses cost as much or more)."""
    lens, n = ctx.seq_lens, ctx.num_ranks
    yield MixedGroupPlans(ctx)
    equal = []
    for groups in group_counts(ctx):
        g = n // groups
        for split, exact in group_splits(ctx, g):
            shards = int((split & (lens >= g)).sum()) * g + lens.size
            cost_s = Budget.layout_s(ctx, shards, groups)
            equal.append((lambda s=split, e=exact, k=groups: group_plan(ctx, k, s, e), cost_s))
    yield sorted(equal, key=lambda maker: maker[1])


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
