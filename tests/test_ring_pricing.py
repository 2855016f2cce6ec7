"""Baselines priced as their systems run (Note [One kernel call per ring step] in ``hdp.ring``):
TransformerEngine's ring makes one kernel call per ring step, every baseline keeps its dK/dV in
the compute dtype, and all-to-alls move at the share of a link FlexSP measured. Each expected
figure is counted by hand from the kernel tables' whole-document prices."""

from dataclasses import replace

import numpy as np
import pytest

from hdp import ClusterSpec, CostModel, GPUProfile, Plan, gpu_preset, model_preset, ulysses
from hdp.planner import STRATEGIES, StepPricing, plan_step
from hdp.profile import TILE_TOKENS
from hdp.specs import GPU_PRESETS

MODEL = model_preset("llama-7b")


def _cost(ranks: int) -> CostModel:
    return CostModel(MODEL, ClusterSpec.preset("h100", ranks))


def _zigzag_plan(lens: list[int], cp: int, strategy: str) -> Plan:
    """Every sequence cut into ``2 cp`` equal chunks, rank ``i`` holding chunks ``i`` and
    ``2 cp - 1 - i`` (TransformerEngine's layout), all in one wave."""
    rank, seq, start, end = [], [], [], []
    for s, L in enumerate(lens):
        c = L // (2 * cp)
        for i in range(cp):
            for j in (i, 2 * cp - 1 - i):
                rank.append(i)
                seq.append(s)
                start.append(j * c)
                end.append((j + 1) * c)
    zeros = np.zeros(len(rank), dtype=np.int64)
    return Plan(lens, cp, rank, zeros, seq, start, end, sync="peer", strategy=strategy)


def _whole_rate(cost: CostModel, length: int) -> float:
    """Query-key pairs per second of a whole causal document, from its table price."""
    c = cost.compute
    t = c.gpu.tables.causal_time(length, MODEL.heads, MODEL.head_dim, c.backend)
    return length * (length + 1) / 2 / float(t)


def test_a_2k_document_at_cp_256_costs_its_padded_pairs_not_207_calls():
    """512 documents of 2,048 tokens at CP 256: 512 chunks of 4 tokens each, 4,096 tokens per
    rank. Chunk ``j`` has 4 queries over ``4j + 2.5`` keys each on average, a tile of 128 rows
    as the kernel runs it; rank ``r`` holds chunks ``r`` and ``511 - r``: 128 (4 x 511 + 5)
    pairs per document, at the whole document's rate. Over the ranks a document costs 32x its
    unsplit attention; priced as calls of its own, each chunk cost over 200x."""
    cost = _cost(256)
    docs, L, cp = 512, 2048, 256
    plan = _zigzag_plan([L] * docs, cp, "static")
    attn, _ = cost.cell_compute(plan)
    recompute = 1 + 1 / 3.5
    per_rank = docs * TILE_TOKENS * (4 * 511 + 5) / _whole_rate(cost, L) * recompute
    assert attn[0] == pytest.approx(np.full(cp, per_rank), rel=1e-9)
    whole = cost.attn_time(np.zeros(1), np.array([L]))[0]
    padded = TILE_TOKENS * (4 * 512 * 511 / 2 + 2.5 * 512)
    assert attn.sum() / docs / whole == pytest.approx(padded / (L * (L + 1) / 2))
    assert attn.sum() / docs / whole == pytest.approx(32.0, rel=1e-3)
    per_call = cost.attn_time(plan.start, plan.end).sum() / docs / whole
    assert per_call > 200  # the same chunks, each priced as its own kernel calls


def test_a_lone_short_document_pays_one_call_per_ring_step():
    """One 2,048-token document alone at CP 256 (8 tokens a rank): its chunks' work is far
    less than the ring's 256 steps, each at least the shortest call the tables price (a
    128-token document)."""
    cost = _cost(256)
    plan = _zigzag_plan([2048], 256, "hybridcp")
    attn, _ = cost.cell_compute(plan)
    c = cost.compute
    shortest = c.gpu.tables.causal_time(TILE_TOKENS, MODEL.heads, MODEL.head_dim, c.backend)
    assert attn[0] == pytest.approx(np.full(256, 256 * shortest * (1 + 1 / 3.5)), rel=1e-9)


def test_long_chunks_run_at_the_rate_of_one_call_over_the_cell():
    """A 65,536-token document on 4 ranks: chunks of 8,192, 16,384 tokens a rank. Every pair
    of a rank's chunks (their own causal pairs, their queries against earlier keys) runs at the
    least rate of a 16K causal document, a 16K x 8K block and an 8K x 16K block (the ring's
    later steps), no faster than the whole document's; the split costs more than the whole
    document."""
    cost = _cost(4)
    L, cp, c = 65536, 4, 8192
    plan = _zigzag_plan([L], cp, "bytescale")
    attn, _ = cost.cell_compute(plan)
    t, h, d, b = cost.compute.gpu.tables, MODEL.heads, MODEL.head_dim, cost.compute.backend
    T = 2 * c
    causal = T * (T + 1) / 2 / float(t.causal_time(T, h, d, b))
    tall = T * c / float(t.full_time(T, c, h, d, b))
    wide = c * T / float(t.full_time(c, T, h, d, b))
    rate = min(causal, tall, wide, _whole_rate(cost, L))
    for i in range(cp):
        starts = [i * c, (2 * cp - 1 - i) * c]
        want = sum(c * (c + 1) / 2 + c * a for a in starts) / rate * (1 + 1 / 3.5)
        assert attn[0, i] == pytest.approx(want, rel=1e-9)
    whole = cost.attn_time(np.zeros(1), np.array([L]))[0]
    assert attn.sum() >= whole


def test_a_cp_group_of_one_runs_one_causal_call_and_hdp_keeps_its_blocks():
    """At CP 1 the zigzag chunks of a document sit on one rank: one causal call over it. hdp's
    plans keep their per-block price: a causal call per shard and a full one for its earlier
    keys."""
    cost = _cost(2)
    c = cost.compute
    t, h, d, b = c.gpu.tables, MODEL.heads, MODEL.head_dim, c.backend
    plan = _zigzag_plan([8192], 1, "static")
    attn, _ = cost.cell_compute(plan)
    assert attn[0, 0] == pytest.approx(float(t.causal_time(8192, h, d, b)) * (1 + 1 / 3.5))
    plan = _zigzag_plan([8192], 2, "hdp")
    attn, _ = cost.cell_compute(plan)
    # rank 0: chunks [0, 2048) and [6144, 8192); rank 1: [2048, 4096) and [4096, 6144)
    diag = float(t.causal_time(2048, h, d, b))
    want = [2 * diag + float(t.full_time(2048, 6144, h, d, b))]
    want.append(
        2 * diag + float(t.full_time(2048, 2048, h, d, b) + t.full_time(2048, 4096, h, d, b))
    )
    assert attn[0] == pytest.approx(np.array(want) * (1 + 1 / 3.5), rel=1e-9)


def test_every_baseline_keeps_dk_dv_in_the_compute_dtype():
    """Priced for fp32 dK/dV sums in flight (hdp's), a baseline still prices its own in bf16;
    hdp keeps fp32. On the wire both send bf16. Static on 2 ranks, one 8,192-token document:
    rank 1 fetches chunk 0 (2,048 tokens), rank 0 chunks 1 and 2 (4,096); each token's K/V
    moves forward and again backward, and its dK/dV (as many bf16 bytes) back: 3 x 6,144
    tokens' K/V bytes a layer."""
    pricing = StepPricing.build(MODEL, ClusterSpec.preset("h100", 2), capacity=4096, dkv_bytes=4)
    for name, strategy in STRATEGIES.items():
        want = 4 if name == "hdp" else 2
        assert pricing.for_strategy(strategy).cost.dkv_bytes == want, name
    plan = plan_step(np.array([8192]), pricing, "static")
    want = 3 * 6144 * MODEL.kv_bytes_per_token * MODEL.layers
    assert plan.predicted["comm_bytes"] == pytest.approx(want)


def test_shipped_presets_take_flexsp_all_to_all_shares_and_a_profile_keeps_its_own():
    """FlexSP measured 35% of NVLink inside a node and 76% of a NIC across nodes; every
    shipped preset takes them, and a profile that states its own keeps them."""
    for name, gpu in GPU_PRESETS.items():
        assert (gpu.alltoall_nvlink_share, gpu.alltoall_nic_share) == (0.35, 0.76), name
    data = gpu_preset("h100").to_json()
    data["alltoall_nvlink_share"], data["alltoall_nic_share"] = 1.0, 0.5
    own = GPUProfile.from_json(data, "own.json")
    assert (own.alltoall_nvlink_share, own.alltoall_nic_share) == (1.0, 0.5)
    # 8 ranks of one node: the bytes of a member cross NVLink at 35% of its bandwidth.
    gpu = gpu_preset("h100")
    bytes_ = ulysses.bytes_per_member(MODEL, 8192, 8, True)
    seconds = ulysses.comm_time(MODEL, ClusterSpec(8, 8, gpu), 8192, 8, True)
    full = ulysses.comm_time(
        MODEL, ClusterSpec(8, 8, replace(gpu, alltoall_nvlink_share=1.0)), 8192, 8, True
    )
    assert seconds - full == pytest.approx(bytes_ / gpu.nvlink_bw * (1 / 0.35 - 1))
