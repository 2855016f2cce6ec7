"""``wave`` sync placement: a step lasts the sum of its waves' slowest cells.

One list scheduler: every job, multi-rank or whole, tallest first, goes where it raises that sum
least (:func:`place_wave`). Jobs and whole sequences share the list because a whole sequence
taller than a job must find a rank the job has not taken yet: placing every job first spreads
their shares over all ranks, and a tall whole sequence then lands on one of them. A cell's
shards run together, layer by layer, so a wave lasts as long as its largest cell sum, as the
cost model prices it; members of a job do not wait for the busiest one to start.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hdp import CostModel

from ..common import Context
from .candidates import Assignment, Candidate, jobs_and_singles, pick_members


def jobs_first_changes(ctx: Context, cand: Candidate) -> bool:
    """Whether placing every multi-rank job first changes :func:`place_wave`'s list: only
    where some whole sequence is taller than some job."""
    multi, single = jobs_and_singles(ctx, cand.degree, cand.job_time)
    tallest = ctx.packed_s[single].max(initial=-math.inf)
    return bool(tallest > cand.job_time[multi].min(initial=math.inf))


@dataclass
class Placed:
    """What a ``wave`` placement has placed so far: per multi-rank job (in placement order) its
    members and wave; per cell ``[waves, ranks]`` the tokens held and the load (s)."""

    members: list[np.ndarray]
    wave: list[int]
    tokens: np.ndarray
    load: np.ndarray

    def add_wave(self) -> None:
        self.tokens = np.vstack([self.tokens, np.zeros((1, self.tokens.shape[1]), dtype=np.int64)])
        self.load = np.vstack([self.load, np.zeros((1, self.load.shape[1]))])


@dataclass(frozen=True)
class CellChoice:
    """Where a whole sequence goes: the raise of its wave's height (s), the cell's load after
    it (s), the wave and the rank."""

    raise_s: float
    new_load: float
    wave: int
    rank: int


def place_wave(
    ctx: Context, num_waves: int, multi: np.ndarray, single: np.ndarray, cand: Candidate
) -> tuple[Assignment, int]:
    """Multi-rank jobs (``multi``, at their time) and whole sequences (``single``, at their
    packed time) in one list, tallest first, multi-rank jobs first on ties (with
    ``cand.jobs_first``, all of them first): each job where it raises its wave's height least
    (:meth:`_Cells.add_job`), each sequence in the cell that does (:meth:`_Cells.choose`). Keys
    are waves. Also how many sequences searched the cells for one that offloads
    (:func:`offloaded_cell`, most of a placement's time where it runs), which the budget charges
    as counted."""
    lens, n = ctx.seq_lens, ctx.num_ranks
    placed = Placed([], [], np.zeros((num_waves, n), dtype=np.int64), np.zeros((num_waves, n)))
    cells = _Cells(ctx, placed)
    most = ctx.splits(lens[multi], cand.degree[multi])[1].tolist()
    single_rank = np.full(lens.size, -1, dtype=np.int64)
    single_key = np.full(lens.size, -1, dtype=np.int64)
    times = np.concatenate([cand.job_time[multi], ctx.packed_s[single]])
    # (Each of ``multi`` and ``single`` is tallest first already: the list keeps their orders.)
    order = np.arange(times.size)
    if not cand.jobs_first:
        order = np.lexsort((order, -times))
    for k in order.tolist():
        if k < multi.size:
            i = int(multi[k])
            cells.add_job(int(cand.degree[i]), float(cand.job_time[i]), most[k], cand.stack_share)
            continue
        i = int(single[k - multi.size])
        L, t = int(lens[i]), float(ctx.packed_s[i])
        choice = cells.choose(L, t) or cells.new_wave(L, t)
        single_rank[i], single_key[i] = cells.put(choice, L, t), choice.wave
    assignment = Assignment(placed.members, placed.wave, single_rank, single_key)
    return assignment, cells.offload_searches


def _best_wave(
    load: np.ndarray, room: np.ndarray, d: int, rpn: int, t: float, stack_share: float | None
) -> tuple[tuple[float, float], int, np.ndarray] | None:
    """((raise s, height s), wave, members): the wave (row of ``load``) where a job of ``d``
    ranks and ``t`` s raises the height least (then the lowest height, then the lowest wave), on
    :func:`pick_members`' ranks among those with ``room``; ``None`` where none takes it. The
    ``d``-th least load with room bounds a wave's raise from below, so waves go in the order of
    that bound and the search stops where the bound cannot win."""
    heights = load.max(axis=1, initial=0.0)
    least = np.zeros((heights.size, 2))  # per wave: (raise, height) at least
    kth = np.partition(np.where(room, load, np.inf), d - 1, axis=1)[:, d - 1]
    least[:, 0], least[:, 1] = np.maximum(0.0, kth + t - heights), heights
    hopeless = ~np.isfinite(kth)
    if stack_share is not None:  # (its raise is at least the bound)
        hopeless |= (heights > 0) & (least[:, 0] > stack_share * t)
    ranked = np.lexsort((np.arange(heights.size), heights, least[:, 0]))
    order = ranked[~hopeless[ranked]].tolist()
    best = None
    for w in order:
        if best is not None and (*least[w].tolist(), w) >= (*best[0], best[1]):
            break
        members = pick_members(load[w], d, rpn, room[w])
        if members is None:
            continue
        height = float(heights[w])
        finish = float(load[w, members].max()) + t
        if stack_share is not None and height > 0 and finish - height > stack_share * t:
            continue
        score = (max(0.0, finish - height), height)
        if best is None or (score, w) < (best[0], best[1]):
            best = (score, w, members)
    return best


class _Cells:
    """The cells of a :class:`Placed` as jobs fill them: each wave's height, its most free
    tokens, and two heaps of its cells: by load those that had room for the last sequence asked
    about, by free tokens (most first) those that had not. Entries go stale as cells fill; a
    stale one is dropped or moved where it is found."""

    def __init__(self, ctx: Context, placed: Placed) -> None:
        self.ctx, self.placed, self.cap = ctx, placed, ctx.capacity
        load, tokens = placed.load, placed.tokens
        self.heights = [float(h) for h in load.max(axis=1)]
        self.heaps = [
            [(float(load[w, r]), r) for r in range(ctx.num_ranks)] for w in range(len(load))
        ]
        for h in self.heaps:
            heapq.heapify(h)
        self.full: list[list[tuple[int, int]]] = [[] for _ in range(len(load))]
        self.room_max = [int(self.cap - tokens[w].min()) for w in range(len(tokens))]
        self.new_wave_s = 2 * ctx.cost.allgather_time() + ctx.cost.reduce_scatter_time()
        # A sequence joining a cell adds its attention (its packed time less its dense work at
        # a full cell's speed) and what the cell's dense work grows by, fixed costs and all.
        self.per_token = float(ctx.cost.dense_s_per_token(max(ctx.capacity, 1)))
        self.dense = _dense_by_tokens(ctx.cost, ctx.capacity)
        self.offload_searches = 0
        self.host = _host_copy(ctx.cost, ctx.sync)

    def least_load(self, w: int, L: int, load: np.ndarray, tokens: np.ndarray) -> tuple:
        """(load, rank) of wave ``w``'s least-loaded cell with room for ``L`` tokens, the first
        rank of ties (``load``, ``tokens``: the placement's cell arrays, passed in by the hot loop).
        Cells with room for ``L`` come back from the free-token heap first, so the load heap's
        first fresh entry with room is the answer."""
        h, full, cap = self.heaps[w], self.full[w], self.cap
        while full and -full[0][0] >= L:  # (recorded free tokens may be stale: more than now)
            r = heapq.heappop(full)[1]
            heapq.heappush(h, (float(load[w, r]), r))
        while h:
            least, r = h[0]
            if least != load[w, r]:  # stale: the cell's fresh entry is deeper
                heapq.heappop(h)
            elif tokens[w, r] + L > cap:
                heapq.heappop(h)
                heapq.heappush(full, (int(tokens[w, r]) - cap, r))
            else:
                return h[0]
        return math.inf, -1

    def choose(self, L: int, t: float) -> CellChoice | None:
        """The cell that raises its wave least (then the least loaded), with offload where that
        raises it less; ``None`` where a new wave costs less or no cell has room."""
        best = None  # (raise, new load, wave): a tuple, this loop runs per sequence and wave
        load, tokens, heights, room_max = (
            self.placed.load,
            self.placed.tokens,
            self.heights,
            self.room_max,
        )
        picks = []
        for w in range(len(heights)):
            if room_max[w] < L:
                continue
            least, r = self.least_load(w, L, load, tokens)
            if r >= 0:
                picks.append((least, w, r))
        dense, attn = self.dense, t - L * self.per_token
        for least, w, r in picks:
            held = int(tokens[w, r])
            new_load = least + dense[held + L] - dense[held] + attn
            score = (max(0.0, new_load - heights[w]), new_load, w, r)
            if best is None or score[:2] < best[:2]:
                best = score
        best = CellChoice(*best) if best is not None else None
        if (best is None or best.raise_s > 0) and self.ctx.offload_capacity > self.cap:
            # Every cell with room raises its wave (or none has room): a cell that offloads part
            # of its activations may raise it less.
            beat_s = math.inf if best is None else best.raise_s
            self.offload_searches += 1
            off = offloaded_cell(self.ctx, self.placed, self.heights, L, t, beat_s, self.host)
            if off is not None and (best is None or off.raise_s < best.raise_s):
                best = off
        if best is not None and best.raise_s >= self.new_wave_s + t:  # a wave of its own is cheaper
            return None
        return best

    def new_wave(self, L: int, t: float) -> CellChoice:
        """A wave of its own for a sequence of ``L`` tokens and ``t`` packed seconds."""
        alone = self.dense[L] + t - L * self.per_token if L <= self.cap else t
        return CellChoice(alone, alone, self._open_wave(), 0)

    def _open_wave(self) -> int:
        """A new, empty wave; its index."""
        self.placed.add_wave()
        self.heights.append(0.0)
        self.heaps.append([(0.0, r) for r in range(self.ctx.num_ranks)])
        self.full.append([])
        self.room_max.append(self.cap)
        return len(self.heights) - 1

    def add_job(self, d: int, t: float, per_rank: int, stack_share: float | None) -> None:
        """A job of ``d`` ranks, ``t`` s and at most ``per_rank`` tokens a member: into the
        wave whose height grows least (ties: the lowest, so tall jobs spread over waves and
        leave token room beside them), on the least-loaded ranks with token room, each member's
        load growing by ``t``; with ``stack_share`` not into a wave that holds work where that
        raises it by more than that share of ``t``; a new wave where none takes it."""
        placed, rpn, off_cap = self.placed, self.ctx.ranks_per_node, self.ctx.offload_capacity
        best = _best_wave(placed.load, per_rank <= off_cap - placed.tokens, d, rpn, t, stack_share)
        if best is None:
            w = self._open_wave()
            room = np.full((1, placed.load.shape[1]), per_rank <= off_cap)
            members = _best_wave(placed.load[w:], room, d, rpn, t, None)[2]
        else:
            _, w, members = best
        placed.tokens[w, members] += per_rank
        placed.load[w, members] += t
        placed.members.append(members)
        placed.wave.append(w)
        loads = placed.load[w, members].tolist()
        self.heights[w] = max(self.heights[w], max(loads))
        self.room_max[w] = int(self.cap - placed.tokens[w].min())
        for r, load in zip(members.tolist(), loads):  # (their old entries are now stale)
            heapq.heappush(self.heaps[w], (load, r))

    def put(self, choice: CellChoice, L: int, t: float) -> int:
        """Add a sequence of ``L`` tokens and ``t`` seconds where ``choice`` says; its rank."""
        tokens, load, w, r = self.placed.tokens, self.placed.load, choice.wave, choice.rank
        emptiest = tokens[w, r] == self.cap - self.room_max[w]
        tokens[w, r] += L
        if emptiest:  # (the most free tokens change only where the emptiest cell fills)
            self.room_max[w] = int(self.cap - tokens[w].min())
        load[w, r] += choice.new_load - load[w, r]
        self.heights[w] = max(self.heights[w], float(load[w, r]))
        heapq.heappush(self.heaps[w], (float(load[w, r]), r))  # the old entry is now stale
        return r


@lru_cache(maxsize=8)
def _dense_by_tokens(cost: CostModel, capacity: int) -> list[float]:
    """The dense time (s) of a cell of each token count up to ``capacity`` (0 for none)."""
    out = cost.dense_time(np.arange(capacity + 1))
    out[0] = 0.0
    return out.tolist()


def offloaded_cell(
    ctx: Context,
    placed: Placed,
    heights: list[float],
    L: int,
    t: float,
    beat_s: float,
    host_copy: tuple[int, float] | None = None,
) -> CellChoice | None:
    """The cell that raises its wave least (then the least loaded, then the first) when it
    takes a sequence of ``L`` tokens and ``t`` seconds and offloads what it then must (its
    exposed host-copy time added to its busy time), among those whose load alone would raise
    it by less than ``beat_s`` (offload only adds to it); ``None`` if none of them has room even
    with offload. ``host_copy``: :func:`_host_copy` of the cost model (a placement looks it up
    once). (In ``wave`` sync with offload this runs for nearly every sequence: few numpy
    passes, over the cells that may win.)"""
    ranks = placed.load.shape[1]
    waves = np.asarray(heights)
    room = placed.tokens <= ctx.offload_capacity - L
    if beat_s < math.inf:  # (no cell raises its wave by inf: every cell with room may win)
        room &= placed.load + t - waves[:, None] < beat_s
    maybe = np.flatnonzero(room)
    if maybe.size == 0:
        return None
    held, s_per_token = host_copy or _host_copy(ctx.cost, ctx.sync)
    new_tokens, busy = placed.tokens.ravel()[maybe] + L, placed.load.ravel()[maybe] + t
    new_load = np.maximum(busy, s_per_token * (new_tokens - held))  # (busy + exposed copy)
    raise_by = np.maximum(0.0, new_load - waves[maybe // ranks])
    # Least raise, then least load, then the first cell: two argmins, not a sort of every cell.
    k = int(np.argmin(np.where(raise_by == raise_by.min(), new_load, np.inf)))
    w, r = divmod(int(maybe[k]), ranks)
    return CellChoice(float(raise_by[k]), float(new_load[k]), w, r)


@lru_cache(maxsize=8)
def _host_copy(cost: CostModel, sync: str) -> tuple[int, float]:
    """The cost model's host copy (out and back) as a line: a rank holding ``T`` tokens past
    the ``held`` it holds without offload copies for ``s_per_token * (T - held)`` s (the
    offloaded share grows so that the bytes kept stay fixed); ``(held, s_per_token)``."""
    held, most = cost.capacity(sync), cost.offload_capacity(sync)
    if most <= held:
        return held, 0.0
    top = np.array([most])
    return held, float(cost.offload_time(top, cost.offload_needed(top, sync))[0]) / (most - held)
