"""Plans on rank groups of mixed power-of-two sizes, seeds of hdp's search (Note [One search]).

Note [Mixed group sizes]
------------------------
FlexSP runs each sequence on a group of ranks of some power-of-two size and chooses, by a MILP
inside a bisection on the step time ``H``, how many groups of each size there are and which
sequences each size runs. Without a MILP, for one ``H``:

1. Every sequence takes the size of least area (size times its time there) among those where it
   runs within ``H``.
2. A size needs ``ceil(load / H)`` groups, at least one where used (in ``wave`` sync also
   enough to hold its sequences' tokens in one wave; what does not pack opens another wave,
   and the cost model prices it). Where they need more ranks than there are, the sequences of
   one size move wholesale to another where they also run within ``H``, whichever move needs
   the fewest ranks, until they fit; else ``H`` is too short.
3. Spare ranks become more groups of the size with the most load per group.

The least ``H`` that fits is bisected. Layouts follow at heights above it, each gap twice the
last (4%, 8%, 16% and 32% of it, up to twice it), while the search's budget lasts. Each is dealt
twice, longest first to the group where a sequence would finish first: among its own size's
groups, or among all (a group its own sequences leave short of the step then takes shorter
ones). The cost model prices every plan; the search keeps the fastest.

Example, 16 ranks: two long sequences of 2 s on 4 ranks, 1.25 s on 8 and 0.75 s on 16 (areas
8, 10 and 12 rank-s), and 40 short ones of 0.25 s whole or 0.1875 s on 2 (areas 0.25 and
0.375). At ``H`` = 1.9 s the long ones take 8 ranks (2 groups, 16 ranks) and the short ones one
(``ceil(10 / 1.9)`` = 6 groups): 22 ranks. Moving the short ones to 2 ranks needs
``16 + 2 ceil(7.5 / 1.9)`` = 24, the long ones to 16 needs ``16 + 6`` = 22: no move needs
fewer, so 1.9 s does not fit. At 2 s the long ones take 4 ranks (2 groups, 8 ranks) and the
short ones 5 groups of one: 13 ranks. The 3 spare become groups of one (a group of 4 no longer
fits): the long ones run in 2 s, the short ones in 1.25 s on each of 8 ranks.

In ``wave`` sync every wave lasts as long as its slowest group, so the batch is first dealt into
the fewest micro-batches that hold it (as FlexSP does: :func:`hdp.planner.common.micro_batches`),
each laid out on all ranks in turn.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from hdp import Plan

from ..common import Context, PlanBuilder, fewest_micro_batches, micro_batches
from .budget import Budget
from .groups import finish, most_members, split_busy, stack


class MixedGroupPlans:
    """Makers of plans on groups of mixed power-of-two sizes (Note [Mixed group sizes]), one per
    height and way of using the waves, from the least height where a layout fits up to twice
    it, each with the budget's estimate of its work (:meth:`.budget.Budget.layout_s` of the
    shards its plans may hold); each makes one plan per way of dealing its layout (none where
    an earlier one gave the same). In ``wave`` sync the batch is dealt into the fewest
    micro-batches that hold it, each laid out on all ranks in one wave, and also laid out whole
    with each group's sequences stacked into as many waves as they need. The first maker
    prices every sequence on every size, so it is said to hold a shard for each sequence on
    each rank; the others, what the plans made so far held."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.ladders: list[tuple[list, list, list]] | None = None  # per way: parts, tables, least
        self.shards = ctx.seq_lens.size * ctx.num_ranks
        self.seen: set[bytes] = set()

    def __iter__(self) -> Iterator[tuple[Callable[[], list[Plan]], float]]:
        factor, gap = 1.0, 0.04
        while factor < 2:
            way = 0
            while self.ladders is None or way < len(self.ladders):
                cost_s = Budget.layout_s(self.ctx, self.shards)
                yield (lambda f=factor, w=way: self.plans_at(f, w)), cost_s
                way += 1
            factor, gap = factor + gap, 2 * gap

    def plans_at(self, factor: float, way: int) -> list[Plan]:
        """The plans of way ``way``'s layout at ``factor`` times its least height."""
        if self.ladders is None:
            self.ladders = _ladders(self.ctx)
        if way >= len(self.ladders):
            return []
        parts, tables, least = self.ladders[way]
        layouts = [_layout(table, h * factor) for table, h in zip(tables, least)]
        if None in layouts:
            return []
        key = b"".join(a.tobytes() for layout in layouts for a in layout) + bytes([way])
        if key in self.seen:
            return []
        self.seen.add(key)
        plans = []
        for any_size in (False, True):
            builder, wave = PlanBuilder(self.ctx, "hdp"), 0
            for part, table, layout in zip(parts, tables, layouts):
                wave += _stack_layout(self.ctx, builder, wave, part, table, layout, any_size)
            plan = finish(self.ctx, builder)
            if plan is not None:
                plans.append(plan)
        self.shards = max((plan.num_shards for plan in plans), default=self.shards)
        return plans


def _ladders(ctx: Context) -> list[tuple[list, list, list]]:
    """Per way of using the waves where layouts fit: its parts of the batch, their tables and
    the least height of each."""
    sizes = 1 << np.arange(int(math.log2(most_members(ctx))) + 1)
    time = _size_times(ctx, sizes)
    ids = np.flatnonzero(ctx.seq_lens > 0)
    if ids.size == 0 or not np.isfinite(time.min(axis=1)).all():
        return []
    ways = [[ids]]
    if ctx.sync == "wave":
        fewest = fewest_micro_batches(ctx)
        ways = [(micro_batches(ctx, ids, fewest) if fewest > 1 else None) or [ids], [ids]]
    # In one wave a group's sequences share each member's micro-batch, so what a micro-batch
    # takes however few its tokens (the dense layers' weights read, their fixed costs) is paid
    # once, not by each sequence: on a batch of short sequences it is most of each one's time.
    floor = float(ctx.cost.dense_time(np.ones(1))[0])
    ladders = []
    for way, parts in enumerate(ways):
        room = ctx.capacity if ctx.sync == "wave" and way == 0 else None
        added = time - floor if room else time
        tables = [_Table(added[p], sizes, ctx.seq_lens[p], ctx.num_ranks, room) for p in parts]
        least = [_least_height(table) for table in tables]
        if None not in least:
            ladders.append((parts, tables, least))
    return ladders


class _Layout(NamedTuple):
    """The size index of each sequence, and the groups of each size."""

    size_of: np.ndarray
    counts: np.ndarray


class _Table(NamedTuple):
    """What a layout is chosen from: each sequence's time (s, rows) on a group of each size
    (columns, inf where it cannot run), its tokens, the ranks, and the tokens a rank holds where
    the layout must run in one wave (``None``: any number of waves)."""

    time: np.ndarray
    sizes: np.ndarray
    lens: np.ndarray
    num_ranks: int
    room: int | None


def _least_height(table: _Table) -> float | None:
    """The least step time at which a layout fits the ranks, bisected to 0.5% (``None``: none
    fits at the work of every sequence one after another)."""
    time, sizes = table.time, table.sizes
    lo = max(float(time.min(axis=1).max()), (time * sizes).min(axis=1).sum() / table.num_ranks)
    hi, serial = lo, float(time.min(axis=1).sum())
    while _layout(table, hi) is None:
        if hi > serial:
            return None
        lo, hi = hi, hi * 2
    while hi > lo * 1.005:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _layout(table, mid) is not None else (mid, hi)
    return hi


def _layout(table: _Table, height: float) -> _Layout | None:
    """(size index of each sequence, groups of each size) at step time ``height``, or ``None``
    where no repair fits the ranks (Note [Mixed group sizes])."""
    time, sizes, n = table.time, table.sizes, table.num_ranks
    fits = time <= height
    if not fits.any(axis=1).all():
        return None
    size_of = np.argmin(np.where(fits, time * sizes, np.inf), axis=1)
    while True:
        counts = _counts(table, size_of, height)
        if int(counts @ sizes) <= n:
            break
        best = None
        for src in np.flatnonzero(counts).tolist():
            moving = size_of == src
            for dst in np.flatnonzero(fits[moving].all(axis=0)).tolist():
                if dst == src:
                    continue
                trial = np.where(moving, dst, size_of)
                need = int(_counts(table, trial, height) @ sizes)
                if best is None or need < best[0]:
                    best = (need, trial)
        if best is None or best[0] >= int(counts @ sizes):
            return None
        size_of = best[1]
    load = _load(table, size_of)
    spare = n - int(counts @ sizes)
    while True:  # spare ranks: another group of the most loaded size that fits
        per_group = np.where((counts > 0) & (sizes <= spare), load / np.maximum(counts, 1), -1.0)
        s = int(np.argmax(per_group))
        if per_group[s] < 0:
            return _Layout(size_of, counts)
        counts[s] += 1
        spare -= int(sizes[s])


def _counts(table: _Table, size_of: np.ndarray, height: float) -> np.ndarray:
    """Groups each size needs to run its sequences within ``height`` (at least one where used,
    and where the layout runs in one wave, enough to hold their tokens)."""
    sizes = table.sizes
    need = np.ceil(_load(table, size_of) / height - 1e-9)
    if table.room is not None:
        tokens = np.bincount(size_of, weights=table.lens, minlength=sizes.size)
        need = np.maximum(need, np.ceil(tokens / (sizes * table.room) - 1e-9))
    used = np.bincount(size_of, minlength=sizes.size) > 0
    return np.where(used, np.maximum(1, need), 0).astype(np.int64)


def _load(table: _Table, size_of: np.ndarray) -> np.ndarray:
    """Seconds of work each size's sequences bring, at their time on that size."""
    return np.bincount(size_of, weights=_chosen(table.time, size_of), minlength=table.sizes.size)


def _chosen(time: np.ndarray, size_of: np.ndarray) -> np.ndarray:
    """Each sequence's time on its chosen size."""
    return time[np.arange(size_of.size), size_of]


def _stack_layout(
    ctx: Context,
    builder: PlanBuilder,
    wave0: int,
    ids: np.ndarray,
    table: _Table,
    layout: _Layout,
    any_size: bool,
) -> int:
    """A layout of the sequences ``ids`` (the rows of ``table``) stacked into ``builder`` from
    wave ``wave0`` as :func:`_deal` deals it, largest groups first on the ranks (so every group
    is aligned to its size); returns the waves used."""
    order, group_sizes, group_of = _deal(table, layout, any_size)
    split = (group_sizes[group_of] > 1) & _splits(table.lens[order], group_sizes[group_of])
    return stack(ctx, builder, wave0, ids[order], group_sizes, group_of, split)


def _deal(table: _Table, layout: _Layout, any_size: bool) -> tuple[np.ndarray, ...]:
    """(the sequences' order, each group's size, each sequence's group in that order): the
    sequences go longest first, each to the group where it would finish first among those
    where it runs (where the layout runs in one wave: of those that still hold it, where any
    does; ties to the first group); a group of its own size, or with ``any_size`` of any, so
    that a group its own sequences leave short of the step takes shorter ones. A sequence too
    short to split (:func:`_splits`) counts whole against the group's time and every member's
    tokens, though it runs on one member: a layout may then leave a group less full than it
    could be. A sequence's time is the same on every group of a size, so each size keeps its
    groups in a heap by load, and a sequence looks at one group per size."""
    size_of, counts = layout
    order = np.argsort(-_chosen(table.time, size_of), kind="stable")
    size_idx = np.repeat(np.arange(table.sizes.size), counts)[::-1]  # of each group
    group_sizes = table.sizes[size_idx]
    sizes, room = table.sizes.tolist(), table.room
    heaps: list[list[tuple[float, int]]] = [[] for _ in sizes]
    for g, s in enumerate(size_idx.tolist()):  # groups in order: each list is a heap
        heaps[s].append((0.0, g))
    used = [s for s, heap in enumerate(heaps) if heap]
    load = [0.0] * group_sizes.size
    held = [0] * group_sizes.size  # tokens on each member
    group_of = np.empty(size_of.size, dtype=np.int64)
    times, lens, own = table.time[order].tolist(), table.lens[order].tolist(), size_of[order]
    for k, (row, tokens) in enumerate(zip(times, lens)):
        first = roomy = None  # (finish, group, size, share): the least, the least with room
        for s in used if any_size else (int(own[k]),):
            if row[s] == math.inf:
                continue
            share = -(-tokens // sizes[s]) if tokens >= sizes[s] else tokens
            top, fits = _least_loaded(heaps[s], load, held, share, room)
            if top is not None and (first is None or (load[top] + row[s], top) < first[:2]):
                first = (load[top] + row[s], top, s, share)
            if fits is not None and (roomy is None or (load[fits] + row[s], fits) < roomy[:2]):
                roomy = (load[fits] + row[s], fits, s, share)
        done, g, s, share = roomy or first
        load[g] = done
        held[g] += share
        heapq.heappush(heaps[s], (done, g))  # its old entry is now stale
        group_of[k] = g
    return order, group_sizes, group_of


def _least_loaded(
    heap: list[tuple[float, int]], load: list[float], held: list[int], share: int, room
) -> tuple[int | None, int | None]:
    """(the least loaded group of ``heap``, the least loaded that holds ``share`` more tokens
    within ``room``, ``None`` where ``room`` is): stale entries, whose group's load has grown
    since, are dropped on the way."""
    full = []
    top = fits = None
    while heap:
        entry = heap[0]
        if entry[0] != load[entry[1]]:
            heapq.heappop(heap)
            continue
        if top is None:
            top = entry[1]
            if room is None:
                break
        if held[entry[1]] + share <= room:
            fits = entry[1]
            break
        full.append(heapq.heappop(heap))
    for entry in full:
        heapq.heappush(heap, entry)
    return top, fits


def _size_times(ctx: Context, sizes: np.ndarray) -> np.ndarray:
    """Time (s) each sequence (rows) adds to a group of each size (columns), in exact shares; a
    sequence with fewer tokens than the group has members runs whole on one of them (a group
    then still takes the short sequences a layout gives it). inf where it cannot run."""
    lens = ctx.seq_lens
    whole = np.where(lens <= ctx.offload_capacity, ctx.whole_s, np.inf)
    time = np.repeat(whole[:, None], sizes.size, axis=1)
    for s, g in enumerate(sizes.tolist()[1:], start=1):
        ok = _splits(lens, g)
        time[ok, s] = split_busy(ctx, lens[ok], np.full(int(ok.sum()), g), 1)
    return time


def _splits(tokens, group_size):
    """Whether a sequence of ``tokens`` splits over a group of ``group_size`` ranks (else it
    runs whole on one member); numpy arrays broadcast."""
    return tokens >= group_size
