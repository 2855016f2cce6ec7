"""``hdp`` restricted to what Megatron's hybrid context parallelism executes (``form="megatron"``).

Each sequence lies whole on one rank or zigzag-split over one of the CP groups Megatron builds
for a DPxCP group of ``n`` ranks (:func:`~hdp.planner.common.megatron_group_sizes`): a range of
``2^i`` consecutive ranks starting at a multiple of ``2^i`` for ``2^i < 2^floor(log2 n)``, or all
``n`` ranks; with no offload. Megatron runs each sequence as a micro-batch of its own, so every
candidate is priced as Megatron runs it (:func:`as_run`): what the form predicts is what the
scheduler's ``megatron_plan`` prices. On ``k > 1`` ranks Megatron needs the sub-sample's length
to be a multiple of ``2k`` (times the tensor-parallel size with sequence parallelism), so
sub-samples are padded, and priced with their padding (:func:`padded_plan`).

Degrees come from the relaxation over menus of the group sizes Megatron builds. Each choice of
degrees is laid out as its sync mode runs: in ``wave`` sync, where every micro-batch ends at a
barrier, waves filled tallest first (:func:`_place_waves`); in ``peer`` sync, one group of
start-time-ordered lists (:func:`_place_one_group`). A layout promises a step from its job
times (the sum of its waves' first jobs; the last rank's finish), and the layouts are priced as
Megatron runs them, most promising first, while the budget lasts (the first is the form's first
plan and always priced; the budget is :class:`~.budget.Budget`'s, charged by its estimate of a
pricing), and the fastest is kept. Pricing is most of the form's work, and the promise ranks
the fastest first on all but one of the benchmark's batches (``docs/benchmarks.md``). The
local search's whole-sequence moves, kept to empty cells as Megatron needs, improved none of
these plans, so the form takes none. Megatron's own ``BalancedCPScheduler`` is an oracle, not
a candidate: tests check that no plan of this form steps slower than its schedule.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from hdp import Plan

from ..common import Context, PlanBuilder, PlanningError, megatron_group_sizes
from ..degrees import Jobs, Relaxation, megatron_waves, relaxation_bound, step_bound
from ..hybridcp import plan_from_sample_id_groups, sample_id_groups_from_plan
from .budget import Budget


def megatron_cp_groups(n: int, size: int) -> list[range]:
    """The CP groups of one size Megatron builds: all ranks for ``size == n``, else the aligned
    ranges of ``size`` consecutive ranks that lie wholly inside the DPxCP group."""
    if size == n:
        return [range(n)]
    return [range(a, a + size) for a in range(0, n - size + 1, size)]


def padded_length(length: int, cp: int, token_multiple: int = 1) -> int:
    """The length Megatron runs a sub-sample of ``length`` tokens at on ``cp`` ranks: a multiple
    of ``2 * cp`` (the zigzag split's chunks) where ``cp > 1``, and of ``token_multiple`` (the
    tensor-parallel size under sequence parallelism)."""
    unit = (2 * cp if cp > 1 else 1) * max(1, token_multiple)
    return -(-int(length) // unit) * unit


def padded_plan(ctx: Context, plan: Plan, token_multiple: int = 1) -> Plan:
    """``plan`` as Megatron runs it: every sequence on ``k > 1`` ranks lengthened to
    :func:`padded_length` (trailing padding tokens, zigzag-split with the rest), same waves, ranks
    and barriers. Its cost is the plan's cost with the padding priced."""
    pairs = np.unique(np.stack([plan.seq, plan.rank], axis=1), axis=0)
    seqs, first = np.unique(pairs[:, 0], return_index=True)
    members = np.split(pairs[:, 1], first[1:])
    waves = np.full(plan.seq_lens.size, -1, dtype=np.int64)
    np.maximum.at(waves, plan.seq, plan.wave)
    lens = plan.seq_lens.copy()
    for s, m in zip(seqs.tolist(), members):
        lens[s] = padded_length(int(lens[s]), m.size, token_multiple)
    if np.array_equal(lens, plan.seq_lens):
        return plan
    builder = PlanBuilder(dataclasses.replace(ctx, seq_lens=lens), plan.strategy)
    builder.add_zigzag(seqs, waves[seqs], members)
    builder.barriers = sorted(plan.barriers)
    return builder.build()


class _Layout(NamedTuple):
    """One choice of degrees laid out: the step its job times promise, the shards its plan
    holds (what pricing it costs), and the plan as Megatron runs it, built on demand."""

    promise_s: float
    shards: int
    build: Callable[[], Plan]


def plan_megatron_form(
    ctx: Context, token_multiple: int = 1, budget_s: float | None = None, gap: float = 1e-3
) -> Plan:
    """The fastest Megatron-form plan by the cost model with its padding priced
    (``token_multiple``: see :func:`padded_length`) that ``budget_s`` affords past the first
    (``None``: :class:`~.options.DynamicOptions`' default, from the first plan's step), or the
    first within ``gap`` of its bound; the bound in ``predicted``. No CP group larger than
    ``ctx.max_ranks_per_seq``."""
    lens, cost = ctx.seq_lens, ctx.cost
    n, cap = ctx.num_ranks, ctx.capacity
    longest = int(lens.max(initial=0))
    need = -(-longest // cap)
    if longest > 0 and need > n:
        raise PlanningError(
            f"hdp (megatron form): a sequence of {longest} tokens needs a CP group of "
            f"{need} ranks at {cap} tokens each, but the DPxCP group has {n}: "
            "raise --max-seqlen-per-dp-cp-rank or use more GPUs"
        )
    limit = ctx.max_ranks_per_seq
    least = min(k for k in megatron_group_sizes(n) if k >= need)
    if limit is not None and least > limit:
        raise PlanningError(
            f"hdp (megatron form): a sequence of {longest} tokens needs a CP group of {least} "
            f"ranks (the least Megatron builds for {need} at {cap} tokens each), but "
            f"--max-ranks-per-seq is {limit}: raise it or --max-seqlen-per-dp-cp-rank"
        )
    rel = relaxation_bound(cost, lens, ctx.sync, cap, n, pow2=True, most_ranks=limit)
    bound_s = float(step_bound(cost, lens, ctx.sync, cap, pow2=True))
    seen: list[np.ndarray] = []
    lay_out = _place_waves if ctx.sync == "wave" else _place_one_group
    layouts = []
    for degree, job_time in _degree_choices(ctx, rel):
        if not any(np.array_equal(degree, d) for d in seen):
            seen.append(degree)
            layouts.append(lay_out(ctx, degree, job_time))
    first, *rest = sorted(layouts, key=lambda lay: lay.promise_s)
    best_s, plan = price(ctx, first, token_multiple)
    budget = Budget.for_step(budget_s, best_s)
    for layout in rest:
        cost_s = Budget.megatron_pricing_s(ctx, layout.shards)
        if best_s <= bound_s * (1 + gap) or not budget.affords(cost_s):
            break
        budget.spend(cost_s)
        step_s, candidate = price(ctx, layout, token_multiple)
        if step_s < best_s:
            best_s, plan = step_s, candidate
    plan.predicted["padded_step_time_s"] = best_s
    plan.predicted["bound_s"] = bound_s
    plan.predicted["relaxation_height_s"] = rel.height_s
    budget.record(plan)
    return plan


def price(ctx: Context, layout: _Layout, token_multiple: int = 1) -> tuple[float, Plan]:
    """``layout``'s plan as Megatron runs it and its step with the padding priced."""
    plan = layout.build()
    return ctx.cost.evaluate(padded_plan(ctx, plan, token_multiple)).step_time_s, plan


def as_run(ctx: Context, plan: Plan) -> Plan:
    """``plan`` as Megatron runs it: each rank's sequences in the order of their waves, a
    micro-batch each, and every sequence as soon as all its ranks reach it
    (:func:`~hdp.planner.hybridcp.plan_from_sample_id_groups` of the plan's sample-id groups).
    Two sequences in one cell of ``plan`` run one after the other."""
    ids = np.arange(ctx.seq_lens.size)
    run = plan_from_sample_id_groups(ctx, sample_id_groups_from_plan(plan, ids), None, "hdp")
    run.predicted.update({k: v for k, v in plan.predicted.items() if k not in run.predicted})
    return run


def _degree_choices(ctx: Context, rel: Relaxation) -> list[Jobs]:
    """The relaxation's degrees at several heights up to a little above its own ``M`` (a job
    on all ranks runs alone in this form, so the jobs after it must be fast rather than
    area-efficient), and mixes in which the jobs that take a quarter of the ranks or more keep
    their degree at ``M`` while the rest run faster (wider) after them: two sequences on half
    the ranks each leave no room beside them, so what follows must be short. In ``wave`` sync,
    where a step is the sum of its waves and a wave holds a sub-sample a rank, also the degrees
    of the relaxation over ranks x the waves the batch needs at least (as hdp's own roundings
    take them): a whole sequence as tall as a wave's share of the step is split too."""
    factors = (0.35, 0.5, 0.7, 1.0, 1.12)
    choices = [rel.degrees_at(rel.height_s * f, ctx.whole_s) for f in factors]
    lens, n = ctx.seq_lens, ctx.num_ranks
    waves = megatron_waves(lens, n, ctx.capacity)
    if ctx.sync == "wave" and waves > 1:
        per_wave = relaxation_bound(
            ctx.cost,
            lens,
            ctx.sync,
            ctx.capacity,
            n * waves,
            pow2=True,
            most_ranks=ctx.max_ranks_per_seq,
        )
        for f in (0.15, 0.25, *factors):
            choices.append(per_wave.degrees_at(per_wave.height_s * f, ctx.whole_s))
    at_m = choices[factors.index(1.0)]
    wide = at_m.degree >= max(2, ctx.num_ranks // 4)
    for f in (0.15, 0.25, 0.35):
        low = rel.degrees_at(rel.height_s * f, ctx.whole_s)
        choices.append(
            Jobs(
                np.where(wide, at_m.degree, low.degree), np.where(wide, at_m.job_time, low.job_time)
            )
        )
    return choices


def _place_waves(ctx: Context, degree: np.ndarray, job_time: np.ndarray) -> _Layout:
    """Waves filled tallest first, for ``wave`` sync, where every wave ends at a barrier: a
    wave's height is its first job's (the layout promises their sum), and the jobs after it,
    in order, take the aligned CP groups (or single ranks) still free in it; the rest wait for
    the next wave. The plan as Megatron runs it (:func:`as_run`): a rank free in a wave runs
    its next sequence there."""
    lens, n = ctx.seq_lens, ctx.num_ranks
    time_of = np.where(degree > 1, job_time, ctx.whole_s)
    todo = [i for i in np.argsort(-time_of, kind="stable").tolist() if lens[i] > 0]
    seqs: list[int] = []
    waves: list[int] = []
    members: list[np.ndarray] = []
    wave, promise_s = 0, 0.0
    while todo:
        promise_s += float(time_of[todo[0]])
        free = np.ones(n, dtype=bool)
        free_ranks = n
        left: list[int] = []
        full: set[int] = set()  # sizes with no group free in this wave (none frees again)
        single = 0  # no rank below is free
        for k, i in enumerate(todo):
            if free_ranks == 0:
                left += todo[k:]
                break
            size = max(1, int(degree[i]))
            if size == 1:
                while single < n and not free[single]:
                    single += 1
                first = single if single < n else None
            else:
                first = None if size in full else _free_group(free, size)
            if first is None:
                full.add(size)
                left.append(i)
                continue
            free[first : first + size] = False
            free_ranks -= size
            seqs.append(i)
            waves.append(wave)
            members.append(np.arange(first, first + size, dtype=np.int64))
        todo = left
        wave += 1

    def build() -> Plan:
        builder = PlanBuilder(ctx, "hdp")
        builder.add_zigzag(seqs, waves, members)
        builder.info = {"max_degree": float(degree.max(initial=1))}
        return as_run(ctx, builder.build())

    return _Layout(promise_s, sum(m.size for m in members), build)


def _free_group(free: np.ndarray, size: int) -> int | None:
    """The first rank of the first CP group of ``size > 1`` ranks that Megatron builds
    (:func:`megatron_cp_groups`) whose ranks are all ``free``; ``None`` where none is."""
    n = free.size
    if size >= n:
        return 0 if free.all() else None
    blocks = free[: n // size * size].reshape(-1, size).all(axis=1)
    b = int(np.argmax(blocks))
    return b * size if blocks[b] else None


def _least_busy_group(load: np.ndarray, size: int) -> tuple[int, float]:
    """(first rank, start) of the CP group of ``size`` ranks Megatron builds
    (:func:`megatron_cp_groups`) whose busiest member frees first (the first of ties)."""
    if size >= load.size:
        return 0, float(load.max())
    starts = load[: load.size // size * size].reshape(-1, size).max(axis=1)
    b = int(np.argmin(starts))
    return b * size, float(starts[b])


def _place_one_group(ctx: Context, degree: np.ndarray, job_time: np.ndarray) -> _Layout:
    """One group (no barrier): each rank runs its list of sub-samples in order and waits only
    for the CP partners of each; a rank may change CP size between its sub-samples. The layout
    promises the last rank's finish.

    Lists are formed by simulating start times: multi-rank jobs, tallest first, on the aligned
    CP group whose busiest member frees first (the others idle until then); whole sequences,
    longest first, into the tightest idle gap they fit, else after the least-loaded rank's work.
    Every rank lists its items by start time, so partners meet in the same order and no CP group
    waits for another in a cycle. The plan is these lists as Megatron runs them."""
    lens, n, whole = ctx.seq_lens, ctx.num_ranks, ctx.whole_s
    load = np.zeros(n)
    items: list[list[tuple[float, int]]] = [[] for _ in range(n)]  # per rank: (start, sequence)
    gaps: list[tuple[float, float, int]] = []  # (length, start, rank), sorted
    by_time = np.argsort(-job_time, kind="stable").tolist()
    for i in [i for i in by_time if degree[i] > 1 and lens[i] > 0]:
        size = int(degree[i])
        first, t0 = _least_busy_group(load, size)
        members = range(first, first + size)
        for r in members:
            if t0 - load[r] > 0:
                bisect.insort(gaps, (t0 - float(load[r]), float(load[r]), r))
            items[r].append((t0, i))
            load[r] = t0 + float(job_time[i])
    heap = [(float(load[r]), r) for r in range(n)]
    heapq.heapify(heap)
    by_whole = np.argsort(-whole, kind="stable").tolist()
    for i in [i for i in by_whole if degree[i] <= 1 and lens[i] > 0]:
        t = float(whole[i])
        k = bisect.bisect_left(gaps, (t, -1.0, -1))
        if k < len(gaps):
            length, start, r = gaps.pop(k)
            items[r].append((start, i))
            if length - t > 0:
                bisect.insort(gaps, (length - t, start + t, r))
            continue
        end, r = heapq.heappop(heap)
        items[r].append((end, i))
        heapq.heappush(heap, (end + t, r))
    lists = [[i for _, i in sorted(row)] for row in items]

    def build() -> Plan:
        plan = plan_from_sample_id_groups(ctx, [lists], None, "hdp")
        plan.predicted.update({"groups": 1.0, "max_degree": float(degree.max(initial=1))})
        return plan

    return _Layout(max((end for end, _ in heap), default=0.0), sum(map(len, lists)), build)
