"""Pieces every strategy uses: the planning context, zigzag splitting, and plan assembly.

Token counts are ints; times are seconds from the one :class:`hdp.CostModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from hdp import CostModel, Plan
from hdp.plan import BLOCK_TOKENS


class PlanningError(ValueError):
    """The batch cannot be planned on this cluster (says why and what to change)."""


@dataclass
class Context:
    """What a strategy gets: the batch, the cost model, the sync mode and its capacity.
    ``any_exchange``: the plan may run in either P2P exchange (``auto``), not only the one
    ``cost`` prices. ``bound_s``: a lower bound of the step already priced (``auto``'s
    head-parallel search takes the P2P search's), so the strategy need not price its own.
    ``max_ranks_per_seq``: the most ranks one sequence may span (``None``: all)."""

    seq_lens: np.ndarray
    cost: CostModel
    sync: str
    capacity: int
    max_seq: int
    tokens_per_step: int
    seed: int = 0
    any_exchange: bool = False
    bound_s: float | None = None
    max_ranks_per_seq: int | None = None

    @property
    def num_ranks(self) -> int:
        return self.cost.cluster.num_ranks

    @property
    def ranks_per_node(self) -> int:
        return self.cost.cluster.ranks_per_node

    @cached_property
    def whole_s(self) -> np.ndarray:
        """Busy time (s) of each sequence whole on one rank, as the cost model prices it."""
        return np.asarray(self.cost.seq_time(self.seq_lens), dtype=np.float64)

    @cached_property
    def packed_s(self) -> np.ndarray:
        """Busy time (s) each sequence adds to a rank's cell that also holds others: its
        attention, and its dense work at the speed of a full cell. Whole sequences placed beside
        each other share a micro-batch's fixed costs, which :attr:`whole_s` charges each."""
        lens = self.seq_lens
        attn = self.cost.model.layers * self.cost.attn_time(np.zeros(lens.size), lens)
        return attn + lens * self.cost.dense_s_per_token(max(self.capacity, 1))

    @cached_property
    def offload_capacity(self) -> int:
        """Most tokens a rank holds in one wave with activation offload (at least the capacity)."""
        return max(self.cost.offload_capacity(self.sync), self.capacity)

    def splits(self, lengths: np.ndarray, parts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """How hdp splits each of ``lengths`` over ``parts`` ranks: (the block size of its shares,
        the tokens its fullest member holds). Shares in 128-token blocks where
        :func:`use_blocks` allows, else exact; in ``ulysses`` exchange always exact (a
        head-parallel member's attention is the same wherever its tokens lie, so the most even
        split holds the fewest)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        parts = np.asarray(parts, dtype=np.int64)
        room = 0 if self.cost.kv_exchange == "ulysses" else self.offload_capacity
        align = np.where(blocks_fit(lengths, parts), BLOCK_TOKENS, 1)
        most = _most_tokens(lengths, parts, align)
        exact = ~use_blocks(lengths, parts, most, room)
        align[exact] = 1
        most[exact] = _most_tokens(lengths[exact], parts[exact], 1)
        return align, most


def next_pow2(x: float) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << math.ceil(math.log2(x))


def megatron_group_sizes(n: int) -> list[int]:
    """The CP sizes Megatron's hybrid context parallelism can run on a DPxCP group of ``n``
    ranks, ascending: 1, the powers of two ``2^i`` with ``1 <= i < floor(log2 n)`` (it builds a
    group of each such size over every aligned range of ranks), and ``n`` (the DPxCP group
    itself). For 6 ranks: 1, 2, 6; for 12: 1, 2, 4, 12; for 8: 1, 2, 4, 8."""
    top = int(math.floor(math.log2(n))) if n >= 1 else 0
    return sorted({1, n, *(1 << i for i in range(1, top))})


def _member_bound(i: np.ndarray, L: np.ndarray, parts: np.ndarray, align: np.ndarray) -> np.ndarray:
    """Boundary ``i`` of ``parts`` near-equal shares of ``L`` tokens, rounded to ``align`` where
    every share can hold at least ``2 * align`` tokens (``align`` 1: no rounding)."""
    b = (i * L) // parts
    rounded = np.minimum((b + align // 2) // align * align, L)
    return np.where((L >= 2 * parts * align) & (i < parts), rounded, b)


def zigzag_shares(
    lengths: np.ndarray, parts: np.ndarray, align: int | np.ndarray = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Zigzag shares of many sequences, one row per group member: (sequence index into
    ``lengths``, member index, head tokens, tail tokens).

    Member ``i`` of a sequence's group of ``p`` ranks gets a share of ``floor`` or ``ceil`` of
    ``L / p`` tokens (so it never holds more than a ``p``-th, rounded up), half as the head chunk
    ``i`` and half as the tail chunk ``2p - 1 - i``: equal causal work per member. With
    ``align > 1``, shares and halves are multiples of ``align`` tokens where the sequence allows.
    A group of one holds the whole sequence as its head."""
    lengths = np.asarray(lengths, dtype=np.int64)
    parts = np.asarray(parts, dtype=np.int64)
    rep = np.repeat(np.arange(lengths.size), parts)
    offsets = np.cumsum(parts) - parts
    member = np.arange(rep.size) - offsets[rep]
    L, p = lengths[rep], parts[rep]
    a = np.broadcast_to(np.asarray(align, dtype=np.int64), lengths.shape)[rep]
    start = _member_bound(member, L, p, a)
    # A member's share ends where the next one's starts; the last one's, at the sequence's end.
    share = np.where(member == p - 1, L, np.append(start[1:], 0)) - start
    head = share // 2
    head = np.where(share >= 2 * a, head // a * a, head)
    head = np.where(p == 1, share, head)
    return rep, member, head, share - head


def zigzag_positions(
    rep: np.ndarray, head: np.ndarray, tail: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Where each member's chunks lie (rows as from :func:`zigzag_shares`, grouped by sequence):
    (head start, tail end). Heads of members ``0..p-1`` come first, then tails of ``p-1..0``."""
    n_seq = int(rep.max()) + 1 if rep.size else 0
    first = np.searchsorted(rep, np.arange(n_seq))
    head_cum = np.cumsum(head)
    head_start = head_cum - head - (head_cum - head)[first][rep]
    head_total = np.bincount(rep, weights=head, minlength=n_seq).astype(np.int64)
    tail_cum = np.cumsum(tail)
    tail_before = (tail_cum - tail) - (tail_cum - tail)[first][rep]  # tails of members before i
    tail_total = np.bincount(rep, weights=tail, minlength=n_seq).astype(np.int64)
    tail_end = head_total[rep] + tail_total[rep] - tail_before
    return head_start, tail_end


def zigzag_arrays(
    seq_ids: np.ndarray,
    lengths: np.ndarray,
    parts: np.ndarray,
    first_rank: np.ndarray | None = None,
    ranks: list[np.ndarray] | None = None,
    align: int | np.ndarray = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Zigzag-split many sequences at once (shares of :func:`zigzag_shares`). Returns (rank, seq,
    start, end) of the non-empty chunks, ordered by sequence (in the given order), then member,
    then head before tail. The ``i``-th member is rank ``first_rank[s] + i`` (consecutive ranks)
    or ``ranks[s][i]`` (explicit)."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    parts = np.asarray(parts, dtype=np.int64)
    rep, member, head, tail = zigzag_shares(lengths, parts, align)
    head_start, tail_end = zigzag_positions(rep, head, tail)
    if ranks is not None:
        flat = (
            np.concatenate([np.asarray(r, dtype=np.int64) for r in ranks])
            if ranks
            else np.zeros(0, np.int64)
        )
        rank = flat[np.arange(rep.size)]
    else:
        rank = np.asarray(first_rank, dtype=np.int64)[rep] + member
    # Interleave each member's head and tail chunk.
    start = np.stack([head_start, tail_end - tail], axis=1).reshape(-1)
    end = np.stack([head_start + head, tail_end], axis=1).reshape(-1)
    keep = end > start
    return (np.repeat(rank, 2)[keep], np.repeat(seq_ids[rep], 2)[keep], start[keep], end[keep])


def blocks_fit(length, parts):
    """Whether every one of ``parts`` shares of ``length`` tokens holds two blocks (a head and a
    tail) of :data:`~hdp.plan.BLOCK_TOKENS`; numpy arrays broadcast."""
    return length >= 2 * parts * BLOCK_TOKENS


def use_blocks(length, parts, blocked_most, room):
    """``hdp``'s split rule, for the planner and for the priced menus alike: shares in whole
    blocks where every share holds two (:func:`blocks_fit`) and the fullest member of that split
    (``blocked_most`` tokens) stays within ``room`` tokens; exact shares otherwise."""
    return blocks_fit(length, parts) & (blocked_most <= room)


def _most_tokens(lengths: np.ndarray, parts: np.ndarray, align: int | np.ndarray) -> np.ndarray:
    """The tokens the fullest member holds of each sequence split in zigzag shares."""
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    _, _, head, tail = zigzag_shares(lengths, parts, align)
    return np.maximum.reduceat(head + tail, np.cumsum(parts) - parts)


class PlanBuilder:
    """Collects shards (in each cell's local order) and builds a :class:`Plan`."""

    def __init__(self, ctx: Context, strategy: str) -> None:
        self.ctx = ctx
        self.strategy = strategy
        self._cols: list[tuple[np.ndarray, ...]] = []
        self.offload: dict[tuple[int, int], float] = {}
        self.barriers: list[int] = []
        self.info: dict[str, float] = {}  # strategy facts (e.g. the CP size) kept in Plan.predicted

    def add(self, wave, rank, seq, start, end) -> None:
        """Append shards; scalars broadcast against arrays."""
        arrays = np.broadcast_arrays(
            *(np.asarray(x, dtype=np.int64) for x in (wave, rank, seq, start, end))
        )
        self._cols.append(tuple(a.reshape(-1) for a in arrays))

    def add_zigzag(self, seq_ids, waves, members: list[np.ndarray], align: int | np.ndarray = 1):
        """Zigzag-split sequences ``seq_ids[k]`` over the ranks ``members[k]`` in wave ``waves[k]``;
        returns the added shards' (wave, rank, seq, start, end)."""
        shards = self.zigzag(seq_ids, waves, members, align)
        self.add(*shards)
        return shards

    def zigzag(self, seq_ids, waves, members: list[np.ndarray], align: int | np.ndarray = 1):
        """The shards (wave, rank, seq, start, end) :meth:`add_zigzag` adds, not added."""
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        parts = np.asarray([m.size for m in members], dtype=np.int64)
        rank, seq, start, end = zigzag_arrays(
            seq_ids, self.ctx.seq_lens[seq_ids], parts, ranks=members, align=align
        )
        pos = np.empty(self.ctx.seq_lens.size, dtype=np.int64)
        pos[seq_ids] = np.arange(seq_ids.size)
        wave = np.asarray(waves, dtype=np.int64)[pos[seq]]
        return wave, rank, seq, start, end

    def offload_where_needed(self) -> None:
        """Offload, in every cell holding more than the capacity, the share of its activations
        the cost model says it must (cells already given a fraction keep it)."""
        if not self._cols:
            return
        wave, rank, _, start, end = (np.concatenate(c) for c in zip(*self._cols))
        cells, idx = np.unique(wave * self.ctx.num_ranks + rank, return_inverse=True)
        tokens = np.bincount(idx, weights=end - start)
        over = tokens > self.ctx.capacity
        fractions = self.ctx.cost.offload_needed(tokens[over], self.ctx.sync)
        for cell, f in zip(cells[over].tolist(), fractions.tolist()):
            self.offload.setdefault(divmod(cell, self.ctx.num_ranks), float(f))

    def build(self) -> Plan:
        if self._cols:
            wave, rank, seq, start, end = (np.concatenate(c) for c in zip(*self._cols))
        else:
            wave = rank = seq = start = end = np.zeros(0, dtype=np.int64)
        num_waves = int(wave.max()) + 1 if wave.size else 1
        offload = None
        if self.offload:
            offload = np.zeros((num_waves, self.ctx.num_ranks))
            for (w, r), f in self.offload.items():
                offload[w, r] = f
        return Plan(
            self.ctx.seq_lens,
            self.ctx.num_ranks,
            rank,
            wave,
            seq,
            start,
            end,
            sync=self.ctx.sync,
            num_waves=num_waves,
            offload=offload,
            barriers=self.barriers,
            strategy=self.strategy,
            capacity=self.ctx.capacity,
            predicted=self.info,
            kv_exchange=self.ctx.cost.kv_exchange,
            ranks_per_node=self.ctx.ranks_per_node,
        )


def option_flag(default: str, *, flag: str, choices: tuple[str, ...], help: str) -> Any:
    """A strategy option that is also a command-line flag of ``hdp-sim`` and ``hdp-plan``
    (:func:`hdp.planner.strategies.add_option_flags`)."""
    return field(default=default, metadata={"flag": flag, "choices": choices, "help": help})


def seconds_flag(default: float, *, flag: str, help: str) -> Any:
    """A strategy option in seconds (at least 0) that is also a flag of ``hdp-sim`` and
    ``hdp-plan``."""
    return field(default=default, metadata={"flag": flag, "seconds": True, "help": help})


def knob_flag(*, flag: str, metavar: str, help: str) -> Any:
    """A strategy's knob (a size in tokens or ranks, ``None``: not set) that is also a flag of
    ``hdp-sim`` and ``hdp-plan``; ``hdp-sim`` searches a baseline's knob that is not set
    (:mod:`hdp.planner.tuning`)."""
    return field(default=None, metadata={"flag": flag, "metavar": metavar, "help": help})


def fewest_micro_batches(ctx: Context) -> int:
    """The fewest micro-batches of at most ``ranks x capacity`` tokens that hold the batch."""
    return -(-int(ctx.seq_lens.sum()) // (ctx.num_ranks * max(ctx.capacity, 1)))


def micro_batches(ctx: Context, ids: np.ndarray, count: int) -> list[np.ndarray] | None:
    """``ids`` dealt into ``count`` micro-batches of at most ``ranks x capacity`` tokens each,
    longest first to the one with the least work so far; ``None`` where they do not fit."""
    lens, room = ctx.seq_lens, ctx.num_ranks * ctx.capacity
    tokens, work = np.zeros(count, dtype=np.int64), np.zeros(count)
    parts: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(ids.tolist(), key=lambda i: -int(lens[i])):
        fits = np.flatnonzero(tokens + lens[i] <= room)
        if fits.size == 0:
            return None
        k = int(fits[np.argmin(work[fits])])
        parts[k].append(i)
        tokens[k] += lens[i]
        work[k] += ctx.whole_s[i]
    return [np.asarray(p, dtype=np.int64) for p in parts if p]
