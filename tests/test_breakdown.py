"""The slowest rank's step, broken down (:mod:`hdp.planner.breakdown`): the parts sum to the step,
and on hand-built plans whose answer is known apart from the breakdown, the right part
dominates; hdp-sim prints a line per strategy and writes the parts to its JSON."""

import re
from dataclasses import replace

import numpy as np
import pytest

from hdp import ClusterSpec, CostModel, Plan, gpu_preset, model_preset
from hdp.planner import StepPricing, plan_and_evaluate
from hdp.planner.breakdown import PARTS, SlowestRank, slowest_rank
from hdp.planner.sim import format_table, simulate
from hdp.workloads import get_workload

LLAMA = model_preset("llama-7b")
K = 1024


def cost_on(ranks: int, gpu=None) -> CostModel:
    return CostModel(LLAMA, ClusterSpec(ranks, 8, gpu or gpu_preset("h100")))


def whole(lens: list[int], ranks: list[int], waves: list[int], n: int, **kw) -> Plan:
    """Each sequence whole on one rank, in the given wave."""
    k = len(lens)
    return Plan(lens, n, ranks, waves, list(range(k)), [0] * k, lens, **kw)


def collectives_reference(cost: CostModel, busy: np.ndarray, sync: str) -> float:
    """The collectives and optimizer around the compute, as docs/cost_model.md prices them:
    under peer sync one all-gather and reduce-scatter share per layer after the last cell; under
    wave sync each wave waits for its all-gathers where they outlast its busiest rank."""
    ag, rs, layers = cost.allgather_time(), cost.reduce_scatter_time(), cost.model.layers
    if sync == "peer":
        return (ag + rs) / layers + cost.optimizer_s
    coll = 2 * ag + rs
    waits = sum(max(0.0, coll - float(w.max())) for w in busy)
    return len(busy) * coll / layers + waits + cost.optimizer_s


@pytest.mark.parametrize("sync", ["peer", "wave"])
def test_the_parts_sum_to_the_step_time_for_every_strategy(sync):
    pricing = StepPricing.build(LLAMA, ClusterSpec.preset("h100", 16), sync=sync)
    lens = get_workload("wlb-128k").sample_batch(np.random.default_rng(3), 1 << 20, 131072)
    for name in ("static", "ulysses", "hybridcp", "bytescale", "flexsp", "hdp"):
        plan, report = plan_and_evaluate(lens, pricing, name)
        b = slowest_rank(plan, report, pricing.cost)
        assert sum(b.parts.values()) == pytest.approx(report.step_time_s, rel=1e-9), name
        assert min(b.parts.values()) >= -1e-9 * report.step_time_s, (name, b)
        assert b.rank == int(np.argmax(report.busy_s.sum(axis=0)))
        reference = collectives_reference(pricing.cost, report.busy_s, plan.sync)
        assert b.collectives == pytest.approx(reference, rel=1e-9, abs=1e-12), name
        # Every rank's parts sum to the same step: it ends when the last rank does.
        other = slowest_rank(plan, report, pricing.cost, rank=plan.num_ranks - 1)
        assert sum(other.parts.values()) == pytest.approx(report.step_time_s, rel=1e-9)


def test_one_long_sequence_whole_on_one_rank_is_attention_bound():
    """Causal attention costs ~2 d L^2 FLOPs a layer against ~2 P L for the linear layers: at
    1M tokens of llama-7b that is ~20 times more, at 4K tokens ~12 times less."""
    cost = cost_on(1)
    d, layers, params = LLAMA.hidden, LLAMA.layers, LLAMA.total_params
    for length, dominant in ((1024 * K, "attention"), (4 * K, "linear")):
        plan = whole([length], [0], [0], 1, sync="peer")
        b = slowest_rank(plan, cost.evaluate(plan), cost)
        flop_ratio = d * length * layers / params
        assert (flop_ratio > 1) == (dominant == "attention")
        assert b.dominant == dominant
        assert b.idle == pytest.approx(0.0, abs=1e-12)
        assert b.exposed_comm == pytest.approx(0.0, abs=1e-12) and b.offload == 0.0
    assert b.linear > 0.5 * b.step_s  # the 4K sequence


def test_a_wave_s_short_rank_waits_for_its_long_one():
    """Wave sync: rank 1's short sequence waits for rank 0's long one; rank 0 is the slowest
    and its step is work, rank 1's is mostly waiting."""
    cost = cost_on(2)
    long, short = 256 * K, 16 * K
    plan = whole([long, short], [0, 1], [0, 0], 2, sync="wave")
    report = cost.evaluate(plan)
    slow = slowest_rank(plan, report, cost)
    assert slow.rank == 0 and slow.dominant == "attention"
    assert slow.idle == pytest.approx(0.0, abs=1e-9)
    waiting = slowest_rank(plan, report, cost, rank=1)
    alone = cost.seq_time(np.array([long, short]))
    assert waiting.idle == pytest.approx(alone[0] - alone[1], rel=1e-9)
    assert waiting.dominant == "idle"


def test_a_peer_holding_the_head_of_a_sequence_waits_for_the_one_holding_its_tail():
    """Peer sync: ranks 0 and 1 split a 256K sequence at its middle; queries of the tail see
    three times the keys of the head, so rank 1 (the head) waits on rank 0, the slowest;
    rank 2's own short sequence sets nothing."""
    cost = cost_on(3)
    half = 128 * K
    rank, seq, start, end = [0, 1, 2], [0, 0, 1], [half, 0, 0], [2 * half, half, 8 * K]
    plan = Plan([2 * half, 8 * K], 3, rank, [0, 0, 0], seq, start, end, sync="peer")
    report = cost.evaluate(plan)
    slow = slowest_rank(plan, report, cost)
    head = slowest_rank(plan, report, cost, rank=1)
    assert slow.rank == 0 and slow.dominant == "attention"
    assert slow.idle == pytest.approx(0.0, abs=1e-9)
    pairs = CostModel.causal_pairs(np.array([half, 0]), np.array([2 * half, half]))
    assert pairs[0] / pairs[1] == pytest.approx(3.0, rel=1e-4)
    assert 2.5 < slow.attention / head.attention < 3.5
    assert head.idle > 0.3 * head.step_s and head.dominant == "idle"
    shorter = slowest_rank(plan, report, cost, rank=2)
    assert shorter.dominant == "idle"


def test_offload_slower_than_compute_shows_as_offload():
    """A cell that offloads all its checkpointed activations over a slow host link: the copy
    out and back (2 x tokens x checkpoint bytes / link) outlasts the compute."""
    slow_link = replace(gpu_preset("h100"), pcie_bw=1e8)
    tokens = 8 * K
    for gpu, dominant in ((slow_link, "offload"), (gpu_preset("h100"), "linear")):
        cost = cost_on(1, gpu)
        plan = whole([tokens], [0], [0], 1, sync="peer", offload=[[1.0]])
        report = cost.evaluate(plan)
        b = slowest_rank(plan, report, cost)
        copy = 2 * tokens * cost.ckpt_bytes_per_token / gpu.pcie_bw
        assert b.offload == pytest.approx(max(0.0, copy - (b.attention + b.linear)), rel=1e-9)
        assert b.dominant == dominant


def test_the_mean_is_part_by_part():
    a = SlowestRank(0, 10.0, 6.0, 2.0, 1.0, 0.0, 0.5, 0.5)
    b = SlowestRank(3, 20.0, 2.0, 8.0, 4.0, 2.0, 3.0, 1.0)
    m = SlowestRank.mean([a, b])
    assert m.rank is None and m.step_s == 15.0
    assert m.parts == dict(zip(PARTS, (4.0, 5.0, 2.5, 1.0, 1.75, 0.75)))
    assert m.dominant == "linear"
    assert m.describe() == (
        "slowest rank 15.000 s = attention 27%, linear 33%, exposed comm 17%, offload 7%, "
        "idle 12%, collectives 5%; dominant: linear"
    )


def test_hdp_sim_prints_a_line_per_strategy_and_writes_the_parts():
    pricing = StepPricing.build(LLAMA, ClusterSpec.preset("h100", 16))
    names = ["static", "bytescale", "hdp"]
    sim = simulate(get_workload("wlb-128k"), pricing, names, steps=2, tokens_per_step=1 << 20)
    lines = format_table(sim).splitlines()
    shown = [line for line in lines if "slowest rank" in line]
    assert [line.split(":")[0] for line in shown] == names
    assert lines.index(shown[-1]) < len(lines) - 1  # above the lines naming the planners
    data = sim.to_json()
    for name, line in zip(names, shown):
        m = re.fullmatch(r"\w+: +slowest rank ([0-9.]+) s = (.*); dominant: ([a-z ]+)", line)
        assert m, line
        step = float(m[1])
        assert step == pytest.approx(sim.results[name].mean()["step_time_s"], abs=1e-3)
        percents = [int(p) for p in re.findall(r"(\d+)%", m[2])]
        assert all(p >= 1 for p in percents) and 95 <= sum(percents) <= 105
        parts = data["slowest_rank"][name]
        assert parts["rank"] is None and m[3].replace(" ", "_") == parts["dominant"]
        assert len(parts["per_step"]) == 2
        for each in (parts, *parts["per_step"]):
            total = sum(each[f"{p}_s"] for p in PARTS)
            assert total == pytest.approx(each["step_s"], rel=1e-9)
