"""The cost model: the single source of time and memory for every strategy and the simulator.

Everything is per training step of one global batch. Units: seconds, bytes, FLOPs, tokens.

Compute (per layer, training = forward + backward [+ forward again with activation
checkpointing]):

* dense layers: ``2 * P_layer`` FLOPs per token forward, x3 for training (x4 with checkpointing),
  at ``linear_efficiency(tokens in the micro-batch)``; the LM head ``2 * vocab * hidden`` per token
  forward, x3, once per step (not per layer);
* attention: a query shard ``[a, b)`` of a causal sequence attends to ``(b - a) * (a + b + 1) / 2``
  query-key pairs (all keys up to its own position); ``4 * heads * head_dim`` FLOPs per pair
  forward, backward 2.5x forward (x3.5 training, x4.5 with checkpointing), at
  ``attn_efficiency(b - a)`` -- the kernel's efficiency for a query block of that length.

Communication (per layer): the KV a rank lacks (see :mod:`hdp.plan`) arrives forward
(``kv_bytes_per_token`` per token); backward fetches it again (buffers are freed after each layer)
and returns dK/dV partials (fp32) to the owners. Traffic between ranks of one node uses NVLink, the
rest the NIC; both directions and both links run concurrently, so a rank's transfer time is the
largest of its four (in/out x NVLink/NIC) byte counts over the link bandwidth, plus one latency per
block. It overlaps with the rank's attention compute of the same layer and pass; only the excess
is exposed.

Parameter traffic (FSDP2 over all ranks): in ``wave`` sync every wave all-gathers the parameters
forward and backward and reduce-scatters the gradients (ZeRO-3: nothing unsharded survives a
wave), hidden under the wave's compute but for the first layer; in ``peer`` sync the parameters are
gathered once per step and kept, gradients accumulate unsharded in fp32 and are reduce-scattered
once at the end (ZeRO-1/2, Megatron's distributed optimizer).

Memory per rank per wave: static state (sharded fp32 master weights, gradients and AdamW moments;
plus the unsharded bf16 parameters and fp32 gradient accumulators in ``peer`` sync), activations
(per token: the layer inputs of all layers when checkpointing, less the part offloaded to host
memory, plus one layer's working set), the chunked loss buffer and the in-flight KV/dKV blocks.

Step time: ``wave`` sync: the sum over waves of the slowest rank. ``peer`` sync: an event
simulation in which the ranks sharing a sequence in a wave start together when the last of them
is free and take the slowest member's time; barriers (Megatron hybrid CP) align every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .plan import Plan
from .specs import ClusterSpec, ModelSpec

_POS_BITS = 36  # positions < 2**36 tokens; group ids < 2**27: packed keys stay below 2**63


@dataclass
class KVTraffic:
    """Per-cell KV traffic of one plan, forward pass of one layer. Arrays are ``[num_waves, num_ranks]``.

    ``*_tokens`` count K/V tokens; multiply by ``ModelSpec.kv_bytes_per_token`` for bytes.
    """

    in_intra: np.ndarray
    in_inter: np.ndarray
    out_intra: np.ndarray
    out_inter: np.ndarray
    in_msgs: np.ndarray
    out_msgs: np.ndarray
    max_in_block: np.ndarray

    @property
    def received(self) -> np.ndarray:
        return self.in_intra + self.in_inter

    @property
    def sent(self) -> np.ndarray:
        return self.out_intra + self.out_inter


@dataclass
class StepReport:
    """What the cost model predicts for one plan. Per-cell arrays are ``[num_waves, num_ranks]``."""

    step_time_s: float
    lower_bound_s: float
    imbalance: float
    exposed_comm_s: float
    comm_bytes: float
    param_comm_bytes: float
    peak_mem_bytes: float
    mfu: float
    model_flops: float
    num_waves: int
    sync: str
    compute_s: np.ndarray
    busy_s: np.ndarray
    start_s: np.ndarray
    mem_bytes: np.ndarray
    tokens: np.ndarray
    plan_time_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """The scalar results, with the keys of ``hdp-sim --json``."""
        return {
            "step_time_s": self.step_time_s,
            "lower_bound_s": self.lower_bound_s,
            "imbalance": self.imbalance,
            "exposed_comm_s": self.exposed_comm_s,
            "comm_bytes": self.comm_bytes,
            "param_comm_bytes": self.param_comm_bytes,
            "peak_mem_bytes": self.peak_mem_bytes,
            "plan_time_s": self.plan_time_s,
            "mfu": self.mfu,
            "num_waves": float(self.num_waves),
            **self.extra,
        }


@dataclass(frozen=True)
class CostModel:
    """Time and memory of plans for one model on one cluster (see the module docstring).

    Args:
        model, cluster: what is trained on what.
        activation_checkpointing: recompute each layer in backward (stores only layer inputs).
        capacity_override: tokens per rank per wave to use instead of the memory-derived value.
        grad_accum_bytes: bytes per parameter of the unsharded gradient accumulators (``peer``).
        kv_prefetch_blocks: KV blocks a rank holds in flight (double buffering = 2).
        loss_chunk_tokens: tokens whose logits are materialised at once by the chunked loss.
    """

    model: ModelSpec
    cluster: ClusterSpec
    activation_checkpointing: bool = True
    capacity_override: int | None = None
    grad_accum_bytes: int = 4
    kv_prefetch_blocks: int = 2
    loss_chunk_tokens: int = 4096

    # ------------------------------------------------------------------ FLOPs
    @property
    def _passes(self) -> float:
        """Forward-equivalents of the dense layers per training step: 1 + 2 (+ 1 recompute)."""
        return 4.0 if self.activation_checkpointing else 3.0

    @property
    def _attn_passes(self) -> float:
        """Forward-equivalents of attention: 1 + 2.5 (+ 1 recompute)."""
        return 4.5 if self.activation_checkpointing else 3.5

    @cached_property
    def linear_flops_per_token(self) -> float:
        """Dense-layer FLOPs of one token in one layer, training (all passes)."""
        return 2.0 * self.model.params_per_layer * self._passes

    @cached_property
    def head_flops_per_token(self) -> float:
        """LM-head FLOPs of one token, training (forward + backward, not recomputed)."""
        return 2.0 * self.model.vocab * self.model.hidden * 3.0

    @cached_property
    def attn_flops_per_pair(self) -> float:
        """Attention FLOPs of one query-key pair in one layer, training (all passes)."""
        return 4.0 * self.model.heads * self.model.head_dim * self._attn_passes

    @property
    def attn_fwd_share(self) -> float:
        """Part of a layer's attention time spent in the forward pass."""
        return 1.0 / self._attn_passes

    @staticmethod
    def causal_pairs(start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray | float:
        """Query-key pairs of queries ``[start, end)`` of a causal sequence (keys ``<=`` query)."""
        a = np.asarray(start, dtype=np.float64)
        b = np.asarray(end, dtype=np.float64)
        return (b - a) * (a + b + 1.0) / 2.0

    def attn_time(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Training time of the attention of query shards ``[start, end)``, one layer, seconds."""
        g = self.cluster.gpu
        pairs = self.causal_pairs(start, end)
        eff = g.attn_efficiency(np.asarray(end) - np.asarray(start))
        return pairs * self.attn_flops_per_pair / (g.peak_flops * eff)

    def dense_time(self, tokens: np.ndarray) -> np.ndarray:
        """Training time of the dense layers (all layers) and the head for micro-batches of ``tokens``."""
        g = self.cluster.gpu
        t = np.asarray(tokens, dtype=np.float64)
        eff = np.where(t > 0, g.linear_efficiency(np.maximum(t, 1.0)), 1.0)
        flops = t * (self.model.layers * self.linear_flops_per_token + self.head_flops_per_token)
        return flops / (g.peak_flops * eff) + np.where(
            t > 0, self.model.layers * g.layer_overhead_s, 0.0
        )

    def seq_time(self, length: np.ndarray | int) -> np.ndarray:
        """Training time of whole sequences alone on one rank (the unsplit reference), seconds."""
        L = np.asarray(length, dtype=np.float64)
        return self.model.layers * self.attn_time(np.zeros_like(L), L) + self.dense_time(L)

    def model_flops(self, seq_lens: np.ndarray) -> float:
        """Useful FLOPs of a global batch (no recompute; backward = 2x forward), for MFU."""
        L = np.asarray(seq_lens, dtype=np.float64)
        m = self.model
        dense = L.sum() * (m.layers * 2.0 * m.params_per_layer + 2.0 * m.vocab * m.hidden) * 3.0
        attn = self.causal_pairs(0, L).sum() * 4.0 * m.heads * m.head_dim * 3.0 * m.layers
        return float(dense + attn)

    def lower_bound(self, seq_lens: np.ndarray) -> float:
        """All work, every sequence at the efficiency it reaches unsplit and dense layers at their
        best efficiency, spread evenly over the ranks, with no communication. Seconds."""
        g = self.cluster.gpu
        L = np.asarray(seq_lens, dtype=np.float64)
        L = L[L > 0]
        attn = self.model.layers * self.attn_time(np.zeros_like(L), L).sum()
        dense = L.sum() * (
            self.model.layers * self.linear_flops_per_token + self.head_flops_per_token
        )
        dense /= g.peak_flops * g.linear_max_efficiency
        return float((attn + dense) / self.cluster.num_ranks)

    # ------------------------------------------------------------------ memory
    @property
    def memory_budget(self) -> float:
        g = self.cluster.gpu
        return g.memory_bytes * g.usable_memory_fraction - g.reserved_bytes

    def static_bytes(self, sync: str) -> float:
        """Parameters, gradients and optimizer states held by every rank for the whole step."""
        m, n = self.model, self.cluster.num_ranks
        p = float(m.total_params)
        largest_unit = max(m.params_per_layer, m.vocab * m.hidden)
        if sync == "wave":
            # fp32 master + fp32 grad + 2 AdamW moments, sharded; unsharded compute copy and grad of
            # the largest unit (a layer or the embedding) being gathered / reduced.
            return 16.0 * p / n + largest_unit * (2.0 * m.dtype_bytes + 4.0)
        # Unsharded compute copy and fp32 gradient accumulators; fp32 master + moments sharded.
        return p * (m.dtype_bytes + self.grad_accum_bytes) + 12.0 * p / n

    @cached_property
    def ckpt_bytes_per_token(self) -> float:
        """Activation bytes per token kept across layers (layer inputs; offloadable)."""
        m = self.model
        return float(m.layers * m.hidden * m.dtype_bytes) if self.activation_checkpointing else 0.0

    @cached_property
    def working_bytes_per_token(self) -> float:
        """Activation bytes per token of the layer(s) whose full activations are alive."""
        m = self.model
        per_layer = (
            6 * m.hidden + 2 * m.heads * m.head_dim + 2 * m.kv_heads * m.head_dim + 3 * m.ffn
        ) * m.dtype_bytes
        return float(per_layer * (1 if self.activation_checkpointing else m.layers))

    @cached_property
    def loss_buffer_bytes(self) -> float:
        m = self.model
        return float(self.loss_chunk_tokens * m.vocab * (m.dtype_bytes + 4))

    @property
    def _kv_block_factor(self) -> float:
        """Bytes of a KV block in flight relative to its forward size: K/V plus fp32 dK/dV."""
        return 1.0 + 4.0 / self.model.dtype_bytes

    def kv_buffer_bytes(self, max_in_block: np.ndarray | float) -> np.ndarray | float:
        """Memory for the KV (and dK/dV) blocks a rank holds in flight."""
        return (
            self.kv_prefetch_blocks
            * np.asarray(max_in_block, dtype=np.float64)
            * self.model.kv_bytes_per_token
            * self._kv_block_factor
        )

    def memory(self, tokens, offload=0.0, max_in_block=0.0, sync: str = "peer") -> np.ndarray:
        """Peak bytes of a rank holding ``tokens`` tokens in a wave (arrays broadcast)."""
        t = np.asarray(tokens, dtype=np.float64)
        act = t * (
            self.ckpt_bytes_per_token * (1.0 - np.asarray(offload)) + self.working_bytes_per_token
        )
        return (
            self.static_bytes(sync)
            + np.where(t > 0, self.loss_buffer_bytes, 0.0)
            + act
            + self.kv_buffer_bytes(max_in_block)
        )

    def activation_budget(self, sync: str, kv_block_tokens: int = 8192) -> float:
        """Bytes for activations: what ``capacity`` tokens without offload use. (Memory left over
        by rounding the capacity down to 128 tokens stays unused, so every check agrees.)"""
        return float(self.capacity(sync, kv_block_tokens)) * (
            self.ckpt_bytes_per_token + self.working_bytes_per_token
        )

    def capacity(self, sync: str = "peer", kv_block_tokens: int = 8192) -> int:
        """Most tokens a rank holds in one wave without offloading (multiple of 128 tokens)."""
        key = (sync, kv_block_tokens)
        if key not in self._capacities:  # planners ask per candidate cell: computed once
            self._capacities[key] = self._capacity(sync, kv_block_tokens)
        return self._capacities[key]

    @cached_property
    def _capacities(self) -> dict[tuple[str, int], int]:
        return {}

    def _capacity(self, sync: str, kv_block_tokens: int) -> int:
        if self.capacity_override is not None:
            return int(self.capacity_override)
        free = (
            self.memory_budget
            - self.static_bytes(sync)
            - self.loss_buffer_bytes
            - self.kv_buffer_bytes(kv_block_tokens)
        )
        if free <= 0:
            return 0
        return int(free // (self.ckpt_bytes_per_token + self.working_bytes_per_token)) // 128 * 128

    def offload_capacity(self, sync: str = "peer", kv_block_tokens: int = 8192) -> int:
        """Most tokens a rank holds in one wave with all checkpointed activations in host memory."""
        if self.ckpt_bytes_per_token == 0:
            return self.capacity(sync, kv_block_tokens)
        offloaded = (
            int(self.activation_budget(sync, kv_block_tokens) // self.working_bytes_per_token)
            // 128
            * 128
        )
        return max(offloaded, self.capacity(sync, kv_block_tokens))

    def offload_needed(
        self, tokens: np.ndarray, sync: str, kv_block_tokens: int = 8192
    ) -> np.ndarray:
        """Smallest offload fraction that lets a rank hold ``tokens`` tokens (0 up to the capacity;
        above 1 means impossible)."""
        t = np.asarray(tokens, dtype=np.float64)
        cap = self.capacity(sync, kv_block_tokens)
        if self.ckpt_bytes_per_token == 0:
            return np.where(t <= cap, 0.0, np.inf)
        # tokens * (ckpt * (1 - f) + work) <= activation budget
        per = self.ckpt_bytes_per_token + self.working_bytes_per_token
        f = (t * per - self.activation_budget(sync, kv_block_tokens)) / np.maximum(
            t * self.ckpt_bytes_per_token, 1.0
        )
        return np.where(t <= cap, 0.0, f)

    def offload_time(self, tokens: np.ndarray, fraction: np.ndarray) -> np.ndarray:
        """Host-copy time of offloading ``fraction`` of the checkpointed activations (out and back)."""
        return (
            2.0
            * np.asarray(fraction)
            * np.asarray(tokens, dtype=np.float64)
            * self.ckpt_bytes_per_token
            / self.cluster.gpu.pcie_bw
        )

    # ------------------------------------------------------------------ parameter traffic
    def _collective_bw(self) -> float:
        c = self.cluster
        return c.gpu.nic_bw if c.num_ranks > c.ranks_per_node else c.gpu.nvlink_bw

    def allgather_time(self) -> float:
        """All-gather of the full parameters (compute dtype) over all ranks, seconds."""
        n = self.cluster.num_ranks
        if n == 1:
            return 0.0
        return (
            self.model.total_params * self.model.dtype_bytes * (n - 1) / n / self._collective_bw()
        )

    def reduce_scatter_time(self) -> float:
        """Reduce-scatter of the full fp32 gradients over all ranks, seconds."""
        n = self.cluster.num_ranks
        if n == 1:
            return 0.0
        return self.model.total_params * 4.0 * (n - 1) / n / self._collective_bw()

    # ------------------------------------------------------------------ KV traffic
    def kv_traffic(self, plan: Plan, labels: np.ndarray | None = None) -> KVTraffic:
        """Vectorised per-cell KV traffic of ``plan``: exactly the tokens of :meth:`Plan.kv_needs`;
        message counts bounded by the distinct peers (``labels``: :func:`wave_components`) plus
        one per ``kv_block_tokens``."""
        W, N = plan.num_waves, plan.num_ranks
        z = lambda: np.zeros((W, N))  # noqa: E731
        out = KVTraffic(z(), z(), z(), z(), z(), z(), z())
        if plan.num_shards == 0:
            return out
        rpn = self.cluster.ranks_per_node
        seq, rank, start, end = plan.seq, plan.rank, plan.start, plan.end
        # (sequence, rank) pairs: how far each holder needs keys (E) and what it holds (n).
        pair_key = seq * N + rank
        pk, pair_idx = np.unique(pair_key, return_inverse=True)
        E = np.zeros(pk.size, dtype=np.int64)
        np.maximum.at(E, pair_idx, end)
        held = np.bincount(pair_idx, weights=end - start, minlength=pk.size)
        own_shards = np.bincount(pair_idx, minlength=pk.size)
        p_seq, p_rank = pk // N, pk % N
        holders = np.bincount(p_seq, minlength=plan.seq_lens.size)
        multi_pair = holders[p_seq] > 1
        if not multi_pair.any():
            return out
        seq_wave = plan.seq_wave()
        p_wave = seq_wave[p_seq]
        # Shards of multi-holder sequences, sorted by (seq, start), for "how much of s lies before E".
        keep = holders[seq] > 1
        s_seq, s_start, s_end, s_rank = seq[keep], start[keep], end[keep], rank[keep]
        o = np.lexsort((s_start, s_seq))
        s_seq, s_start, s_end, s_rank = s_seq[o], s_start[o], s_end[o], s_rank[o]
        s_node = s_rank // rpn
        ps, pr, pE = p_seq[multi_pair], p_rank[multi_pair], E[multi_pair]
        pn = held[multi_pair]
        pw = p_wave[multi_pair]
        recv = pE - pn
        # Tokens of the pair's own node (all holders there, itself included) before E.
        s_gid, sorted_keys = _group_ids(s_seq, s_node)
        lens = (s_end - s_start).astype(np.float64)
        o2 = np.lexsort((s_start, s_gid))
        g_gid, g_start, g_end, g_len = s_gid[o2], s_start[o2], s_end[o2], lens[o2]
        cum = np.concatenate([[0.0], np.cumsum(g_len)])
        gkey = (g_gid << _POS_BITS) + g_start
        pair_gid = _lookup_group(sorted_keys, ps, pr // rpn)
        node_before = _tokens_before(gkey, g_gid, g_start, g_end, cum, pair_gid, pE)
        in_intra = node_before - pn
        in_inter = recv - in_intra
        # Pieces received: other holders' shards starting before E.
        akey = (s_seq << _POS_BITS) + s_start
        n_before = np.searchsorted(akey, (ps << _POS_BITS) + pE, side="left") - np.searchsorted(
            akey, ps << _POS_BITS, side="left"
        )
        in_pieces = n_before - own_shards[multi_pair]
        max_in = np.minimum(recv, plan.kv_block_tokens)
        # Sent: each shard [a, b) goes to every other holder c of its sequence, truncated at E_c.
        consumers_seq, consumers_E, consumers_node = ps, pE, pr // rpn
        o3 = np.lexsort((consumers_E, consumers_seq))
        c_seq, c_E = consumers_seq[o3], consumers_E[o3]
        sent_all, cnt_all = _truncated_sum(c_seq, c_E, s_seq, s_start, s_end)
        c_gid = _lookup_group(sorted_keys, consumers_seq, consumers_node)
        o4 = np.lexsort((consumers_E, c_gid))
        sent_node, _ = _truncated_sum(c_gid[o4], consumers_E[o4], s_gid, s_start, s_end)
        own = (s_end - s_start).astype(np.float64)
        out_all = sent_all - own  # the owner itself counted as a consumer needing all of it
        out_node = sent_node - own
        out_pieces = cnt_all - 1
        # Aggregate to cells.
        s_cell = seq_wave[s_seq] * N + s_rank
        p_cell = pw * N + pr
        size = W * N
        agg = lambda cell, v: np.bincount(cell, weights=v, minlength=size).reshape(W, N)  # noqa: E731
        out.in_intra = agg(p_cell, in_intra)
        out.in_inter = agg(p_cell, in_inter)
        out.out_intra = agg(s_cell, out_node)
        out.out_inter = agg(s_cell, out_all - out_node)
        # Messages: one per peer (pieces from one peer travel together), one more per full block.
        if labels is None:
            labels = wave_components(plan)
        flat = (labels + (np.arange(W) * N)[:, None]).reshape(-1)
        peers = (np.bincount(flat, minlength=size)[flat] - 1).reshape(W, N)
        blk = plan.kv_block_tokens
        out.in_msgs = np.minimum(agg(p_cell, in_pieces), peers) + (out.received // blk)
        out.out_msgs = np.minimum(agg(s_cell, out_pieces), peers) + (out.sent // blk)
        mx = np.zeros(size)
        np.maximum.at(mx, p_cell, max_in)
        out.max_in_block = mx.reshape(W, N)
        return out

    def comm_time_per_layer(self, traffic: KVTraffic) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) KV transfer time of one layer per cell, seconds."""
        g, kvb = self.cluster.gpu, self.model.kv_bytes_per_token
        dkv = 4.0 / self.model.dtype_bytes  # dK/dV partials travel in fp32
        blocks_all = np.maximum(traffic.in_msgs, traffic.out_msgs)
        t_fwd, t_bwd = np.zeros(blocks_all.shape), np.zeros(blocks_all.shape)
        # Only cells that exchange K/V cost anything; at scale they are a small share of the
        # (waves x ranks) grid, so the arithmetic runs on them alone.
        cells = np.nonzero(blocks_all > 0)
        if cells[0].size == 0:
            return t_fwd, t_bwd
        in_intra, in_inter = traffic.in_intra[cells], traffic.in_inter[cells]
        out_intra, out_inter = traffic.out_intra[cells], traffic.out_inter[cells]
        blocks = blocks_all[cells]

        def link_time(i_intra, i_inter, o_intra, o_inter):
            return np.maximum(
                np.maximum(i_intra / g.nvlink_bw, i_inter / g.nic_bw),
                np.maximum(o_intra / g.nvlink_bw, o_inter / g.nic_bw),
            )

        lat = np.where(in_inter + out_inter > 0, g.nic_latency, g.nvlink_latency)
        t_fwd[cells] = kvb * link_time(in_intra, in_inter, out_intra, out_inter) + blocks * lat
        # Backward: KV in again and dK/dV of the owners' blocks in; KV out again and dK/dV out.
        t_bwd[cells] = (
            kvb
            * link_time(
                in_intra + dkv * out_intra,
                in_inter + dkv * out_inter,
                out_intra + dkv * in_intra,
                out_inter + dkv * in_inter,
            )
            + 2 * blocks * lat
        )
        return t_fwd, t_bwd

    # ------------------------------------------------------------------ evaluation
    def cell_compute(self, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """(attention per layer, total compute) of every cell, ``[num_waves, num_ranks]`` seconds."""
        W, N = plan.num_waves, plan.num_ranks
        cell = plan.wave * N + plan.rank
        attn = np.bincount(
            cell, weights=self.attn_time(plan.start, plan.end), minlength=W * N
        ).reshape(W, N)
        tokens = plan.tokens_per_cell()
        compute = self.model.layers * attn.astype(np.float64)
        busy = np.nonzero(tokens > 0)  # most cells of a large peer plan are empty
        compute[busy] += self.dense_time(tokens[busy])
        return attn, compute

    def evaluate(self, plan: Plan, plan_time_s: float = 0.0) -> StepReport:
        """Predict step time, balance, communication and memory of ``plan``."""
        m = self.model
        tokens = plan.tokens_per_cell()
        attn_layer, compute = self.cell_compute(plan)
        labels = wave_components(plan)
        traffic = self.kv_traffic(plan, labels)
        t_fwd, t_bwd = self.comm_time_per_layer(traffic)
        fwd_share = self.attn_fwd_share
        exposed_kv = m.layers * (
            np.maximum(0.0, t_fwd - fwd_share * attn_layer)
            + np.maximum(0.0, t_bwd - (1.0 - fwd_share) * attn_layer)
        )
        exposed_off = np.maximum(0.0, self.offload_time(tokens, plan.offload) - compute)
        busy = compute + exposed_kv + exposed_off
        busy_no_comm = compute + exposed_off
        step, start = self._step_time(plan, busy, labels, with_collectives=True)
        step_nc, _ = self._step_time(plan, busy_no_comm, labels, with_collectives=False)
        mem = self.memory(tokens, plan.offload, traffic.max_in_block, plan.sync)
        mem = np.where(tokens > 0, mem, self.static_bytes(plan.sync))
        per_rank = compute.sum(axis=0)
        mean = per_rank.mean()
        kvb = m.kv_bytes_per_token
        dkv = 4.0 / m.dtype_bytes
        sent = traffic.sent.sum()
        comm_bytes = float(
            sent * kvb * m.layers * (2.0 + dkv)
        )  # KV forward, KV again + dK/dV backward
        n = self.cluster.num_ranks
        per_gather = m.total_params * m.dtype_bytes * (n - 1) if n > 1 else 0.0
        per_scatter = m.total_params * 4.0 * (n - 1) if n > 1 else 0.0
        if plan.sync == "wave":
            param_bytes = plan.num_waves * (2 * per_gather + per_scatter)
        else:
            param_bytes = per_gather + per_scatter
        flops = self.model_flops(plan.seq_lens)
        g = self.cluster.gpu
        return StepReport(
            step_time_s=float(step),
            lower_bound_s=self.lower_bound(plan.seq_lens),
            imbalance=float(per_rank.max() / mean) if mean > 0 else 1.0,
            exposed_comm_s=float(max(0.0, step - step_nc)),
            comm_bytes=comm_bytes,
            param_comm_bytes=float(param_bytes),
            peak_mem_bytes=float(mem.max()),
            mfu=float(flops / (step * n * g.peak_flops)) if step > 0 else 0.0,
            model_flops=flops,
            num_waves=plan.num_waves,
            sync=plan.sync,
            compute_s=compute,
            busy_s=busy,
            start_s=start,
            mem_bytes=mem,
            tokens=tokens,
            plan_time_s=plan_time_s,
        )

    def _step_time(
        self, plan: Plan, busy: np.ndarray, labels: np.ndarray, with_collectives: bool
    ) -> tuple[float, np.ndarray]:
        """Step time and the start time of every cell, given each cell's busy time."""
        W, N = busy.shape
        L = self.model.layers
        start = np.zeros((W, N))
        if plan.sync == "wave":
            coll = (
                2 * self.allgather_time() + self.reduce_scatter_time() if with_collectives else 0.0
            )
            t = 0.0
            for w in range(W):
                start[w] = t
                t += max(float(busy[w].max()), coll) + coll / L
            return t, start
        finish = np.zeros(N)
        barriers = set(plan.barriers)
        for w in range(W):
            if w in barriers:
                finish[:] = finish.max()
            lab = labels[w]
            group_start = np.zeros(N)
            np.maximum.at(group_start, lab, finish)
            group_dur = np.zeros(N)
            np.maximum.at(group_dur, lab, busy[w])
            active = group_dur[lab] > 0
            start[w] = np.where(active, group_start[lab], finish)
            finish = np.where(active, group_start[lab] + group_dur[lab], finish)
        t = float(finish.max()) if N else 0.0
        if with_collectives:
            t += (self.allgather_time() + self.reduce_scatter_time()) / L
        return t, start


def wave_components(plan: Plan) -> np.ndarray:
    """``[W, N]`` label of each rank's group in each wave: ranks sharing a sequence are joined
    (the label is the group's smallest rank)."""
    W, N = plan.num_waves, plan.num_ranks
    labels = np.tile(np.arange(N), (W, 1))
    if plan.num_shards == 0:
        return labels
    key = plan.seq * N + plan.rank
    pk = np.unique(key)
    p_seq, p_rank = pk // N, pk % N
    holders = np.bincount(p_seq, minlength=plan.seq_lens.size)
    multi = holders[p_seq] > 1
    if not multi.any():
        return labels
    p_seq, p_rank = p_seq[multi], p_rank[multi]
    seq_wave = plan.seq_wave()
    first = np.full(plan.seq_lens.size, -1, dtype=np.int64)
    # first holder of each sequence (p_seq is sorted, so the first occurrence)
    idx = np.flatnonzero(np.r_[True, p_seq[1:] != p_seq[:-1]])
    first[p_seq[idx]] = p_rank[idx]
    u = seq_wave[p_seq] * N + first[p_seq]
    v = seq_wave[p_seq] * N + p_rank
    flat = labels.reshape(-1).copy() + (np.arange(W) * N).repeat(N)
    while True:
        m = np.minimum(flat[u], flat[v])
        before = flat.copy()
        np.minimum.at(flat, u, m)
        np.minimum.at(flat, v, m)
        flat = flat[flat]  # pointer jumping
        if np.array_equal(before, flat):
            break
    return (flat - (np.arange(W) * N).repeat(N)).reshape(W, N)


def _group_ids(seq: np.ndarray, sub: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids of (seq, sub) pairs; returns (id of each element, sorted unique packed keys)."""
    key = (seq << 20) + sub
    uniq, inv = np.unique(key, return_inverse=True)
    return inv.astype(np.int64), uniq


def _lookup_group(sorted_keys: np.ndarray, seq: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Dense id of (seq, sub) in ``sorted_keys`` (-1 where absent)."""
    key = (seq << 20) + sub
    i = np.searchsorted(sorted_keys, key)
    i = np.minimum(i, max(sorted_keys.size - 1, 0))
    return np.where(sorted_keys[i] == key, i, -1)


def _tokens_before(gkey, g_gid, g_start, g_end, cum, query_gid, query_pos) -> np.ndarray:
    """Tokens held by group ``query_gid`` before position ``query_pos`` (groups of disjoint shards)."""
    first = np.searchsorted(gkey, query_gid << _POS_BITS, side="left")
    k = np.searchsorted(
        gkey, (query_gid << _POS_BITS) + query_pos, side="left"
    )  # shards starting < pos
    full = cum[np.maximum(k - 1, first)] - cum[first]  # shards first .. k-2 entirely before
    last = np.maximum(k - 1, 0)
    part = np.where(k > first, np.minimum(g_end[last], query_pos) - g_start[last], 0)
    return np.where(query_gid >= 0, full + part, 0.0)


def _truncated_sum(c_group, c_E, s_group, s_start, s_end) -> tuple[np.ndarray, np.ndarray]:
    """For each shard ``[a, b)`` of group ``g``: sum over consumers of g of ``clip(min(b, E) - a, 0)``,
    and the number of consumers with ``E > a``. Consumers must be sorted by (group, E)."""
    key = (c_group << _POS_BITS) + c_E
    cumE = np.concatenate([[0.0], np.cumsum(c_E.astype(np.float64))])
    lo = np.searchsorted(key, (s_group << _POS_BITS) + s_start, side="right")  # first E > a
    mid = np.searchsorted(key, (s_group << _POS_BITS) + s_end, side="left")  # first E >= b
    hi = np.searchsorted(key, (s_group + 1) << _POS_BITS, side="left")  # end of group
    a = s_start.astype(np.float64)
    b = s_end.astype(np.float64)
    partial = (cumE[mid] - cumE[lo]) - (mid - lo) * a
    full = (hi - mid) * (b - a)
    return partial + full, (hi - lo).astype(np.float64)
