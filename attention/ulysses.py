"""``dist_attn`` for plans in ``ulysses`` exchange: each split sequence attends head-parallel.

The members of a sequence (the ranks holding its tokens in the wave) split its query heads into
contiguous ranges, one each, near-equal. Forward, an all-to-all gives every member the whole
sequence's queries of its heads and the K/V heads those read; the member runs causal attention
over all ``L`` tokens and an all-to-all returns each token owner its rows of the output. Backward
runs the same two all-to-alls on ``dout`` and on the gradients. A sequence held by one rank is a
group of one: no messages, all heads. The cost model prices the same work and bytes
(:mod:`hdp.ulysses`).

Note [Head ranges and K/V heads]
--------------------------------
With ``H`` query heads on ``H_kv`` K/V heads, query head ``h`` reads K/V head ``h // (H / H_kv)``.
A member's heads ``[a, b)`` read the K/V heads ``[a // r, (b - 1) // r + 1)`` (``r = H / H_kv``),
and those travel to it. Where the range holds whole groups of ``r`` heads, or lies inside one
group, local query head ``i`` reads local K/V head ``i // r'`` for one ``r'`` and the kernel runs
as grouped-query attention. Otherwise (8 heads, 2 K/V heads, 3 members: heads ``[0, 3)``,
``[3, 6)``, ``[6, 8)``; the second reads K/V heads 0 and 1 for one and two of its heads) the
member repeats the K/V heads it received to one per query head and sums their gradients back.
Several members may read one K/V head; its owner adds their dK/dV partials in fp32, which, as
the dQ, travel in the compute dtype (Note [dK/dV on the wire] in :mod:`hdp.attention.dist`).

A member's sequences with the same head range attend in one variable-length kernel call; the
sequences only one rank holds go first, while the all-to-all is in flight.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from hdp import Plan

from .kernels import AttentionBackend, acc_dtype, to_device
from .messages import post, wait_all


@dataclass(frozen=True)
class _Member:
    """One member of a sequence's group: its rank, heads and tokens."""

    peer: int
    heads: tuple[int, int]  # query heads [a, b)
    kv: tuple[int, int]  # the K/V heads they read
    positions: torch.Tensor  # positions in the sequence of its tokens, in its local order
    head_cols: torch.Tensor  # its query heads, as columns of q
    qkv_cols: torch.Tensor  # its query and K/V heads, as columns of [q, k, v] side by side

    @property
    def width(self) -> int:
        return self.qkv_cols.numel()


@dataclass(frozen=True)
class _Sequence:
    """A sequence this rank holds tokens of, and its group."""

    length: int
    rows: torch.Tensor  # this rank's local rows of it, in local order
    members: tuple[_Member, ...]  # ascending rank, this rank among them
    me: int  # this rank's index in ``members``

    @property
    def mine(self) -> _Member:
        return self.members[self.me]


@dataclass(frozen=True)
class _Batch:
    """Sequences this rank attends in one kernel call: the same heads of each."""

    seqs: tuple[int, ...]  # indices into ``UlyssesLayout.sequences``
    heads: int
    kv_heads: int
    kv_of_head: torch.Tensor | None  # local K/V head of each local query head, where not GQA
    cu: torch.Tensor  # int32 [n + 1], on the host
    max_len: int
    remote: bool  # whether it waits for the all-to-all


@dataclass(frozen=True)
class UlyssesLayout:
    """What one rank does in one wave of a ``ulysses`` plan, for ``H`` and ``H_kv`` heads."""

    tokens: int
    sequences: tuple[_Sequence, ...]  # ascending sequence id
    batches: tuple[_Batch, ...]  # local ones first

    @classmethod
    def build(cls, plan: Plan, wave: int, rank: int, heads: int, kv_heads: int) -> UlyssesLayout:
        at = np.flatnonzero(plan.wave == wave)  # cell order: by rank, then local order
        seq, member, start, end = plan.seq[at], plan.rank[at], plan.start[at], plan.end[at]
        mine = member == rank
        size = end - start
        offset = np.zeros(at.size, dtype=np.int64)
        offset[mine] = np.cumsum(size[mine]) - size[mine]
        sequences = []
        for s in np.unique(seq[mine]).tolist():
            of_s = seq == s
            peers = np.unique(member[of_s]).tolist()
            if len(peers) > heads:
                raise ValueError(
                    f"dist_attn: sequence {s} is split over {len(peers)} ranks in wave {wave}, "
                    f"but a ulysses plan splits heads and q has {heads}: plan at most {heads} "
                    "ranks per sequence, or run the placement with plan.with_exchange('rank')"
                )
            members = []
            for p, (a, b) in zip(peers, _head_ranges(heads, len(peers))):
                held = of_s & (member == p)
                pos = _ranges(start[held], end[held])
                members.append(_member(p, a, b, heads, kv_heads, pos))
            held = of_s & mine
            rows = _ranges(offset[held], offset[held] + size[held])
            me = peers.index(rank)
            sequences.append(_Sequence(int(plan.seq_lens[s]), rows, tuple(members), me))
        tokens = int(size[mine].sum())
        return cls(tokens, tuple(sequences), _batches(sequences, heads // kv_heads))


def _ranges(a: np.ndarray, b: np.ndarray) -> torch.Tensor:
    """``[a[0], b[0]) + [a[1], b[1]) + ...`` as one int64 tensor."""
    return torch.from_numpy(np.concatenate([np.arange(x, y) for x, y in zip(a, b)]))


def _head_ranges(heads: int, members: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal query head ranges of ``members`` ranks (the first ones one more)."""
    cuts = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(heads), members)])
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]


def _member(peer: int, a: int, b: int, heads: int, kv_heads: int, pos: torch.Tensor) -> _Member:
    r = heads // kv_heads
    ka, kb = a // r, (b - 1) // r + 1
    cols = [*range(a, b), *range(heads + ka, heads + kb)]
    cols += range(heads + kv_heads + ka, heads + kv_heads + kb)
    return _Member(peer, (a, b), (ka, kb), pos, torch.arange(a, b), torch.tensor(cols))


def _kv_of_head(m: _Member, r: int) -> torch.Tensor | None:
    """Note [Head ranges and K/V heads]: ``None`` where the kernel can run grouped-query
    attention on the member's heads, else the local K/V head of each local query head."""
    (a, b), (ka, kb) = m.heads, m.kv
    local = np.arange(a, b) // r - ka
    h, nkv = b - a, kb - ka
    if h % nkv == 0 and (local == np.arange(h) // (h // nkv)).all():
        return None
    return torch.from_numpy(local)


def _batches(sequences: list[_Sequence], r: int) -> tuple[_Batch, ...]:
    by_heads: dict[tuple[bool, tuple[int, int]], list[int]] = {}
    for i, s in enumerate(sequences):
        by_heads.setdefault((len(s.members) > 1, s.mine.heads), []).append(i)
    out = []
    for (remote, _), idx in sorted(by_heads.items()):
        m = sequences[idx[0]].mine
        lens = [sequences[i].length for i in idx]
        cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
        h, nkv = m.heads[1] - m.heads[0], m.kv[1] - m.kv[0]
        out.append(_Batch(tuple(idx), h, nkv, _kv_of_head(m, r), cu, max(lens), remote))
    return tuple(out)


_LAYOUTS: weakref.WeakKeyDictionary[Plan, dict] = weakref.WeakKeyDictionary()


def ulysses_layout(plan: Plan, wave: int, rank: int, heads: int, kv_heads: int) -> UlyssesLayout:
    """Cached :class:`UlyssesLayout` (every layer of a step reuses it)."""
    per_plan = _LAYOUTS.setdefault(plan, {})
    key = (wave, rank, heads, kv_heads)
    if key not in per_plan:
        per_plan[key] = UlyssesLayout.build(plan, wave, rank, heads, kv_heads)
    return per_plan[key]


class _AllToAll:
    """The all-to-alls of one pass over the layout's sequences."""

    def __init__(self, layout: UlyssesLayout, group, backward: bool) -> None:
        self.layout, self.group, self.backward = layout, group, backward

    def to_members(self, x: torch.Tensor, cols, tag: int) -> tuple[list, list]:
        """Token owners to head owners: each member of each sequence gets this rank's rows of
        ``x`` ``[T, C, d]`` at its columns ``cols(member)``. Returns, per sequence, the rows of
        every member at this rank's columns (member order), and the requests."""
        sends, recvs, got = [], [], []
        for s in self.layout.sequences:
            mine = x.index_select(0, s.rows.to(x.device))
            own = cols(s.mine).to(x.device)
            parts = []
            for i, m in enumerate(s.members):
                if i == s.me:
                    parts.append(mine.index_select(1, own))
                    continue
                sends.append((mine.index_select(1, cols(m).to(x.device)), m.peer))
                parts.append(x.new_empty((m.positions.numel(), own.numel(), x.shape[2])))
                recvs.append((parts[-1], m.peer))
            got.append(parts)
        return got, post(self.group, sends, recvs, tag, self.backward)

    def whole(self, batch: _Batch, got: list) -> torch.Tensor:
        """The batch's sequences end to end, each in token order, from :meth:`to_members`."""
        out = []
        for i in batch.seqs:
            s, parts = self.layout.sequences[i], got[i]
            rows = torch.cat(parts)
            pos = torch.cat([m.positions for m in s.members]).to(rows.device)
            out.append(rows.new_empty((s.length, *rows.shape[1:])).index_copy_(0, pos, rows))
        return torch.cat(out)

    def to_owners(self, whole: dict[int, torch.Tensor], width, tag: int) -> tuple[list, list]:
        """Head owners to token owners: ``whole[i]`` ``[L, C, d]`` is sequence ``i`` at this
        rank's columns; each member gets its tokens' rows. Returns, per sequence, the rows of
        this rank's tokens from every member (``width(member)`` columns each), and the
        requests."""
        sends, recvs, got = [], [], []
        for i, s in enumerate(self.layout.sequences):
            y = whole[i]
            n = s.rows.numel()
            parts = []
            for j, m in enumerate(s.members):
                rows = y.index_select(0, m.positions.to(y.device))
                if j == s.me:
                    parts.append(rows)
                    continue
                sends.append((rows, m.peer))
                parts.append(y.new_empty((n, width(m), y.shape[2])))
                recvs.append((parts[-1], m.peer))
            got.append(parts)
        return got, post(self.group, sends, recvs, tag, self.backward)


def _by_sequence(batch: _Batch, y: torch.Tensor, into: dict[int, torch.Tensor]) -> None:
    cu = batch.cu.tolist()
    for k, i in enumerate(batch.seqs):
        into[i] = y[cu[k] : cu[k + 1]]


def _expand(kv: torch.Tensor, batch: _Batch) -> torch.Tensor:
    if batch.kv_of_head is None:
        return kv
    return kv.index_select(1, batch.kv_of_head.to(kv.device))


class UlyssesAttn(torch.autograd.Function):
    """Causal attention of one rank's tokens of one wave of a ``ulysses`` plan."""

    @staticmethod
    def forward(ctx, q, k, v, layout: UlyssesLayout, group, scale: float, backend):
        T, H, d = q.shape
        comm = _AllToAll(layout, group, backward=False)
        got, reqs = comm.to_members(torch.cat([q, k, v], 1), lambda m: m.qkv_cols, 1)
        outs: dict[int, torch.Tensor] = {}
        saved = []
        for b in layout.batches:
            if b.remote:
                wait_all(reqs)
                reqs = []
            x = comm.whole(b, got)
            qb, kb, vb = (t.contiguous() for t in x.split([b.heads, b.kv_heads, b.kv_heads], 1))
            cu = _cu(b, backend, q.device)
            out, lse = backend.forward(
                qb, _expand(kb, b), _expand(vb, b), *cu, b.max_len, b.max_len, True, scale
            )
            saved += [qb, kb, vb, out, lse]
            _by_sequence(b, out, outs)
        wait_all(reqs)
        got, reqs = comm.to_owners(outs, lambda m: m.head_cols.numel(), 3)
        wait_all(reqs)
        result = q.new_empty((T, H, d))
        for s, parts in zip(layout.sequences, got):
            for m, part in zip(s.members, parts):
                result[s.rows.to(q.device), m.heads[0] : m.heads[1]] = part
        ctx.save_for_backward(*saved)
        ctx.layout, ctx.group, ctx.scale, ctx.backend = layout, group, scale, backend
        ctx.shapes = (q.shape, k.shape, q.dtype, k.dtype)
        return result

    @staticmethod
    def backward(ctx, dout):
        layout, scale, backend = ctx.layout, ctx.scale, ctx.backend
        q_shape, k_shape, q_dtype, k_dtype = ctx.shapes
        saved = ctx.saved_tensors
        device = dout.device
        comm = _AllToAll(layout, ctx.group, backward=True)
        got, reqs = comm.to_members(dout.contiguous(), lambda m: m.head_cols, 5)
        wait_all(reqs)
        ad = acc_dtype(q_dtype)
        grads: dict[int, torch.Tensor] = {}
        for n, b in enumerate(layout.batches):
            qb, kb, vb, out, lse = saved[5 * n : 5 * n + 5]
            lse = lse if backend.name == "reference" else lse.float()
            dq, dk, dv = backend.backward(
                comm.whole(b, got),
                qb,
                _expand(kb, b),
                _expand(vb, b),
                out,
                lse,
                *_cu(b, backend, device),
                b.max_len,
                b.max_len,
                True,
                scale,
            )
            # (Summed in fp32, sent in the compute dtype: Note [dK/dV on the wire] in dist.py.)
            dk, dv = (_fold(g.to(ad), b).to(q_dtype) for g in (dk, dv))
            _by_sequence(b, torch.cat([dq.to(q_dtype), dk, dv], 1), grads)
        got, reqs = comm.to_owners(grads, lambda m: m.width, 7)
        wait_all(reqs)
        dq = torch.zeros(q_shape, dtype=ad, device=device)
        dk = torch.zeros(k_shape, dtype=ad, device=device)
        dv = torch.zeros(k_shape, dtype=ad, device=device)
        for s, parts in zip(layout.sequences, got):
            rows = s.rows.to(device)
            for m, part in zip(s.members, parts):
                (a, b), (ka, kb) = m.heads, m.kv
                gq, gk, gv = part.split([b - a, kb - ka, kb - ka], 1)
                dq[rows, a:b] += gq
                dk[rows, ka:kb] += gk
                dv[rows, ka:kb] += gv
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(k_dtype), None, None, None, None


def _cu(batch: _Batch, backend: AttentionBackend, device) -> tuple[torch.Tensor, torch.Tensor]:
    cu = batch.cu if backend.host_lengths else to_device(batch.cu, device)
    return cu, cu


def _fold(g: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """Gradients of the repeated K/V heads summed back onto the heads that were sent."""
    if batch.kv_of_head is None:
        return g
    folded = g.new_zeros((g.shape[0], batch.kv_heads, g.shape[2]))
    return folded.index_add_(1, batch.kv_of_head.to(g.device), g)
