"""The cost model: the single source of time and memory for every strategy and the simulator.

Everything is per training step of one global batch. Units: seconds, bytes, FLOPs, tokens.

Compute: each layer's GEMMs, attention calls and memory-bound ops priced by the GPU profile's
measured tables, with recompute under activation checkpointing (Note [What a layer costs] in
:mod:`hdp.compute`); the LM head and loss once per micro-batch, the optimizer once per step.
hdp's runtime calls attention once per K/V block; the baselines that run TransformerEngine's
ring call it once per ring step over all their chunks (Note [One kernel call per ring step] in
:mod:`hdp.ring`).

Communication (per layer; counted in :mod:`hdp.traffic`): the KV a rank lacks arrives forward
(``kv_bytes_per_token`` per token); backward fetches it again (buffers are freed after each layer)
and returns dK/dV partials to the owners, as many bytes again: every system sends them in the
compute dtype (hdp's ``dist_attn`` sums them in fp32, Note [dK/dV on the wire] in
:mod:`hdp.attention.dist`). Traffic between ranks of one node uses NVLink, the rest the NIC; both
directions and both links run concurrently, so a rank's transfer time is the largest of its four
(in/out x NVLink/NIC) byte counts over the link bandwidth, plus one latency per block. It
overlaps with the rank's attention compute of the same layer and pass; only the excess is
exposed.

Parameter traffic (FSDP2 over all ranks): in ``wave`` sync every wave all-gathers the parameters
forward and backward and reduce-scatters the gradients (ZeRO-3: nothing unsharded survives a
wave), hidden under the wave's compute but for the first layer. In ``peer`` sync the parameters are
gathered once per step and kept; gradients accumulate unsharded in fp32 and are reduce-scattered
once at the end (ZeRO-1/2, Megatron's distributed optimizer).

Memory per rank per wave: static state (sharded fp32 master weights, gradients and AdamW moments;
plus the unsharded bf16 parameters and fp32 gradient accumulators in ``peer`` sync), activations
(per token: the inputs of the recomputed layers, less the part offloaded to host memory, and
the working sets of the others, at least one), the chunked loss buffer and the in-flight KV/dKV
blocks.

Step time: ``wave`` sync: the sum over waves of the slowest rank. ``peer`` sync: an event
simulation in which the ranks sharing a sequence in a wave start together when the last of them
is free and take the slowest member's time; barriers (Megatron hybrid CP) align every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from . import collectives, ring, traffic, ulysses
from .compute import ComputeModel
from .exchange import KV_EXCHANGES, RELAY_SLOTS
from .exchange_cost import price_exchange
from .plan import BLOCK_TOKENS, DEFAULT_KV_BLOCK_TOKENS, Plan
from .report import StepReport
from .specs import ClusterSpec, ModelSpec
from .traffic import KVTraffic, wave_components

__all__ = ["CostModel", "KVTraffic", "StepReport", "wave_components"]


@dataclass(frozen=True)
class CostModel:
    """Time and memory of plans for one model on one cluster (see the module docstring).

    Args:
        model, cluster: what is trained on what.
        activation_checkpointing: recompute layers in backward (stores only their inputs).
        checkpointed_layers: with activation checkpointing, how many layers are recomputed (the
            first ones; ``None``: every layer); the others keep their activations.
        kept_attention: the recomputed layers keep attention's q, k, v, output and LSE, and
            recompute only the work around it (Note [Selective activation checkpointing] in
            :mod:`hdp.launch.model`).
        compiled: the layers and the loss run compiled (Note [What a layer costs]).
        capacity_override: tokens per rank per wave to use instead of the memory-derived value.
        grad_accum_bytes: bytes per parameter of the unsharded gradient accumulators (``peer``).
        kv_prefetch_blocks: KV blocks a rank holds in flight (double buffering = 2).
        loss_chunk_tokens: tokens whose logits are materialised at once by the chunked loss.
        attention_backend: the attention kernel priced (default: the GPU profile's).
        kv_exchange: the K/V exchange planners price before a plan exists (``rank`` or ``node``,
            :mod:`hdp.exchange`); :meth:`evaluate` prices each plan's own.
        tensor_parallel: GPUs of a tensor-parallel group, one rank of the plan; ``model`` is
            then one GPU's shard and ``cluster`` counts groups (:meth:`StepPricing.build
            <hdp.planner.StepPricing.build>` makes both). Activations of width ``hidden`` are
            split over the group (sequence parallelism).
        dkv_bytes: bytes per element of the dK/dV sums a rank holds beside each K/V block in
            flight (memory; on the wire dK/dV travel in the compute dtype): 4 for hdp's
            ``dist_attn``, which sums them in fp32; the model's ``dtype_bytes`` for every
            baseline, whose systems keep them in the compute dtype as TransformerEngine's ring
            attention does (the rule :meth:`StepPricing.cost_for
            <hdp.planner.StepPricing.cost_for>` applies).
        own_runtimes: price a baseline's plan as its own system runs it (a ring baseline's one
            kernel call per ring step, Note [One kernel call per ring step] in :mod:`hdp.ring`);
            False where hdp's runtime runs every plan, as training does.
    """

    model: ModelSpec
    cluster: ClusterSpec
    activation_checkpointing: bool = True
    capacity_override: int | None = None
    grad_accum_bytes: int = 4
    kv_prefetch_blocks: int = 2
    loss_chunk_tokens: int = 4096
    attention_backend: str | None = None
    kv_exchange: str = "rank"
    tensor_parallel: int = 1
    dkv_bytes: int = 4
    checkpointed_layers: int | None = None
    own_runtimes: bool = True
    kept_attention: bool = False
    compiled: bool = False

    def __post_init__(self) -> None:
        if self.dkv_bytes not in (2, 4):
            raise ValueError(f"dkv_bytes must be 2 or 4, got {self.dkv_bytes!r}")
        if not 0 <= self.recomputed_layers <= self.model.layers:
            raise ValueError(f"checkpointed_layers must be 0 to {self.model.layers}")

    @property
    def recomputed_layers(self) -> int:
        """``checkpointed_layers`` (all where ``None``) with activation checkpointing, else 0."""
        layers = self.checkpointed_layers
        return (self.model.layers if layers is None else layers) * self.activation_checkpointing

    def with_exchange(self, kv_exchange: str) -> CostModel:
        """This model pricing ``kv_exchange`` for planners (the kernel tables are shared)."""
        if kv_exchange == self.kv_exchange:
            return self
        if kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}, got {kv_exchange!r}")
        if kv_exchange not in self._variants:
            other = replace(self, kv_exchange=kv_exchange)
            other.__dict__["compute"] = self.compute
            other.__dict__["_variants"] = self._variants
            self._variants[self.kv_exchange] = self
            self._variants[kv_exchange] = other
        return self._variants[kv_exchange]

    @cached_property
    def _variants(self) -> dict[str, CostModel]:
        return {}

    # ------------------------------------------------------------------ compute
    @cached_property
    def compute(self) -> ComputeModel:
        """Kernel times from the GPU profile's measured tables (Note [What a layer costs])."""
        return ComputeModel(
            self.model,
            self.cluster.gpu,
            self.activation_checkpointing,
            self.loss_chunk_tokens,
            self.attention_backend,
            self.tensor_parallel,
            self.recomputed_layers / self.model.layers,
            self.kept_attention,
            self.compiled,
        )

    @property
    def attn_fwd_share(self) -> float:
        """Part of a layer's attention time spent in the forward pass: backward does 2.5x the
        forward's FLOPs, and with checkpointing also the forward again."""
        return 1.0 / (3.5 + self.compute.attention_recomputed)

    @staticmethod
    def causal_pairs(start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray | float:
        """Query-key pairs of queries ``[start, end)`` of a causal sequence (keys ``<=`` query)."""
        a = np.asarray(start, dtype=np.float64)
        b = np.asarray(end, dtype=np.float64)
        return (b - a) * (a + b + 1.0) / 2.0

    def attn_time(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Training time of the attention of query shards ``[start, end)``, one layer, seconds."""
        return self.compute.attn_time(start, end)

    def dense_time(self, tokens: np.ndarray) -> np.ndarray:
        """Training time of all dense layers and the head for micro-batches of ``tokens``."""
        return self.compute.dense_time(tokens)

    def dense_s_per_token(self, tokens: np.ndarray | float) -> np.ndarray:
        """Dense time per token in micro-batches of ``tokens`` (no fixed overhead), seconds."""
        return self.compute.dense_s_per_token(tokens)

    @cached_property
    def optimizer_s(self) -> float:
        """The optimizer step over one rank's shard of the parameters, seconds."""
        return self.compute.optimizer_time(self.model.total_params / self.cluster.num_ranks)

    def seq_time(self, length: np.ndarray | int) -> np.ndarray:
        """Training time of whole sequences alone on one rank (the unsplit reference), seconds."""
        L = np.asarray(length, dtype=np.float64)
        return self.model.layers * self.attn_time(np.zeros_like(L), L) + self.dense_time(L)

    def model_flops(self, seq_lens: np.ndarray) -> float:
        """Useful FLOPs of a global batch (no recompute; backward = 2x forward), for MFU; with
        tensor parallelism, one GPU's share of them (the model is its shard)."""
        L = np.asarray(seq_lens, dtype=np.float64)
        m = self.model
        dense = L.sum() * (m.layers * 2.0 * m.params_per_layer + 2.0 * m.vocab * m.hidden) * 3.0
        attn = self.causal_pairs(0, L).sum() * 4.0 * m.heads * m.head_dim * 3.0 * m.layers
        return float(dense + attn)

    def least_attn_time(self, length: np.ndarray) -> np.ndarray:
        """The least attention time of sequences of ``length`` tokens, one layer, over their
        splits into 1, 2, 4, ... equal contiguous shards (up to 128, while a split still saves
        time). Where a causal call runs slower per FLOP than a full one (the CPU's reference
        kernel computes the masked half too), a split does less work than the whole sequence."""
        L = np.asarray(length, dtype=np.float64)
        best = self.attn_time(np.zeros_like(L), L)
        rows = np.flatnonzero(L >= 2)
        parts = 2
        while rows.size and parts <= 128:
            edges = np.floor(L[rows, None] * np.arange(parts + 1) / parts)
            split = self.attn_time(edges[:, :-1], edges[:, 1:]).sum(axis=1)
            better = split < best[rows]
            best[rows] = np.minimum(best[rows], split)
            rows = rows[better & (L[rows] >= 2 * parts)]
            parts *= 2
        return best

    def least_attn_of(self, lengths: np.ndarray) -> np.ndarray:
        """:meth:`least_attn_time` of integer ``lengths``, each length priced once per cost model
        (planners evaluate many plans of one batch: the last batch's answer is kept whole)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        batch, memo = lengths.tobytes(), self._least_attn_last
        last = memo[0] if memo else None  # (one read: a planning thread may replace it)
        if last is not None and last[0] == batch:
            return last[1].copy()
        known, listed = self._least_attn, lengths.tolist()
        new = sorted({x for x in listed if x not in known})
        if new:
            known.update(zip(new, self.least_attn_time(np.asarray(new)).tolist()))
        out = np.fromiter((known[x] for x in listed), dtype=np.float64, count=len(listed))
        memo[:] = [(batch, out.copy())]
        return out

    def lower_bound(self, seq_lens: np.ndarray) -> float:
        """All work, each sequence's attention at the least of its equal splits
        (:meth:`least_attn_time`) and dense layers at their best speed per token, spread evenly
        over the ranks, with no communication; plus the optimizer step. Seconds."""
        L = np.asarray(seq_lens, dtype=np.int64)
        L = L[L > 0]
        attn = self.model.layers * self.least_attn_of(L).sum()
        dense = L.sum() * self.compute.best_dense_s_per_token
        return float((attn + dense) / self.cluster.num_ranks) + self.optimizer_s

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
        """Activation bytes per token kept across layers (layer inputs, and attention's q, k, v,
        output and fp32 LSE where the layers keep them; offloadable)."""
        m = self.model
        hidden = m.hidden / self.tensor_parallel  # layer inputs are split (sequence parallel)
        per_layer = hidden * m.dtype_bytes
        if self.kept_attention:
            q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
            # A head-parallel member keeps its own output beside the one the owner's layer keeps.
            outputs = 2 if self.kv_exchange == "ulysses" else 1
            per_layer += ((1 + outputs) * q + 2 * kv) * m.dtype_bytes + 4 * m.heads
        layers = self.recomputed_layers
        return float(layers * per_layer) * self.cluster.gpu.activation_memory_scale

    @cached_property
    def working_bytes_per_token(self) -> float:
        """Activation bytes per token of the layer(s) whose full activations are alive."""
        m = self.model
        hidden = m.hidden / self.tensor_parallel  # norms and residuals: sequence parallel
        per_layer = (
            (5 if self.compiled else 6) * hidden
            + 2 * m.heads * m.head_dim
            + 2 * m.kv_heads * m.head_dim
            + 3 * m.ffn
        ) * m.dtype_bytes
        # The layers kept whole hold theirs from forward until their backward, which comes
        # before the recomputed (first) layers' backward, when one recomputed layer's are alive.
        layers = max(m.layers - self.recomputed_layers, 1)
        return float(per_layer * layers) * self.cluster.gpu.activation_memory_scale

    @cached_property
    def loss_buffer_bytes(self) -> float:
        m = self.model
        return float(self.loss_chunk_tokens * m.vocab * (m.dtype_bytes + 4))

    @property
    def _kv_block_factor(self) -> float:
        """Bytes of a KV block in flight relative to its forward size: K/V plus its dK/dV sums."""
        return 1.0 + self.dkv_bytes / self.model.dtype_bytes

    def kv_buffer_bytes(
        self, max_in_block: np.ndarray | float, relay_block: np.ndarray | float = 0.0
    ) -> np.ndarray | float:
        """Memory for the KV (and dK/dV) blocks a rank holds in flight, and the fetched blocks it
        relays in ``node`` exchange (with their dK/dV sums, ``dkv_bytes`` per element)."""
        blocks = self.kv_prefetch_blocks * np.asarray(max_in_block, dtype=np.float64)
        blocks = blocks + RELAY_SLOTS * np.asarray(relay_block, dtype=np.float64)
        return blocks * self.model.kv_bytes_per_token * self._kv_block_factor

    def memory(
        self, tokens, offload=0.0, max_in_block=0.0, sync: str = "peer", relay_block=0.0
    ) -> np.ndarray:
        """Peak bytes of a rank holding ``tokens`` tokens in a wave (arrays broadcast)."""
        t = np.asarray(tokens, dtype=np.float64)
        return (
            self.static_bytes(sync)
            + np.where(t > 0, self.loss_buffer_bytes, 0.0)
            + self.activation_bytes(t, offload)
            + self.kv_buffer_bytes(max_in_block, relay_block)
        )

    def activation_bytes(self, tokens, offload=0.0) -> np.ndarray:
        """Activation bytes of a rank holding ``tokens`` tokens, ``offload`` of the checkpointed
        layer inputs in host memory (arrays broadcast)."""
        t = np.asarray(tokens, dtype=np.float64)
        return t * (
            self.ckpt_bytes_per_token * (1.0 - np.asarray(offload)) + self.working_bytes_per_token
        )

    def activation_budget(self, sync: str, kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS) -> float:
        """Bytes for activations: what ``capacity`` tokens without offload use. (Memory left over
        by rounding the capacity down to whole blocks stays unused, so every check agrees.)"""
        return float(self.capacity(sync, kv_block_tokens)) * (
            self.ckpt_bytes_per_token + self.working_bytes_per_token
        )

    def capacity(self, sync: str = "peer", kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS) -> int:
        """Most tokens a rank holds in one wave without offloading (whole ``BLOCK_TOKENS``)."""
        key = (sync, kv_block_tokens)
        if key not in self._capacities:  # planners ask per candidate cell: computed once
            self._capacities[key] = self._capacity(sync, kv_block_tokens)
        return self._capacities[key]

    @cached_property
    def _least_attn(self) -> dict[int, float]:
        """{length: :meth:`least_attn_time`} of the lengths :meth:`lower_bound` has priced."""
        return {}

    @cached_property
    def _least_attn_last(self) -> list[tuple[bytes, np.ndarray]]:
        """[(the lengths' bytes, their :meth:`least_attn_of`)] of the last batch asked."""
        return []

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
            - self.kv_buffer_bytes(
                kv_block_tokens, kv_block_tokens if self.kv_exchange == "node" else 0
            )
        )
        if free <= 0:
            return 0
        return (
            int(free // (self.ckpt_bytes_per_token + self.working_bytes_per_token))
            // BLOCK_TOKENS
            * BLOCK_TOKENS
        )

    def offload_capacity(
        self, sync: str = "peer", kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS
    ) -> int:
        """Most tokens a rank holds in one wave with all checkpointed activations in host memory."""
        if self.ckpt_bytes_per_token == 0:
            return self.capacity(sync, kv_block_tokens)
        offloaded = (
            int(self.activation_budget(sync, kv_block_tokens) // self.working_bytes_per_token)
            // BLOCK_TOKENS
            * BLOCK_TOKENS
        )
        return max(offloaded, self.capacity(sync, kv_block_tokens))

    def offload_needed(
        self, tokens: np.ndarray, sync: str, kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS
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
        """Host-copy time (out and back) of offloading ``fraction`` of the checkpointed
        activations."""
        return (
            2.0
            * np.asarray(fraction)
            * np.asarray(tokens, dtype=np.float64)
            * self.offloaded_bytes_per_token
            / self.cluster.gpu.pcie_bw
        )

    @cached_property
    def offloaded_bytes_per_token(self) -> float:
        """Bytes per token an offloaded layer copies to host memory: its kept activations, and
        where attention is kept, its input and output once more (each is saved by two regions,
        and the host copy is made per saved tensor)."""
        extra = 0.0
        if self.kept_attention:
            m = self.model
            extra = (m.hidden / self.tensor_parallel + m.heads * m.head_dim) * m.dtype_bytes
            extra *= self.recomputed_layers * self.cluster.gpu.activation_memory_scale
        return self.ckpt_bytes_per_token + extra

    # ------------------------------------------------------------------ parameter traffic
    def allgather_time(self) -> float:
        """All-gather of the full parameters (compute dtype) over all ranks, seconds."""
        return collectives.fsdp_time(
            self.model, self.cluster, "all_gather", self.model.total_params * self.model.dtype_bytes
        )

    def reduce_scatter_time(self) -> float:
        """Reduce-scatter of the full fp32 gradients over all ranks, seconds."""
        return collectives.fsdp_time(
            self.model, self.cluster, "reduce_scatter", self.model.total_params * 4.0
        )

    # ------------------------------------------------------------------ KV traffic
    def kv_traffic(self, plan: Plan, labels: np.ndarray | None = None) -> KVTraffic:
        """Per-cell KV traffic of ``plan`` in its exchange on this cluster's nodes
        (:func:`hdp.traffic.kv_traffic`; ``labels``: :func:`wave_components`)."""
        rpn = self.cluster.ranks_per_node
        if plan.kv_exchange == "node" and plan.ranks_per_node != rpn:
            raise ValueError(
                f"the plan's node exchange assumes {plan.ranks_per_node} GPUs per node but the "
                f"cluster has {rpn}: plan it for this cluster"
            )
        return traffic.kv_traffic(plan, rpn, labels)

    def comm_time_per_layer(self, traffic: KVTraffic) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) KV transfer time of one layer per cell, seconds."""
        g, kvb = self.cluster.gpu, self.model.kv_bytes_per_token
        blocks_all = np.maximum(traffic.in_msgs, traffic.out_msgs)

        def link_time(i_intra, i_inter, o_intra, o_inter):
            return np.maximum(
                np.maximum(i_intra / g.nvlink_bw, i_inter / g.nic_bw),
                np.maximum(o_intra / g.nvlink_bw, o_inter / g.nic_bw),
            )

        def times(in_intra, in_inter, out_intra, out_inter, blocks):
            lat = np.where(in_inter + out_inter > 0, g.nic_latency, g.nvlink_latency)
            fwd = kvb * link_time(in_intra, in_inter, out_intra, out_inter) + blocks * lat
            # Backward: the K/V both ways again, and as many dK/dV bytes the opposite way, so
            # each direction carries what both did forward.
            both_intra, both_inter = in_intra + out_intra, in_inter + out_inter
            bwd = kvb * link_time(both_intra, both_inter, both_intra, both_inter)
            return fwd, bwd + 2 * blocks * lat

        fields = (traffic.in_intra, traffic.in_inter, traffic.out_intra, traffic.out_inter)
        exchanging = blocks_all > 0
        if 2 * np.count_nonzero(exchanging) > exchanging.size:  # (a menu's members, mostly)
            return tuple(np.where(exchanging, t, 0.0) for t in times(*fields, blocks_all))
        # Only cells that exchange K/V cost anything; in a plan they are a small share of the
        # (waves x ranks) grid, so the arithmetic runs on them alone.
        t_fwd, t_bwd = np.zeros(blocks_all.shape), np.zeros(blocks_all.shape)
        cells = np.nonzero(exchanging)
        if cells[0].size:
            t_fwd[cells], t_bwd[cells] = times(*(x[cells] for x in fields), blocks_all[cells])
        return t_fwd, t_bwd

    # ------------------------------------------------------------------ evaluation
    def cell_compute(self, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """(attention per layer, total compute) of every cell, ``[num_waves, num_ranks]`` s."""
        W, N = plan.num_waves, plan.num_ranks
        if self.own_runtimes and ring.runs_ring(
            plan
        ):  # one kernel call per ring step (Note in hdp.ring)
            attn = ring.cell_attention(self.compute, plan)
        else:
            cell = plan.wave * N + plan.rank
            per_shard = self.attn_time(plan.start, plan.end)
            if plan.kv_exchange == "ulysses":  # members attend over the whole sequence
                whole = lambda lens: self.attn_time(np.zeros_like(lens), lens)  # noqa: E731
                groups = ulysses.Groups.of(plan)
                per_shard = ulysses.shard_attention(plan, groups, whole, per_shard)
            attn = np.bincount(cell, weights=per_shard, minlength=W * N).reshape(W, N)
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
        ex = price_exchange(self, plan, attn_layer, labels)
        exposed_kv = ex.exposed_s
        exposed_off = np.maximum(0.0, self.offload_time(tokens, plan.offload) - compute)
        busy = compute + exposed_kv + exposed_off
        busy_no_comm = compute + exposed_off
        step, start = self._step_time(plan, busy, labels, with_collectives=True)
        step_nc, _ = self._step_time(plan, busy_no_comm, labels, with_collectives=False)
        step, step_nc = step + self.optimizer_s, step_nc + self.optimizer_s
        mem = self.memory(tokens, plan.offload, ex.max_in_block, plan.sync, ex.relay_block)
        mem = np.where(tokens > 0, mem, self.static_bytes(plan.sync))
        per_rank = compute.sum(axis=0)
        mean = per_rank.mean()
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
            comm_bytes=ex.nic_bytes + ex.nvlink_bytes,
            nic_bytes=ex.nic_bytes,
            nvlink_bytes=ex.nvlink_bytes,
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
