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
(:class:`PartialAttention`). At most two received messages are alive at once.

Backward: with the final ``out`` and ``lse``, local blocks give dq, dk, dv directly; each round's
KV message is fetched again (buffers are not kept across the layer), its dq part is added locally,
and its dK/dV partials (fp32) travel back to the owner, who adds them to its own. The same rounds
run in the same order on every rank (sends posted before waits), so no plan can deadlock, on gloo
or NCCL. Every rank of ``group`` must call with the same plan and wave, including ranks with no
tokens in it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hdp import Plan

from .kernels import AttentionBackend, acc_dtype, get_backend, select_backend
from .merge import PartialAttention


@dataclass
class Segments:
    """Independent attention blocks of one kernel call: query rows and key rows per segment."""

    q_rows: torch.Tensor  # int64, concatenated query row indices (each row at most once)
    k_rows: torch.Tensor  # int64, concatenated key row indices into the key source
    cu_q: torch.Tensor  # int32 [n + 1]
    cu_k: torch.Tensor  # int32 [n + 1]
    max_q: int
    max_k: int

    @classmethod
    def build(cls, pairs: list[tuple[list[range], list[range]]]) -> Segments | None:
        """``pairs``: for each segment, (query row ranges, key row ranges)."""
        q_rows, k_rows, cu_q, cu_k = [], [], [0], [0]
        for qr, kr in pairs:
            nq = sum(len(r) for r in qr)
            nk = sum(len(r) for r in kr)
            if nq == 0 or nk == 0:
                continue
            for r in qr:
                q_rows.extend(r)
            for r in kr:
                k_rows.extend(r)
            cu_q.append(cu_q[-1] + nq)
            cu_k.append(cu_k[-1] + nk)
        if len(cu_q) == 1:
            return None
        nq = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
        nk = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
        return cls(
            torch.tensor(q_rows, dtype=torch.int64),
            torch.tensor(k_rows, dtype=torch.int64),
            torch.tensor(cu_q, dtype=torch.int32),
            torch.tensor(cu_k, dtype=torch.int32),
            max(nq),
            max(nk),
        )

    def to(self, device: torch.device) -> Segments:
        return Segments(
            self.q_rows.to(device),
            self.k_rows.to(device),
            self.cu_q.to(device),
            self.cu_k.to(device),
            self.max_q,
            self.max_k,
        )


@dataclass
class RoundIO:
    """What this rank sends and receives in one round (``None`` where nothing)."""

    send_to: int | None = None
    send_rows: torch.Tensor | None = None  # local rows of the KV it sends, message order
    recv_from: int | None = None
    recv_tokens: int = 0
    recv_pieces: list = field(default_factory=list)  # (seq, start, end) in message order
    recv_segments: Segments | None = None  # local queries x received keys
    recv_rows: torch.Tensor | None = None  # for the owner's side: local rows its dK/dV returns to


@dataclass
class WaveLayout:
    """Everything one rank needs to run ``dist_attn`` for one wave, derived from the plan alone."""

    tokens: int
    diag: Segments | None
    local_full: Segments | None
    rounds: list[RoundIO]

    @classmethod
    def build(cls, plan: Plan, wave: int, rank: int) -> WaveLayout:
        shards = plan.shards(rank, wave)
        offsets, off = [], 0
        by_seq: dict[int, list[int]] = {}
        for i, sh in enumerate(shards):
            offsets.append(off)
            off += sh.end - sh.start
            by_seq.setdefault(sh.seq, []).append(i)
        rows = [range(o, o + sh.end - sh.start) for o, sh in zip(offsets, shards)]
        diag = Segments.build([([r], [r]) for r in rows])
        local_pairs = []
        for i, sh in enumerate(shards):
            before = [rows[j] for j in by_seq[sh.seq] if shards[j].end <= sh.start]
            local_pairs.append(([rows[i]], before))
        local_full = Segments.build(local_pairs)

        def local_rows_of(seq: int, a: int, b: int) -> range:
            for j in by_seq.get(seq, ()):
                sj = shards[j]
                if sj.start <= a and b <= sj.end:
                    return range(offsets[j] + a - sj.start, offsets[j] + b - sj.start)
            raise AssertionError(f"rank {rank} does not hold tokens [{a}, {b}) of sequence {seq}")

        rounds = []
        for msgs in plan.comm_rounds(wave):
            io = RoundIO()
            for m in msgs:
                if m.src == rank:
                    io.send_to = m.dst
                    io.send_rows = torch.tensor(
                        [t for p in m.pieces for t in local_rows_of(*p)], dtype=torch.int64
                    )
                if m.dst == rank:
                    io.recv_from = m.src
                    io.recv_pieces = list(m.pieces)
                    io.recv_tokens = m.tokens
                    pos, piece_rows = 0, []
                    for p in m.pieces:
                        piece_rows.append((p, range(pos, pos + p.end - p.start)))
                        pos += p.end - p.start
                    io.recv_segments = Segments.build(
                        [
                            (
                                [rows[i]],
                                [r for p, r in piece_rows if p.seq == sh.seq and p.end <= sh.start],
                            )
                            for i, sh in enumerate(shards)
                        ]
                    )
            rounds.append(io)
        return cls(off, diag, local_full, rounds)


_LAYOUTS: weakref.WeakKeyDictionary[Plan, dict] = weakref.WeakKeyDictionary()


def wave_layout(plan: Plan, wave: int, rank: int) -> WaveLayout:
    """Cached :class:`WaveLayout` (every layer of a step reuses it)."""
    per_plan = _LAYOUTS.setdefault(plan, {})
    key = (wave, rank)
    if key not in per_plan:
        per_plan[key] = WaveLayout.build(plan, wave, rank)
    return per_plan[key]


@dataclass
class CommCounter:
    """Bytes this process sent and received through ``dist_attn`` (forward and backward)."""

    fwd_bytes_sent: int = 0
    fwd_bytes_received: int = 0
    bwd_bytes_sent: int = 0
    bwd_bytes_received: int = 0
    messages: int = 0

    def reset(self) -> None:
        self.__init__()


COMM = CommCounter()
_WARMED: set = set()


def _global(group, r: int) -> int:
    return r if group is None or group is dist.group.WORLD else dist.get_global_rank(group, r)


def _exchange(
    send: torch.Tensor | None,
    send_to: int | None,
    recv: torch.Tensor | None,
    recv_from: int | None,
    group,
    tag: int,
) -> list:
    """Post one round's send and receive (either may be absent); returns the requests."""
    ops = []
    if send is not None and send_to is not None:
        ops.append(dist.P2POp(dist.isend, send, _global(group, send_to), group, tag))
    if recv is not None and recv_from is not None:
        ops.append(dist.P2POp(dist.irecv, recv, _global(group, recv_from), group, tag))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def _post_kv(io: RoundIO, k: torch.Tensor, v: torch.Tensor, group, tag: int, backward: bool):
    """Post one round's K/V message out and in; returns (receive buffer, requests, send buffer)."""
    device = k.device
    send = (
        torch.stack([k[io.send_rows.to(device)], v[io.send_rows.to(device)]], 1)
        if io.send_to is not None
        else None
    )
    recv = (
        torch.empty(io.recv_tokens, 2, k.shape[1], k.shape[2], dtype=k.dtype, device=device)
        if io.recv_from is not None
        else None
    )
    if send is not None:
        COMM.messages += 1
        if backward:
            COMM.bwd_bytes_sent += send.numel() * send.element_size()
        else:
            COMM.fwd_bytes_sent += send.numel() * send.element_size()
    if recv is not None:
        if backward:
            COMM.bwd_bytes_received += recv.numel() * recv.element_size()
        else:
            COMM.fwd_bytes_received += recv.numel() * recv.element_size()
    return recv, _exchange(send, io.send_to, recv, io.recv_from, group, tag), send


class _DistAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: WaveLayout, group, scale: float, backend: AttentionBackend):
        device = q.device
        T, H, d = q.shape
        acc = PartialAttention(T, H, d, q.dtype, device)
        rounds = layout.rounds
        pending = _post_kv(rounds[0], k, v, group, 0, backward=False) if rounds else None
        for seg, causal in ((layout.diag, True), (layout.local_full, False)):
            if seg is not None:
                _attend(acc, backend, q, k, v, seg.to(device), causal, scale)
        for r in range(len(rounds)):
            recv, reqs, _send = pending
            _wait(reqs)
            pending = (
                _post_kv(rounds[r + 1], k, v, group, 2 * r + 2, backward=False)
                if r + 1 < len(rounds)
                else None
            )
            seg = rounds[r].recv_segments
            if recv is not None and seg is not None:
                _attend(acc, backend, q, recv[:, 0], recv[:, 1], seg.to(device), False, scale)
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.layout, ctx.group, ctx.scale, ctx.backend = layout, group, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group, scale, backend = ctx.layout, ctx.group, ctx.scale, ctx.backend
        device = q.device
        hk, d = k.shape[1], k.shape[2]
        ad = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=ad, device=device)
        dk = torch.zeros(k.shape, dtype=ad, device=device)
        dv = torch.zeros(v.shape, dtype=ad, device=device)
        dout = dout.contiguous()
        for seg, causal in ((layout.diag, True), (layout.local_full, False)):
            if seg is not None:
                seg = seg.to(device)
                gq, gk, gv = _grad(backend, dout, q, k, v, out, lse, seg, causal, scale)
                dq.index_add_(0, seg.q_rows, gq.to(ad))
                dk.index_add_(0, seg.k_rows, gk.to(ad))
                dv.index_add_(0, seg.k_rows, gv.to(ad))
        rounds = layout.rounds
        pending = _post_kv(rounds[0], k, v, group, 0, backward=True) if rounds else None
        for r in range(len(rounds)):
            io = rounds[r]
            recv, reqs, _send = pending
            _wait(reqs)
            pending = (
                _post_kv(rounds[r + 1], k, v, group, 2 * r + 2, backward=True)
                if r + 1 < len(rounds)
                else None
            )
            # dK/dV partials of the received keys go back to their owner; ours come back to us.
            dkv_out = None
            if recv is not None:
                dkv_out = torch.zeros(io.recv_tokens, 2, hk, d, dtype=ad, device=device)
                seg = io.recv_segments
                if seg is not None:
                    seg = seg.to(device)
                    gq, gk, gv = _grad(
                        backend, dout, q, recv[:, 0], recv[:, 1], out, lse, seg, False, scale
                    )
                    dq.index_add_(0, seg.q_rows, gq.to(ad))
                    dkv_out[:, 0].index_add_(0, seg.k_rows, gk.to(ad))
                    dkv_out[:, 1].index_add_(0, seg.k_rows, gv.to(ad))
            dkv_in = (
                torch.empty(io.send_rows.numel(), 2, hk, d, dtype=ad, device=device)
                if io.send_to is not None
                else None
            )
            if dkv_out is not None:
                COMM.bwd_bytes_sent += dkv_out.numel() * dkv_out.element_size()
                COMM.messages += 1
            if dkv_in is not None:
                COMM.bwd_bytes_received += dkv_in.numel() * dkv_in.element_size()
            _wait(_exchange(dkv_out, io.recv_from, dkv_in, io.send_to, group, 2 * r + 1))
            if dkv_in is not None:
                rows = io.send_rows.to(device)
                dk.index_add_(0, rows, dkv_in[:, 0])
                dv.index_add_(0, rows, dkv_in[:, 1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


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
    out, lse = backend.forward(qp, kp, vp, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, causal, scale)
    acc.merge(seg.q_rows, out, lse)


def _grad(
    backend: AttentionBackend, dout, q, k, v, out, lse, seg: Segments, causal: bool, scale: float
):
    """(dq of seg's query rows, dk and dv of seg's key rows) with the final out/lse."""
    qp = q.index_select(0, seg.q_rows)
    kp = k.index_select(0, seg.k_rows)
    vp = v.index_select(0, seg.k_rows)
    dop = dout.index_select(0, seg.q_rows)
    op = out.index_select(0, seg.q_rows)
    lp = lse.index_select(1, seg.q_rows)
    if backend.name != "reference":
        lp = lp.float()
    return backend.backward(
        dop, qp, kp, vp, op, lp, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, causal, scale
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
    ``softmax_scale`` defaults to ``1 / sqrt(d)``; ``backend`` (``reference``, ``torch_flash``,
    ``flash_attn``) defaults to the fastest for the device and dtype. Returns ``[T_local, H, d]``
    in ``q.dtype``.
    """
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world != plan.num_ranks:
        raise ValueError(
            f"dist_attn: the plan is for {plan.num_ranks} ranks but the group has {world}"
        )
    if not 0 <= wave < plan.num_waves:
        raise ValueError(f"dist_attn: wave {wave} is outside the plan's {plan.num_waves} waves")
    layout = wave_layout(plan, wave, rank)
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
    if q.shape[0] != layout.tokens:
        raise ValueError(
            f"dist_attn: rank {rank} holds {layout.tokens} tokens in wave {wave} of the plan, "
            f"but q has {q.shape[0]} rows"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"dist_attn: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads"
        )
    if dist.is_initialized() and group not in _WARMED and q.device.type == "cuda":
        # NCCL: the first P2P call on a communicator must involve every rank; a barrier does that.
        dist.barrier(group)
        _WARMED.add(group)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    impl = get_backend(backend) if backend else select_backend(q.device, q.dtype)
    return _DistAttn.apply(q, k, v, layout, group, scale, impl)
