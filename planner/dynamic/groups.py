"""Plans of a whole batch on rank groups, seeds of hdp's search (Note [One search]).

The relaxation's packing gives a long sequence most ranks and puts the short ones whole beside
its shares. Two things it misses, which a system like FlexSP exploits, are cheap to build here:

- Sequences that share a group's waves share its micro-batches, so the dense layers' fixed cost
  is paid once, not once a sequence. Equal jobs stacked on the same ranks as separate waves pay
  it each time.
- On a profile where a split saves work (the CPU's reference attention), every sequence split
  over a large group beats the relaxation's mix of degrees, which cannot all fit side by side.

A head-parallel member (``ulysses`` exchange) attends over its whole sequence for ``1 / G`` of
the heads wherever its tokens lie, so such a group is balanced at any length; a P2P group runs
zigzag shares.

:func:`group_plan` cuts the ranks into groups of ``G`` ranks (as many as :func:`group_counts`
says: the search tries each) and deals the sequences to groups longest work first (LPT);
:mod:`.mixed` cuts them into groups of several power-of-two sizes. Either way :func:`stack`
stacks each group's sequences into its waves while every member stays within the capacity (a
sequence that alone overflows it gets a wave of its own and offloads); sequences that do not
split stay whole, on the least-filled member of their group's first wave with room.
"""

from __future__ import annotations

import numpy as np

from hdp import Plan, ulysses

from ..common import Context, PlanBuilder, zigzag_shares
from ..splits import head_split_times, split_times


def group_counts(ctx: Context) -> list[int]:
    """How many groups to try: the fewest (one, or in ``ulysses`` exchange as few as have at
    most one rank a head), twice as many and so on while a group still holds the longest
    sequence, and one group a node (a node's traffic stays on NVLink)."""
    n, rpn = ctx.num_ranks, ctx.ranks_per_node
    least = max(1, -(-int(ctx.seq_lens.max(initial=1)) // ctx.offload_capacity))
    most = most_members(ctx)
    counts, c = [], -(-n // most)
    while n // c >= least and c <= n:
        counts.append(c)
        c *= 2
    if least <= rpn <= most and n % rpn == 0 and n // rpn not in counts:
        counts.append(n // rpn)
    return counts


def group_splits(ctx: Context, g: int) -> list[tuple[np.ndarray, bool]]:
    """Which sequences a group of ``g`` ranks splits, and whether in exact shares, one per
    variant to try: head-parallel, every sequence of at least ``g`` tokens, exactly; P2P, that
    too (for the profiles where splits save work), and only those a rank cannot hold, in hdp's
    usual shares (:meth:`~hdp.planner.common.Context.split`)."""
    lens = ctx.seq_lens
    if ctx.cost.kv_exchange == "ulysses":
        return [(lens >= g, True)]
    return [(lens >= g, True), (lens > ctx.capacity, False)]


def group_plan(ctx: Context, groups: int, split: np.ndarray, exact: bool) -> Plan | None:
    """Every sequence in ``split`` split over one of ``groups`` groups of ``G = N // groups``
    ranks (in exact shares, or hdp's usual ones), the others whole (module docstring); ``None``
    where a rank would hold more than it can even with offload."""
    g = ctx.num_ranks // groups
    lens = ctx.seq_lens
    split = split & (lens >= g)
    align = np.ones(lens.size, dtype=np.int64)
    if not exact:
        align[split] = ctx.splits(lens[split], np.full(int(split.sum()), g))[0]
    busy = ctx.whole_s.copy()
    busy[split] = split_busy(ctx, lens[split], np.full(int(split.sum()), g), align[split])
    order = np.argsort(-busy, kind="stable")
    group_of = np.empty(lens.size, dtype=np.int64)  # in ``order``
    load = np.zeros(groups)
    for k, i in enumerate(order.tolist()):
        group = int(np.argmin(load))
        load[group] += busy[i]
        group_of[k] = group
    builder = PlanBuilder(ctx, "hdp")
    stack(ctx, builder, 0, order, np.full(groups, g), group_of, split[order], align[order])
    return finish(ctx, builder)


def stack(
    ctx: Context,
    builder: PlanBuilder,
    wave0: int,
    ids: np.ndarray,
    group_sizes: np.ndarray,
    group_of: np.ndarray,
    split: np.ndarray,
    align: int | np.ndarray = 1,
) -> int:
    """Groups of ``group_sizes`` ranks on consecutive ranks; sequence ``ids[k]`` (in this order)
    in group ``group_of[k]``, split over all its members where ``split[k]`` (in shares aligned
    to ``align[k]``) and else whole on one, stacked into the group's waves from ``wave0``;
    returns the waves used."""
    lens = ctx.seq_lens
    align = np.broadcast_to(np.asarray(align, dtype=np.int64), ids.shape)
    starts = np.cumsum(group_sizes) - group_sizes
    splits = np.flatnonzero(split)
    held: dict[int, np.ndarray] = {}  # tokens of each split sequence per member
    if splits.size:
        degree = group_sizes[group_of[splits]]
        _, _, head, tail = zigzag_shares(lens[ids[splits]], degree, align[splits])
        rows = np.split(head + tail, np.cumsum(degree)[:-1])
        if ctx.cost.kv_exchange == "ulysses":  # exact shares; count the fullest member's on each
            rows = [np.full(r.size, r.max()) for r in rows]
        held = dict(zip(splits.tolist(), rows))
    waves = [_Waves(int(size)) for size in group_sizes.tolist()]
    jobs: tuple[list, list, list, list] = ([], [], [], [])  # split: ids, waves, members, align
    whole: tuple[list, list, list] = ([], [], [])  # whole ones: waves, ranks, ids
    for k, i in enumerate(ids.tolist()):
        if lens[i] == 0:
            continue
        group = int(group_of[k])
        first, size = int(starts[group]), int(group_sizes[group])
        if split[k]:
            jobs[0].append(i)
            jobs[1].append(wave0 + waves[group].split(held[k], ctx.capacity))
            jobs[2].append(np.arange(first, first + size))
            jobs[3].append(align[k])
        else:
            wave, member = waves[group].whole(int(lens[i]), ctx.capacity)
            whole[0].append(wave0 + wave)
            whole[1].append(first + member)
            whole[2].append(i)
    if jobs[0]:
        builder.add_zigzag(jobs[0], jobs[1], jobs[2], align=np.array(jobs[3], dtype=np.int64))
    if whole[0]:
        seqs = np.array(whole[2], dtype=np.int64)
        builder.add(np.array(whole[0]), np.array(whole[1]), seqs, 0, lens[seqs])
    return max((len(w) for w in waves), default=0)


def finish(ctx: Context, builder: PlanBuilder) -> Plan | None:
    """The builder's plan with offload where needed; ``None`` where a rank would hold more than
    it can even with offload."""
    builder.offload_where_needed()
    plan = builder.build()
    return plan if plan.tokens_per_cell().max(initial=0) <= ctx.offload_capacity else None


def most_members(ctx: Context) -> int:
    """The most ranks a group may have: all, or in ``ulysses`` exchange one a head, and at most
    ``ctx.max_ranks_per_seq``."""
    n = ctx.num_ranks
    most = ulysses.most_members(ctx.cost.model, n) if ctx.cost.kv_exchange == "ulysses" else n
    return min(most, ctx.max_ranks_per_seq or n)


def split_busy(ctx: Context, lens: np.ndarray, degree: np.ndarray, align: np.ndarray) -> np.ndarray:
    """Busy time (s) of each sequence split over ``degree`` ranks, as the exchange runs it."""
    if ctx.cost.kv_exchange == "ulysses":
        return head_split_times(ctx.cost, lens, degree, ctx.sync)[0]
    return split_times(ctx.cost, lens, degree, ctx.sync, align)[0]


class _Waves:
    """One group's waves: the tokens each member holds in each, and each wave's least and most
    (so that finding a wave with room scans numbers, not arrays)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.tokens: list[np.ndarray] = []
        self.least: list[int] = []
        self.most: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def whole(self, length: int, capacity: int) -> tuple[int, int]:
        """(wave, member) for a whole sequence: the least-filled member of the first wave where
        it keeps room for ``length`` tokens (a new wave where none does), with the tokens
        added."""
        for w, least in enumerate(self.least):
            if least + length <= capacity:
                tokens = self.tokens[w]
                member = int(np.argmin(tokens))
                tokens[member] += length
                self._update(w)
                return w, member
        tokens = np.zeros(self.size, dtype=np.int64)
        tokens[0] = length
        self._append(tokens)
        return len(self) - 1, 0

    def split(self, share: np.ndarray, capacity: int) -> int:
        """The first wave whose members all keep room for ``share`` (a new one where none does),
        with ``share`` added to it."""
        low, high = int(share.min()), int(share.max())
        for w, most in enumerate(self.most):
            if most + low > capacity:  # its fullest member cannot take the smallest piece
                continue
            tokens = self.tokens[w]
            if most + high <= capacity or (tokens + share <= capacity).all():
                tokens += share
                self._update(w)
                return w
        self._append(share.astype(np.int64).copy())
        return len(self) - 1

    def _append(self, tokens: np.ndarray) -> None:
        self.tokens.append(tokens)
        self.least.append(0)
        self.most.append(0)
        self._update(len(self) - 1)

    def _update(self, w: int) -> None:
        self.least[w] = int(self.tokens[w].min())
        self.most[w] = int(self.tokens[w].max())
