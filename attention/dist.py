"""``dist_attn``: causal attention of one wave of a :class:`hdp.Plan`, exact for any placement.

Each rank holds its shards' tokens of the wave, packed in ``plan.shards(rank, wave)`` order:
``q`` ``[T_local, H, d]``, ``k`` and ``v`` ``[T_local, H_kv, d]``. A query shard of sequence ``s``
attends to every key of ``s`` at or before it: its own shard (causal diagonal block), the rank's
other shards of ``s`` that lie before it (full blocks), and the pieces of other ranks' shards that
lie before it, which arrive by P2P.

Forward: the rank posts the sends and receives of the plan's first round of KV messages
(:meth:`hdp.Plan.comm_rounds`: each rank sends and receives at most one message per round) and
computes its local blocks while they fly. Then for each round it waits for it, posts the next round
and computes against the message it received; partial results merge by log-sum-exp in fp32
(:class:`PartialAttention`). At most two received messages are alive at once, plus, in ``node``
exchange, the two blocks a relay holds to forward (Note [Node exchange rounds] in
:mod:`hdp.exchange`).

Backward: with the final ``out`` and ``lse``, local blocks give dq, dk, dv directly; each round's
KV message is fetched again (buffers are not kept across the layer), its dq part is added locally,
and its dK/dV partials travel back to the owner, who adds them to its own (in fp32, Note [dK/dV on
the wire]); a relay adds the partials of a block it fetched (its own and those its forwards
return) and sends the sum to the owner in the block's return phase. The same rounds
run in the same order on every rank (sends posted before waits), so no plan can deadlock, on gloo
or NCCL. Every rank of ``group`` must call with the same plan and wave, including ranks with no
tokens in it.

A plan in ``ulysses`` exchange runs head-parallel instead (:mod:`hdp.attention.ulysses`).

Note [dK/dV on the wire]
------------------------
Every sum of gradients runs in fp32 (the accumulation dtype), but dK/dV travel in the compute
dtype, as TransformerEngine's ring sends them: each kernel call returns its dK/dV in that dtype
already, so a partial of one call arrives exactly; only a sum of several (a relay's, or the rows
two query shards of one rank share) is rounded once more on its way. Sent in fp32, dK/dV would be
half of the bytes a layer moves (K/V forward, K/V again and dK/dV backward: 1 + 1 + 2); in the
compute dtype they are a third (1 + 1 + 1). For example, in bf16 a rank that received 8,192
tokens of K/V (8 heads of 128) returns 32 MiB of dK/dV in a layer, not 64 MiB; in float32 or
float64 nothing changes.

Note [One block per query row]
------------------------------
The diagonal blocks (each shard against itself, causal) hold every local row once, in order, so
their kernel call reads q, k and v as they are and its ``(out, lse)`` covers every row. Where that
is all a rank computes in a wave (:attr:`WaveLayout.local_only`: no earlier local shard of the
same sequence, nothing sent or received), it is the answer: one kernel call forward and one
backward, outputs and gradients in the compute dtype, no merge, no accumulator. That is every
rank of a one-rank run and every rank whose wave holds whole sequences. Otherwise the diagonal
call starts the fp32 accumulators (out and lse forward; dq, dk, dv backward) instead of merging
into zeros, and the other blocks merge or add into them. For example, a rank holding whole
sequences of 300 and 200 tokens makes one varlen call with ``cu = [0, 300, 500]``; a rank holding
tokens 0-299 of one sequence and 300-499 of another sequence's second half makes that call, then
merges the keys of the second sequence's first half when they arrive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hdp import Plan

from .kernels import AttentionBackend, acc_dtype, get_backend, select_backend
from .layout import RoundIO, Segments, WaveLayout, wave_layout
from .merge import PartialAttention
from .messages import post, wait_all, warm_up
from .ulysses import UlyssesAttn, ulysses_layout


class _DistAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: WaveLayout, group, scale: float, backend: AttentionBackend):
        ctx.layout, ctx.group, ctx.scale, ctx.backend = layout, group, scale, backend
        if layout.local_only:  # Note [One block per query row]
            out, lse = _diagonal(backend, q, k, v, layout.diag, scale)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        device = q.device
        comm = _Messenger(group, backward=False)
        rounds, slots = layout.rounds, {}
        pending = comm.post_kv(rounds[0], k, v, slots, 0) if rounds else None
        acc = _local_attention(backend, q, k, v, layout, scale)
        for r, io in enumerate(rounds):
            recv, reqs = pending
            wait_all(reqs)
            if io.keep_as >= 0:
                slots[io.keep_as] = recv
            pending = (
                comm.post_kv(rounds[r + 1], k, v, slots, r + 1) if r + 1 < len(rounds) else None
            )
            seg = io.recv_segments
            if recv is not None and seg is not None:
                _attend(acc, backend, q, recv[:, 0], recv[:, 1], seg.to(device), False, scale)
            _drop_forwarded(slots, layout, r)
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group, scale, backend = ctx.layout, ctx.group, ctx.scale, ctx.backend
        dout = dout.contiguous()
        if layout.local_only:
            grads = _grad(backend, dout, q, k, v, out, lse, layout.diag, True, scale, False)
            return (*grads, None, None, None, None)
        device = q.device
        ad = acc_dtype(q.dtype)
        if layout.diag is None:  # no tokens in this wave
            grads = _Grads(*(torch.zeros(t.shape, dtype=ad, device=device) for t in (q, k, k)))
        else:  # the diagonal blocks cover every row in order: their gradients start the sums
            gq, gk, gv = _grad(backend, dout, q, k, v, out, lse, layout.diag, True, scale, False)
            grads = _Grads(gq.to(ad), gk.to(ad), gv.to(ad))
        if layout.local_full is not None:
            seg = layout.local_full.to(device)
            gq, gk, gv = _grad(backend, dout, q, k, v, out, lse, seg, False, scale)
            grads.dq.index_add_(0, seg.q_rows, gq.to(ad))
            grads.dk.index_add_(0, seg.k_rows, gk.to(ad))
            grads.dv.index_add_(0, seg.k_rows, gv.to(ad))
        comm = _Messenger(group, backward=True, wire=k.dtype)
        rounds, slots = layout.rounds, {}
        pending = comm.post_kv(rounds[0], k, v, slots, 0) if rounds else None
        for r, io in enumerate(rounds):
            recv, reqs = pending
            wait_all(reqs)
            if io.keep_as >= 0:
                slots[io.keep_as] = recv
                grads.sums[io.keep_as] = torch.zeros(recv.shape, dtype=ad, device=device)
            pending = (
                comm.post_kv(rounds[r + 1], k, v, slots, r + 1) if r + 1 < len(rounds) else None
            )
            dkv_out = None
            if recv is not None:
                # dK/dV partials of received keys: a relay sums them for the owner; anyone else
                # sends them back along the message's edge.
                dkv_out = grads.sums.get(io.keep_as)
                if dkv_out is None:
                    dkv_out = torch.zeros(recv.shape, dtype=ad, device=device)
                seg = io.recv_segments
                if seg is not None:
                    seg = seg.to(device)
                    gq, gk, gv = _grad(
                        backend, dout, q, recv[:, 0], recv[:, 1], out, lse, seg, False, scale
                    )
                    grads.dq.index_add_(0, seg.q_rows, gq.to(ad))
                    dkv_out[:, 0].index_add_(0, seg.k_rows, gk.to(ad))
                    dkv_out[:, 1].index_add_(0, seg.k_rows, gv.to(ad))
                if io.keep_as >= 0:
                    dkv_out = None
            _drop_forwarded(slots, layout, r)
            comm.dkv_phase(io, dkv_out, layout, r, grads)
        comm.dkv_phase(None, None, layout, len(rounds), grads)
        return (
            grads.dq.to(q.dtype),
            grads.dk.to(k.dtype),
            grads.dv.to(v.dtype),
            None,
            None,
            None,
            None,
        )


@dataclass
class _Grads:
    """Gradient sums of one backward in the accumulation dtype: local dq, dk, dv, and the relay
    slots' sums."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    sums: dict[int, torch.Tensor] = field(default_factory=dict)

    def add_local(self, rows: torch.Tensor, dkv: torch.Tensor) -> None:
        rows = rows.to(self.dk.device)
        self.dk.index_add_(0, rows, dkv[:, 0])
        self.dv.index_add_(0, rows, dkv[:, 1])


def _drop_forwarded(slots: dict, layout: WaveLayout, r: int) -> None:
    """Free the relay slots whose last forward left in round ``r`` (their sends are done)."""
    for hop in [h for h in slots if layout.slot_last_round[h] <= r]:
        del slots[hop]


class _Messenger:
    """The P2P traffic of one ``dist_attn`` pass: K/V rounds and, backward, dK/dV phases, whose
    partials and sums travel in ``wire``, the compute dtype (Note [dK/dV on the wire])."""

    def __init__(self, group, backward: bool, wire: torch.dtype | None = None) -> None:
        self.group, self.backward, self.wire = group, backward, wire

    def post_kv(self, io: RoundIO, k, v, slots: dict, r: int):
        """Post round ``r``'s K/V message out and in; returns (receive buffer, requests)."""
        send = None
        if io.send_to is not None:
            rows = io.send_rows.to(k.device)
            if io.send_slot >= 0:
                send = slots[io.send_slot].index_select(0, rows)
            else:
                send = torch.stack([k[rows], v[rows]], 1)
        recv = None
        if io.recv_from is not None:
            shape = (io.recv_tokens, 2, k.shape[1], k.shape[2])
            recv = torch.empty(shape, dtype=k.dtype, device=k.device)
        sends = [(send, io.send_to)] if send is not None else []
        recvs = [(recv, io.recv_from)] if recv is not None else []
        return recv, self._post(sends, recvs, 2 * r + 2)

    def dkv_phase(self, io: RoundIO | None, dkv_out, layout: WaveLayout, p: int, grads: _Grads):
        """Phase ``p`` of backward: dK/dV partials back along round ``p``'s edges (``io``) and the
        relay sums due in phase ``p``; adds what arrives into ``grads``."""
        sends, recvs, after = [], [], []
        if dkv_out is not None:
            sends.append((dkv_out.to(self.wire), io.recv_from))
        if io is not None and io.send_to is not None and io.send_dkv_back:
            buf = self._buffer(io.send_rows.numel(), grads)
            recvs.append((buf, io.send_to))
            after.append((buf, io.send_rows, io.send_slot))
        for ret in layout.returns_out[p]:
            sends.append((grads.sums.pop(ret.hop).to(self.wire), ret.peer))
        for ret in layout.returns_in[p]:
            buf = self._buffer(ret.tokens, grads)
            recvs.append((buf, ret.peer))
            after.append((buf, ret.rows, -1))
        wait_all(self._post(sends, recvs, 2 * p + 1, tag_step=len(layout.rounds) + 1))
        for buf, rows, slot in after:
            buf = buf.to(grads.dk.dtype)  # (the sums stay in the accumulation dtype)
            if slot >= 0:
                grads.sums[slot].index_add_(0, rows.to(buf.device), buf)
            else:
                grads.add_local(rows, buf)

    def _buffer(self, tokens: int, grads: _Grads) -> torch.Tensor:
        """A receive buffer for ``tokens`` tokens' dK/dV partials, on the wire's dtype."""
        dk = grads.dk
        return torch.empty((tokens, 2, *dk.shape[1:]), dtype=self.wire, device=dk.device)

    def _post(self, sends: list, recvs: list, tag: int, tag_step: int = 0) -> list:
        return post(self.group, sends, recvs, tag, self.backward, tag_step)


def _attend(
    acc: PartialAttention,
    backend: AttentionBackend,
    q,
    k,
    v,
    seg: Segments,
    causal: bool,
    scale: float,
) -> None:
    qp = q.index_select(0, seg.q_rows)
    kp = k.index_select(0, seg.k_rows)
    vp = v.index_select(0, seg.k_rows)
    cu_q, cu_k = seg.cu(host=backend.host_lengths)
    out, lse = backend.forward(qp, kp, vp, cu_q, cu_k, seg.max_q, seg.max_k, causal, scale)
    acc.merge(seg.q_rows, out, lse)


def _diagonal(backend: AttentionBackend, q, k, v, diag: Segments, scale: float):
    """``(out, lse)`` of the diagonal blocks: every local row, in order, so q, k and v are read
    as they are (Note [One block per query row])."""
    cu_q, cu_k = diag.cu(host=backend.host_lengths, device=q.device)
    return backend.forward(q, k, v, cu_q, cu_k, diag.max_q, diag.max_k, True, scale)


def _local_attention(
    backend: AttentionBackend, q, k, v, layout: WaveLayout, scale: float
) -> PartialAttention:
    """The running result of the rank's local blocks: the diagonal blocks, which cover every
    query row in order, start it (Note [One block per query row]); the full blocks of earlier
    local shards merge into it."""
    T, H, d = q.shape
    diag = layout.diag
    if diag is None:  # no tokens in this wave
        acc = PartialAttention.empty(T, H, d, q.dtype, q.device)
    else:
        acc = PartialAttention.start(*_diagonal(backend, q, k, v, diag, scale))
    if layout.local_full is not None:
        _attend(acc, backend, q, k, v, layout.local_full.to(q.device), False, scale)
    return acc


def _grad(
    backend: AttentionBackend,
    dout,
    q,
    k,
    v,
    out,
    lse,
    seg: Segments,
    causal: bool,
    scale: float,
    gather: bool = True,
):
    """(dq of seg's query rows, dk and dv of seg's key rows) with the final out/lse; without
    ``gather``, seg's rows are all rows in order (the diagonal blocks)."""
    if gather:
        q, dout, out = (t.index_select(0, seg.q_rows) for t in (q, dout, out))
        k, v = k.index_select(0, seg.k_rows), v.index_select(0, seg.k_rows)
        lse = lse.index_select(1, seg.q_rows)
    if backend.name != "reference":
        lse = lse.float()
    cu_q, cu_k = seg.cu(host=backend.host_lengths, device=q.device)
    return backend.backward(
        dout, q, k, v, out, lse, cu_q, cu_k, seg.max_q, seg.max_k, causal, scale
    )


def dist_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    wave: int,
    group=None,
    softmax_scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's tokens of ``wave`` of ``plan``; differentiable in q, k, v.

    ``q`` ``[T_local, H, d]``, ``k``/``v`` ``[T_local, H_kv, d]``, rows in
    ``plan.shards(rank, wave)`` order, where ``rank`` is this process's rank in ``group`` (default:
    the world). A collective: every rank of the group calls it with the same plan and wave.
    ``softmax_scale`` defaults to ``1 / sqrt(d)``; ``backend`` (``reference``, ``cudnn``,
    ``torch_flash``, ``flash_attn``) defaults to the fastest for the device and dtype (see
    :func:`hdp.attention.select_backend`). Returns ``[T_local, H, d]`` in ``q.dtype``.
    """
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world != plan.num_ranks:
        raise ValueError(
            f"dist_attn: the plan is for {plan.num_ranks} ranks but the group has {world}"
        )
    if not 0 <= wave < plan.num_waves:
        raise ValueError(f"dist_attn: wave {wave} is outside the plan's {plan.num_waves} waves")
    if (
        q.dim() != 3
        or k.dim() != 3
        or v.shape != k.shape
        or q.shape[0] != k.shape[0]
        or q.shape[2] != k.shape[2]
    ):
        raise ValueError(
            f"dist_attn: expected q [T, H, d] and k, v [T, H_kv, d]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"dist_attn: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads"
        )
    if plan.kv_exchange == "ulysses":
        layout = ulysses_layout(plan, wave, rank, q.shape[1], k.shape[1])
    else:
        layout = wave_layout(plan, wave, rank)
    if q.shape[0] != layout.tokens:
        raise ValueError(
            f"dist_attn: rank {rank} holds {layout.tokens} tokens in wave {wave} of the plan, "
            f"but q has {q.shape[0]} rows"
        )
    warm_up(group, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    impl = get_backend(backend) if backend else select_backend(q.device, q.dtype)
    attn = UlyssesAttn if plan.kv_exchange == "ulysses" else _DistAttn
    return attn.apply(q, k, v, layout, group, scale, impl)
