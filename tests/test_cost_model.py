"""The cost model against values computed by hand for llama-7b (FLOPs, bytes, memory, times)."""

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from hdp import ClusterSpec, CostModel, Plan, model_preset, parse_size
from hdp.specs import GPU_PRESETS, MODEL_PRESETS, gpu_preset

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"

# Llama 2 7B: hidden 4096, 32 heads of 128 (MHA), SwiGLU 11008, vocab 32000, 32 layers.
P_LAYER = 4096 * 4096 + 4096 * 2 * 4096 + 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
P_TOTAL = 32 * P_LAYER + 2 * 32000 * 4096 + 4096


@pytest.fixture
def cm():
    return CostModel(model_preset("llama-7b"), ClusterSpec.preset("h100", 8))


def test_parameter_counts():
    m = model_preset("llama-7b")
    assert m.params_per_layer == P_LAYER == 202_383_360
    assert m.total_params == P_TOTAL == 6_738_415_616
    assert m.kv_bytes_per_token == 2 * 32 * 128 * 2 == 16384
    # Llama 2 70B is ~69B parameters with 8 KV heads.
    assert 68.9e9 < model_preset("llama-70b").total_params < 69.1e9
    assert model_preset("llama-70b").kv_bytes_per_token == 2 * 8 * 128 * 2
    assert model_preset("tiny").vocab >= 256


def test_flops_per_layer(cm):
    # Dense: 2 FLOPs per parameter per token forward; x3 train; +1 forward recompute.
    assert cm.linear_flops_per_token == 2 * P_LAYER * 4
    # Attention: 4 * heads * head_dim per pair forward; backward 2.5x; +1 recompute.
    assert cm.attn_flops_per_pair == 4 * 32 * 128 * 4.5
    assert cm.causal_pairs(0, 4096) == 4096 * 4097 / 2
    # A head/tail zigzag pair of q tokens in a sequence of L covers q * (L + 1) / 2 query-key
    # pairs (key <= query), whatever the pair's position: balanced by construction.
    L, q = 8192, 1024
    for k in range(0, L // 2, q // 2):
        head = cm.causal_pairs(k, k + q // 2)
        tail = cm.causal_pairs(L - k - q // 2, L - k)
        assert head + tail == q * (L + 1) / 2
    no_ckpt = CostModel(
        model_preset("llama-7b"), ClusterSpec.preset("h100", 8), activation_checkpointing=False
    )
    assert no_ckpt.linear_flops_per_token == 2 * P_LAYER * 3
    assert no_ckpt.attn_flops_per_pair == 4 * 32 * 128 * 3.5


def _reference_curve():
    """Relative attention efficiency by length, straight from the shared CSV."""
    rows = []
    with open(SHARED / "profiles" / "attention_h100_distca.csv") as f:
        for r in csv.DictReader(f):
            if r["cp"] == "1" and r["tp"] == "1":
                L = float(r["L"])
                rows.append((L, L * L / float(r["duration_per_doc"])))
    top = max(rows)[1]
    return {L: e / top for L, e in rows}


@pytest.mark.skipif(
    not (SHARED / "profiles").exists(), reason="../shared/data not beside the checkout"
)
def test_attention_efficiency_curve_matches_measurement():
    ref = _reference_curve()
    g = gpu_preset("h100")
    for L, rel in ref.items():
        assert g.attn_efficiency(L) == pytest.approx(g.attn_max_efficiency * rel)
    # DESIGN: a 512-token block reaches about 25% of the 4K-block rate.
    assert 0.2 < g.attn_efficiency(512) / g.attn_efficiency(4096) < 0.32


def test_single_sequence_time(cm):
    g = cm.cluster.gpu
    pairs = 4096 * 4097 / 2
    attn = 32 * pairs * 4 * 32 * 128 * 4.5 / (g.peak_flops * g.attn_efficiency(4096))
    lin_eff = g.linear_max_efficiency * 4096 / (4096 + g.linear_half_tokens)
    dense = (
        4096 * (32 * 2 * P_LAYER * 4 + 2 * 32000 * 4096 * 3) / (g.peak_flops * lin_eff)
        + 32 * g.layer_overhead_s
    )
    assert cm.seq_time(4096) == pytest.approx(attn + dense, rel=1e-12)
    plan = Plan.from_shards([4096], 8, [[[(0, 0, 4096)]] + [[]] * 7])
    rep = cm.evaluate(plan)
    assert rep.compute_s[0, 0] == pytest.approx(attn + dense, rel=1e-12)
    assert rep.comm_bytes == 0
    # Wave sync (the default): only the first layer's share of the per-wave parameter all-gathers
    # (forward and backward) and gradient reduce-scatter is exposed.
    expected = (2 * cm.allgather_time() + cm.reduce_scatter_time()) / 32
    assert rep.exposed_comm_s == pytest.approx(expected)
    assert cm.allgather_time() == pytest.approx(P_TOTAL * 2 * 7 / 8 / cm.cluster.gpu.nvlink_bw)
    assert cm.reduce_scatter_time() == pytest.approx(P_TOTAL * 4 * 7 / 8 / cm.cluster.gpu.nvlink_bw)


def test_memory_terms(cm):
    n = 8
    static_wave = 16 * P_TOTAL / n + P_LAYER * (2 * 2 + 4)
    static_peer = P_TOTAL * (2 + 4) + 12 * P_TOTAL / n
    assert cm.static_bytes("wave") == pytest.approx(static_wave)
    assert cm.static_bytes("peer") == pytest.approx(static_peer)
    assert cm.ckpt_bytes_per_token == 32 * 4096 * 2
    assert cm.working_bytes_per_token == (6 * 4096 + 2 * 4096 + 2 * 4096 + 3 * 11008) * 2
    loss = 4096 * 32000 * (2 + 4)
    kv_buf = 2 * 8192 * 16384 * 3  # two blocks of K/V (bf16) with fp32 dK/dV in flight
    mem = cm.memory(10_000, 0.0, 8192, "wave")
    assert mem == pytest.approx(
        static_wave + loss + 10_000 * (32 * 4096 * 2 + cm.working_bytes_per_token) + kv_buf
    )
    # Capacity: the most tokens (multiple of 128) whose memory fits the budget.
    budget = 80e9 * 0.92 - 3e9
    for sync in ("wave", "peer"):
        cap = cm.capacity(sync)
        assert cap % 128 == 0
        assert cm.memory(cap, 0.0, 8192, sync) <= budget < cm.memory(cap + 128, 0.0, 8192, sync)
    # Offloading all checkpointed activations lets a rank hold more.
    assert cm.offload_capacity("peer") > cm.capacity("peer")
    f = cm.offload_needed(np.array([cm.offload_capacity("peer")]), "peer")[0]
    assert 0 < f <= 1


def test_kv_traffic_two_ranks(cm):
    # One 8192-token sequence, first half on rank 0, second half on rank 1 (same node).
    plan = Plan.from_shards([8192], 8, [[[(0, 0, 4096)], [(0, 4096, 8192)]] + [[]] * 6])
    tr = cm.kv_traffic(plan)
    assert tr.received[0, 1] == 4096 and tr.received[0, 0] == 0
    assert tr.sent[0, 0] == 4096 and tr.in_inter.sum() == 0
    t_fwd, t_bwd = cm.comm_time_per_layer(tr)
    g = cm.cluster.gpu
    assert t_fwd[0, 1] == pytest.approx(4096 * 16384 / g.nvlink_bw + g.nvlink_latency)
    # Backward: K/V again in, fp32 dK/dV (2x the bf16 bytes) back out.
    assert t_bwd[0, 1] == pytest.approx(2 * 4096 * 16384 / g.nvlink_bw + 2 * g.nvlink_latency)
    rep = cm.evaluate(plan)
    assert rep.comm_bytes == pytest.approx(4096 * 16384 * 32 * (1 + 1 + 2))


def test_kv_traffic_across_nodes():
    cm = CostModel(model_preset("llama-7b"), ClusterSpec.preset("h100", 16))
    plan = Plan.from_shards(
        [8192], 16, [[[(0, 0, 4096)]] + [[]] * 8 + [[(0, 4096, 8192)]] + [[]] * 6]
    )
    tr = cm.kv_traffic(plan)
    assert tr.in_inter[0, 9] == 4096 and tr.in_intra[0, 9] == 0 and tr.out_inter[0, 0] == 4096
    t_fwd, _ = cm.comm_time_per_layer(tr)
    assert t_fwd[0, 9] == pytest.approx(
        4096 * 16384 / cm.cluster.gpu.nic_bw + cm.cluster.gpu.nic_latency
    )


def test_lower_bound_and_mfu(cm):
    lens = np.array([4096, 100_000])
    g = cm.cluster.gpu
    attn = sum(
        32 * (L * (L + 1) / 2) * 4 * 32 * 128 * 4.5 / (g.peak_flops * g.attn_efficiency(L))
        for L in lens
    )
    dense = (
        lens.sum()
        * (32 * 2 * P_LAYER * 4 + 2 * 32000 * 4096 * 3)
        / (g.peak_flops * g.linear_max_efficiency)
    )
    assert cm.lower_bound(lens) == pytest.approx((attn + dense) / 8)
    flops = (
        lens.sum() * (32 * 2 * P_LAYER + 2 * 32000 * 4096) * 3
        + sum(L * (L + 1) / 2 for L in lens) * 4 * 32 * 128 * 3 * 32
    )
    assert cm.model_flops(lens) == pytest.approx(flops)


def test_wave_and_peer_step_time():
    cm = CostModel(model_preset("tiny"), ClusterSpec.preset("cpu", 2, 2))
    # Wave sync: the sum over waves of the slowest rank. Peer: each rank runs its own waves.
    shards = [[[(0, 0, 4000)], [(1, 0, 1000)]], [[(2, 0, 1000)], [(3, 0, 4000)]]]
    lens = [4000, 1000, 1000, 4000]
    wave = cm.evaluate(Plan.from_shards(lens, 2, shards, sync="wave"))
    peer = cm.evaluate(Plan.from_shards(lens, 2, shards, sync="peer"))
    t_long, t_short = cm.seq_time(4000), cm.seq_time(1000)
    # Every wave all-gathers parameters forward and backward and reduce-scatters gradients;
    # hidden under compute but the first layer's share.
    coll = 2 * cm.allgather_time() + cm.reduce_scatter_time()
    per_wave = max(t_long, coll) + coll / 2
    assert wave.step_time_s == pytest.approx(2 * per_wave, rel=1e-9)
    tail = (cm.allgather_time() + cm.reduce_scatter_time()) / 2
    assert peer.step_time_s == pytest.approx(t_long + t_short + tail, rel=1e-9)
    # Peer: ranks sharing a sequence start together, when the later of them is free.
    shards = [[[(0, 0, 4000)], []], [[(1, 0, 500)], [(1, 500, 1000)]]]
    rep = cm.evaluate(Plan.from_shards([4000, 1000], 2, shards, sync="peer"))
    assert rep.start_s[1, 1] == pytest.approx(rep.start_s[1, 0]) == pytest.approx(rep.busy_s[0, 0])


def test_presets_and_sizes():
    assert (
        parse_size("2M") == 2_097_152
        and parse_size("64K") == 65536
        and parse_size("32m") == 32 << 20
    )
    assert parse_size("1000") == 1000
    for bad in ("", "abc", "-5", "1.5"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert set(MODEL_PRESETS) >= {
        "tiny",
        "llama-1b",
        "llama-7b",
        "llama-13b",
        "llama-30b",
        "llama-70b",
    }
    assert set(GPU_PRESETS) >= {"h100", "a100-80g", "a100-40g", "h200", "cpu"}
    with pytest.raises(ValueError, match="unknown model preset 'llama-9b'.*llama-7b"):
        model_preset("llama-9b")
    with pytest.raises(ValueError, match="unknown GPU preset 'v100'"):
        gpu_preset("v100")
    assert math.isclose(gpu_preset("h200").memory_bytes, 141e9)
