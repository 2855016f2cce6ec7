"""Plan invariants, PLAN.json, and the KV traffic against a token-by-token reference."""

import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hdp import ClusterSpec, CostModel, Plan, PlanError, Shard, model_preset
from hdp.rounds import edge_colour_rounds


def example_plan():
    # seq 0 (10 tokens) zigzag over ranks 0 and 1; seq 1 whole on rank 1; seq 2 in wave 1 on rank 0.
    waves = [
        [[(0, 0, 3), (0, 8, 10)], [(0, 3, 8), (1, 0, 4)]],
        [[(2, 0, 5)], []],
    ]
    return Plan.from_shards([10, 4, 5], 2, waves, sync="peer")


def test_shards_and_json_round_trip():
    p = example_plan()
    p.validate(capacity=10)
    assert p.shards(0, 0) == [Shard(0, 0, 3), Shard(0, 8, 10)]
    assert p.shards(1, 1) == []
    assert p.tokens_per_cell().tolist() == [[5, 9], [5, 0]]
    d = p.to_json()
    assert d["sync"] == "peer" and d["num_ranks"] == 2 and d["seq_lens"] == [10, 4, 5]
    assert d["waves"][0][0] == [[0, 0, 3], [0, 8, 10]]
    q = Plan.from_json(json.loads(json.dumps(d)))
    assert q.to_json() == d
    # sync defaults to wave; predicted is optional and kept when given
    d2 = {k: v for k, v in d.items() if k != "sync"}
    d2["predicted"] = {"step_time_s": 1.5}
    q2 = Plan.from_json(d2)
    assert q2.sync == "wave" and q2.predicted["step_time_s"] == 1.5


@pytest.mark.parametrize(
    "waves, message",
    [
        ([[[(0, 0, 3)], [(0, 4, 10)]]], "gap"),
        ([[[(0, 0, 5)], [(0, 4, 10)]]], "overlap"),
        ([[[(0, 0, 3)], []]], r"tokens \[3, 10\) are in no shard"),
        ([[[(0, 2, 10)], []]], r"tokens \[0, 2\) are in no shard"),
        ([[[(0, 0, 5)], []], [[], [(0, 5, 10)]]], "all must share one wave"),
        ([[[(0, 0, 11)], []]], "not a non-empty range"),
        ([[[(0, 5, 5), (0, 0, 10)], []]], "not a non-empty range"),
        ([[[(1, 0, 10)], []]], "names a sequence outside"),
    ],
)
def test_validate_rejects(waves, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_shards([10], 2, waves).validate()


def test_validate_capacity_and_missing_sequence():
    with pytest.raises(PlanError, match="rank 0 holds 10 tokens in wave 0, above its capacity 8"):
        Plan.from_shards([10], 1, [[[(0, 0, 10)]]]).validate(capacity=8)
    with pytest.raises(PlanError, match="sequence 1 .* is in no shard"):
        Plan.from_shards([10, 3], 1, [[[(0, 0, 10)]]]).validate()
    # empty sequences need no shard
    Plan.from_shards([10, 0], 1, [[[(0, 0, 10)]]]).validate()
    with pytest.raises(PlanError, match="wave 0 lists 1 ranks"):
        Plan.from_shards([10], 2, [[[(0, 0, 10)]]])


def test_from_json_errors(tmp_path):
    with pytest.raises(PlanError, match="lacks the required key 'waves'"):
        Plan.from_json({"num_ranks": 1, "seq_lens": [1]})
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(PlanError, match="plan.json: not valid JSON"):
        Plan.load(path)
    with pytest.raises(PlanError, match="no-such.json: cannot read plan"):
        Plan.load(tmp_path / "no-such.json")


def reference_kv(plan: Plan, rpn: int):
    """Token-by-token: per (wave, rank), KV tokens received and sent, split intra/inter node."""
    recv = defaultdict(lambda: [0, 0])
    sent = defaultdict(lambda: [0, 0])
    for w in range(plan.num_waves):
        owner = {}
        need = defaultdict(int)
        for r in range(plan.num_ranks):
            for s, a, b in plan.shards(r, w):
                for t in range(a, b):
                    owner[(s, t)] = r
                need[(s, r)] = max(need[(s, r)], b)
        for (s, r), e in need.items():
            for t in range(e):
                src = owner[(s, t)]
                if src != r:
                    inter = int(src // rpn != r // rpn)
                    recv[(w, r)][inter] += 1
                    sent[(w, src)][inter] += 1
    return recv, sent


@st.composite
def random_plans(draw):
    """Random valid plans: sequences cut at random points, pieces placed on random ranks/waves."""
    n = draw(st.integers(1, 6))
    W = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    waves = [[[] for _ in range(n)] for _ in range(W)]
    for s, L in enumerate(lens):
        if L == 0:
            continue
        cuts = sorted(
            set(draw(st.lists(st.integers(1, max(L - 1, 1)), max_size=5)) if L > 1 else [])
        )
        bounds = [0] + [c for c in cuts if 0 < c < L] + [L]
        w = draw(st.integers(0, W - 1))
        for a, b in zip(bounds[:-1], bounds[1:]):
            waves[w][draw(st.integers(0, n - 1))].append((s, a, b))
    for w in range(W):
        for r in range(n):
            draw(st.randoms()).shuffle(waves[w][r])
    return Plan.from_shards(lens, n, waves, kv_block_tokens=draw(st.integers(1, 16)))


@settings(max_examples=150, deadline=None)
@given(random_plans(), st.integers(1, 4))
def test_kv_traffic_matches_token_reference(plan, rpn):
    plan.validate()
    cm = CostModel(model_preset("tiny"), ClusterSpec.preset("cpu", plan.num_ranks, rpn))
    tr = cm.kv_traffic(plan)
    recv, sent = reference_kv(plan, rpn)
    for w in range(plan.num_waves):
        for r in range(plan.num_ranks):
            assert tr.in_intra[w, r] == recv[(w, r)][0]
            assert tr.in_inter[w, r] == recv[(w, r)][1]
            assert tr.out_intra[w, r] == sent[(w, r)][0]
            assert tr.out_inter[w, r] == sent[(w, r)][1]
        # The explicit messages carry exactly those tokens, none above the block size.
        msgs = plan.kv_transfers(w)
        got_recv = defaultdict(int)
        for m in msgs:
            assert 0 < m.tokens <= plan.kv_block_tokens and m.src != m.dst
            got_recv[m.dst] += m.tokens
        for r in range(plan.num_ranks):
            assert got_recv[r] == sum(recv[(w, r)])
        assert plan.kv_tokens_sent(w).tolist() == [sum(sent[(w, r)]) for r in range(plan.num_ranks)]


@settings(max_examples=150, deadline=None)
@given(random_plans())
def test_comm_rounds_are_congestion_free_and_optimal(plan):
    for w in range(plan.num_waves):
        msgs = plan.kv_transfers(w)
        rounds = plan.comm_rounds(w)
        assert sorted(map(repr, (m for r in rounds for m in r))) == sorted(map(repr, msgs))
        for rnd in rounds:
            assert len({m.src for m in rnd}) == len(rnd)
            assert len({m.dst for m in rnd}) == len(rnd)
        deg = defaultdict(int)
        for m in msgs:
            deg[("s", m.src)] += 1
            deg[("r", m.dst)] += 1
        assert len(rounds) == max(deg.values(), default=0)
        assert rounds == plan.comm_rounds(w)  # deterministic


def test_edge_colouring_dense_multigraph():
    from hdp.plan import KVTransfer

    rng = np.random.default_rng(0)
    msgs = [
        KVTransfer(int(a), int(b), (Shard(0, i, i + 1),))
        for i, (a, b) in enumerate(rng.integers(0, 12, (400, 2)))
        if a != b
    ]
    rounds = edge_colour_rounds(msgs)
    deg = defaultdict(int)
    for m in msgs:
        deg[("s", m.src)] += 1
        deg[("r", m.dst)] += 1
    assert len(rounds) == max(deg.values())
    for rnd in rounds:
        assert len({m.src for m in rnd}) == len({m.dst for m in rnd}) == len(rnd)


def assert_same_plan(p, q):
    """Every field of two plans equal (arrays element-wise, floats exactly)."""
    for name in ("seq_lens", "rank", "wave", "seq", "start", "end", "offload"):
        a, b = getattr(p, name), getattr(q, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    for name in ("num_ranks", "num_waves", "sync", "barriers", "kv_block_tokens", "strategy"):
        assert getattr(p, name) == getattr(q, name), name
    assert p.capacity == q.capacity and type(p.capacity) is type(q.capacity)
    assert p.predicted == q.predicted


def test_wire_round_trip_keeps_every_field():
    waves = [
        [[(0, 0, 3), (0, 8, 10)], [(0, 3, 8), (1, 0, 4)]],
        [[(2, 0, 5)], []],
        [[], []],  # an empty last wave still counts
    ]
    p = Plan.from_shards(
        [10, 4, 5],
        2,
        waves,
        sync="peer",
        offload=np.array([[0.0, 0.25], [1 / 3, 0.0], [0.0, 0.0]]),
        barriers=[2, 1],
        kv_block_tokens=3,
        predicted={"step_time_s": 0.1 + 0.2, "bound_s": float("inf"), "mfu": -0.0},
        strategy="hdp",
        capacity=4096,
    )
    buf = p.to_wire()
    assert buf.dtype == np.uint8 and buf.ndim == 1
    q = Plan.from_wire(buf)
    assert_same_plan(p, q)
    assert q.num_waves == 3 and q.barriers == (1, 2) and q.offload[1, 0] == 1 / 3
    assert_same_plan(p, Plan.from_wire(buf.tobytes()))  # bytes work too
    # Defaults survive as such: no offload, no strategy, no capacity, nothing predicted.
    r = example_plan()
    assert_same_plan(r, Plan.from_wire(r.to_wire()))
    assert Plan.from_wire(r.to_wire()).capacity is None
    # An empty plan.
    e = Plan.from_shards([0], 3, [[[], [], []]])
    assert_same_plan(e, Plan.from_wire(e.to_wire()))


def test_wire_is_independent_of_the_shard_order_given():
    # Shards given out of cell order are sorted (each cell's own order kept) before they travel.
    p = Plan([6, 6], 2, [1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 1], [3, 0, 3, 0], [6, 3, 6, 3])
    q = Plan.from_wire(p.to_wire())
    assert_same_plan(p, q)
    assert q.shards(1, 0) == [Shard(0, 3, 6), Shard(1, 3, 6)]


def test_wire_keeps_the_communication_rounds():
    # A long sequence zigzagged over 4 ranks with 16-token messages: many rounds per wave, which
    # every rank must derive alike (a rank rebuilding the plan with the default block size would
    # count one message per pair and wait for messages that never come).
    n, L = 4, 800
    cut = np.linspace(0, L, 2 * n + 1).astype(int)
    owner = list(range(n)) + list(reversed(range(n)))
    waves = [
        [[(0, int(a), int(b)) for a, b, o in zip(cut, cut[1:], owner) if o == r]] for r in range(n)
    ]
    waves = [[cell[0] for cell in waves], [[(1, 0, 40)], [(1, 40, 90)], [], []]]
    p = Plan.from_shards([L, 90], n, waves, kv_block_tokens=16)
    q = Plan.from_wire(p.to_wire())
    assert q.kv_block_tokens == 16
    for w in range(p.num_waves):
        assert len(p.comm_rounds(w)) > 1
        assert q.comm_rounds(w) == p.comm_rounds(w)
    default = Plan(p.seq_lens, n, p.rank, p.wave, p.seq, p.start, p.end)
    assert len(default.comm_rounds(0)) < len(p.comm_rounds(0))


def test_wire_rejects_other_buffers():
    with pytest.raises(PlanError, match="not a plan in wire form"):
        Plan.from_wire(np.zeros(3, dtype=np.uint8))
    buf = example_plan().to_wire()
    with pytest.raises(PlanError, match="not a plan in wire form"):
        Plan.from_wire(buf[: buf.size - 8])  # truncated
    from hdp import wire

    with pytest.raises(PlanError, match="format"):
        Plan.from_wire(wire.pack({"format": "other"}, {}))


def _plan_json(**change):
    base = {
        "num_ranks": 2,
        "seq_lens": [1000, 300],
        "waves": [[[[0, 0, 500]], [[0, 500, 1000]]], [[[1, 0, 300]], []]],
    }
    return {**base, **change}


def test_a_plan_file_json_cannot_hold_is_one_error(tmp_path):
    path = tmp_path / "PLAN.json"
    for text, message in (
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
        ('{"num_ranks": ' + "9" * 5000 + "}", "not valid JSON: Exceeds the limit"),
    ):
        path.write_text(text)
        with pytest.raises(PlanError, match=f"PLAN.json: {message}"):
            Plan.load(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"waves": [[[[0, 0, 400]], [[0, 500, 1000]]], [[[1, 0, 300]], []]]}, "leave a gap"),
        ({"waves": [[[[0, 0, 600]], [[0, 500, 1000]]], [[[1, 0, 300]], []]]}, "overlap"),
        (
            {"waves": [[[[0, 0, 500]], [[0, 500, 1200]]], [[[1, 0, 300]], []]]},
            "inside \\[0, 1000\\)",
        ),
        ({"waves": [[[[0, 0, 500]], [[0, 500, 1000]]], [[[7, 0, 300]], []]]}, "sequence"),
        ({"waves": [[[[0, 500, 0]], [[0, 500, 1000]]], [[[1, 0, 300]], []]]}, "non-empty range"),
        ({"waves": [[[[0, -5, 500]], [[0, 500, 1000]]], [[[1, 0, 300]], []]]}, "non-empty range"),
        ({"seq_lens": [1000, -300]}, "'seq_lens\\[1\\]' must be >= 0, got -300"),
        ({"waves": [[[[0, 0, 500]], [[0, 500, 1000]]], [[], []]]}, "sequence 1 .* is in no shard"),
        ({"offload": [[5.0, 0.0], [0.0, 0.0]]}, "'offload\\[0\\]\\[0\\]' must be a number in"),
        ({"offload": [[-1.0, 0.0], [0.0, 0.0]]}, "'offload\\[0\\]\\[0\\]' must be a number in"),
        ({"offload": [[float("nan"), 0.0], [0.0, 0.0]]}, "'offload\\[0\\]\\[0\\]' must be a"),
        ({"offload": [["0.5", 0], [0, 0]]}, "'offload\\[0\\]\\[0\\]' must be a number"),
        ({"num_ranks": 10**30}, "'num_ranks' must be <= 1048576, got an integer"),
        ({"seq_lens": [2**40, 300]}, "'seq_lens\\[0\\]' must be <= 68719476736"),
        ({"strategy": 123}, "'strategy' must be a string, got 123"),
        ({"predicted": {"step_time_s": "1.5"}}, "'predicted.step_time_s' must be a number"),
        ({"barriers": [99]}, "barriers must name waves in \\[0, 2\\)"),
        ({"waves": [[[[0, 0, 500]], [[1, 0, 300]]], [[[0, 500, 1000]], []]]}, "one wave"),
        ({"waves": [[[[0, 0, 500.7]], [[0, 500, 1000]]], [[[1, 0, 300]], []]]}, "500.7"),
        ({"num_ranks": "two"}, "'num_ranks' must be an integer, got 'two'"),
        ({"num_ranks": 0}, "'num_ranks' must be >= 1"),
        ({"kv_block_tokens": 1.5}, "'kv_block_tokens' must be an integer"),
        ({"barriers": "0"}, "'barriers' must be a list"),
        ({"offload": [["a", 0], [0, 0]]}, "'offload\\[0\\]\\[0\\]' must be a number"),
        ({"offload": [[0, 0]]}, "'offload' must be \\[num_waves\\]\\[num_ranks\\] numbers"),
    ],
)
def test_from_json_refuses_an_invalid_plan_naming_what(change, message, tmp_path):
    """Each bad PLAN.json of the audit: one PlanError naming the field or the broken invariant,
    from ``from_json`` and from ``load`` (which names the file), never a plan that is wrong."""
    Plan.from_json(_plan_json())  # the unchanged plan is valid
    with pytest.raises(PlanError, match=message):
        Plan.from_json(_plan_json(**change))
    path = tmp_path / "PLAN.json"
    path.write_text(json.dumps(_plan_json(**change)))
    with pytest.raises(PlanError, match=f"PLAN.json: .*{message}"):
        Plan.load(path)
