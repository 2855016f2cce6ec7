"""What one rank does in one wave of ``dist_attn``, derived from the plan alone.

:class:`WaveLayout` holds the rank's local attention blocks and, per round of the wave's K/V
exchange (:meth:`hdp.Plan.exchange`), the message it sends and the one it receives. In ``node``
exchange a rank may also relay: it keeps a fetched block in a *slot* to forward parts of it, and
backward it sums the block's dK/dV partials there and returns the sum to the owner in the block's
return phase (Note [Node exchange rounds] in :mod:`hdp.exchange`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from hdp import Plan, Shard

from .kernels import to_device


@dataclass
class Segments:
    """Independent attention blocks of one kernel call: query rows and key rows per segment."""

    q_rows: torch.Tensor  # int64, concatenated query row indices (each row at most once)
    k_rows: torch.Tensor  # int64, concatenated key row indices into the key source
    cu_q: torch.Tensor  # int32 [n + 1], on the host
    cu_k: torch.Tensor  # int32 [n + 1], on the host
    max_q: int
    max_k: int

    def cu(self, *, host: bool, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_q, cu_k)`` on the host, or copied to ``device`` (default: the rows') for backends
        that read them there (a host-reading backend on a GPU would wait for the stream to fetch
        a device copy back)."""
        if host:
            return self.cu_q, self.cu_k
        device = self.q_rows.device if device is None else device
        return to_device(self.cu_q, device), to_device(self.cu_k, device)

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
        """The rows on ``device``; the lengths stay on the host (:meth:`cu` copies them)."""
        return Segments(
            to_device(self.q_rows, device),
            to_device(self.k_rows, device),
            self.cu_q,
            self.cu_k,
            self.max_q,
            self.max_k,
        )


@dataclass
class Return:
    """A relay's dK/dV sum of fetched block ``hop``: sent by the relay, received by the owner."""

    hop: int
    peer: int  # the owner (for the relay) or the relay (for the owner)
    rows: torch.Tensor | None = None  # the owner's local rows the sum adds to
    tokens: int = 0


@dataclass
class RoundIO:
    """What this rank sends and receives in one round (``None`` where nothing)."""

    send_to: int | None = None
    send_rows: torch.Tensor | None = None  # rows of the KV it sends (local, or of ``send_slot``)
    send_slot: int = -1  # node exchange: the fetched block a forward is cut from
    send_dkv_back: bool = True  # False for a fetch: its dK/dV comes back in a return phase
    recv_from: int | None = None
    recv_tokens: int = 0
    recv_pieces: list = field(default_factory=list)  # (seq, start, end) in message order
    recv_segments: Segments | None = None  # local queries x received keys
    keep_as: int = -1  # node exchange: keep the received block as relay slot ``keep_as``


@dataclass
class WaveLayout:
    """Everything one rank needs to run ``dist_attn`` for one wave, derived from the plan alone.

    ``diag`` holds every local row once, in order, as query and key rows (each shard's causal
    block), so its kernel call needs no gather. ``returns_out[p]`` / ``returns_in[p]``: the relay
    sums this rank sends / receives in phase ``p`` (after round ``p - 1``; ``len(rounds) + 1``
    phases). ``slot_last_round``: the round after which a relay slot's K/V is no longer
    forwarded.
    """

    tokens: int
    diag: Segments | None
    local_full: Segments | None
    rounds: list[RoundIO]
    returns_out: list[list[Return]]
    returns_in: list[list[Return]]
    slot_last_round: dict[int, int]

    @property
    def local_only(self) -> bool:
        """Every query row's keys lie in its own shard and this rank sends and receives nothing
        in the wave (Note [One block per query row] in :mod:`hdp.attention.dist`)."""
        quiet = all(io.send_to is None and io.recv_from is None for io in self.rounds)
        returns = any(self.returns_out) or any(self.returns_in)
        return self.diag is not None and self.local_full is None and quiet and not returns

    @classmethod
    def build(cls, plan: Plan, wave: int, rank: int) -> WaveLayout:
        shards = plan.shards(rank, wave)
        local = _LocalRows(shards, rank)
        rows = local.rows
        diag = Segments.build([([r], [r]) for r in rows])
        local_pairs = []
        for i, sh in enumerate(shards):
            before = [rows[j] for j in local.by_seq[sh.seq] if shards[j].end <= sh.start]
            local_pairs.append(([rows[i]], before))
        local_full = Segments.build(local_pairs)
        ex = plan.exchange(wave)
        slots: dict[int, tuple[Shard, ...]] = {}  # fetches this rank relays: hop -> pieces
        owned: dict[int, torch.Tensor] = {}  # fetches this rank sent: hop -> its local rows
        rounds, last = [], {}
        for r, msgs in enumerate(ex.rounds):
            io = RoundIO()
            for m in msgs:
                if m.src == rank:
                    _add_send(io, m, local, slots)
                    if m.relay:
                        owned[m.hop] = io.send_rows
                    if m.via >= 0:
                        last[m.via] = r
                if m.dst == rank:
                    _add_recv(io, m, shards, rows)
                    if m.relay:
                        slots[m.hop] = m.pieces
                        last.setdefault(m.hop, r)
            rounds.append(io)
        phases = len(ex.rounds) + 1
        outs: list[list[Return]] = [[] for _ in range(phases)]
        ins: list[list[Return]] = [[] for _ in range(phases)]
        for m in ex.transfers:
            if not m.relay:
                continue
            tokens = m.tokens
            if m.dst == rank:
                outs[ex.returns[m.hop]].append(Return(m.hop, m.src, tokens=tokens))
            if m.src == rank:
                ins[ex.returns[m.hop]].append(Return(m.hop, m.dst, owned[m.hop], tokens))
        return cls(local.tokens, diag, local_full, rounds, outs, ins, last)


class _LocalRows:
    """Where each token of this rank's shards sits in its local K/V."""

    def __init__(self, shards: list[Shard], rank: int) -> None:
        self.shards, self.rank = shards, rank
        self.offsets, off = [], 0
        self.by_seq: dict[int, list[int]] = {}
        for i, sh in enumerate(shards):
            self.offsets.append(off)
            off += sh.end - sh.start
            self.by_seq.setdefault(sh.seq, []).append(i)
        self.tokens = off
        self.rows = [range(o, o + sh.end - sh.start) for o, sh in zip(self.offsets, shards)]

    def of(self, seq: int, a: int, b: int) -> range:
        for j in self.by_seq.get(seq, ()):
            sj = self.shards[j]
            if sj.start <= a and b <= sj.end:
                o = self.offsets[j]
                return range(o + a - sj.start, o + b - sj.start)
        raise AssertionError(f"rank {self.rank} does not hold tokens [{a}, {b}) of sequence {seq}")


def _rows_in(pieces: tuple[Shard, ...], seq: int, a: int, b: int) -> range:
    """Rows of tokens ``[a, b)`` of ``seq`` in a message holding ``pieces`` in order."""
    pos = 0
    for p in pieces:
        if p.seq == seq and p.start <= a and b <= p.end:
            return range(pos + a - p.start, pos + b - p.start)
        pos += p.end - p.start
    raise AssertionError(f"a relayed block lacks tokens [{a}, {b}) of sequence {seq}")


def _add_send(io: RoundIO, m, local: _LocalRows, slots: dict[int, tuple[Shard, ...]]) -> None:
    io.send_to = m.dst
    if m.via >= 0:  # a forward: rows of the relayed block
        io.send_slot = m.via
        rows = [t for p in m.pieces for t in _rows_in(slots[m.via], *p)]
    else:
        rows = [t for p in m.pieces for t in local.of(*p)]
    io.send_rows = torch.tensor(rows, dtype=torch.int64)
    io.send_dkv_back = not m.relay


def _add_recv(io: RoundIO, m, shards: list[Shard], rows: list[range]) -> None:
    io.recv_from = m.src
    io.recv_pieces = list(m.pieces)
    io.recv_tokens = m.tokens
    io.keep_as = m.hop if m.relay else -1
    pos, piece_rows = 0, []
    for p in m.pieces:
        piece_rows.append((p, range(pos, pos + p.end - p.start)))
        pos += p.end - p.start
    io.recv_segments = Segments.build(
        [
            ([rows[i]], [r for p, r in piece_rows if p.seq == sh.seq and p.end <= sh.start])
            for i, sh in enumerate(shards)
        ]
    )


_LAYOUTS: weakref.WeakKeyDictionary[Plan, dict] = weakref.WeakKeyDictionary()


def wave_layout(plan: Plan, wave: int, rank: int) -> WaveLayout:
    """Cached :class:`WaveLayout` (every layer of a step reuses it)."""
    per_plan = _LAYOUTS.setdefault(plan, {})
    key = (wave, rank)
    if key not in per_plan:
        per_plan[key] = WaveLayout.build(plan, wave, rank)
    return per_plan[key]
