"""The local search of :mod:`.search`: whole sequences move off the cells that set the step.

A placed plan's step is set by a few cells: in ``wave`` sync each wave's slowest cell, in
``peer`` sync the last cells of the rank that finishes last. The placers price a whole sequence
at its share of a full cell (:attr:`hdp.planner.common.Context.packed_s`); a cell that ends up
holding few tokens pays the dense layers' fixed cost all the same. Here the cells are priced as
the cost model prices them (:meth:`hdp.CostModel.cell_compute`): a move takes a whole sequence
off a cell that sets the step and puts it in the cell, with token room, where it raises the step
least, while that lowers the step. The cost model then prices the moved plan, which is kept only
where it is faster.

In ``peer`` sync only a rank's *tail* moves (the cells after its last multi-rank job): nothing
waits for them, so a rank's finish is its last job's end plus its tail's busy time, and a move
changes two ranks' finish times and nothing else.
"""

from __future__ import annotations

import numpy as np

from hdp import Plan, StepReport

from ..common import Context, PlanBuilder
from .budget import Budget


class Cells:
    """A plan's cells as the moves change them: tokens, compute and busy time (s) per ``[wave,
    rank]``, and where each movable sequence (whole, in one cell) lies."""

    def __init__(self, ctx: Context, plan: Plan, report: StepReport) -> None:
        self.ctx, self.plan = ctx, plan
        cost, lens = ctx.cost, ctx.seq_lens
        self.tokens = plan.tokens_per_cell().astype(np.int64)
        self.compute = report.compute_s.copy()
        self.busy = report.busy_s.copy()
        self.start = report.start_s.copy()
        self.attn = cost.model.layers * cost.attn_time(np.zeros(lens.size), lens)
        shards = np.bincount(plan.seq, minlength=lens.size)
        whole = (plan.start == 0) & (plan.end == lens[plan.seq]) & (shards[plan.seq] == 1)
        self.row = np.full(lens.size, -1, dtype=np.int64)  # each movable sequence's shard
        self.row[plan.seq[whole]] = np.flatnonzero(whole)
        self.wave = plan.wave.copy()
        self.rank = plan.rank.copy()
        self.rows_in: dict[tuple[int, int], list[int]] = {}  # movable shards per cell
        for k, w, r in zip(*(np.flatnonzero(whole), plan.wave[whole], plan.rank[whole])):
            self.rows_in.setdefault((int(w), int(r)), []).append(int(k))
        self.moved = 0

    def held(self, w: int, r: int) -> np.ndarray:
        """The movable sequences in cell ``(w, r)``, in the plan's order of shards."""
        return self.plan.seq[np.sort(np.asarray(self.rows_in.get((w, r), []), dtype=np.int64))]

    def compute_with(self, tokens: np.ndarray, compute: np.ndarray, seq, sign: int):
        """Compute (s) of cells of ``tokens`` and ``compute`` once sequence ``seq`` joins
        (``sign`` 1) or leaves (-1) each; an emptied cell costs nothing. ``seq`` may be an
        array that broadcasts against the cells."""
        cost, L = self.ctx.cost, self.ctx.seq_lens[seq]
        after = tokens + sign * L
        dense = np.where(after > 0, cost.dense_time(np.maximum(after, 1)), 0.0)
        dense_before = np.where(tokens > 0, cost.dense_time(np.maximum(tokens, 1)), 0.0)
        out = compute + dense - dense_before + sign * self.attn[seq]
        return np.where(after > 0, out, 0.0)

    def offload_s(self, tokens: np.ndarray, compute: np.ndarray) -> np.ndarray:
        """The host copy compute does not hide in cells of ``tokens`` over the capacity (inf
        where even offload leaves no room)."""
        ctx, cost = self.ctx, self.ctx.cost
        over = tokens > ctx.capacity
        fits = tokens <= ctx.offload_capacity
        need = np.where(over & fits, cost.offload_needed(np.where(fits, tokens, 0), ctx.sync), 0.0)
        exposed = np.maximum(0.0, cost.offload_time(tokens, need) - compute)
        return np.where(fits, exposed, np.inf)

    def busy_with(self, tokens, compute, busy, seq, sign: int) -> np.ndarray:
        """Busy time (s) of cells (``tokens``, ``compute``, ``busy``) once sequence ``seq``
        joins (``sign`` 1) or leaves (-1) each, its compute and exposed host copy changed
        (``seq`` as in :meth:`compute_with`)."""
        return self._busy(tokens, compute, busy, self.compute_with(tokens, compute, seq, sign),
                          sign * self.ctx.seq_lens[seq])  # fmt: skip

    def _busy(self, tokens, compute, busy, after, L) -> np.ndarray:
        """:meth:`busy_with` of cells whose compute becomes ``after`` as ``L`` tokens join."""
        copy = self.offload_s(tokens + L, after) - self.offload_s(tokens, compute)
        return np.where(tokens + L > 0, busy + after - compute + copy, 0.0)

    def move(self, seq: int, w: int, r: int) -> None:
        """Move sequence ``seq`` to cell ``(w, r)``, a new wave where ``w`` is past the last."""
        k = int(self.row[seq])
        w0, r0 = int(self.wave[k]), int(self.rank[k])
        if w >= self.busy.shape[0]:
            pad = ((0, w + 1 - self.busy.shape[0]), (0, 0))
            self.tokens, self.compute = np.pad(self.tokens, pad), np.pad(self.compute, pad)
            self.busy, self.start = np.pad(self.busy, pad), np.pad(self.start, pad)
        for (cw, cr), sign in (((w0, r0), -1), ((w, r), 1)):
            tokens, compute = self.tokens[cw, cr], self.compute[cw, cr]
            after = self.compute_with(tokens, compute, seq, sign)
            L = sign * int(self.ctx.seq_lens[seq])
            self.busy[cw, cr] = self._busy(tokens, compute, self.busy[cw, cr], after, L)
            self.compute[cw, cr] = after
            self.tokens[cw, cr] += L
        self.rows_in[w0, r0].remove(k)
        self.rows_in.setdefault((w, r), []).append(k)
        self.wave[k], self.rank[k] = w, r
        self.moved += 1

    def plan_after(self) -> Plan:
        """The plan with the moves made."""
        return rebuilt(self.ctx, self.plan, self.wave, self.rank)


def rebuilt(ctx: Context, plan: Plan, wave: np.ndarray, rank: np.ndarray) -> Plan:
    """``plan`` with its shards in ``wave`` and on ``rank`` (waves that emptied dropped, its
    barriers kept between the same work; one with no work left on a side of it is dropped),
    offload where needed."""
    used = np.unique(wave)
    builder = PlanBuilder(ctx, plan.strategy)
    builder.add(np.searchsorted(used, wave), rank, plan.seq, plan.start, plan.end)
    kept = {int(np.searchsorted(used, b)) for b in plan.barriers}
    builder.barriers = sorted(b for b in kept if 0 < b < used.size)
    builder.offload_where_needed()
    builder.info = dict(plan.predicted)
    return builder.build()


class Work:
    """What the moves looked at, for the budget (:meth:`.budget.Budget.move_s`): the shards of
    the plan they start from (its cells are built and the moved plan priced once), searches for
    a move, sequences tried in them, and the cells priced for those sequences."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.searches = self.tried = self.cells = 0

    def add(self, tried: int, cells: int) -> None:
        self.searches += 1
        self.tried += tried
        self.cells += cells


def improve(
    ctx: Context, plan: Plan, report: StepReport, seconds: float
) -> tuple[tuple[Plan, StepReport] | None, Work]:
    """``plan`` after the moves (module docstring) that ``seconds`` of the budget's estimates
    afford and its report, or ``None`` where none lowers the step the cost model predicts;
    and the work done."""
    cells, work = Cells(ctx, plan, report), Work(plan.num_shards)
    (_wave_moves if ctx.sync == "wave" else _peer_moves)(cells, work, seconds)
    if cells.moved == 0:
        return None, work
    moved = cells.plan_after()
    priced = ctx.cost.evaluate(moved)
    return ((moved, priced) if priced.step_time_s < report.step_time_s else None), work


def _wave_moves(cells: Cells, work: Work, seconds: float, targets: int = 16) -> None:
    """``wave`` sync: a sequence leaves a wave's slowest cell for the cell where it ends
    soonest (offloading there where it must) without raising that cell's wave, while both
    cells then end before the slowest one did; each wave in turn, until none of its slowest
    cell's sequences can move or ``work`` has cost ``seconds``. Targets are each wave's
    ``targets`` least busy cells."""
    waves, n = cells.busy.shape
    k = min(targets, n)
    for w in range(waves):
        while Budget.move_s(cells.ctx, work) < seconds:
            r = int(np.argmax(cells.busy[w]))
            top = float(cells.busy[w, r])
            heights = cells.busy.max(axis=1)
            heights[w] = top * (1 - 1e-9)  # in its own wave a target must end before ``top``
            ranks = np.argpartition(cells.busy, k - 1, axis=1)[:, :k]
            rows = np.repeat(np.arange(cells.busy.shape[0]), k)
            cols = ranks.reshape(-1)
            tokens, compute, busy = (
                a[rows, cols] for a in (cells.tokens, cells.compute, cells.busy)
            )
            # Every sequence of the slowest cell against every target at once: (seq, target).
            held = cells.held(w, r)
            work.add(held.size, held.size * rows.size + cells.busy.size)
            left = cells.busy_with(cells.tokens[w, r], cells.compute[w, r], top, held, -1)
            after = cells.busy_with(tokens, compute, busy, held[:, None], 1)
            after[:, (rows == w) & (cols == r)] = np.inf
            after[after > heights[rows]] = np.inf
            t = np.argmin(after, axis=1)
            best_after = after[np.arange(held.size), t]
            end = np.maximum(left, np.where(rows[t] == w, best_after, 0.0))
            end[~np.isfinite(best_after) | (end >= top * (1 - 1e-9))] = np.inf
            if not np.isfinite(end).any():
                break
            i = int(np.argmin(end))  # (the first of ties, as held lists them)
            cells.move(int(held[i]), int(rows[t[i]]), int(cols[t[i]]))


def _peer_moves(cells: Cells, work: Work, seconds: float) -> None:
    """``peer`` sync: a sequence leaves the tail of the rank that finishes last for the tail of
    the rank where it ends earliest, joining a tail cell with room or opening one, while that
    finishes before the old last rank did and ``work`` has cost less than ``seconds``."""
    ctx, cap = cells.ctx, cells.ctx.capacity
    plan = cells.plan
    shards = np.bincount(plan.seq, minlength=ctx.seq_lens.size)
    in_job = shards[plan.seq] > 1
    last_job = np.full(plan.num_ranks, -1, dtype=np.int64)
    np.maximum.at(last_job, plan.rank[in_job], plan.wave[in_job])
    tried: set[int] = set()  # ranks whose tail has no move that helps
    while Budget.move_s(ctx, work) < seconds:
        finish = (cells.start + cells.busy).max(axis=0)
        finish = np.where((cells.busy > 0).any(axis=0), finish, 0.0)
        r = int(np.argmax(finish))
        if r in tried:
            break
        tail = cells.busy.shape[0]
        best = None  # (new finish of the pair, sequence, wave, rank)
        seqs = [cells.held(w, r) for w in range(int(last_job[r]) + 1, tail)]
        tried_now = sum(x.size for x in seqs)
        work.add(tried_now, tried_now * cells.busy.size)
        for w, held in zip(range(int(last_job[r]) + 1, tail), seqs):
            for seq in held.tolist():
                best = _best_target(cells, seq, w, r, finish, last_job, cap, best)
        if best is None or best[0] >= finish[r] * (1 - 1e-9):
            tried.add(r)
            continue
        _, seq, tw, tr = best
        cells.move(seq, tw, tr)
        _restart_tail(cells, r, int(last_job[r]))
        _restart_tail(cells, tr, int(last_job[tr]))
        tried.clear()


def _best_target(cells, seq, w, r, finish, last_job, cap, best):
    """The better of ``best`` and moving ``seq`` from cell ``(w, r)`` to the tail cell (or a
    new one) where it finishes earliest; entries are (the pair's later finish, seq, wave, rank)."""
    L = int(cells.ctx.seq_lens[seq])
    left = float(cells.compute_with(cells.tokens[w, r], cells.compute[w, r], seq, -1))
    r_finish = finish[r] - (cells.compute[w, r] - left)
    waves = cells.busy.shape[0]
    in_tail = np.arange(waves)[:, None] > last_job[None, :]
    added = cells.compute_with(cells.tokens, cells.compute, seq, 1) - cells.compute
    joins = in_tail & (cells.tokens > 0) & (cells.tokens + L <= cap)
    joins[:, r] = False
    join_cost = np.where(joins, added, np.inf).min(axis=0)
    alone = float(cells.compute_with(np.zeros(1, np.int64), np.zeros(1), seq, 1)[0])
    cost = np.minimum(join_cost, alone)
    cost[r] = np.inf
    tr = int(np.argmin(finish + cost))
    pair = max(r_finish, float(finish[tr] + cost[tr]))
    if best is not None and pair >= best[0]:
        return best
    if join_cost[tr] <= alone:
        tw = int(np.argmin(np.where(joins[:, tr], added[:, tr], np.inf)))
    else:
        tw = waves  # a new cell after everything
    return (pair, seq, tw, tr)


def _restart_tail(cells: Cells, r: int, last_job: int) -> None:
    """Start times of rank ``r``'s tail cells after its busy times changed: each starts where
    the one before it on the rank ends."""
    end = float(cells.start[last_job, r] + cells.busy[last_job, r]) if last_job >= 0 else 0.0
    for w in range(last_job + 1, cells.busy.shape[0]):
        if cells.busy[w, r] > 0:
            cells.start[w, r] = end
            end += float(cells.busy[w, r])
