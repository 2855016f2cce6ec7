"""hdp's plans on groups of mixed power-of-two sizes (``hdp.planner.dynamic.mixed``)."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_strategies import check_plan

from hdp import ClusterSpec, CostModel, model_preset
from hdp.planner.common import Context
from hdp.planner.dynamic import mixed

INF = np.inf


def test_the_worked_example_of_the_note():
    """Note [Mixed group sizes]: 1.9 s fits no layout; the least that fits gives the long
    sequences 2 groups of 4 and the short ones the 8 ranks left, one each."""
    sizes = np.array([1, 2, 4, 8, 16])
    time = np.vstack([[[INF, INF, 2.0, 1.25, 0.75]] * 2, [[0.25, 0.1875, INF, INF, INF]] * 40])
    table = mixed._Table(time, sizes, np.array([8000] * 2 + [500] * 40), 16, None)
    assert mixed._layout(table, 1.9) is None
    layout = mixed._layout(table, mixed._least_height(table))
    assert layout.counts.tolist() == [8, 0, 2, 0, 0]
    assert layout.size_of.tolist() == [2, 2] + [0] * 40


def _context(lens, profile: str, n: int, cap: int, sync: str, exchange: str) -> Context:
    model = model_preset("tiny" if profile == "cpu" else "llama-7b")
    cost = CostModel(model, ClusterSpec.preset(profile, n, 4), capacity_override=cap)
    lens = np.asarray(lens, dtype=np.int64)
    return Context(
        seq_lens=lens,
        cost=cost.with_exchange(exchange),
        sync=sync,
        capacity=cap,
        max_seq=int(lens.max()),
        tokens_per_step=int(lens.sum()),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=st.sampled_from(["cpu", "h100"]),
    n=st.sampled_from([4, 8, 12, 16]),
    sync=st.sampled_from(["peer", "wave"]),
    exchange=st.sampled_from(["rank", "ulysses"]),
    data=st.data(),
)
def test_every_sequence_runs_on_one_aligned_power_of_two_group(profile, n, sync, exchange, data):
    """Each plan holds every token once within the ranks' room (written out independently of
    ``Plan.validate``), and each sequence's ranks are a block of a power-of-two size that
    starts at a multiple of it (at most one a head in ``ulysses`` exchange)."""
    cap = 1024
    lens = data.draw(st.lists(st.integers(cap, 4 * cap), min_size=1, max_size=2))
    lens += data.draw(st.lists(st.integers(1, cap), min_size=1, max_size=40))
    ctx = _context(lens, profile, n, cap, sync, exchange)
    plans = [plan for make, _ in mixed.MixedGroupPlans(ctx) for plan in make()]
    assert plans
    for plan in plans:
        check_plan(plan, np.asarray(lens), n, cap)
        for s in range(len(lens)):
            ranks = np.unique(plan.rank[plan.seq == s])
            size = ranks.size
            assert size & (size - 1) == 0, (s, ranks)
            assert ranks[0] % size == 0 and ranks[-1] == ranks[0] + size - 1, (s, ranks)
            if exchange == "ulysses":
                assert size <= ctx.cost.model.heads


def _deal_by_scan(table, layout, any_size):
    """A brute force of ``mixed._deal``: every group scanned for every sequence."""
    size_of, counts = layout
    order = np.argsort(-table.time[np.arange(size_of.size), size_of], kind="stable")
    size_idx = np.repeat(np.arange(table.sizes.size), counts)[::-1]
    group_sizes = table.sizes[size_idx]
    load = np.zeros(group_sizes.size)
    held = np.zeros(group_sizes.size, dtype=np.int64)
    group_of = np.empty(size_of.size, dtype=np.int64)
    for k, i in enumerate(order.tolist()):
        time_s = table.time[i, size_idx]
        allowed = np.isfinite(time_s) & (any_size | (size_idx == size_of[i]))
        tokens = int(table.lens[i])
        share = np.where(tokens >= group_sizes, -(-tokens // group_sizes), tokens)
        if table.room is not None:
            roomy = allowed & (held + share <= table.room)
            allowed = roomy if roomy.any() else allowed
        done_s = np.where(allowed, load + time_s, np.inf)
        g = int(np.argmin(done_s))
        load[g], held[g], group_of[k] = done_s[g], held[g] + share[g], g
    return order, group_sizes, group_of


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.integers(1, 40),
    n=st.sampled_from([4, 8, 16]),
    room=st.sampled_from([None, 600, 2000]),
    any_size=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_deal_gives_each_sequence_the_group_where_it_finishes_first(
    seqs, n, room, any_size, seed
):
    """Each size's groups in a heap give what scanning every group gives: each sequence, longest
    first, on the group where it finishes first (of those that still hold it), ties to the
    first. Times are multiples of 1/8 s, so that ties happen and sums are exact."""
    rng = np.random.default_rng(seed)
    sizes = 1 << np.arange(int(np.log2(n)) + 1)
    lens = rng.integers(1, 3000, seqs)
    time = rng.integers(1, 40, (seqs, sizes.size)) / 8.0
    time[rng.random(time.shape) < 0.3] = INF
    time[np.arange(seqs), rng.integers(0, sizes.size, seqs)] = rng.integers(1, 40, seqs) / 8.0
    table = mixed._Table(time, sizes, lens, n, room)
    size_of = np.array([rng.choice(np.flatnonzero(np.isfinite(row))) for row in time])
    counts = np.where(np.bincount(size_of, minlength=sizes.size) > 0, 1, 0)
    counts += rng.integers(0, 3, sizes.size) * (counts > 0)
    layout = mixed._Layout(size_of, counts)
    got, want = mixed._deal(table, layout, any_size), _deal_by_scan(table, layout, any_size)
    for a, b in zip(got, want):
        assert a.tolist() == b.tolist()


@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
def test_a_groups_waves_take_each_sequence_where_a_scan_of_every_wave_puts_it(size, seed):
    """``groups._Waves`` against scanning every wave's members: a whole sequence on the
    least-filled member of the first wave with room for it, a split one on the first wave
    whose members all have room for their pieces, a new wave where none has."""
    from hdp.planner.dynamic.groups import _Waves

    rng, cap = np.random.default_rng(seed), 1000
    waves, scanned = _Waves(size), []
    for _ in range(60):
        if rng.random() < 0.5:
            length = int(rng.integers(1, cap + 1))
            want = next((w for w, t in enumerate(scanned) if t.min() + length <= cap), None)
            if want is None:
                scanned.append(np.zeros(size, dtype=np.int64))
                want, member = len(scanned) - 1, 0
            else:
                member = int(np.argmin(scanned[want]))
            scanned[want][member] += length
            assert waves.whole(length, cap) == (want, member)
        else:
            share = rng.integers(1, cap // 2, size) // rng.integers(1, 4)
            want = next((w for w, t in enumerate(scanned) if (t + share <= cap).all()), None)
            if want is None:
                scanned.append(np.zeros(size, dtype=np.int64))
                want = len(scanned) - 1
            scanned[want] += share
            assert waves.split(share, cap) == want
        assert [t.tolist() for t in waves.tokens] == [t.tolist() for t in scanned]


@settings(max_examples=40, deadline=None)
@given(groups=st.sampled_from([1, 2, 3, 8, 64]), seed=st.integers(0, 2**16))
def test_the_deal_by_waves_takes_the_group_a_scan_of_every_group_finds(groups, seed):
    """``groups._deal_by_waves`` (a heap of the groups that hold sequences, one empty group
    for all) against scanning every group: each sequence, in order, to the group where it
    ends first (its work besides its dense layers, plus the dense work of the group's tokens
    a member in as few evenly filled waves as hold them), the first of equals."""
    from hdp.planner.dynamic.groups import _deal_by_waves

    rng, cap = np.random.default_rng(seed), 1024
    ctx = _context([cap], "h100", 8, cap, "peer", "rank")
    count = int(rng.integers(1, 40))
    tokens = rng.integers(1, 3 * cap, count) / rng.integers(1, 5, count)
    dense_of = ctx.cost.dense_time
    busy = dense_of(np.minimum(np.ceil(tokens), cap)) + rng.random(count)

    def dense(held: float) -> float:
        waves = max(int(np.ceil(held / cap)), 1)
        return waves * float(dense_of(np.array([np.ceil(held / waves)]))[0])

    rest = busy - dense_of(np.minimum(np.ceil(tokens), cap))
    held, load, want = np.zeros(groups), np.zeros(groups), []
    for t, other in zip(tokens, rest):
        ends = [load[g] + other + dense(held[g] + t) for g in range(groups)]
        g = int(np.argmin(ends))
        held[g], load[g] = held[g] + t, load[g] + other
        want.append(g)
    assert _deal_by_waves(ctx, busy, tokens, groups).tolist() == want
