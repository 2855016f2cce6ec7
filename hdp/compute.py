"""Compute time of one model on one device, from the device's measured kernel tables.

Note [What a layer costs]
-------------------------
The runtime (launch/model.py) runs, per decoder layer and micro-batch of ``T`` tokens:

- seven GEMMs (q, k, v, o projections; gate, up, down of the SwiGLU MLP), each priced by the
  profile's GEMM table at ``T`` tokens;
- attention calls, priced per call by the attention table (:meth:`ComputeModel.attn_time`);
  a baseline running TransformerEngine's ring makes one call per ring step instead (Note [One
  kernel call per ring step] in :mod:`hdp.ring`);
- memory-bound ops: two RMSNorms and two residual adds over ``hidden``, SwiGLU over ``ffn``,
  RoPE over the query and key widths;
- a fixed overhead (``layer_overhead_s``: launches and Python, not proportional to tokens).

With tensor parallelism over ``tp`` GPUs (``tensor_parallel``; the model is then one GPU's shard,
:meth:`ModelSpec.tensor_shard`) and Megatron's sequence parallelism, the GEMMs run on all ``T``
tokens at a ``1/tp`` width, the norms and residual adds on ``T / tp`` tokens, and each layer adds
four collectives over ``T x hidden`` activations forward (all-gather before attention and the MLP,
reduce-scatter after) and four backward, four more with checkpointing; they run on NVLink and are
not overlapped with compute.

Once per micro-batch: the LM head and the cross-entropy over ``vocab`` in chunks of
``loss_chunk_tokens`` (recomputed in backward when there is more than one chunk); once per step:
the optimizer over the rank's parameter shard. The tables hold forward + backward times.
Activation checkpointing recomputes a layer's forward in backward: the forward is taken as
1/3 of a GEMM's or memory-bound op's forward + backward time and 1/3.5 of attention's (its
backward does 2.5x the forward's FLOPs). Those shares are assumed, not measured. Where only some
layers are checkpointed (``recompute_share`` of them), a layer's price is the mean over the
layers: its forward is recomputed ``recompute_share`` times on average. Where the recomputed
layers keep attention's output (``attention_kept``), only their dense work runs again.

Compiled layers (``compiled``: ``--compile``, Note [Compiled layers] in :mod:`hdp.launch.model`)
fuse the memory-bound ops around attention and the loss's cross-entropy; those ops then take the
profile's ``compiled_memory_bound_scale`` of their eager time in the tables, a share fitted to
training steps measured with and without ``--compile`` (``docs/benchmarks.md``). The GEMMs and
attention run the same kernels either way. A compiled layer whose activations are kept holds one
``[tokens, hidden]`` tensor fewer (:attr:`hdp.CostModel.working_bytes_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .profile import backend_name
from .specs import GPUProfile, ModelSpec

_GRID_PER_OCTAVE = 16
_GRID_MAX_TOKENS = 1 << 25
_RING_PER_OCTAVE = 64


@dataclass(frozen=True)
class ComputeModel:
    """Training compute time of ``model`` on ``gpu`` (Note [What a layer costs])."""

    model: ModelSpec
    gpu: GPUProfile
    activation_checkpointing: bool = True
    loss_chunk_tokens: int = 4096
    attention_backend: str | None = None
    tensor_parallel: int = 1
    recompute_share: float = 1.0  # of the layers, with activation checkpointing
    attention_kept: bool = False  # the recomputed layers keep attention's output (no rerun)
    compiled: bool = False  # the layers and the loss run as torch.compile fuses them

    @property
    def backend(self) -> str:
        return backend_name(self.attention_backend or self.gpu.attention_backend)

    @property
    def recomputed(self) -> float:
        """Share of the layers whose forward runs again in backward."""
        return self.recompute_share if self.activation_checkpointing else 0.0

    @property
    def attention_recomputed(self) -> float:
        """Share of the layers whose attention (with its exchanges) runs again in backward."""
        return 0.0 if self.attention_kept else self.recomputed

    @property
    def attn_recompute(self) -> float:
        """Attention time with recompute over its forward + backward time."""
        return 1.0 + self.attention_recomputed / 3.5

    @property
    def dense_recompute(self) -> float:
        return 1.0 + self.recomputed / 3.0

    @property
    def memory_bound_scale(self) -> float:
        """Time of the memory-bound ops as they run over their eager time in the tables."""
        return self.gpu.compiled_memory_bound_scale if self.compiled else 1.0

    # ------------------------------------------------------------------ attention
    def attn_time(self, start, end) -> np.ndarray:
        """Training time of the attention of causal query shards ``[start, end)``, one layer (s):
        the diagonal block as a causal call, the keys before ``start`` as one full block."""
        m, t = self.model, self.gpu.tables
        a = np.asarray(start, dtype=np.float64)
        q = np.asarray(end, dtype=np.float64) - a
        diag = t.causal_time(q, m.heads, m.head_dim, self.backend)
        earlier = t.full_time(q, a, m.heads, m.head_dim, self.backend)
        total = diag + np.where(a > 0, earlier, 0.0)
        return np.where(q > 0, total, 0.0) * self.attn_recompute

    # ------------------------------------------------------------------ dense work
    @property
    def linears(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of the seven GEMMs of a decoder layer."""
        m = self.model
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        h, f = m.hidden, m.ffn
        return ((h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h))

    def layer_time(self, tokens) -> np.ndarray:
        """Dense and memory-bound training time of one decoder layer on ``tokens`` (no
        attention, no fixed overhead), seconds."""
        m, t = self.model, self.gpu.tables
        T = np.asarray(tokens, dtype=np.float64)
        gemm = sum(t.gemm_time(T, n_in, n_out) for n_in, n_out in self.linears)
        local = T / self.tensor_parallel  # sequence parallelism: a GPU's share of the tokens
        mem = (
            2 * t.memory_bound_time("rmsnorm", m.hidden, local)
            + 2 * t.memory_bound_time("residual_add", m.hidden, local)
            + t.memory_bound_time("swiglu", m.ffn, T)
            + t.memory_bound_time("rope", (m.heads + m.kv_heads) * m.head_dim, T)
        ) * self.memory_bound_scale
        return (gemm + mem) * self.dense_recompute + self.tensor_comm_time(T)

    def tensor_comm_time(self, tokens) -> np.ndarray:
        """One layer's tensor-parallel all-gathers and reduce-scatters on ``tokens`` tokens
        (Note [What a layer costs]), seconds; 0 without tensor parallelism."""
        tp = self.tensor_parallel
        T = np.asarray(tokens, dtype=np.float64)
        if tp == 1:
            return np.zeros_like(T)
        g, m = self.gpu, self.model
        calls = 8 + 4 * self.recomputed
        per_call = (tp - 1) / tp * T * m.hidden * m.dtype_bytes / g.nvlink_bw + g.nvlink_latency
        return np.where(T > 0, calls * per_call, 0.0)

    def head_time(self, tokens) -> np.ndarray:
        """LM head and cross-entropy of ``tokens`` in chunks of ``loss_chunk_tokens``, seconds."""
        m, t, c = self.model, self.gpu.tables, self.loss_chunk_tokens
        T = np.asarray(tokens, dtype=np.float64)

        def chunk(n):
            gemm = t.gemm_time(n, m.hidden, m.vocab)
            loss = t.memory_bound_time("cross_entropy", m.vocab, n) * self.memory_bound_scale
            return np.where(n > 0, gemm + loss, 0.0)

        full, rest = np.floor(T / c), T - np.floor(T / c) * c
        recompute = np.where(T > c, 4.0 / 3.0, 1.0)  # the chunks run under checkpoint
        return (full * chunk(np.full_like(T, c)) + chunk(rest)) * recompute

    @cached_property
    def _dense_grid(self) -> tuple[np.ndarray, np.ndarray]:
        """(log tokens, log seconds) of :meth:`dense_work` on a fine grid, for fast lookups."""
        octaves = int(np.log2(_GRID_MAX_TOKENS))
        T = 2.0 ** np.linspace(0, octaves, octaves * _GRID_PER_OCTAVE + 1)
        work = self.model.layers * self.layer_time(T) + self.head_time(T)
        return np.log(T), np.log(work)

    def dense_work(self, tokens) -> np.ndarray:
        """Dense, memory-bound and head time of a micro-batch of ``tokens``, without the fixed
        per-layer overhead, seconds (interpolated on a fine log grid)."""
        T = np.asarray(tokens, dtype=np.float64)
        xs, ys = self._dense_grid
        out = np.exp(np.interp(np.log(np.maximum(T, 1.0)), xs, ys))
        return np.where(T > 0, out, 0.0)

    def dense_time(self, tokens) -> np.ndarray:
        """:meth:`dense_work` plus the fixed overhead of every layer, seconds."""
        T = np.asarray(tokens, dtype=np.float64)
        overhead = self.model.layers * self.gpu.layer_overhead_s
        return self.dense_work(T) + np.where(T > 0, overhead, 0.0)

    def dense_s_per_token(self, tokens) -> np.ndarray:
        """Dense time per token in a micro-batch of ``tokens`` tokens, seconds."""
        T = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)
        return self.dense_work(T) / T

    @cached_property
    def best_dense_s_per_token(self) -> float:
        """The least dense time per token over every micro-batch size."""
        xs, ys = self._dense_grid
        return float(np.exp(ys - xs).min())

    def least_dense_s_per_token(self, up_to: float) -> float:
        """The least dense time per token of micro-batches of at most ``up_to`` tokens: a bound
        for any token that shares such a micro-batch."""
        return float(self.least_dense_s_per_token_of(np.asarray([up_to]))[0])

    def least_dense_s_per_token_of(self, up_to: np.ndarray) -> np.ndarray:
        """:meth:`least_dense_s_per_token` of each of ``up_to`` (per-token time is linear in
        log-log between grid points, so its least up to ``x`` is at ``x`` or a grid point below)."""
        xs, ys = self._dense_grid
        x = np.log(np.maximum(np.asarray(up_to, dtype=np.float64), 1.0))
        at = np.interp(x, xs, ys) - x
        below = np.minimum.accumulate(ys - xs)[np.searchsorted(xs, x, side="right") - 1]
        return np.exp(np.minimum(at, below))

    @cached_property
    def _least_dense_from_grid(self) -> np.ndarray:
        """Log seconds of the least :meth:`dense_work` from each point of the dense grid on."""
        return np.minimum.accumulate(self._dense_grid[1][::-1])[::-1]

    def least_dense_time_from(self, tokens) -> np.ndarray:
        """The least :meth:`dense_time` of micro-batches of at least ``tokens`` tokens: a bound
        for a rank's share of ``tokens`` that may share its micro-batch (dense work is linear in
        log-log between grid points, so its least from ``x`` on is at ``x`` or a grid point
        above)."""
        xs, ys = self._dense_grid
        T = np.asarray(tokens, dtype=np.float64)
        x = np.log(np.maximum(T, 1.0))
        after = self._least_dense_from_grid
        i = np.searchsorted(xs, x, side="left")
        above = np.where(i < xs.size, after[np.minimum(i, xs.size - 1)], np.inf)
        work = np.exp(np.minimum(np.interp(x, xs, ys), above))
        overhead = self.model.layers * self.gpu.layer_overhead_s
        return np.where(T > 0, work + overhead, 0.0)

    def least_dense_time_ladder(self, tokens, quarters: int) -> np.ndarray:
        """``[quarters + 1, len(tokens)]``: row ``k`` at most :meth:`least_dense_time_from` of
        ``tokens`` times ``2^(k/4)``, row 0 equal to it (the others from the grid point at or
        below, a quarter octave being whole grid steps)."""
        xs, after = self._dense_grid[0], self._least_dense_from_grid
        T = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)
        first = np.maximum(np.searchsorted(xs, np.log(T), side="right") - 1, 0)
        at = first[None, :] + (_GRID_PER_OCTAVE // 4) * np.arange(1, quarters + 1)[:, None]
        overhead = self.model.layers * self.gpu.layer_overhead_s
        higher = np.exp(after[np.minimum(at, xs.size - 1)]) + overhead
        return np.concatenate([self.least_dense_time_from(T)[None, :], higher])

    @cached_property
    def _ring_call_rates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Query-key pairs per second of a ring step's call over a cell of ``T`` split tokens
        (:func:`hdp.ring.cell_attention`'s rate, the least of its three shapes), on a grid of
        ``T`` 64 to an octave: (log ``T``, the most over each grid point's quarter octave up,
        the most from each grid point on)."""
        m, t = self.model, self.gpu.tables
        octaves = int(np.log2(_GRID_MAX_TOKENS))
        T = 2.0 ** np.linspace(0, octaves, octaves * _RING_PER_OCTAVE + 1)
        h, d, b = m.heads, m.head_dim, self.backend
        shapes = [t.causal_rate(T, h, d, b), t.full_rate(T, T / 2, h, d, b)]
        call = np.minimum.reduce([*shapes, t.full_rate(T / 2, T, h, d, b)])
        # A quarter octave from a grid point at or below its start spans this many points.
        span = _RING_PER_OCTAVE // 4 + 2
        padded = np.append(call, np.zeros(span - 1))
        quarter = np.lib.stride_tricks.sliding_window_view(padded, span).max(axis=1)
        return np.log(T), quarter, np.maximum.accumulate(call[::-1])[::-1]

    def fastest_ring_rates(self, tokens, quarters: int) -> np.ndarray:
        """``[quarters + 1, len(tokens)]``: the most query-key pairs per second of a ring step's
        call over a cell of ``tokens`` times ``2^(k/4)`` to ``2^((k+1)/4)`` split tokens in row
        ``k``, and of any more in the last row (grid points around each range, so that each
        stays a bound)."""
        xs, quarter, suffix = self._ring_call_rates
        x = np.log(np.maximum(np.asarray(tokens, dtype=np.float64), 1.0))
        first = np.maximum(np.searchsorted(xs, x, side="right") - 1, 0)
        at = first[None, :] + (_RING_PER_OCTAVE // 4) * np.arange(quarters + 1)[:, None]
        at = np.minimum(at, xs.size - 1)
        return np.concatenate([quarter[at[:-1]], suffix[at[-1:]]])

    def optimizer_time(self, params: float) -> float:
        """One optimizer step over ``params`` parameters (a rank's shard), seconds."""
        return self.gpu.tables.optimizer_time(params)
