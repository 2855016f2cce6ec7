"""The node K/V exchange against a token-by-token reference: what crosses nodes, what each rank
receives, round and relay-slot rules, and the cost model's counts of it."""

from collections import defaultdict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import random_plans

from hdp import ClusterSpec, CostModel, Plan, model_preset
from hdp.exchange import RELAY_SLOTS


def in_node_mode(plan: Plan, rpn: int) -> Plan:
    d = plan.to_json()
    d.update(kv_exchange="node", ranks_per_node=rpn)
    return Plan.from_json(d)


def needed_tokens(plan: Plan, w: int) -> dict[int, set]:
    """rank -> the (seq, position) K/V it needs and does not hold, from the shards alone."""
    owner, end = {}, defaultdict(int)
    for r in range(plan.num_ranks):
        for s, a, b in plan.shards(r, w):
            for t in range(a, b):
                owner[(s, t)] = r
            end[(s, r)] = max(end[(s, r)], b)
    need = defaultdict(set)
    for (s, r), e in end.items():
        for t in range(e):
            if owner[(s, t)] != r:
                need[r].add((s, t))
    return need


def tokens_of(pieces) -> list:
    return [(p.seq, t) for p in pieces for t in range(p.start, p.end)]


@settings(max_examples=200, deadline=None)
@given(random_plans(), st.integers(1, 4))
def test_node_exchange_delivers_each_needed_token_once(plan, rpn):
    plan = in_node_mode(plan, rpn)
    for w in range(plan.num_waves):
        need = needed_tokens(plan, w)
        ex = plan.exchange(w)
        got = defaultdict(list)
        into_node = defaultdict(list)
        at_round = {}
        for r, rnd in enumerate(ex.rounds):
            assert len({m.src for m in rnd}) == len(rnd), "a rank sends twice in one round"
            assert len({m.dst for m in rnd}) == len(rnd), "a rank receives twice in one round"
            for m in rnd:
                at_round[m.hop] = (r, m)
                assert 0 < m.tokens <= plan.kv_block_tokens and m.src != m.dst
                toks = tokens_of(m.pieces)
                got[m.dst] += [t for t in toks if t in need[m.dst]]
                if m.src // rpn != m.dst // rpn:
                    into_node[m.dst // rpn] += toks
                    assert m.relay, "only fetches cross nodes"
        for r in range(plan.num_ranks):
            assert sorted(got[r]) == sorted(need[r]), f"rank {r} wave {w}"
        # Each remote token a node needs crosses into it exactly once.
        for node in range(-(-plan.num_ranks // rpn)):
            ranks = range(node * rpn, min(plan.num_ranks, (node + 1) * rpn))
            held = {(s, t) for r in ranks for s, a, b in plan.shards(r, w) for t in range(a, b)}
            wanted = set().union(*(need[r] for r in ranks)) - held
            assert sorted(into_node[node]) == sorted(wanted)
        check_relays(ex, at_round)


def check_relays(ex, at_round) -> None:
    """Forwards follow their fetch from the relay, within its block; a relay holds at most
    RELAY_SLOTS blocks; each sum returns after the block's last forward."""
    last = {}
    for _hop, (r, m) in at_round.items():
        if m.via >= 0:
            f_round, f = at_round[m.via]
            assert f.relay and f.dst == m.src and f_round < r
            assert set(tokens_of(m.pieces)) <= set(tokens_of(f.pieces))
            last[m.via] = max(last.get(m.via, f_round), r)
    held = defaultdict(int)
    for hop, (r, m) in at_round.items():
        if m.relay:
            assert ex.returns[hop] == last.get(hop, r) + 1
            for t in range(r, last.get(hop, r) + 1):
                held[(m.dst, t)] += 1
    assert max(held.values(), default=0) <= RELAY_SLOTS


@settings(max_examples=100, deadline=None)
@given(random_plans(), st.integers(1, 4))
def test_cost_model_counts_the_node_exchange(plan, rpn):
    """NIC tokens into each node and out of each rank are exact; every rank's received tokens
    add up."""
    plan = in_node_mode(plan, rpn)
    cm = CostModel(model_preset("tiny"), ClusterSpec.preset("cpu", plan.num_ranks, rpn))
    tr = cm.kv_traffic(plan)
    node = np.arange(plan.num_ranks) // rpn
    for w in range(plan.num_waves):
        nic_in, nic_out = np.zeros(plan.num_ranks), np.zeros(plan.num_ranks)
        for m in plan.kv_transfers(w):
            if m.src // rpn != m.dst // rpn:
                nic_in[m.dst] += m.tokens
                nic_out[m.src] += m.tokens
        assert np.allclose(np.bincount(node, nic_in), np.bincount(node, tr.in_inter[w]))
        assert np.allclose(nic_out, tr.out_inter[w])
        need = needed_tokens(plan, w)
        for r in range(plan.num_ranks):
            assert tr.received[w, r] >= len(need[r]) - 1e-9


def test_a_long_sequence_crosses_each_nic_once():
    """One sequence zigzag over every rank: NIC tokens of node exchange are at most those of rank
    exchange over the GPUs per node, plus one block per node."""
    for n, rpn in ((4, 2), (6, 3), (16, 8)):
        L = 64 * n
        b = np.linspace(0, L, 2 * n + 1).astype(int)
        cells = [
            [[(0, int(b[i]), int(b[i + 1])), (0, int(b[-2 - i]), int(b[-1 - i]))]] for i in range(n)
        ]
        plan = Plan.from_shards([L], n, [[c[0] for c in cells]], kv_block_tokens=16)
        node_plan = in_node_mode(plan, rpn)
        rank_nic = sum(m.tokens for m in plan.kv_transfers(0) if m.src // rpn != m.dst // rpn)
        node_nic = sum(m.tokens for m in node_plan.kv_transfers(0) if m.src // rpn != m.dst // rpn)
        assert 0 < node_nic <= rank_nic / rpn + 16 * (n // rpn)
