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
says: the search tries each) and deals the sequences to groups longest work first, by their
times alone (LPT) and by what a group's waves cost (:func:`_deals`); :mod:`.mixed` cuts them
into groups of several power-of-two sizes. Either way :func:`stack` stacks each group's sequences
into its waves while every member stays within the capacity (a sequence that alone overflows
it gets a wave of its own and offloads): each into the first wave with room, or in ``peer``
sync the least filled of as few waves as that needs (:func:`_cells`). Sequences that do not
split stay whole, on the least-filled member of their wave.

Example (``tests/test_bounds.py``): 7 sequences of 457-2,417 tokens on two groups of two
a100-80g ranks, 2,048 tokens a rank, ``peer`` sync, every sequence split over its group by
heads. Dealt by their times alone (LPT), the groups hold 4,214 and 5,220 tokens, and first fit
fills each member's first wave (1,802 and 1,844 tokens) and leaves its second light (305 and
767). A micro-batch's dense work costs about what its weights take to read up to a thousand
tokens or so (0.45 s for one token, 0.54 s for 1,132, 0.76 s for 1,802), so the light waves
buy little: 1.403 s. Dealt by what a group's waves cost, the groups hold 4,671 and 4,763
tokens, in waves of 1,208 and 1,128 tokens a member, and of 970 and 1,412: 1.269 s (the
Ulysses mesh: 1.253 s).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from hdp import CostModel, Plan, ulysses

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


def group_plan(ctx: Context, groups: int, split: np.ndarray, exact: bool) -> list[Plan]:
    """Every sequence in ``split`` split over one of ``groups`` groups of ``G = N // groups``
    ranks (in exact shares, or hdp's usual ones), the others whole (module docstring), a plan
    per way of dealing them to groups (:func:`_deals`); none where a rank would hold more than
    it can even with offload."""
    g = ctx.num_ranks // groups
    lens = ctx.seq_lens
    split = split & (lens >= g)
    align = np.ones(lens.size, dtype=np.int64)
    if not exact:
        align[split] = ctx.splits(lens[split], np.full(int(split.sum()), g))[0]
    busy = ctx.whole_s.copy()
    busy[split] = split_busy(ctx, lens[split], np.full(int(split.sum()), g), align[split])
    order = np.argsort(-busy, kind="stable")
    share = np.where(split, -(-lens // g), lens / g)[order]
    plans = []
    for group_of in _deals(ctx, busy[order], share, groups):
        builder = PlanBuilder(ctx, "hdp")
        stack(ctx, builder, 0, order, np.full(groups, g), group_of, split[order], align[order])
        plans.append(finish(ctx, builder))
    return [plan for plan in plans if plan is not None]


def _deals(ctx: Context, busy: np.ndarray, tokens: np.ndarray, groups: int) -> list[np.ndarray]:
    """The group of each sequence (``busy``: its time alone on a group, ``tokens``: what it
    adds to a member, on average), in this order, each to the group it would finish first:
    by the sum of their times alone (LPT), and also by what a group's sequences take besides
    their dense work plus the dense work of its tokens in as few waves as hold them, evenly
    filled (:func:`_cells`): the sequences in one wave share its micro-batches, which LPT
    charges once a sequence. Either may be faster: where they differ, both are laid out."""
    heap, lpt = [(0.0, g) for g in range(groups)], np.empty(busy.size, dtype=np.int64)
    for k, t in enumerate(busy.tolist()):  # (the least loaded group, the first of equals)
        load, lpt[k] = heapq.heappop(heap)
        heapq.heappush(heap, (load + t, int(lpt[k])))
    if groups == 1:
        return [lpt]
    by_waves = _deal_by_waves(ctx, busy, tokens, groups)
    return [lpt] if (by_waves == lpt).all() else [lpt, by_waves]


def _deal_by_waves(ctx: Context, busy: np.ndarray, tokens: np.ndarray, groups: int) -> np.ndarray:
    """:func:`_deals`' second deal. The groups that hold sequences are looked at in the order
    of their finish so far (a heap, entries dropped once stale), until one would finish no
    sooner than the best found even if the sequence added no dense work (its dense work grows
    with its tokens). Of the empty groups, all alike, only the first is."""
    rest, dense = _besides_dense(ctx, busy, tokens)
    held, load, done = [0.0] * groups, [0.0] * groups, [0.0] * groups
    heap: list[tuple[float, int]] = []
    empty, out = 0, np.empty(busy.size, dtype=np.int64)  # the first empty group
    for k, (t, other) in enumerate(zip(tokens.tolist(), rest.tolist())):
        best = (other + dense(t), empty) if empty < groups else (math.inf, 0)
        seen = []
        while heap and (heap[0][0] + other, heap[0][1]) < best:
            now, g = heapq.heappop(heap)
            if now != done[g]:
                continue  # stale
            seen.append((now, g))
            best = min(best, (load[g] + other + dense(held[g] + t), g))
        end, g = best
        for entry in seen:
            if entry[1] != g:
                heapq.heappush(heap, entry)
        empty += g == empty
        held[g] += t
        load[g] += other
        done[g] = end
        heapq.heappush(heap, (end, g))
        out[k] = g
    return out


def _besides_dense(
    ctx: Context, busy: np.ndarray, tokens: np.ndarray
) -> tuple[np.ndarray, Callable[[float], float]]:
    """What each sequence takes besides its dense work (``busy`` less the dense work of its
    ``tokens`` a member), and the dense work of a member's tokens in as few waves as hold
    them, evenly filled."""
    cap = max(ctx.capacity, 1)
    table, times = _dense_table(ctx.cost, cap)

    def dense(held: float) -> float:
        waves = max(math.ceil(held / cap), 1)
        return waves * times[math.ceil(held / waves)]

    return busy - table[np.minimum(np.ceil(tokens), cap).astype(np.int64)], dense


@lru_cache(maxsize=4)
def _dense_table(cost: CostModel, cap: int) -> tuple[np.ndarray, list[float]]:
    """The dense time of a micro-batch of each token count up to ``cap``, as an array and a
    list."""
    table = cost.dense_time(np.arange(cap + 1))
    return table, table.tolist()


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
    cells = _cells(ctx, ids, group_sizes, group_of, split, held)
    jobs: tuple[list, list, list, list] = ([], [], [], [])  # split: ids, waves, members, align
    whole: tuple[list, list, list] = ([], [], [])  # whole ones: waves, ranks, ids
    for k, (i, (wave, member)) in enumerate(zip(ids.tolist(), cells)):
        if lens[i] == 0:
            continue
        first, size = int(starts[group_of[k]]), int(group_sizes[group_of[k]])
        if split[k]:
            jobs[0].append(i)
            jobs[1].append(wave0 + wave)
            jobs[2].append(np.arange(first, first + size))
            jobs[3].append(align[k])
        else:
            whole[0].append(wave0 + wave)
            whole[1].append(first + member)
            whole[2].append(i)
    if jobs[0]:
        builder.add_zigzag(jobs[0], jobs[1], jobs[2], align=np.array(jobs[3], dtype=np.int64))
    if whole[0]:
        seqs = np.array(whole[2], dtype=np.int64)
        builder.add(np.array(whole[0]), np.array(whole[1]), seqs, 0, lens[seqs])
    return max((wave + 1 for i, (wave, _) in zip(ids.tolist(), cells) if lens[i]), default=0)


def _cells(
    ctx: Context,
    ids: np.ndarray,
    group_sizes: np.ndarray,
    group_of: np.ndarray,
    split: np.ndarray,
    held: dict[int, np.ndarray],
) -> list[tuple[int, int]]:
    """(wave, member) of each of ``ids`` in its group (member 0 for a split one), first fit.
    In ``peer`` sync, where a rank runs its cells one after another, first fit gives the
    fewest waves each group needs; then each sequence goes, in the same order, to the least
    filled of that many waves with room, so that a group's waves hold about as many tokens
    each (a micro-batch's dense work costs at least what its weights take to read, so a full
    wave beside a nearly empty one pays that twice for one wave's work). A group keeps first
    fit where the even deal needs more waves, or where its fullest members' dense work comes
    to more (the dense time is not convex everywhere)."""
    lens = ctx.seq_lens
    sizes, groups = group_sizes.tolist(), group_of.tolist()

    def deal(waves: list[_Waves], of: list[int] | None = None) -> list[tuple[int, int]]:
        out = []
        for k, i in enumerate(ids.tolist()):
            w = waves[groups[k]]
            if lens[i] == 0 or (of is not None and groups[k] not in of):
                out.append((0, 0))
            elif split[k]:
                out.append((w.split(held[k], ctx.capacity), 0))
            else:
                out.append(w.whole(int(lens[i]), ctx.capacity))
        return out

    firsts = [_Waves(size) for size in sizes]
    first = deal(firsts)
    several = {g for g, w in enumerate(firsts) if len(w) > 1}
    if ctx.sync != "peer" or not several:
        return first  # (in ``wave`` sync a wave lasts as long as its slowest group)
    evens = [_Waves(size, len(w)) for size, w in zip(sizes, firsts)]
    even = deal(evens, several)
    dense = ctx.cost.dense_time
    keep = {
        g
        for g in several
        if len(evens[g]) <= len(firsts[g])
        and dense(np.array(evens[g].most)).sum() <= dense(np.array(firsts[g].most)).sum()
    }
    return [e if g in keep else f for e, f, g in zip(even, first, groups)]


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


class SplitPrices:
    """:func:`split_busy` of (length, degree) pairs, each priced once across calls: in hdp's
    usual shares (:meth:`~hdp.planner.common.Context.splits`), or with ``exact`` in exact
    ones."""

    def __init__(self, ctx: Context, exact: bool = False) -> None:
        self.ctx, self.exact = ctx, exact
        self.keys = np.zeros(0, dtype=np.int64)  # length * 2**32 + degree, sorted
        self.times = np.zeros(0)

    def of(self, lens: np.ndarray, degree: np.ndarray) -> np.ndarray:
        keys = (np.asarray(lens, dtype=np.int64) << 32) + degree
        new = np.setdiff1d(keys, self.keys)
        if new.size:
            L, d = new >> 32, new & 0xFFFFFFFF
            align = np.ones(new.size, dtype=np.int64) if self.exact else self.ctx.splits(L, d)[0]
            times = split_busy(self.ctx, L, d, align)
            keys_all = np.concatenate([self.keys, new])
            order = np.argsort(keys_all, kind="stable")
            self.keys, self.times = keys_all[order], np.concatenate([self.times, times])[order]
        return self.times[np.searchsorted(self.keys, keys)]


class _Waves:
    """One group's waves: the tokens each member holds in each, and each wave's least and most
    (so that finding a wave with room scans numbers, not arrays). With ``even`` waves opened up
    front, a sequence takes the least filled one with room (heaps of the waves by their least
    and most, entries dropped once stale); otherwise the first."""

    def __init__(self, size: int, even: int = 0) -> None:
        self.size = size
        self.even = even > 0
        self.tokens: list[np.ndarray] = []
        self.members: list[list[tuple[int, int]] | None] = []  # a heap of (tokens, member)
        self.least: list[int] = []
        self.most: list[int] = []
        self.by_least: list[tuple[int, int]] = []
        self.by_most: list[tuple[int, int]] = []
        for _ in range(even):
            self._append(np.zeros(size, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.tokens)

    def whole(self, length: int, capacity: int) -> tuple[int, int]:
        """(wave, member) for a whole sequence: the least-filled member of the wave where it
        keeps room for ``length`` tokens (a new wave where none does), with the tokens added."""
        w = self._emptiest(length, capacity) if self.even else self._first(length, capacity)
        if w is None:
            tokens = np.zeros(self.size, dtype=np.int64)
            self._append(tokens)
            w = len(self) - 1
        members = self.members[w]
        if members is None:  # (a split added to every member since: sorted again)
            members = self.members[w] = list(zip(self.tokens[w].tolist(), range(self.size)))
            heapq.heapify(members)
        held, member = members[0]
        heapq.heapreplace(members, (held + length, member))
        self.tokens[w][member] += length
        self.least[w] = members[0][0]
        self.most[w] = max(self.most[w], held + length)
        self._index(w)
        return w, member

    def _first(self, length: int, capacity: int) -> int | None:
        for w, least in enumerate(self.least):
            if least + length <= capacity:
                return w
        return None

    def _emptiest(self, length: int, capacity: int) -> int | None:
        heap = self.by_least
        while heap[0][0] != self.least[heap[0][1]]:  # (each wave has one fresh entry)
            heapq.heappop(heap)
        return heap[0][1] if heap[0][0] + length <= capacity else None

    def split(self, share: np.ndarray, capacity: int) -> int:
        """The wave whose members all keep room for ``share`` (a new one where none does),
        with ``share`` added to it."""
        low, high = int(share.min()), int(share.max())

        def fits(w: int) -> bool:  # (its fullest member takes the smallest piece first)
            most = self.most[w]
            if most + low > capacity:
                return False
            return most + high <= capacity or bool((self.tokens[w] + share <= capacity).all())

        w = None
        if not self.even:
            w = next((w for w in range(len(self)) if fits(w)), None)
        else:  # the least filled first, while its fullest member takes the smallest piece
            heap, seen = self.by_most, []
            while heap and heap[0][0] + low <= capacity:
                entry = heapq.heappop(heap)
                if entry[0] == self.most[entry[1]]:
                    seen.append(entry)
                    if fits(entry[1]):
                        w = entry[1]
                        break
            for entry in seen:
                heapq.heappush(heap, entry)
        if w is None:
            self._append(share.astype(np.int64).copy())
            return len(self) - 1
        self.tokens[w] += share
        self._update(w)
        return w

    def _append(self, tokens: np.ndarray) -> None:
        self.tokens.append(tokens)
        self.members.append(None)
        self.least.append(0)
        self.most.append(0)
        self._update(len(self) - 1)

    def _update(self, w: int) -> None:
        self.members[w] = None
        self.least[w] = int(self.tokens[w].min())
        self.most[w] = int(self.tokens[w].max())
        self._index(w)

    def _index(self, w: int) -> None:
        """Wave ``w``'s fresh entries in the heaps (its older ones go stale)."""
        if self.even:
            heapq.heappush(self.by_least, (self.least[w], w))
            heapq.heappush(self.by_most, (self.most[w], w))
