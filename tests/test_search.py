"""hdp's one search (Note [One search] in ``hdp.planner.dynamic.search``): every move keeps a
valid plan, the search never ends slower than the rounding it starts from, and it stops where
its budget says, with plans that depend only on the batch and the options."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_strategies import check_plan

from hdp import ClusterSpec, CostModel, model_preset
from hdp.planner import plan_step
from hdp.planner.common import Context
from hdp.planner.degrees import relaxation_bound
from hdp.planner.dynamic import DynamicOptions
from hdp.planner.dynamic.budget import LEAST_S
from hdp.planner.dynamic.candidates import num_waves_for
from hdp.planner.dynamic.local import improve
from hdp.planner.dynamic.place import place
from hdp.planner.dynamic.regroup import Layout, regroup
from hdp.planner.dynamic.rounding import roundings
from hdp.planner.dynamic.search import level_budgets


def _context(lens, n: int, cap: int, sync: str) -> Context:
    """llama-7b on ``n`` H100 ranks, 4 a node, ``cap`` tokens a rank."""
    cost = CostModel(
        model_preset("llama-7b"), ClusterSpec.preset("h100", n, 4), capacity_override=cap
    )
    lens = np.asarray(lens, dtype=np.int64)
    return Context(lens, cost, sync, cap, int(lens.max()), int(lens.sum()))


def _roundings(ctx: Context):
    """The relaxation's roundings, placed: where the search starts."""
    alone = ctx.sync == "peer"
    rel = relaxation_bound(
        ctx.cost, ctx.seq_lens, ctx.sync, ctx.capacity, ctx.num_ranks, alone=alone
    )
    return [place(ctx, num_waves_for(ctx), cand) for cand in roundings(ctx, rel)]


def _rounding(ctx: Context):
    """The first of the relaxation's roundings, placed."""
    return _roundings(ctx)[0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 8),
    cap=st.integers(256, 2048),
    sync=st.sampled_from(["peer", "wave"]),
    data=st.data(),
)
def test_moves_keep_plans_valid_and_only_ever_help(n, cap, sync, data):
    # Whole-sequence moves: every token once, within the capacity, and the cost model prices
    # the moved plan no slower than the one it came from.
    lens = data.draw(st.lists(st.integers(1, min(n * cap, 6000)), min_size=1, max_size=40))
    ctx = _context(lens, n, cap, sync)
    plan = _rounding(ctx)
    report = ctx.cost.evaluate(plan)
    improved, _ = improve(ctx, plan, report, seconds=1.0)
    if improved is not None:
        moved = improved[0]
        check_plan(moved, lens, n, cap)
        assert ctx.cost.evaluate(moved).step_time_s < report.step_time_s


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 8),
    sync=st.sampled_from(["peer", "wave"]),
    data=st.data(),
)
def test_regroup_keeps_plans_valid_and_only_ever_helps(n, sync, data):
    # A plan laid out again as its groups holds every token once within the capacity; what
    # regroup keeps, the cost model prices faster than the plan it came from.
    cap = 2048
    lens = data.draw(st.lists(st.integers(1, 3 * cap), min_size=1, max_size=16))
    ctx = _context(lens, n, cap, sync)
    plan = _rounding(ctx)
    again = Layout.of(plan).plan(ctx, ctx.whole_s)
    if again is not None:
        check_plan(again, lens, n, cap)
    report = ctx.cost.evaluate(plan)
    found, _ = regroup(ctx, plan, report, seconds=0.05)
    if found is not None:
        check_plan(found[0], lens, n, cap)
        assert ctx.cost.evaluate(found[0]).step_time_s < report.step_time_s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.sampled_from([2, 4, 8, 16]),
    sync=st.sampled_from(["peer", "wave"]),
    data=st.data(),
)
def test_the_search_never_ends_slower_than_its_rounding(n, sync, data):
    cap = 2048
    lens = data.draw(st.lists(st.integers(1, min(6, n) * cap), min_size=1, max_size=60))
    ctx = _context(lens, n, cap, sync)
    start = ctx.cost.evaluate(_rounding(ctx)).step_time_s
    cluster = ClusterSpec.preset("h100", n, 4)
    kw = dict(capacity=cap, sync=sync, kv_exchange="rank")
    plan = plan_step(lens, cluster, model_preset("llama-7b"), "hdp", **kw)
    check_plan(plan, lens, n, cap)
    assert plan.predicted["step_time_s"] <= start * (1 + 1e-12)
    assert plan.predicted["step_time_s"] >= plan.predicted["bound_s"] * (1 - 1e-9)


def test_fewer_cells_on_short_documents_at_1024_ranks():
    """wikipedia-384k on 1,024 H100s: the placer left the short documents after a rank's share
    of a split one in a cell of their own, which paid a micro-batch's fixed cost twice; it now
    puts them in the share's cell, one cell a rank, and the search still finds a faster plan
    than the rounding's."""
    from hdp.planner import StepPricing, plan_and_evaluate
    from hdp.workloads import get_workload

    lens = get_workload("wikipedia-384k").sample_batch(np.random.default_rng(0))
    pricing = StepPricing.build(model_preset("llama-7b"), ClusterSpec.preset("h100", 1024))
    plan, report = plan_and_evaluate(lens, pricing, "hdp")
    cost = pricing.cost.with_exchange(plan.kv_exchange)
    ctx = Context(lens, cost, "peer", int(plan.predicted["capacity"]), 1, 1)
    rounded = _rounding(ctx)
    assert int((rounded.tokens_per_cell() > 0).sum()) == rounded.num_ranks
    assert report.step_time_s < cost.evaluate(rounded).step_time_s


def test_the_budget_bounds_the_search_and_plans_do_not_depend_on_the_clock():
    """No budget: the first rounding and nothing else. A budget buys more; the same budget
    gives the same plan twice."""
    from hdp.workloads import get_workload

    lens = get_workload("wlb-128k").sample_batch(np.random.default_rng(2), tokens_per_step=1 << 21)
    cluster, model = ClusterSpec.preset("h100", 64), model_preset("llama-7b")
    kw = dict(sync="peer", kv_exchange="rank")
    none = plan_step(lens, cluster, model, "hdp", hdp_options=DynamicOptions(plan_budget_s=0), **kw)
    ctx = Context(lens, CostModel(model, cluster), "peer", int(none.predicted["capacity"]), 1, 1)
    assert none.predicted["step_time_s"] == ctx.cost.evaluate(_rounding(ctx)).step_time_s
    plans = [plan_step(lens, cluster, model, "hdp", **kw) for _ in range(2)]
    assert plans[0].predicted["step_time_s"] <= none.predicted["step_time_s"]
    for field in ("rank", "wave", "seq", "start", "end"):
        assert np.array_equal(getattr(plans[0], field), getattr(plans[1], field))


@settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    n=st.sampled_from([4, 8, 16]),
    sync=st.sampled_from(["peer", "wave"]),
    budget=st.sampled_from([0.05, 0.08, 0.12]),
    data=st.data(),
)
def test_four_times_the_budget_never_plans_a_slower_step(n, sync, budget, data):
    # From 0.05 s on the search spends its budget in levels, each three times as large as all
    # before it: four times the budget runs the same levels and one more (Note [One search]).
    cap = 2048
    lens = data.draw(st.lists(st.integers(1, min(6, n) * cap), min_size=1, max_size=60))
    cluster = ClusterSpec.preset("h100", n, 4)
    kw = dict(capacity=cap, sync=sync, kv_exchange="rank")
    steps = []
    for b in (budget, 4 * budget, 16 * budget, math.inf):
        options = DynamicOptions(plan_budget_s=b)
        plan = plan_step(lens, cluster, model_preset("llama-7b"), "hdp", hdp_options=options, **kw)
        assert plan.predicted["search_s"] <= 1.2 * b
        steps.append(plan.predicted["step_time_s"])
    assert steps[1] <= steps[0] and steps[2] <= steps[1]


def test_the_budget_is_spent_in_levels_each_three_times_all_before_it():
    for total in (0.0, 0.03, 0.05, 0.1, 0.2, 0.3, 1.0, 16.7):
        levels = list(level_budgets(total))
        assert sum(levels) == pytest.approx(total)
        assert all(b == pytest.approx(3 * sum(levels[:k])) for k, b in enumerate(levels) if k)
        assert len(levels) == 1 or levels[0] >= LEAST_S
        assert list(level_budgets(4 * total)) == levels + [3 * total] or total < LEAST_S
    unlimited = level_budgets(math.inf)
    assert [next(unlimited) for _ in range(4)] == pytest.approx([0.05, 0.15, 0.6, 2.4])
    with pytest.raises(ValueError, match="seconds of at least 0"):
        DynamicOptions(plan_budget_s=-1.0)


def test_both_searches_of_a_step_share_its_budget():
    """Under ``auto`` at 16 ranks the plan says what the step had and what its searches
    charged (a head-parallel search's first plan too, where what the P2P search left affords
    it), within a fifth of the budget."""
    from hdp.planner import StepPricing, plan_and_evaluate
    from hdp.workloads import get_workload

    lens = get_workload("wikipedia-384k").sample_batch(np.random.default_rng(0), 16 * 8192)
    pricing = StepPricing.build(model_preset("llama-7b"), ClusterSpec.preset("h100", 16))
    for budget in (0.0, 0.02, 0.05):
        options = DynamicOptions(plan_budget_s=budget)
        plan, _ = plan_and_evaluate(lens, pricing, "hdp", hdp_options=options)
        assert plan.predicted["budget_s"] == budget
        assert plan.predicted["search_s"] <= 1.2 * budget


def test_the_worked_example_of_the_note():
    """Note [One search]: the rounding splits 32K over 4 ranks and 24K over 3, its placement
    leaves one cell a rank, and nothing the search finds is faster."""
    lens = np.array([32768, 24576] + [2048] * 24 + [256] * 12)
    cluster = ClusterSpec.preset("h100", 8)
    kw = dict(sync="peer", kv_exchange="rank")
    model = model_preset("llama-7b")
    ctx = Context(
        lens, CostModel(model, cluster), "peer", CostModel(model, cluster).capacity("peer"), 1, 1
    )
    start = _rounding(ctx)
    held = np.bincount(np.unique(start.seq * 8 + start.rank) // 8, minlength=lens.size)
    assert held[:2].tolist() == [4, 3]
    assert all(np.unique(start.wave[start.rank == r]).size == 1 for r in range(8))
    plan = plan_step(lens, cluster, model, "hdp", **kw)
    assert plan.predicted["step_time_s"] <= ctx.cost.evaluate(start).step_time_s * (1 + 1e-12)
    assert plan.predicted["step_time_s"] >= plan.predicted["bound_s"]


def test_moves_keep_a_plans_barriers_between_waves_it_still_has():
    """2 ranks, 64 tokens each, three tiny sequences in the Megatron form: its barrier-separated
    groups put one after a barrier, and a move emptied every wave past it; the barrier then
    named a wave the plan no longer had (plan_step validates the plan)."""
    cluster, model = ClusterSpec.preset("h100", 2, 4), model_preset("llama-7b")
    plan = plan_step([1, 2, 2], cluster, model, "hdp", capacity=64, form="megatron")
    assert all(0 < b < plan.num_waves for b in plan.barriers)


def test_a_wave_placement_reports_the_offload_searches_the_budget_charges(monkeypatch):
    """llama-70b in ``wave`` sync offloads: the first placement says how many sequences
    searched the cells for one that offloads (the count the budget charges), one per search
    the placer ran."""
    from hdp.planner.dynamic import wave
    from hdp.workloads import get_workload

    searched = []
    search = wave.offloaded_cell
    monkeypatch.setattr(wave, "offloaded_cell", lambda *a: searched.append(1) or search(*a))
    lens = get_workload("wikipedia-384k").sample_batch(np.random.default_rng(0), 1 << 21)
    cluster, model = ClusterSpec.preset("h100", 64), model_preset("llama-70b")
    options = DynamicOptions(plan_budget_s=0.0)  # the first placement and nothing else
    plan = plan_step(
        lens, cluster, model, "hdp", sync="wave", kv_exchange="rank", hdp_options=options
    )
    assert len(searched) > lens.size // 2
    assert plan.predicted["offload_searches"] == len(searched)


@settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    n=st.sampled_from([2, 4, 6, 8, 16]),
    sync=st.sampled_from(["peer", "wave"]),
    form=st.sampled_from(["free", "megatron"]),
    exchange=st.sampled_from(["auto", "rank", "ulysses"]),
    data=st.data(),
)
def test_no_sequence_spans_more_ranks_than_max_ranks_per_seq(n, sync, form, exchange, data):
    """``max_ranks_per_seq`` is a constraint of the search: every plan keeps to it, or the
    batch is refused with a message that names it (or, where all the ranks could not hold a
    sequence either, that says so)."""
    from hdp.planner import PlanningError

    limit = data.draw(st.integers(1, n))
    lens = data.draw(st.lists(st.integers(1, 12_000), min_size=1, max_size=3 * n))
    if form == "megatron":
        exchange = "rank"
    options = DynamicOptions(form=form, max_ranks_per_seq=limit)
    cluster = ClusterSpec.preset("h100", n, 4)
    model = model_preset("llama-7b")
    kw = dict(capacity=2048, sync=sync, kv_exchange=exchange, hdp_options=options)
    try:
        plan = plan_step(lens, cluster, model, "hdp", **kw)
    except PlanningError as e:
        said = str(e)
        assert "--max-ranks-per-seq" in said or "cluster cannot hold" in said or form == "megatron"
        return
    ranks = [np.unique(plan.rank[plan.seq == s]).size for s in range(len(lens))]
    assert max(ranks) <= limit, (ranks, limit)


def test_max_ranks_per_seq_refuses_a_batch_that_needs_more():
    import pytest

    from hdp.planner import PlanningError

    cluster = ClusterSpec.preset("h100", 8, 4)
    options = DynamicOptions(max_ranks_per_seq=2)
    with pytest.raises(PlanningError, match="--max-ranks-per-seq is 2; raise it"):
        plan_step([40_000], cluster, model_preset("llama-7b"), "hdp", capacity=4096,
                  sync="peer", kv_exchange="rank", hdp_options=options)  # fmt: skip
    with pytest.raises(ValueError, match="at least one rank"):
        DynamicOptions(max_ranks_per_seq=0)


@settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    n=st.sampled_from([4, 8, 16]),
    sync=st.sampled_from(["peer", "wave"]),
    f=st.sampled_from([1.0, 1.04, 1.1]),
    data=st.data(),
)
def test_room_for_tall_jobs_splits_only_tall_jobs_until_each_has_a_rank(n, sync, f, data):
    """Note [One search], item 2: at a height ``H`` a rank holds at most one job taller than
    ``H / 2``. The packed rounding only raises the degrees of such jobs, each to at most three
    times its own, where its members (priced alone by the cost model) run under ``H / 2``; and
    it stops once they fit the ranks, or leaves more only where no job left could be split
    so."""
    from hdp.planner.dynamic.groups import split_busy
    from hdp.planner.dynamic.rounding import room_for_tall_jobs

    cost = CostModel(model_preset("llama-7b"), ClusterSpec.preset("h100", n, 4))
    lens = np.array(data.draw(st.lists(st.integers(256, 24_000), min_size=n, max_size=4 * n)))
    ctx = Context(lens, cost, sync, cost.capacity(sync), int(lens.max()), int(lens.sum()))
    rel = relaxation_bound(cost, lens, sync, ctx.capacity, n, alone=sync == "peer")
    height = rel.height_s * f
    degree, job_time = rel.degrees_at(height, ctx.whole_s)
    time = np.where(degree > 1, job_time, ctx.packed_s)
    got = room_for_tall_jobs(ctx, rel, height)

    def none_splits_under_half(cand_degree, times):
        for i in np.flatnonzero(times > height / 2).tolist():
            d = np.arange(cand_degree[i] + 1, min(3 * cand_degree[i], lens[i] // 2, n) + 1)
            L = np.full(d.size, lens[i])
            if d.size and (split_busy(ctx, L, d, ctx.splits(L, d)[0]) <= height / 2).any():
                return False
        return True

    if got is None:
        assert int(degree[time > height / 2].sum()) <= n or none_splits_under_half(degree, time)
        return
    raised = np.flatnonzero(got.degree != degree)
    assert raised.size and (got.degree[raised] > degree[raised]).all()
    assert (time[raised] > height / 2).all() and (got.degree[raised] <= 3 * degree[raised]).all()
    for i in raised.tolist():  # each priced alone, as a one-sequence plan
        one = Context(lens[i : i + 1], cost, sync, ctx.capacity, int(lens[i]), int(lens[i]))
        d = np.array([got.degree[i]])
        alone = float(split_busy(one, lens[i : i + 1], d, one.splits(lens[i : i + 1], d)[0])[0])
        assert got.job_time[i] == alone <= height / 2
    after = np.where(got.degree > 1, got.job_time, ctx.packed_s)
    if int(got.degree[after > height / 2].sum()) > n:
        assert none_splits_under_half(got.degree, after)
