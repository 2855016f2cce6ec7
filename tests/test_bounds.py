"""Bounds that are bounds on every profile, and an hdp plan never slower than a baseline's.

On the GPU profiles a sequence's work is least when it stays whole; on the measured CPU profile
(its reference attention computes a causal block's masked half too) an equal split does less
work. The planner's bound (``predicted["bound_s"]``) and the cost model's simple lower bound
(``lower_bound_s``) must hold on both, against the plans of every strategy priced as its own
system runs. hdp's plan is compared with each baseline's placement run on hdp's runtime: a
baseline's own runtime may be cheaper where hdp's is not (TransformerEngine's ring makes one
kernel call per ring step and returns dK/dV in bf16), which no placement of hdp's can match.
"""

import copy
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hdp import ClusterSpec, model_preset
from hdp.planner import STRATEGIES, PlanningError, StepPricing, plan_step

PROFILES = {"cpu": "tiny", "h100": "llama-7b", "a100-80g": "llama-7b"}
# hdp's search no longer runs the baselines inside it (Note [One search]): on batches this small
# its plan may trail a baseline's placement by this share where neither its roundings, its group
# layouts nor its moves reach it (docs/benchmarks.md has the most seen on random batches: the
# static mesh's packing of short sequences on 4-8 ranks). The hypothesis tests below are
# derandomized: CI checks one fixed set of batches, so a rare draw past this share cannot fail
# an unrelated change.
TRAILS = 0.05


def _plans(lens, pricing) -> dict:
    """Each strategy's plan's predictions, with ``on_hdp_s``: its step on hdp's runtime;
    ``flexsp-rank``: FlexSP's placement with the P2P exchange hdp runs (``flexsp`` itself is
    priced with its Ulysses all-to-all)."""
    out = {}
    runs = [(name, name, pricing) for name in STRATEGIES]
    runs.append(("flexsp-rank", "flexsp", replace(pricing, kv_exchange="rank")))
    for key, name, priced in runs:
        opts = {"hybridcp_impl": "ours"} if name == "hybridcp" else {}
        try:
            plan = plan_step(lens, priced, name, **opts)
        except PlanningError:  # a baseline that cannot hold the batch: nothing to compare
            continue
        on_hdp = copy.copy(plan)
        on_hdp.strategy = "hdp"
        cost = pricing.cost.with_exchange(plan.kv_exchange)
        out[key] = {**plan.predicted, "on_hdp_s": cost.evaluate(on_hdp).step_time_s}
    return out


def _check_bounds_and_hdp_first(plans: dict) -> None:
    """No plan steps under hdp's bound or its own simple lower bound, and hdp's plan is no
    slower than any baseline's placement on hdp's runtime (within ``TRAILS``), head-parallel
    ones included."""
    hdp = plans["hdp"]
    for name, p in plans.items():
        assert p["step_time_s"] >= hdp["bound_s"] * (1 - 1e-9), (name, p["step_time_s"], hdp)
        assert p["step_time_s"] >= p["lower_bound_s"] * (1 - 1e-9), (name, p)
        assert hdp["step_time_s"] <= p["on_hdp_s"] * (1 + TRAILS), name


@settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    profile=st.sampled_from(sorted(PROFILES)),
    n=st.sampled_from([2, 3, 4, 8]),
    nodes=st.sampled_from([1, 2]),
    cap=st.sampled_from([1024, 2048, 4096]),
    sync=st.sampled_from(["peer", "wave"]),
    data=st.data(),
)
def test_no_plan_beats_the_bounds_and_hdp_never_trails_a_baseline(
    profile, n, nodes, cap, sync, data
):
    """On one node and on two (where hdp may plan in ``node`` exchange), in both sync modes."""
    cluster = ClusterSpec.preset(profile, n, n // nodes if n % nodes == 0 else n)
    pricing = StepPricing.build(model_preset(PROFILES[profile]), cluster, capacity=cap, sync=sync)
    lens = data.draw(st.lists(st.integers(cap // 2, 2 * cap), min_size=1, max_size=3))
    lens += data.draw(st.lists(st.integers(1, cap), max_size=10))
    _check_bounds_and_hdp_first(_plans(np.asarray(lens), pricing))


@settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    profile=st.sampled_from(sorted(PROFILES)),
    n=st.sampled_from([12, 16, 24]),
    per_node=st.sampled_from([4, 8]),
    sync=st.sampled_from(["peer", "wave"]),
    data=st.data(),
)
def test_hdp_never_trails_a_baseline_on_more_ranks(profile, n, per_node, sync, data):
    """Past 8 ranks FlexSP's mixed group sizes once beat hdp's placement by up to 1.8x (the CPU
    profile, where splits save work) and 1.16x (H100)."""
    cap = 2048
    cluster = ClusterSpec.preset(profile, n, per_node)
    pricing = StepPricing.build(model_preset(PROFILES[profile]), cluster, capacity=cap, sync=sync)
    lens = data.draw(st.lists(st.integers(cap // 2, 8 * cap), min_size=1, max_size=3))
    lens += data.draw(st.lists(st.integers(1, cap), max_size=30))
    _check_bounds_and_hdp_first(_plans(np.asarray(lens), pricing))


@settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    profile=st.sampled_from(sorted(PROFILES)),
    n=st.sampled_from([16, 32]),
    sync=st.sampled_from(["peer", "wave"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_hdp_never_trails_a_baseline_on_many_sequences(profile, n, sync, seed):
    """Batches of 101-203 sequences, past the 64 where equal-group plans are tried: FlexSP's
    plan once beat hdp's by up to 1.33x here (CPU profile, 32 ranks). In ``wave`` sync the
    batches need 4 or more micro-batches on 16 ranks, where FlexSP's plan is no rival in hdp's
    search (its MILP would be solved once per micro-batch): there hdp's own plans must match."""
    cap = 2048 if sync == "peer" else 1024
    n = n if sync == "peer" else 16
    cluster = ClusterSpec.preset(profile, n, 2)
    pricing = StepPricing.build(model_preset(PROFILES[profile]), cluster, capacity=cap, sync=sync)
    rng = np.random.default_rng(seed)
    longs = rng.integers(cap // 2, 8 * cap, int(rng.integers(1, 4)))
    lens = np.concatenate([longs, rng.integers(1, cap, int(rng.integers(100, 201)))])
    if sync == "wave":
        assume(-(-int(lens.sum()) // (n * cap)) >= 4)
    _check_bounds_and_hdp_first(_plans(lens, pricing))


def test_mixed_group_sizes_beat_flexsp_without_its_plan():
    """32 CPU ranks, 122 sequences: hdp's plan stepped 1.33x FlexSP's, whose plan was no rival
    past 64 sequences. hdp's own mixed-size groups (Note [Mixed group sizes]) now beat it with
    FlexSP's plan left out of the search."""
    rng = np.random.default_rng(7)
    lens = np.concatenate([rng.integers(1024, 16384, 2), rng.integers(1, 2048, 120)])
    cluster = ClusterSpec.preset("cpu", 32, 2)
    pricing = StepPricing.build(
        model_preset("tiny"), cluster, capacity=2048, sync="peer", kv_exchange="rank"
    )
    flexsp = plan_step(lens, pricing, "flexsp").predicted["step_time_s"]
    own = plan_step(lens, pricing, "hdp")
    assert own.predicted["step_time_s"] <= flexsp * (1 + 1e-9)


@pytest.mark.parametrize(
    "profile,n,cap,lens",
    [
        ("cpu", 16, 4096, [22284, 11841, 1292, 1271]),
        ("h100", 12, 2048, [2026, 476, 1674, 1826, 816, 799, 1606, 314, 28, 426, 2046, 910, 1956]),
    ],
)
def test_equal_groups_match_flexsp_without_its_plan(profile, n, cap, lens):
    """16 CPU ranks: the relaxation gives the longest sequence 15 ranks and the next 4, which
    cannot run side by side, and its plan stepped 1.7x FlexSP's (every sequence over all 16 in
    one micro-batch); on 12 H100 ranks 1.15x. hdp's equal-group plans find such plans: with
    FlexSP's plan left out of its search, hdp is no slower than it."""
    cluster = ClusterSpec.preset(profile, n, 4 if profile == "cpu" else 8)
    model = model_preset(PROFILES[profile])
    pricing = StepPricing.build(model, cluster, capacity=cap, sync="peer", kv_exchange="rank")
    lens = np.asarray(lens)
    flexsp = plan_step(lens, pricing, "flexsp").predicted["step_time_s"]
    own = plan_step(lens, pricing, "hdp")
    assert own.predicted["step_time_s"] <= flexsp * (1 + 1e-9)


def test_the_cpu_case_where_static_once_beat_both_bounds_and_hdp():
    """``hdp-sim --workload wlb-128k --model tiny --gpu cpu --gpus 2 --tokens-per-step 16K
    --max-seq 8K --capacity 4K``, first batch: static stepped under the simple lower bound, and
    hdp's plan was 4% slower than static's."""
    lens = np.array([4289, 4287, 3934, 2766, 1108])
    pricing = StepPricing.build(model_preset("tiny"), ClusterSpec.preset("cpu", 2), capacity=4096)
    plans = _plans(lens, pricing)
    static, hdp = plans["static"], plans["hdp"]
    assert static["step_time_s"] >= max(hdp["bound_s"], static["lower_bound_s"])
    assert hdp["step_time_s"] <= static["step_time_s"]


def test_a_node_exchange_bound_below_the_cpu_plans_on_two_nodes():
    """4 CPU ranks on two nodes in ``wave`` sync: hdp's ``node``-exchange plan and static's once
    stepped under the bound, whose menus ended at a floor of packed work and assumed every
    degree past it covers more area (on the CPU profile splits save work)."""
    lens = np.array([3045, 806])
    cluster = ClusterSpec.preset("cpu", 4, 2)
    pricing = StepPricing.build(model_preset("tiny"), cluster, capacity=1024, sync="wave")
    plans = _plans(lens, pricing)
    bound = plans["hdp"]["bound_s"]
    for name, p in plans.items():
        assert p["step_time_s"] >= max(bound, p["lower_bound_s"]) * (1 - 1e-9), name


def test_hdp_in_node_exchange_never_trails_a_rank_exchange_baseline():
    """6 H100 ranks on three nodes: hdp plans for ``node`` exchange here, and FlexSP's placement
    made for the ``rank`` exchange once stepped 0.1% faster than hdp's plan."""
    lens = np.array([3382, 2731, 723, 1782, 1080, 746, 1692, 1715])
    cluster = ClusterSpec.preset("h100", 6, 2)
    pricing = StepPricing.build(model_preset("llama-7b"), cluster, capacity=2048, sync="peer")
    plans = _plans(lens, pricing)
    for name in ("static", "hybridcp", "bytescale", "flexsp-rank"):
        assert plans["hdp"]["step_time_s"] <= plans[name]["step_time_s"] * (1 + 1e-9), name


def test_a_head_parallel_plan_does_not_beat_the_bound():
    """32 H100 ranks, two a node: FlexSP's Ulysses group of 32 moves about 1/20 of the bytes a
    zigzag ring of the 47,552-token sequence would, and once stepped 1.7x under the bound."""
    lens = np.array([47552, 1502, 1663])
    cluster = ClusterSpec.preset("h100", 32, 2)
    pricing = StepPricing.build(model_preset("llama-7b"), cluster, capacity=2048, sync="wave")
    bound = plan_step(lens, pricing, "hdp").predicted["bound_s"]
    for name in ("flexsp", "ulysses"):
        assert plan_step(lens, pricing, name).predicted["step_time_s"] >= bound * (1 - 1e-9), name


@pytest.mark.parametrize("per_node", [2, 8])
def test_hdp_keeps_up_with_head_parallel_plans(per_node):
    """The same step: under ``auto`` exchange hdp plans head-parallel groups too, so it steps
    no slower than FlexSP's or DeepSpeed-Ulysses' own plans, and its plan runs in dist_attn
    (groups of at most one rank a head)."""
    lens = np.array([47552, 1502, 1663])
    model = model_preset("llama-7b")
    cluster = ClusterSpec.preset("h100", 32, per_node)
    pricing = StepPricing.build(model, cluster, capacity=2048, sync="wave")
    plan = plan_step(lens, pricing, "hdp")
    assert plan.kv_exchange == "ulysses"
    members = np.unique(plan.seq * plan.num_ranks + plan.rank) // plan.num_ranks
    assert np.bincount(members).max() <= model.heads
    for name in ("flexsp", "ulysses"):
        rival = plan_step(lens, pricing, name)
        assert plan.predicted["step_time_s"] <= rival.predicted["step_time_s"] * (1 + 1e-9), name


def test_auto_plans_head_parallel_after_a_head_parallel_rival_wins():
    """24 a100-80g ranks: under ``auto`` the P2P search's best plan was a head-parallel rival's,
    and hdp then skipped its own head-parallel planning, stepping 9% slower than it plans in
    ``ulysses`` exchange. ``auto`` plans both wherever the head-parallel relaxation is below
    the P2P plan, so it is never behind the head-parallel plan."""
    lens = [14948, 3703, 6987, 249, 1090, 1567, 1675, 565, 1454, 1679, 1276, 1009, 1381, 1522]
    lens += [918, 309, 1651, 1366, 1715, 1484, 1160]
    cluster = ClusterSpec.preset("a100-80g", 24, 8)
    pricing = StepPricing.build(model_preset("llama-7b"), cluster, capacity=2048, sync="peer")
    auto = plan_step(lens, pricing, "hdp").predicted["step_time_s"]
    heads = plan_step(lens, replace(pricing, kv_exchange="ulysses"), "hdp")
    assert auto <= heads.predicted["step_time_s"] * (1 + 1e-9)


def test_equal_groups_share_waves_as_the_ulysses_mesh_does():
    """4 a100-80g ranks in two nodes, 7 sequences of 457-2,417 tokens, ``peer`` sync: the
    Ulysses mesh runs two groups of two ranks, two waves each of about 1,180 tokens a member,
    where a micro-batch costs at least what its weights take to read. hdp dealt the sequences to
    groups by their times alone and filled each group's first wave to the capacity, leaving
    the second nearly empty, and stepped 7.4% slower. Its groups now hold as few waves as
    first fit, evenly filled, and are dealt by what a group's waves cost too."""
    lens = np.array([1939, 1188, 2417, 457, 1076, 609, 1748])
    cluster = ClusterSpec.preset("a100-80g", 4, 2)
    pricing = StepPricing.build(model_preset("llama-7b"), cluster, capacity=2048, sync="peer")
    plans = _plans(lens, pricing)
    assert plans["hdp"]["step_time_s"] <= plans["ulysses"]["on_hdp_s"] * (1 + 0.02)


def test_equal_groups_deal_by_what_a_wave_costs_in_wave_sync():
    """4 CPU-profile ranks in two nodes, 4 sequences of 295-1,158 tokens, one ``wave``:
    FlexSP's placement (two groups of two ranks, the longest sequence alone on one) stepped
    8.5% under hdp's, whose groups were dealt by each sequence's time alone (its micro-batch's
    fixed cost counted once a sequence). The second deal counts it once a wave."""
    lens = np.array([822, 1158, 583, 295])
    cluster = ClusterSpec.preset("cpu", 4, 2)
    pricing = StepPricing.build(model_preset("tiny"), cluster, capacity=1024, sync="wave")
    plans = _plans(lens, pricing)
    assert plans["hdp"]["step_time_s"] <= plans["flexsp-rank"]["on_hdp_s"] * (1 + 1e-9)


def test_regroup_puts_two_long_sequences_on_one_group_as_flexsp_does():
    """4 h100 ranks in two nodes, 6 sequences of 1,839-6,831 tokens, ``peer`` sync: FlexSP's
    placement runs the longest two one after the other on a group of two ranks and the other
    four whole on the other two. hdp's plan stepped 9.6% slower: its relaxation keeps the
    3,326-token sequence whole, and no change of degree or whole-sequence move puts it on the
    longest one's ranks. *regroup* moves it there and halves the other group."""
    lens = np.array([6831, 3326, 1839, 2831, 3828, 2817])
    cluster = ClusterSpec.preset("h100", 4, 2)
    pricing = StepPricing.build(model_preset("llama-7b"), cluster, capacity=4096, sync="peer")
    plans = _plans(lens, pricing)
    assert plans["hdp"]["step_time_s"] <= plans["flexsp-rank"]["on_hdp_s"] * (1 + 1e-9)


def test_hdp_keeps_up_with_head_parallel_meshes_past_the_rival_ranks():
    """1024 a100-80g ranks, 31 sequences of at most 7,247 tokens: FlexSP's plan and the
    DeepSpeed-Ulysses mesh, both head-parallel, stepped 0.4% under hdp's, which was within the
    2% that makes ``auto`` plan head-parallel groups too, and past the ranks where FlexSP's plan
    is a rival. The mesh is now priced wherever the static one is."""
    lens = [4069, 4633, 7247, 620, 940, 801, 429, 812, 819, 964, 99, 750, 456, 345, 498, 910]
    lens += [420, 473, 629, 325, 20, 416, 462, 484, 134, 911, 140, 334, 51, 431, 484]
    cluster = ClusterSpec.preset("a100-80g", 1024, 4)
    pricing = StepPricing.build(model_preset("llama-7b"), cluster, capacity=1024, sync="wave")
    hdp = plan_step(lens, pricing, "hdp").predicted["step_time_s"]
    for name in ("flexsp", "ulysses"):
        rival = plan_step(lens, pricing, name).predicted["step_time_s"]
        assert hdp <= rival * (1 + TRAILS), name


@settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    profile=st.sampled_from(sorted(PROFILES)),
    n=st.sampled_from([2, 4, 8]),
    cap=st.sampled_from([1024, 2048]),
    sync=st.sampled_from(["peer", "wave"]),
    data=st.data(),
)
def test_no_head_parallel_plan_beats_the_head_parallel_bound(profile, n, cap, sync, data):
    """``auto`` plans head-parallel groups only where ``heads_bound`` is below the P2P plan, so
    it must bound them: hdp's own head-parallel plan, FlexSP's and the DeepSpeed-Ulysses mesh's
    step no faster."""
    from hdp.planner.degrees import heads_bound
    from hdp.planner.strategies import get_strategy

    cluster = ClusterSpec.preset(profile, n, n)
    model = model_preset(PROFILES[profile])
    pricing = StepPricing.build(model, cluster, capacity=cap, sync=sync, kv_exchange="ulysses")
    lens = data.draw(st.lists(st.integers(cap // 2, 3 * cap), min_size=1, max_size=3))
    lens = np.asarray(lens + data.draw(st.lists(st.integers(1, cap), max_size=12)))
    hdp = get_strategy("hdp")
    try:
        cost, settled_sync, _ = pricing.settle(hdp, int(lens.max()), hdp.options(None), "ulysses")
    except PlanningError:  # the ranks cannot hold the longest sequence at all
        return
    bound = heads_bound(cost, lens, settled_sync, n)
    for name in ("hdp", "flexsp", "ulysses"):
        try:
            plan = plan_step(lens, pricing, name)
        except PlanningError:  # groups of at most one rank a head cannot hold the batch
            continue
        assert plan.predicted["step_time_s"] >= bound * (1 - 1e-9), name


@settings(max_examples=80, deadline=None)
@given(
    seqs=st.integers(1, 6),
    base=st.tuples(st.integers(0, 8), st.integers(0, 40)),
    slots=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_the_sweep_finds_the_least_step_over_every_height(seqs, base, slots, seed):
    """``degrees._sweep`` against trying every option's height as the tallest job: each
    sequence then takes its smallest-area option no taller (heights and areas in eighths,
    ties included)."""
    from hdp.planner.degrees import Options, _sweep

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, seqs)
    seq = np.repeat(np.arange(seqs), sizes)
    height = rng.integers(1, 30, seq.size) / 8.0
    area = rng.integers(1, 60, seq.size) / 8.0
    area[rng.random(seq.size) < 0.1] = np.inf
    options = Options(height, area, seq)
    base_height, base_area = base[0] / 8.0, base[1] / 8.0
    best = np.inf
    for m in np.unique(height):
        least = [area[(seq == s) & (height <= m)].min(initial=np.inf) for s in range(seqs)]
        if np.isfinite(least).all():
            best = min(best, max(m, base_height, (base_area + sum(least)) / slots))
    assert _sweep(options, seqs, base_height, base_area, slots)[0] == pytest.approx(best)


@pytest.mark.parametrize("profile", ["cpu", "h100"])
@pytest.mark.parametrize("tokens", [7, 3000, 40_000])
def test_the_rank_floor_against_every_busy_part_and_every_rank_size(profile, tokens):
    """Note [Every rank holds its tokens]: :class:`~hdp.planner.degrees.RankFloor` against a
    brute force over every whole number of tokens a rank may hold and a fine grid of busy
    parts ``B``: the most tokens busy no longer than ``B``, their least speed per token
    (:meth:`dense_work` of every smaller micro-batch), and the least of ``max(B, (area +
    extra) / ranks)``. The floor is below it, and within its grid's step (1.1%) of it."""
    from hdp.planner.degrees import rank_floor

    cost = StepPricing.build(model_preset(PROFILES[profile]), ClusterSpec.preset(profile, 8)).cost
    comp, sync = cost.compute, "peer"
    cap = cost.offload_capacity(sync)
    per = comp.dense_work(np.arange(1, tokens + 1)) / np.arange(1, tokens + 1)
    q = np.minimum.accumulate(per)  # least speed per token up to each size
    q_full = min(float(q[min(cap, tokens) - 1]), comp.least_dense_s_per_token(cap))
    q = np.maximum(q, q_full)
    o = cost.model.layers * cost.cluster.gpu.layer_overhead_s
    busy = np.arange(1, tokens + 1) * q + o  # a rank of each size, at least
    floor = rank_floor(cost, np.array([tokens]), sync)
    for area in np.array([0.0, 0.3, 1.0, 3.0]) * float(busy[-1]):
        best = np.inf
        for b in np.geomspace(busy.min(), 4 * busy[-1] + area, 4000):
            fits = np.flatnonzero(busy <= b)
            if fits.size == 0:
                continue
            most = int(fits.max()) + 1
            extra = tokens * (q[most - 1] - q_full) + o * -(-tokens // most)
            best = min(best, max(b, (area + extra) / 8))
        got = float(floor.value(np.array([area]), 8)[0])
        assert got <= best * (1 + 1e-9)
        assert got >= best * 0.985


@pytest.mark.parametrize("length, sync", [(131_072, "peer"), (255_093, "wave")])
def test_one_long_sequence_bound_pays_a_message_from_every_partner(length, sync):
    """Note [Bounds price bytes and partners]: one long sequence on 256 H100s (32 nodes),
    ``node`` exchange. A brute force over every degree, in both splits, on the first ranks,
    priced by the cost model (dK/dV in bf16 on the wire, as every system sends them): the
    bound is below the
    fastest, and within 2% of it (by bytes alone it sat 12-15% below: a member waits on a
    message from each of its partners every layer)."""
    from hdp.planner.common import Context, PlanBuilder
    from hdp.planner.degrees import step_bound

    pricing = StepPricing.build(
        model_preset("llama-7b"), ClusterSpec.preset("h100", 256), sync=sync
    )
    cost = pricing.cost.with_exchange("node")
    cap = cost.capacity(sync)
    lens = np.array([length])
    ctx = Context(lens, cost, sync, cap, length, length)
    best = np.inf
    for d in range(1, 257):
        for align in (128, 1):
            if length < 2 * d * align:
                continue
            builder = PlanBuilder(ctx, "hdp")
            builder.add_zigzag([0], [0], [np.arange(d)], align)
            builder.offload_where_needed()
            best = min(best, cost.evaluate(builder.build()).step_time_s)
    bound = float(step_bound(cost, lens, sync, cap))
    assert best * 0.98 <= bound <= best * (1 + 1e-9)


def test_a_ring_plan_of_one_sequence_stays_over_the_bound():
    """Note [A member's cell in a bound]: 6,138 tokens on two A100s of one node, 2,048 a rank.
    ByteScale's ring runs each member's attention in one call a step, faster than hdp's
    runtime runs the same split; the bound, which counts each member's dense time with its
    fixed costs, stays under ByteScale's plan and within 2% of it."""
    cluster = ClusterSpec.preset("a100-80g", 2, 2)
    pricing = StepPricing.build(model_preset("llama-7b"), cluster, capacity=2048, sync="peer")
    plans = _plans(np.array([6138]), pricing)
    bound = plans["hdp"]["bound_s"]
    fastest = min(p["step_time_s"] for p in plans.values())
    assert bound * (1 - 1e-9) <= fastest <= bound * 1.02
    _check_bounds_and_hdp_first(plans)


@pytest.mark.parametrize("profile", ["cpu", "h100"])
def test_dense_and_ring_call_ladders_against_a_scan(profile):
    """The bound's cells (Note [A member's cell in a bound]): for shares of several sizes,
    each rung's least dense time is at most :meth:`dense_time` of every micro-batch in its
    range scanned finely (row 0 the least of every larger one), and each rung's fastest ring
    call at least the rate :mod:`hdp.ring` prices every cell of its range at."""
    cost = StepPricing.build(model_preset(PROFILES[profile]), ClusterSpec.preset(profile, 8)).cost
    comp, m, tables = cost.compute, cost.model, cost.cluster.gpu.tables
    held = np.array([1.0, 100.0, 1000.0, 3069.0, 40_000.0])
    dense, rates = comp.least_dense_time_ladder(held, 8), comp.fastest_ring_rates(held, 8)

    def call_rate(T):
        args = (m.heads, m.head_dim, comp.backend)
        shapes = [tables.causal_rate(T, *args), tables.full_rate(T, T / 2, *args)]
        return np.minimum.reduce([*shapes, tables.full_rate(T / 2, T, *args)])

    for j, x in enumerate(held):
        beyond = np.geomspace(x, 1 << 25, 3000)
        assert dense[0, j] == pytest.approx(comp.dense_time(beyond).min(), rel=1e-6)
        for k in range(9):
            lo = x * 2.0 ** (k / 4)
            scan = np.geomspace(lo, lo * 2**0.25 if k < 8 else 1 << 25, 400)
            assert dense[k, j] <= comp.dense_time(scan).min() * (1 + 1e-9)
            assert rates[k, j] >= call_rate(scan).max() * (1 - 1e-6)
