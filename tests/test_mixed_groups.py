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
