"""The cost model against values computed by hand for llama-7b (FLOPs, bytes, memory, times)."""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hdp import ClusterSpec, CostModel, Plan, model_preset, parse_size
from hdp.models import MODEL_PRESETS
from hdp.specs import GPU_PRESETS, GPUProfile, gpu_preset

ROOT = Path(__file__).resolve().parents[1]

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


def test_causal_pairs(cm):
    assert cm.causal_pairs(0, 4096) == 4096 * 4097 / 2
    # A head/tail zigzag pair of q tokens in a sequence of L covers q * (L + 1) / 2 query-key
    # pairs (key <= query), whatever the pair's position: balanced by construction.
    L, q = 8192, 1024
    for k in range(0, L // 2, q // 2):
        head = cm.causal_pairs(k, k + q // 2)
        tail = cm.causal_pairs(L - k - q // 2, L - k)
        assert head + tail == q * (L + 1) / 2


def _h100_rows(table: str) -> list[list]:
    """Rows of the shipped h100 profile, read as plain JSON (not through the code under test)."""
    data = json.loads((ROOT / "hdp" / "data" / "profiles" / "h100.json").read_text())
    return data["tables"][table]["rows"]


def test_measured_calls_are_priced_at_their_measured_time():
    tables = gpu_preset("h100").tables
    for backend, kind, heads, _, hd, a, b, seconds in _h100_rows("attention"):
        if kind == "causal":
            got = tables.causal_time(a, heads, hd, backend) * b
        else:
            got = tables.full_time(a, b, heads, hd, backend)
        assert got == pytest.approx(seconds, rel=1e-9), (backend, kind, hd, a, b)
    for tokens, n_in, n_out, seconds in _h100_rows("gemm"):
        assert tables.gemm_time(tokens, n_in, n_out) == pytest.approx(seconds, rel=1e-9)


def test_unmeasured_calls_lie_between_their_neighbours():
    tables = gpu_preset("h100").tables
    # Between two measured document lengths the rate (pairs per second) lies between theirs.
    rate = lambda L: L * (L + 1) / 2 / tables.causal_time(L, 32, 128, "torch_flash")  # noqa: E731
    assert rate(2048) < rate(4096) < rate(8192)
    # 64 heads give the kernel the parallel tiles of twice the queries at 32 heads.
    assert tables.full_time(512, 65536, 64, 128, "torch_flash") == pytest.approx(
        tables.full_time(1024, 65536, 32, 128, "torch_flash"), rel=1e-12
    )
    # A head dimension between two measured ones runs at a rate between theirs.
    per_dim = [
        4096 * 65536 * d / tables.full_time(4096, 65536, 32, d, "torch_flash")
        for d in (64, 96, 128)
    ]
    assert per_dim[0] < per_dim[1] < per_dim[2]
    # A GEMM shape that was not measured runs at a rate within the measured shapes' range.
    rates = [6 * 4096 * i * o / s for t, i, o, s in _h100_rows("gemm") if t == 4096]
    t = tables.gemm_time(4096, 4096, 11008)
    assert min(rates) <= 6 * 4096 * 4096 * 11008 / t <= max(rates)
    # Fewer tokens than measured take as long as the fewest measured.
    assert tables.gemm_time(100, 4096, 4096) == tables.gemm_time(1024, 4096, 4096)


def test_memory_bound_and_optimizer_fits_follow_the_rows():
    tables = gpu_preset("h100").tables
    ops = {"rmsnorm": [], "swiglu": [], "residual_add": []}
    for op, width, tokens, seconds in _h100_rows("memory_bound"):
        if op in ops:
            ops[op].append(tables.memory_bound_time(op, width, tokens) / seconds - 1)
    for op, errors in ops.items():
        assert np.median(np.abs(errors)) < 0.35, op
    for params, seconds in _h100_rows("optimizer"):
        assert tables.optimizer_time(params) == pytest.approx(seconds, rel=0.05)


def test_single_sequence_time(cm):
    # A whole sequence on one rank: its causal call, recomputed forward included, in every layer,
    # and the dense work of a micro-batch of its tokens.
    tables, L = cm.cluster.gpu.tables, 8192
    per_doc = next(s / b for bk, k, h, _, d, a, b, s in _h100_rows("attention")
                   if (bk, k, d, a) == ("torch_flash", "causal", 128, L))  # fmt: skip
    attn = 32 * per_doc * 4.5 / 3.5
    assert cm.seq_time(L) == pytest.approx(attn + cm.dense_time(L), rel=1e-12)
    m = cm.model
    layer = sum(tables.gemm_time(L, i, o) for i, o in cm.compute.linears) + (
        2 * tables.memory_bound_time("rmsnorm", m.hidden, L)
        + 2 * tables.memory_bound_time("residual_add", m.hidden, L)
        + tables.memory_bound_time("swiglu", m.ffn, L)
        + tables.memory_bound_time("rope", (m.heads + m.kv_heads) * m.head_dim, L)
    )
    chunk = tables.gemm_time(4096, m.hidden, m.vocab) + tables.memory_bound_time(
        "cross_entropy", m.vocab, 4096
    )
    head = 2 * chunk * 4 / 3  # two 4K-token loss chunks, recomputed in backward
    expected = 32 * (layer * 4 / 3 + cm.cluster.gpu.layer_overhead_s) + head
    assert cm.dense_time(L) == pytest.approx(expected, rel=2e-3)  # a log grid interpolates it
    plan = Plan.from_shards([L], 8, [[[(0, 0, L)]] + [[]] * 7])
    rep = cm.evaluate(plan)
    assert rep.compute_s[0, 0] == pytest.approx(cm.seq_time(L), rel=1e-12)
    assert rep.comm_bytes == 0
    # Wave sync (the default): only the first layer's share of the per-wave parameter all-gathers
    # (forward and backward) and gradient reduce-scatter is exposed.
    expected = (2 * cm.allgather_time() + cm.reduce_scatter_time()) / 32
    assert rep.exposed_comm_s == pytest.approx(expected)
    assert cm.allgather_time() == pytest.approx(P_TOTAL * 2 * 7 / 8 / cm.cluster.gpu.nvlink_bw)
    assert cm.reduce_scatter_time() == pytest.approx(P_TOTAL * 4 * 7 / 8 / cm.cluster.gpu.nvlink_bw)
    # The optimizer steps over the rank's shard once, after the waves.
    assert cm.optimizer_s == pytest.approx(tables.optimizer_time(P_TOTAL / 8))
    assert rep.step_time_s == pytest.approx(rep.busy_s.max() + expected + cm.optimizer_s)


def test_compiled_layers_take_the_profiles_share_of_their_memory_bound_time(cm):
    """``compiled``: the GEMMs as eager, the memory-bound ops of a layer and of the loss at the
    profile's ``compiled_memory_bound_scale`` of their table time, and one ``[tokens, hidden]``
    activation fewer per layer whose activations are kept."""
    gpu = replace(cm.cluster.gpu, compiled_memory_bound_scale=0.4)
    eager = replace(cm, cluster=replace(cm.cluster, gpu=gpu))
    compiled = replace(eager, compiled=True)
    tables, m, T = gpu.tables, cm.model, 16384
    memory_bound = (
        2 * tables.memory_bound_time("rmsnorm", m.hidden, T)
        + 2 * tables.memory_bound_time("residual_add", m.hidden, T)
        + tables.memory_bound_time("swiglu", m.ffn, T)
        + tables.memory_bound_time("rope", (m.heads + m.kv_heads) * m.head_dim, T)
    )
    saved = (1 - 0.4) * memory_bound * 4 / 3  # every layer recomputed
    assert eager.compute.layer_time(T) - compiled.compute.layer_time(T) == pytest.approx(saved)
    loss = tables.memory_bound_time("cross_entropy", m.vocab, 4096)
    saved = (1 - 0.4) * loss * 4 * 4 / 3  # four 4K-token chunks, recomputed in backward
    assert eager.compute.head_time(T) - compiled.compute.head_time(T) == pytest.approx(saved)
    for layers in (None, 20):
        e, c = (replace(x, checkpointed_layers=layers) for x in (eager, compiled))
        kept = 32 - e.recomputed_layers if layers else 1  # all recomputed: one layer's at once
        assert e.working_bytes_per_token - c.working_bytes_per_token == kept * 4096 * 2
    with pytest.raises(ValueError, match="compiled_memory_bound_scale"):
        data = json.loads((ROOT / "hdp/data/profiles/h100.json").read_text())
        GPUProfile.from_json(data | {"compiled_memory_bound_scale": 1.5}, "h100.json")


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
    # Backward: K/V again in, dK/dV (bf16, as many bytes) back out, both links at once.
    assert t_bwd[0, 1] == pytest.approx(4096 * 16384 / g.nvlink_bw + 2 * g.nvlink_latency)
    rep = cm.evaluate(plan)
    assert rep.comm_bytes == pytest.approx(4096 * 16384 * 32 * (1 + 1 + 1))


def test_dkv_bytes_prices_the_sums_in_flight_not_the_wire():
    """hdp's dist_attn keeps a block's dK/dV sums in fp32 and TransformerEngine's ring in bf16:
    the memory of the blocks in flight differs, the bytes on the wire (bf16) do not."""
    bf16 = CostModel(model_preset("llama-7b"), ClusterSpec.preset("h100", 8), dkv_bytes=2)
    fp32 = CostModel(model_preset("llama-7b"), ClusterSpec.preset("h100", 8))
    plan = Plan.from_shards([8192], 8, [[[(0, 0, 4096)], [(0, 4096, 8192)]] + [[]] * 6])
    for cm in (bf16, fp32):
        assert cm.evaluate(plan).comm_bytes == pytest.approx(4096 * 16384 * 32 * 3)
    # Two 8K-token blocks in flight, each K/V plus its dK/dV: 2 + 2 bytes per element, or 2 + 4.
    assert bf16.kv_buffer_bytes(8192) == pytest.approx(2 * 8192 * 16384 * 2)
    assert fp32.kv_buffer_bytes(8192) == pytest.approx(2 * 8192 * 16384 * 3)
    with pytest.raises(ValueError, match="dkv_bytes must be 2 or 4"):
        CostModel(model_preset("llama-7b"), ClusterSpec.preset("h100", 8), dkv_bytes=1)


def test_parameter_collectives_across_nodes_share_every_nic_of_a_node():
    """NCCL runs a collective across nodes as one ring per NIC, so a node's NICs together carry
    its inter-node bytes, unless NVLink is slower (Note [Ring collectives across nodes])."""
    a100 = gpu_preset("a100-40g")  # NVLink 240 GB/s, one 22.5 GB/s NIC per GPU
    cm = CostModel(model_preset("llama-7b"), ClusterSpec(32, 8, a100))
    assert cm.allgather_time() == pytest.approx(P_TOTAL * 2 * 31 / 32 / (8 * 22.5e9))
    assert cm.reduce_scatter_time() == pytest.approx(P_TOTAL * 4 * 31 / 32 / (8 * 22.5e9))
    slow_nvlink = replace(a100, nvlink_bw=100e9)
    cm = CostModel(model_preset("llama-7b"), ClusterSpec(32, 8, slow_nvlink))
    assert cm.allgather_time() == pytest.approx(P_TOTAL * 2 * 31 / 32 / 100e9)
    # A rank of TP 2 is two GPUs, each gathering its half of the parameters on its own rings:
    # 4 ranks to a node share the node's 8 NICs, 4 x 22.5 GB/s for each half.
    tp = CostModel(
        model_preset("llama-7b").tensor_shard(2), ClusterSpec(32, 8, a100).tensor_groups(2)
    )
    shard = model_preset("llama-7b").tensor_shard(2).total_params
    assert tp.allgather_time() == pytest.approx(shard * 2 * 15 / 16 / (4 * 22.5e9))
    # 12 GPUs: the second node has 4, so every ring crosses into it over 4 NICs.
    cm = CostModel(model_preset("llama-7b"), ClusterSpec(12, 8, a100))
    assert cm.allgather_time() == pytest.approx(P_TOTAL * 2 * 11 / 12 / (4 * 22.5e9))
    # One node: NVLink alone.
    cm = CostModel(model_preset("llama-7b"), ClusterSpec(8, 8, a100))
    assert cm.allgather_time() == pytest.approx(P_TOTAL * 2 * 7 / 8 / 240e9)


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

    def least(L):  # every split into 2^k equal contiguous shards, one by one
        times = []
        for parts in 2 ** np.arange(8):
            edges = [int(L * j // parts) for j in range(parts + 1)]
            times.append(
                sum(cm.attn_time(np.array([a]), np.array([b]))[0] for a, b in zip(edges, edges[1:]))
            )
        return min(times)

    attn = sum(32 * least(L) for L in lens)
    assert attn <= sum(32 * cm.attn_time(np.array([0]), np.array([L]))[0] for L in lens)
    per_token = min(cm.dense_s_per_token(t) for t in 2.0 ** np.arange(0, 25, 1 / 16))
    assert cm.compute.best_dense_s_per_token == pytest.approx(per_token, rel=1e-6)
    dense = lens.sum() * per_token
    assert cm.lower_bound(lens) == pytest.approx((attn + dense) / 8 + cm.optimizer_s)
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
    assert wave.step_time_s == pytest.approx(2 * per_wave + cm.optimizer_s, rel=1e-9)
    tail = (cm.allgather_time() + cm.reduce_scatter_time()) / 2
    assert peer.step_time_s == pytest.approx(t_long + t_short + tail + cm.optimizer_s, rel=1e-9)
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


def test_ulysses_all_to_all_bytes_and_attention():
    """A flexsp plan priced as Ulysses: each member's all-to-all bytes counted by hand (Q, K, V,
    O out of its L/g tokens to g-1 peers, K/V heads replicated past kv_heads; forward, again,
    backward), and its attention a g-th of the whole sequence's."""
    from hdp import ulysses

    model = model_preset("llama-7b")  # 32 heads, 32 K/V heads of 128
    for g, kv_heads in ((4, 32), (8, 2)):
        m = replace(model, kv_heads=kv_heads)
        L, b, d = 8192, m.dtype_bytes, m.head_dim
        local = L // g
        q_o = 2 * local * (g - 1) / g * m.heads * d * b
        kv = 2 * sum(local * max(kv_heads // g, 1) * d * b for _ in range(g - 1))
        assert ulysses.bytes_per_member(m, L, g, True) == pytest.approx(3 * (q_o + kv))
    cluster = ClusterSpec.preset("h100", 8, 4)
    cost = CostModel(model, cluster)
    shards = [[[(0, r * 1024, (r + 1) * 1024)] for r in range(8)]]
    plan = Plan.from_shards([8192], 8, shards, kv_exchange="ulysses", sync="peer")
    attn, _ = cost.cell_compute(plan)
    whole = cost.attn_time(np.zeros(1), np.array([8192]))[0]
    assert attn[0] == pytest.approx(np.full(8, whole / 8))
    rep = cost.evaluate(plan)
    per_member = ulysses.bytes_per_member(model, 8192, 8, True) * model.layers
    assert rep.nic_bytes + rep.nvlink_bytes == pytest.approx(8 * per_member)
    assert rep.nic_bytes == pytest.approx(8 * per_member * 4 / 7)  # 4 of 7 peers on the other node


def test_all_to_all_at_the_measured_share_of_each_link():
    """A profile's measured all-to-all shares slow the head-parallel exchange by link: 8 ranks
    on two nodes, 4 of a member's 7 peers across the NIC, each link's bytes over its bandwidth
    times its share, the slower link deciding (a hand count), plus one latency per call."""
    from hdp import ulysses

    model = model_preset("llama-7b")
    gpu = replace(gpu_preset("h100"), alltoall_nic_share=0.5, alltoall_nvlink_share=0.25)
    cluster = ClusterSpec(8, 4, gpu)
    total = ulysses.bytes_per_member(model, 8192, 8, True)
    nic_s = total * 4 / 7 / (gpu.nic_bw * 0.5)
    nvlink_s = total * 3 / 7 / (gpu.nvlink_bw * 0.25)
    want = max(nic_s, nvlink_s) + 6 * gpu.nic_latency
    assert ulysses.comm_time(model, cluster, 8192, 8, True) == pytest.approx(want)
    data = gpu_preset("h100").to_json()
    for bad in (0, 1.5):
        data["alltoall_nvlink_share"] = bad
        with pytest.raises(ValueError, match="p.json: alltoall_nvlink_share must be above 0"):
            GPUProfile.from_json(data, "p.json")


def test_recomputing_some_layers_prices_their_inputs_and_the_others_whole(cm):
    """``checkpointed_layers=k`` of llama-7b's 32: k layer inputs and the working sets of the
    32 - k layers kept whole (at least one); each layer's forward recomputed k / 32 times."""
    per_layer = (6 * 4096 + 2 * 4096 + 2 * 4096 + 3 * 11008) * 2
    none = replace(cm, activation_checkpointing=False)
    for k, kept in ((0, 32), (8, 24), (31, 1), (32, 1)):
        some = replace(cm, checkpointed_layers=k)
        assert some.ckpt_bytes_per_token == k * 4096 * 2
        assert some.working_bytes_per_token == kept * per_layer
        # The dense work: the share k / 32 of a forward (a third of forward + backward) again.
        base = float(none.compute.layer_time(8192))
        assert float(some.compute.layer_time(8192)) == pytest.approx(base * (1 + k / 32 / 3))
        assert float(some.attn_time(0, 8192)) == pytest.approx(
            float(none.attn_time(0, 8192)) * (1 + k / 32 / 3.5)
        )
    assert replace(cm, checkpointed_layers=32).capacity("wave") == cm.capacity("wave")
    with pytest.raises(ValueError, match="checkpointed_layers must be 0 to 32"):
        replace(cm, checkpointed_layers=33)
