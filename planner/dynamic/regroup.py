"""The local search's *regroup* (Note [One search] in :mod:`.search`, ``peer`` sync): sequences
and ranks move between rank groups.

Any plan lays its ranks out as groups: ranks that share a multi-rank job form one group, every
other rank a group of its own (:meth:`Layout.of`). A layout says each group's size, each
sequence's group and whether it splits over the whole group or runs whole on one member;
:func:`.groups.stack` builds it again (groups on consecutive ranks, exact shares). The moves:

- a sequence of the group that ends the step moves to another group, split or whole there, or
  changes from one to the other in its own group;
- it swaps groups with a shorter sequence of another group;
- a group halves (its sequences dealt to the halves, longest first to the one where they would
  end first), or joins the group after it. The moves above then run on the new layout, and it is
  kept where they end faster than the layout it came from: a group that halves must first
  shed work before it pays.

Each trial is built and priced by the cost model in full, the first that lowers the step is
kept, and the search stops where no trial does or the budget is spent. Moves are tried in the
order of where they would end the group they add to, and not at all where that is no sooner
than the step, since a rank's finish is what a ``peer``-sync step waits for. The placers and the
whole-sequence moves of :mod:`.local` keep each job on the ranks they gave it; these moves
reach the plans FlexSP's MILP finds on small batches (two long sequences sharing a group one
after the other, the short ones whole on the other ranks), which no change of degree does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hdp import Plan, StepReport

from ..common import Context, PlanBuilder
from .budget import Budget
from .groups import SplitPrices, finish, most_members, stack


@dataclass(frozen=True)
class Layout:
    """Groups of ``sizes`` ranks, on consecutive ranks in this order; each sequence's group,
    and whether it splits over all of it (else it runs whole on one member)."""

    sizes: np.ndarray
    group_of: np.ndarray
    split: np.ndarray

    @classmethod
    def of(cls, plan: Plan) -> Layout:
        """The groups of ``plan``: ranks joined by a multi-rank job, in the order of their first
        rank."""
        n, lens = plan.num_ranks, plan.seq_lens
        parent = np.arange(n)

        def root(r: int) -> int:
            while parent[r] != r:
                parent[r] = parent[parent[r]]
                r = int(parent[r])
            return r

        shards = np.bincount(plan.seq, minlength=lens.size)
        multi = shards[plan.seq] > 1
        order = np.argsort(plan.seq[multi], kind="stable")
        seqs, ranks = plan.seq[multi][order], plan.rank[multi][order]
        first = np.searchsorted(seqs, seqs)  # each shard's job's first shard
        for r, r0 in zip(ranks.tolist(), ranks[first].tolist()):
            a, b = root(r), root(r0)
            if a != b:
                parent[max(a, b)] = min(a, b)
        roots = np.array([root(r) for r in range(n)])
        _, group_of_rank, sizes = np.unique(roots, return_inverse=True, return_counts=True)
        group_of = np.zeros(lens.size, dtype=np.int64)
        group_of[plan.seq] = group_of_rank[plan.rank]
        return cls(sizes, group_of, shards > 1)

    def plan(self, ctx: Context, busy: np.ndarray) -> Plan | None:
        """This layout stacked into waves (:func:`.groups.stack`), the sequences in the order
        of their ``busy`` time, longest first; ``None`` where a rank would hold more than it
        can even with offload."""
        order = np.argsort(-busy, kind="stable")
        builder = PlanBuilder(ctx, "hdp")
        stack(ctx, builder, 0, order, self.sizes, self.group_of[order], self.split[order])
        return finish(ctx, builder)

    @property
    def key(self) -> bytes:
        return b"".join(x.tobytes() for x in (self.sizes, self.group_of, self.split))

    def with_seqs(self, ctx: Context, seqs: list[int], groups: list[int], split: list[bool]):
        """Sequences ``seqs`` in ``groups``, split there as ``split`` says where they can."""
        group_of, out = self.group_of.copy(), self.split.copy()
        group_of[seqs] = groups
        out[seqs] = split
        return Layout(self.sizes, group_of, _can_split(ctx, self.sizes, group_of, out))

    def joined(self, ctx: Context, g: int) -> Layout:
        """Group ``g`` and the next one as one group, each sequence split as it was."""
        sizes = np.concatenate([self.sizes[:g], [self.sizes[g : g + 2].sum()], self.sizes[g + 2 :]])
        group_of = np.where(self.group_of > g, self.group_of - 1, self.group_of)
        return Layout(sizes, group_of, _can_split(ctx, sizes, group_of, self.split))


def _can_split(ctx: Context, sizes: np.ndarray, group_of: np.ndarray, split: np.ndarray):
    """``split`` for each sequence where its group lets it (:func:`_splits`)."""
    return _splits(ctx, ctx.seq_lens, sizes[group_of], split)


def _splits(ctx: Context, lens, size, split) -> np.ndarray:
    """Whether sequences of ``lens`` tokens split over groups of ``size`` ranks, asked to
    (``split``) or not: where a group has a member a token and no more members than a job may
    have (:func:`.groups.most_members`); and must, where one is too long for one rank."""
    fits = (size > 1) & (size <= most_members(ctx)) & (lens >= size)
    return np.asarray((split | (lens > ctx.offload_capacity)) & fits, dtype=bool)


class _Times:
    """Each sequence's busy time (s) whole, or split over a group of a size in exact shares."""

    def __init__(self, ctx: Context) -> None:
        self.ctx, self.prices = ctx, SplitPrices(ctx, exact=True)

    def of(self, layout: Layout, seqs: np.ndarray) -> np.ndarray:
        """The busy time of each of ``seqs`` in ``layout``."""
        out = self.ctx.whole_s[seqs]
        split = layout.split[seqs]
        size = layout.sizes[layout.group_of[seqs]]
        out[split] = self.prices.of(self.ctx.seq_lens[seqs][split], size[split])
        return out

    def on(self, k: int, size: int, split: bool) -> float:
        """Sequence ``k``'s busy time on a group of ``size`` ranks, split over it or whole."""
        if not split:
            return float(self.ctx.whole_s[k])
        return float(self.prices.of(self.ctx.seq_lens[[k]], np.array([size]))[0])


def regroup(
    ctx: Context, plan: Plan, report: StepReport, seconds: float
) -> tuple[tuple[Plan, StepReport] | None, float]:
    """``plan`` after the moves of the module docstring that ``seconds`` of
    :meth:`.budget.Budget.regroup_trial_s` estimates afford, and its report (``None`` where none is
    faster than ``plan``); and the seconds charged."""
    search = _Regroup(ctx, Budget.regroup_trial_s(plan), seconds)
    start = search.price(Layout.of(plan))
    best = None if start is None or start.plan is None else search.descent(start)
    while best is not None:
        found = search.regrouped_faster(best)
        if found is None:
            break
        best = found
    if best is None or best.step_s >= report.step_time_s * (1 - 1e-9):
        return None, search.spent_s
    return (best.plan, best.report), search.spent_s


class _Tried(NamedTuple):
    """A layout built and priced (``plan`` ``None`` and ``step_s`` inf: it does not fit), and
    each sequence's busy time in it."""

    step_s: float
    layout: Layout
    plan: Plan | None
    report: StepReport | None
    busy: np.ndarray


class _Regroup:
    """The moves of one call of :func:`regroup`: layouts built and priced, each charged
    ``per_trial_s`` of ``seconds`` the first time (the moves of one layout often lead back to
    one tried from another)."""

    def __init__(self, ctx: Context, per_trial_s: float, seconds: float) -> None:
        self.ctx, self.per_trial_s, self.seconds = ctx, per_trial_s, seconds
        self.spent_s = 0.0
        self.times = _Times(ctx)
        self.tried: dict[bytes, _Tried] = {}

    def price(self, layout: Layout) -> _Tried | None:
        """``layout`` built and priced; ``None`` where the budget affords no more trials."""
        key = layout.key
        if key in self.tried:
            return self.tried[key]
        if self.spent_s + self.per_trial_s > self.seconds:
            return None
        self.spent_s += self.per_trial_s
        ctx = self.ctx
        busy = self.times.of(layout, np.arange(ctx.seq_lens.size))
        plan = layout.plan(ctx, busy)
        report = None if plan is None else ctx.cost.evaluate(plan)
        step_s = np.inf if report is None else report.step_time_s
        self.tried[key] = _Tried(step_s, layout, plan, report, busy)
        return self.tried[key]

    def descent(self, best: _Tried) -> _Tried:
        """``best`` after moves and swaps while one lowers the step (or the budget lasts)."""
        while True:
            for layout in self.moves(best):
                tried = self.price(layout)
                if tried is None:
                    return best
                if tried.step_s < best.step_s * (1 - 1e-9):
                    best = tried
                    break
            else:
                return best

    def regrouped_faster(self, best: _Tried) -> _Tried | None:
        """The first layout with a group halved, or two joined, that ends faster than ``best``
        after :meth:`descent` (``None``: none, or the budget is spent)."""
        layout = best.layout
        halved = (self.halved(layout, g) for g in np.flatnonzero(layout.sizes > 1).tolist())
        joined = (layout.joined(self.ctx, g) for g in range(layout.sizes.size - 1))
        for other in itertools.chain(halved, joined):
            tried = self.price(other)
            if tried is None:
                return None
            if tried.plan is not None:
                tried = self.descent(tried)
                if tried.step_s < best.step_s * (1 - 1e-9):
                    return tried
        return None

    def halved(self, layout: Layout, g: int) -> Layout:
        """Group ``g`` of ``layout`` cut into two of half its size; its sequences dealt
        longest first to the half where they would end first, each split where it was and
        its half can (one too long for a rank must)."""
        ctx, times = self.ctx, self.times
        size = int(layout.sizes[g])
        halves = (size // 2, size - size // 2)
        sizes = np.concatenate([layout.sizes[:g], halves, layout.sizes[g + 1 :]])
        group_of = np.where(layout.group_of > g, layout.group_of + 1, layout.group_of)
        split = layout.split.copy()
        work = [0.0, 0.0]
        mine = np.flatnonzero((layout.group_of == g) & (ctx.seq_lens > 0))
        for members in (m for m in halves if m > 1):  # (priced together, not one by one)
            lens = ctx.seq_lens[mine][ctx.seq_lens[mine] >= members]
            times.prices.of(lens, np.full(lens.size, members))
        for k in mine[np.argsort(-ctx.whole_s[mine], kind="stable")].tolist():
            ends = []
            for h, members in enumerate(halves):
                on = bool(_splits(ctx, ctx.seq_lens[k], members, layout.split[k]))
                fits = on or ctx.seq_lens[k] <= ctx.offload_capacity
                t = times.on(k, members, on) / (1 if on else members)
                ends.append((work[h] + t if fits else np.inf, h, on, t))
            end, h, split[k], t = min(ends)
            group_of[k] = g + h
            work[h] += t
        return Layout(sizes, group_of, split)

    def moves(self, tried: _Tried) -> Iterator[Layout]:
        """The moves and swaps of ``tried``'s layout (module docstring): of the group that ends
        the step, its longest sequences first, each one's in the order of where they would end
        the group they add to: its end (its least busy member's, where the sequence runs whole)
        plus the sequence's time there. Those that would end no sooner than the step are not
        tried."""
        ctx, times, layout, now = self.ctx, self.times, tried.layout, tried.busy
        sizes = layout.sizes
        ends, first = tried.report.finish_s, np.cumsum(sizes) - sizes
        most, least = np.maximum.reduceat(ends, first), np.minimum.reduceat(ends, first)
        c = int(np.argmax(most))
        step = float(most[c]) * (1 - 1e-9)
        by_time = np.argsort(-ctx.whole_s, kind="stable")
        by_time = by_time[ctx.seq_lens[by_time] > 0]
        mine = by_time[layout.group_of[by_time] == c]
        others = by_time[layout.group_of[by_time] != c]
        groups = np.arange(sizes.size)
        for k in mine.tolist():
            base = most.copy()
            base[c] -= now[k]
            # Moves: each group split over (where it can) or whole (where it fits a rank);
            # swaps: each shorter sequence of another group, this one split where it can.
            can = _splits(ctx, ctx.seq_lens[k], sizes, True)
            fits = ctx.seq_lens[k] <= ctx.offload_capacity
            t_split = np.full(sizes.size, np.inf)
            for size in np.unique(sizes[can]).tolist():
                t_split[sizes == size] = times.on(k, size, True)
            split_ok = can & ((groups != c) | ~layout.split[k])
            whole_ok = fits & ((groups != c) | layout.split[k])
            k2 = others[ctx.whole_s[others] < ctx.whole_s[k]]
            g2 = layout.group_of[k2]
            t_swap = np.where(can[g2] | ~fits, t_split[g2], ctx.whole_s[k])
            ends = np.concatenate(
                [
                    np.where(split_ok, base + t_split, np.inf),
                    np.where(whole_ok, np.maximum(base, least + ctx.whole_s[k]), np.inf),
                    most[g2] - now[k2] + t_swap,
                ]
            )
            for j in np.flatnonzero(ends < step)[np.argsort(ends[ends < step], kind="stable")]:
                if j < 2 * sizes.size:
                    g, split = int(j % sizes.size), bool(j < sizes.size)
                    yield layout.with_seqs(ctx, [k], [g], [split])
                else:
                    k_2 = int(k2[j - 2 * sizes.size])
                    other = int(layout.group_of[k_2])
                    yield layout.with_seqs(ctx, [k, k_2], [other, c], [True, True])
