"""How long a sequence takes on ``d`` ranks, for many ``d`` at once, and the relaxation bound.

A sequence zigzag-split over ``d`` ranks (consecutive from a node boundary, ``ranks_per_node``
per node) is a *malleable job*. Its ranks start together and are held for the slowest member's
busy time ``T(d)``, the cost model's ``peer`` rule. In ``peer`` sync it covers an area
``d * T(d)`` of rank-time: cells holding a multi-rank shard hold nothing else. In ``wave`` sync it
covers at least its members' compute: a wave lasts as long as its slowest rank anyway, and whole
sequences may share a member's cell.

:func:`hdp.planner.splits.split_times` is the closed form of what :meth:`hdp.CostModel.evaluate`
computes for such a plan (``tests/test_planner_hdp.py`` checks the two agree). Take member ``i`` of
``d``, with head ``h_i`` and tail ``t_i`` tokens. The tail chunks of members ``j > i`` lie before
member ``i``'s, so it receives every other head and the tails of ``j > i``; it sends its head to
all ``d - 1`` others and its tail to the ``i`` members ``j < i``. The closed form is vectorised
over all members of all (length, degree) pairs: one call prices a whole degree menu
(:mod:`hdp.planner.menus`).

:func:`relaxation_bound` is the planner's own lower bound: choose one degree per sequence so
that ``max(M, area / ranks)`` is smallest, where ``M`` is the tallest job. The rectangles may be
cut (the area is divisible) but every job keeps its height. The sweep over every height in the
menus is exact over ``M``, so the bound is at least the LP relaxation of the malleable-job MILP
(:mod:`hdp.planner.dynamic.milp`) and at most any plan built from such jobs. Degrees the menu skips
are covered by the smaller height and smaller area of the two menu degrees around them.
:func:`step_bound` adds the parameter collectives and, in ``wave`` sync, takes the higher of it
and :func:`shelf_bound`, which accounts for the token room of the longest sequences' waves.

Note [Bounds cover head-parallel plans]: FlexSP and DeepSpeed-Ulysses split a sequence by heads
(:mod:`hdp.ulysses`): each of ``g`` members attends over all ``L`` tokens for ``1/g`` of the
heads, after all-to-alls that move about ``L / g`` tokens' activations each, not ``L``'s K/V.
On llama-7b across 32 ranks of two a node, a 47,552-token sequence runs so 1.7 times faster than
any zigzag split. So bounds give every long sequence an option per group size up to the heads:
its attention over ``g``, the all-to-alls by their bytes, and dense work at the packed speed
(area: ``g`` times that in ``peer`` sync, the members' work in ``wave``). hdp's own relaxation
leaves them out, since it plans zigzag splits only.

Note [Splits that save work]: the relaxation gives menus to long sequences only; a short one is
assumed to cover least area whole. That holds where attention's time grows no faster than its
work, as on the GPU profiles. The measured CPU profile's reference kernel computes a causal
block's masked half too, so an 8192-token sequence of the tiny model split in two (four equal
chunks, each a causal block plus a full block of the keys before it) covers 0.78 of its area
whole, and in four 0.74. A sequence whose attention some equal split does faster
(:meth:`hdp.CostModel.least_attn_time`) therefore gets a menu as well; the static mesh's plan,
which splits every sequence, no longer steps under the bound there.

Note [Every rank holds its tokens]: the bounds' areas price dense work at its best speed per
token, a full micro-batch's. But every token lies on one rank, and a rank that holds ``T``
tokens runs their dense layers in micro-batches of at most ``T``, at no better than ``q(T)`` a
token (the least dense time per token up to ``T``), and pays the layers' fixed overhead ``o``
at least once: it is busy at least ``T q(T) + o``. So in a step whose busy part is ``B`` no
rank holds more than the ``T*`` tokens that fit in ``B``; every token costs at least
``q(T*)``, and at least ``tokens / T*`` ranks pay ``o``. The shorter ``B``, the more area the
batch covers: the bound is the least ``B`` that covers its own area (:class:`RankFloor`, on
the dense grid, rounded so that it stays a bound). Example: the 4,194,304 tokens of
wikipedia-384k's bench batch, llama-7b on 1,024 H100s. A rank of 5,547 tokens runs dense work
at 0.125 ms a token (0.109 ms in a full micro-batch) and is busy at least 0.69 s, so under
0.69 s the batch costs 0.067 s a rank more than the relaxation priced it: the bound rises from
0.632 s to 0.694 s (hdp's plan: 0.771 s). Only the bounds of any strategy's plans count it:
the Megatron form's bound prices each micro-batch as it runs already, and hdp's own relaxation
keeps the best speed, so its degrees are as they were.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

from hdp import CostModel

from .menus import Menu, first_least, length_menus, menu_floor, split_saves_work
from .splits import ulysses_options


def packed_time(cost: CostModel, lengths: np.ndarray, cell_tokens: int) -> np.ndarray:
    """Least time whole sequences can take on one rank: their attention, and dense layers at the
    best speed per token of a micro-batch of at most ``cell_tokens`` tokens (sharing a cell with
    other sequences raises the dense speed; the per-layer overhead is shared too, so it is left
    out)."""
    L = np.asarray(lengths, dtype=np.float64)
    per_token = cost.compute.least_dense_s_per_token(cell_tokens)
    return cost.model.layers * cost.attn_time(np.zeros_like(L), L) + L * per_token


def _whole_time(cost: CostModel, lens: np.ndarray, sync: str, pow2: bool) -> np.ndarray:
    """The least time of each sequence whole on one rank: :func:`packed_time`, or for the
    Megatron form (``pow2``), which runs every sequence in a micro-batch of its own, its time
    alone, the micro-batch's fixed costs included."""
    if pow2:
        return np.asarray(cost.seq_time(lens), dtype=np.float64)
    return packed_time(cost, lens, cost.offload_capacity(sync))


def megatron_waves(lens: np.ndarray, num_ranks: int, capacity: int) -> int:
    """The fewest waves a Megatron-form plan of ``lens`` has in ``wave`` sync: a wave holds one
    sub-sample a rank and at most ``capacity`` tokens a rank (no offload)."""
    subsamples = -(-int(np.count_nonzero(lens)) // num_ranks)
    return max(1, subsamples, -(-int(np.sum(lens)) // (num_ranks * max(capacity, 1))))


def least_time(cost: CostModel, lengths: np.ndarray, cell_tokens: int) -> np.ndarray:
    """Least rank-seconds any plan spends on whole or split sequences: :func:`packed_time` with
    each attention at the least of its equal splits (:meth:`hdp.CostModel.least_attn_of`)."""
    L = np.asarray(lengths, dtype=np.int64)
    per_token = cost.compute.least_dense_s_per_token(cell_tokens)
    return cost.model.layers * cost.least_attn_of(L) + L * per_token


class RankFloor(NamedTuple):
    """What the least area of a step grows by with its busy part (Note [Every rank holds its
    tokens]): for a busy part from ``height[j]`` up to ``height[j + 1]``, at least
    ``extra[j]`` rank-seconds."""

    height: np.ndarray
    extra: np.ndarray

    def value(self, area: np.ndarray, slots: int) -> np.ndarray:
        """The least busy part ``B`` with ``B >= (area + extra at B) / slots``, for each of
        ``area`` (rank-seconds): where the condition first holds at a ``height[j]``, the lesser
        of that height and the value on the piece before it."""
        # (slots * height[j] - extra[j] rises with j: the first j where it reaches the area.)
        j = np.searchsorted(slots * self.height - self.extra, area, side="left")
        last = self.height.size - 1
        at = np.where(j <= last, self.height[np.minimum(j, last)], np.inf)
        before = np.where(j > 0, (area + self.extra[np.maximum(j - 1, 0)]) / slots, np.inf)
        return np.minimum(at, before)


def rank_floor(cost: CostModel, lens: np.ndarray, sync: str) -> RankFloor:
    """:class:`RankFloor` of a batch of ``lens`` (Note [Every rank holds its tokens]), for
    ranks of up to the batch's tokens, 64 sizes an octave."""
    tokens = float(np.sum(lens))
    cap = cost.offload_capacity(sync)
    T = 2.0 ** (np.arange(0, 64 * max(1.0, np.log2(max(tokens, 1.0))) + 2) / 64)
    q0 = cost.compute.least_dense_s_per_token(cap)
    q = cost.compute.least_dense_s_per_token_of(np.minimum(T, cap))  # (q0 at least: up to cap)
    o = cost.model.layers * cost.cluster.gpu.layer_overhead_s
    # A rank of T[j] to T[j + 1] tokens is busy at least T[j] q(T[j + 1]) + o; with at least
    # T[j] tokens, at least the least of that from j on.
    lowest = T[:-1] * q[1:] + o
    height = np.minimum.accumulate(lowest[::-1])[::-1]
    # Below height[j + 1] no rank holds T[j + 1] tokens: dense work at q(T[j + 1]) at least,
    # and ceil(tokens / T[j + 1]) ranks that hold some, each paying the overhead.
    extra = tokens * (q - q0) + o * np.ceil(tokens / T)
    return RankFloor(height, extra[1:])


class Jobs(NamedTuple):
    """A degree for every sequence (1: whole on one rank) and its busy time there (s)."""

    degree: np.ndarray
    job_time: np.ndarray


@dataclass(frozen=True)
class Relaxation:
    """Solution of the relaxation: the bound (seconds), its height ``M``, its area (rank-seconds),
    and the priced menus of the sequences that may split (``long_ids``)."""

    bound_s: float
    height_s: float
    area_s: float
    seq_lens: np.ndarray
    long_ids: np.ndarray
    menus: tuple[Menu, ...]

    @cached_property
    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The menus' entries end to end: degrees, heights, areas, and the menu of each."""
        fields = [np.concatenate([getattr(mu, f) for mu in self.menus] or [[]]) for f in _FLAT]
        sizes = [mu.degrees.size for mu in self.menus]
        return (*fields, np.repeat(np.arange(len(sizes)), sizes))

    def degrees_at(self, height: float, whole_s: np.ndarray) -> Jobs:
        """Each sequence's smallest-area menu degree no taller than ``height`` (the lowest one
        where none is), and its busy time; ``whole_s`` for the sequences that stay whole."""
        degrees = np.ones(self.seq_lens.size, dtype=np.int64)
        job_time = np.array(whole_s, dtype=np.float64)
        if not self.menus:
            return Jobs(degrees, job_time)
        deg, h, area, seg = self.entries
        allowed = h <= height * (1 + 1e-12)
        some = np.bincount(seg[allowed], minlength=len(self.menus)) > 0
        # Per menu, the first entry of the least area among those allowed, else of the least
        # height.
        first = first_least(seg, np.where(some[seg], np.where(allowed, area, np.inf), h))
        ids = self.long_ids[seg[first]]
        degrees[ids], job_time[ids] = deg[first], h[first]
        return Jobs(degrees, job_time)


_FLAT = ("degrees", "height", "area")


def relaxation_bound(
    cost: CostModel,
    seq_lens: np.ndarray,
    sync: str,
    capacity: int,
    slots: int,
    fixed_s: float = 0.0,
    min_step_s: float = 0.0,
    pow2: bool = False,
    any_split: bool = False,
    alone: bool = False,
    most_ranks: int | None = None,
) -> Relaxation:
    """Lower bound of the step over plans of zigzag-split jobs (module docstring) and the menus
    that attain it. ``slots``: ranks (``peer``) or ranks x waves (``wave``); ``fixed_s`` is added
    to the bound (parameter collectives); ``min_step_s`` floors the busy part; ``pow2`` restricts
    degrees to the CP groups Megatron builds, and with ``any_split`` (the form's bound) prices
    every sequence and share in a micro-batch of its own, as Megatron runs them.
    ``any_split``: over the exact zigzag splits of other strategies too, not only hdp's
    128-token blocks (a bound for any strategy's plan; hdp plans with the relaxation of its own
    splits). ``alone``: a sequence that stays whole is as tall as it runs alone in a cell (dense
    layers at its own speed, their fixed cost paid), so one taller than the mean busy time of a
    rank gets a menu too: in ``peer`` sync a sequence that long is often alone on its rank (not a
    bound: a cell it shares costs less).
    ``most_ranks``: no sequence on more ranks (hdp's ``--max-ranks-per-seq``; not a bound of
    plans without that limit)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    # (The Megatron form's own relaxation keeps the packed time: its degrees came out faster so.)
    packed = _whole_time(cost, lens, sync, pow2 and any_split)
    # Sequences that fit a rank and take less than the mean never gain from splitting (a split
    # covers at least the packed area, and every M is at least the mean): they stay whole.
    simple = float(packed.sum()) / max(slots, 1)
    splittable = (lens > capacity) | (packed > simple) | split_saves_work(cost, lens)
    if alone:  # the mean busy time of a rank: its packed work and one cell's fixed cost
        fixed = float(cost.dense_time(np.ones(1))[0]) - cost.compute.least_dense_s_per_token(1)
        splittable |= np.asarray(cost.seq_time(lens)) > simple + fixed
    long_ids = np.flatnonzero(splittable)
    short = np.ones(lens.size, dtype=bool)
    short[long_ids] = False
    # A whole sequence's rank runs a micro-batch of it or more, fixed costs included.
    tall = packed
    if any_split and not pow2:
        tall = cost.model.layers * cost.attn_time(np.zeros(lens.size), lens)
        tall = tall + cost.compute.least_dense_time_from(lens)
    base_area = float(packed[short].sum())
    base_height = float(tall[short].max(initial=0.0))
    # Only node exchange needs the cut (Note [Menus end at the floor]); rank menus stay whole.
    floor_s = (
        menu_floor(least_time(cost, lens, cost.offload_capacity(sync)), slots)
        if cost.kv_exchange == "node"
        else 0.0
    )
    menus = length_menus(
        cost, lens[long_ids].tolist(), sync, capacity, pow2, floor_s, any_split, most_ranks
    )
    # The bound's areas price dense work at the best speed (Note [Every rank holds its tokens]).
    floor = rank_floor(cost, lens, sync) if any_split and not pow2 and lens.sum() > 0 else None
    if not menus:
        spread = float(_spread(np.array([base_area]), slots, floor)[0])
        b = max(base_height, spread, min_step_s) + fixed_s
        return Relaxation(b, base_height, base_area, lens, long_ids, menus)
    # Events: (height at which an option becomes allowed, its area, its sequence).
    options = _bound_options(menus, packed[long_ids], tall[long_ids], pow2, any_split, alone)
    finite = np.bincount(options.seq[np.isfinite(options.height)], minlength=len(menus))
    if (finite == 0).any():
        length = int(lens[long_ids[int(np.argmin(finite))]])
        raise ValueError(f"a sequence of {length} tokens fits no degree")
    value, m_star, area = _sweep(
        options, len(menus), base_height, base_area, slots, min_step_s, floor
    )
    return Relaxation(value + fixed_s, m_star, area, lens, long_ids, menus)


class Options(NamedTuple):
    """Options of many sequences, flat: each one's height (s), area (rank-s) and sequence."""

    height: np.ndarray
    area: np.ndarray
    seq: np.ndarray


def _sweep(
    options: Options,
    count: int,
    base_height: float,
    base_area: float,
    slots: int,
    min_step_s: float = 0.0,
    floor: RankFloor | None = None,
) -> tuple[float, float, float]:
    """(least ``max(M, area / slots)``, its ``M``, its area) when each of ``count`` sequences
    takes its smallest-area option no taller than ``M``, beside work of ``base_area`` that is
    ``base_height`` tall: ``M`` swept over every option's height, in order of height then
    area; the first ``M`` where the least is reached."""
    order = np.lexsort((options.area, options.height))
    H, A, S = options.height[order], options.area[order], options.seq[order]
    # Each sequence's least area before each of its options (in the sweep's order): a row per
    # sequence, its options in order, the rest inf.
    by_seq = np.argsort(S, kind="stable")
    sizes = np.bincount(S, minlength=count)
    row = S[by_seq]
    col = np.arange(S.size) - (np.cumsum(sizes) - sizes)[row]
    grid = np.full((count, int(sizes.max()) + 1), np.inf)
    grid[row, col + 1] = A[by_seq]
    cur = np.empty_like(A)
    cur[by_seq] = np.minimum.accumulate(grid, axis=1)[row, col]
    smaller = A < cur
    first = smaller & (cur == np.inf)
    # The total of the least areas changes by an option's area where its sequence had none, and
    # by what it saves where it is smaller (the same sums, in the same order, as one by one).
    change = np.subtract(A, cur, out=np.zeros_like(A), where=smaller)
    change[first] = A[first]
    total = np.cumsum(change)
    m_here = np.maximum(H, base_height)
    spread = _spread(base_area + total, slots, floor)
    value = np.maximum(np.maximum(m_here, spread), min_step_s)
    value[np.cumsum(first) < count] = np.inf
    k = int(np.argmin(value))
    if value[k] == np.inf:
        return math.inf, 0.0, 0.0
    return float(value[k]), float(m_here[k]), float(base_area + total[k])


def _spread(area: np.ndarray, slots: int, floor: RankFloor | None) -> np.ndarray:
    """The least busy part that covers each of ``area`` on ``slots`` (with ``floor``, what its
    ranks' tokens cost too: Note [Every rank holds its tokens])."""
    return area / slots if floor is None else floor.value(area, slots)


def heads_bound(cost: CostModel, seq_lens: np.ndarray, sync: str, slots: int) -> float:
    """A lower bound of the busy part of plans that run each sequence whole or on one
    head-parallel group (``cost`` in ``ulysses`` exchange): the sweep of
    :func:`relaxation_bound` over the options bounds give them (:func:`ulysses_options`, by
    bytes, dense work at the packed speed), with no menus to price."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    room = cost.offload_capacity(sync)
    packed = packed_time(cost, lens, room)
    simple = float(packed.sum()) / max(slots, 1)
    split = (lens > room) | (packed > simple)
    whole = ~split
    heights, areas = [], []
    for (h, a), length, t in zip(
        ulysses_options(cost, lens[split].tolist(), sync), lens[split], packed[split]
    ):
        fits = length <= room  # whole on one rank, sharing its cell
        heights.append(np.concatenate([[t] if fits else [], h]))
        areas.append(np.concatenate([[t] if fits else [], a]))
    if any(h.size == 0 for h in heights):
        return math.inf
    base_height, base_area = float(packed[whole].max(initial=0.0)), float(packed[whole].sum())
    if not heights:
        return max(base_height, simple)
    seq = np.repeat(np.arange(len(heights)), [h.size for h in heights])
    options = Options(np.concatenate(heights), np.concatenate(areas), seq)
    return _sweep(options, len(heights), base_height, base_area, slots)[0]


def _bound_options(
    menus: tuple[Menu, ...],
    packed: np.ndarray,
    tall: np.ndarray,
    pow2: bool,
    any_split: bool,
    alone: bool = False,
) -> Options:
    """Every option a bound may give each sequence (menu ``menus[j]``, packed time
    ``packed[j]``, least height whole ``tall[j]``), flat, each sequence's in one run: its menu
    entries, hdp's or with ``any_split`` the bound's (either split, the faster). Degree 1
    covers its packed time and is ``tall`` high, since whole on one rank it may share its cell
    as the short ones do (``alone``: its height is the menu's, alone in a cell). For each run
    of degrees the menu skips, a virtual option takes the smaller height and the smaller area
    of the two entries around it, so that a bound over the options covers every degree. With
    ``any_split``, the degrees past a cut menu's end (Note [Menus end at the floor]) at the
    menu's least height (at most the floor, which no relaxation value goes below) and least
    tail area, and the head-parallel options (Note [Bounds cover head-parallel plans]). A
    sequence with an empty menu has none."""
    prefix = "bound_" if any_split else ""
    degrees, height, area = (
        [getattr(mu, prefix + f) for mu in menus] for f in ("degrees", "height", "area")
    )
    sizes = np.array([d.size for d in degrees])
    D, H, A = (np.concatenate(x) for x in (degrees, height, area))
    S = np.repeat(np.arange(len(menus)), sizes)
    starts = (np.cumsum(sizes) - sizes)[sizes > 0]
    one = starts[D[starts] == 1]
    A[one] = packed[S[one]]
    if not alone:
        H[one] = tall[S[one]]
    kinds = [(H, A, S, np.arange(S.size))]
    if not pow2:
        gap = np.flatnonzero((np.diff(D) > 1) & (S[1:] == S[:-1]))
        heights, areas = np.minimum(H[gap], H[gap + 1]), np.minimum(A[gap], A[gap + 1])
        kinds.append((heights, areas, S[gap], gap))
    if any_split:
        tail = np.array([mu.tail_area for mu in menus])
        cut = np.flatnonzero((sizes > 0) & np.isfinite(tail))
        least = np.minimum.reduceat(H, starts) if starts.size else H[:0]
        lowest = np.full(len(menus), np.inf)
        lowest[sizes > 0] = least
        kinds.append((lowest[cut], tail[cut], cut, cut))
        heads = [mu.ulysses_height.size if size else 0 for mu, size in zip(menus, sizes)]
        uh = [mu.ulysses_height for mu, k in zip(menus, heads) if k]
        ua = [mu.ulysses_area for mu, k in zip(menus, heads) if k]
        seq = np.repeat(np.arange(len(menus)), heads)
        if uh:
            kinds.append((np.concatenate(uh), np.concatenate(ua), seq, np.arange(seq.size)))
    # Each sequence's options in one run, in the order above (ties in the sweep keep it).
    kind = np.concatenate([np.full(k[2].size, i) for i, k in enumerate(kinds)])
    H, A, S, at = (np.concatenate([k[i] for k in kinds]) for i in range(4))
    order = np.lexsort((at, kind, S))
    return Options(H[order], A[order], S[order].astype(np.int64))


def _partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into non-empty groups (Bell(len) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _partitions(rest):
        yield [[first]] + p
        for k in range(len(p)):
            yield p[:k] + [[first] + p[k]] + p[k + 1 :]


def shelf_bound(
    cost: CostModel, rel: Relaxation, sync: str, giants: int = 4, pow2: bool = False
) -> float:
    """``wave`` sync: a lower bound of the busy part of the step (s, collectives left out) that
    :func:`relaxation_bound` misses where one sequence dominates the batch.

    Take the ``giants`` sequences of largest least area (4: their Bell(4) = 15 partitions into
    waves are each priced). In any plan they lie in some waves. A
    wave holding the set ``S`` of them lasts ``H >= max height`` of their options and covers
    ``n H`` rank-seconds: at least their areas ``A`` plus the work of the other sequences beside
    them. It holds at most ``n C`` tokens (``C`` the offload capacity). So the work the other
    sequences can put into the giants' ``k`` waves is at most ``K``, the fractional knapsack of
    them (densest, in seconds per token, first) into ``k n C`` tokens less the giants'. The rest,
    ``F`` in all, lasts at least its work over ``n`` in the other waves. With every other sequence
    at its least area, the step's busy part is at least
    ``max(sum H + max(0, F - K) / n, (F + sum A) / n)``.
    Minimised exactly over the heights where the giants share one wave, and by its Lagrangian dual
    (a bound of that minimum) over the other partitions of the giants into waves. It binds where
    a giant runs fastest on many ranks: on fewer it would cover less area, but the sequences
    beside it could not fill its wave's time within their tokens. ``pow2``: as the menus of
    ``rel``."""
    if not rel.menus:
        return 0.0
    lens, n = rel.seq_lens, cost.cluster.num_ranks
    room = cost.offload_capacity(sync)
    packed = _whole_time(cost, lens, sync, pow2)
    least = packed.copy()
    whole = packed[rel.long_ids]  # (a whole sequence here is as tall as its packed time)
    flat = _bound_options(rel.menus, whole, whole, pow2, any_split=True)
    ends = np.cumsum(np.bincount(flat.seq, minlength=len(rel.menus)))[:-1]
    options = []
    for j, (h, a) in enumerate(zip(np.split(flat.height, ends), np.split(flat.area, ends))):
        order = np.argsort(h, kind="stable")
        ok = np.isfinite(h[order])
        options.append(
            (h[order][ok], np.minimum.accumulate(a[order][ok]))
        )  # least area at each height
        least[rel.long_ids[j]] = min(float(least[rel.long_ids[j]]), float(a.min()))
    chosen = sorted(range(len(rel.menus)), key=lambda j: (-least[rel.long_ids[j]], j))[:giants]
    others = np.ones(lens.size, dtype=bool)
    others[rel.long_ids[chosen]] = False
    work = float(least[others].sum())
    densest = np.argsort(-(least[others] / np.maximum(lens[others], 1)), kind="stable")
    cum_tokens = np.concatenate([[0.0], np.cumsum(lens[others][densest], dtype=np.float64)])
    cum_work = np.concatenate([[0.0], np.cumsum(least[others][densest])])
    giant_tokens = float(lens[rel.long_ids[chosen]].sum())
    lam = np.linspace(0.0, 1.0, 101)[:, None]

    def wave_curve(group: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(heights, least total area of the group's giants under each) for one wave."""
        heights = np.unique(np.concatenate([options[j][0] for j in group]))
        heights = heights[heights >= max(options[j][0][0] for j in group)]
        area = np.zeros(heights.size)
        for j in group:
            h, a = options[j]
            area += a[np.searchsorted(h, heights, side="right") - 1]
        return heights, area

    best = math.inf
    for partition in _partitions(chosen):
        absorbed = float(np.interp(len(partition) * n * room - giant_tokens, cum_tokens, cum_work))
        rest = max(0.0, work - absorbed) / n
        curves = [wave_curve(group) for group in partition]
        if len(curves) == 1:
            heights, area = curves[0]
            value = float(np.maximum(heights + rest, (work + area) / n).min())
        else:  # max(x, y) >= l x + (1 - l) y for every l in [0, 1]
            dual = lam[:, 0] * rest + (1 - lam[:, 0]) * work / n
            for heights, area in curves:
                dual = dual + (lam * heights[None, :] + (1 - lam) * area[None, :] / n).min(axis=1)
            value = float(dual.max())
        best = min(best, value)
    return best


def step_bound(
    cost: CostModel, seq_lens: np.ndarray, sync: str, capacity: int, pow2: bool = False
) -> float:
    """The planner's lower bound of the step time, seconds, for a plan of any strategy's zigzag
    splits: :func:`relaxation_bound` over all
    ranks (``wave``: or :func:`shelf_bound`, whichever is higher) plus what the synchronisation
    mode adds for parameter collectives (``wave``: at least as many waves as the tokens need with
    offload, each gathering and scattering parameters), plus the optimizer step. ``pow2``: over
    the Megatron form's plans, which hold at most ``capacity`` tokens a rank and run every
    sequence in micro-batches of its own (in ``wave`` sync a wave then holds at most one a
    rank)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    n, layers = cost.cluster.num_ranks, cost.model.layers
    if sync == "wave":
        if pow2:
            waves = megatron_waves(lens, n, capacity)
        else:
            waves = max(1, -(-int(lens.sum()) // (n * max(cost.offload_capacity(sync), 1))))
        coll = 2 * cost.allgather_time() + cost.reduce_scatter_time()
        rel = relaxation_bound(
            cost,
            lens,
            sync,
            capacity,
            n,
            fixed_s=waves * coll / layers,
            min_step_s=waves * coll,
            pow2=pow2,
            any_split=True,
        )
        shelf = shelf_bound(cost, rel, sync, pow2=pow2) + waves * coll / layers
        return max(rel.bound_s, shelf) + cost.optimizer_s
    rel = relaxation_bound(
        cost,
        lens,
        sync,
        capacity,
        n,
        pow2=pow2,
        any_split=True,
        fixed_s=(cost.allgather_time() + cost.reduce_scatter_time()) / layers,
    )
    return rel.bound_s + cost.optimizer_s
