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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hdp import CostModel

from .menus import Menu, length_menus, menu_floor
from .splits import ulysses_options


def packed_time(cost: CostModel, lengths: np.ndarray, cell_tokens: int) -> np.ndarray:
    """Least time whole sequences can take on one rank: their attention, and dense layers at the
    best speed per token of a micro-batch of at most ``cell_tokens`` tokens (sharing a cell with
    other sequences raises the dense speed; the per-layer overhead is shared too, so it is left
    out)."""
    L = np.asarray(lengths, dtype=np.float64)
    per_token = cost.compute.least_dense_s_per_token(cell_tokens)
    return cost.model.layers * cost.attn_time(np.zeros_like(L), L) + L * per_token


def least_time(cost: CostModel, lengths: np.ndarray, cell_tokens: int) -> np.ndarray:
    """Least rank-seconds any plan spends on whole or split sequences: :func:`packed_time` with
    each attention at the least of its equal splits (:meth:`hdp.CostModel.least_attn_of`)."""
    L = np.asarray(lengths, dtype=np.int64)
    per_token = cost.compute.least_dense_s_per_token(cell_tokens)
    return cost.model.layers * cost.least_attn_of(L) + L * per_token


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

    def degrees_at(self, height: float, whole_s: np.ndarray) -> Jobs:
        """Each sequence's smallest-area menu degree no taller than ``height`` (the lowest one
        where none is), and its busy time; ``whole_s`` for the sequences that stay whole."""
        degrees = np.ones(self.seq_lens.size, dtype=np.int64)
        job_time = np.array(whole_s, dtype=np.float64)
        for i, mu in zip(self.long_ids.tolist(), self.menus):
            allowed = mu.height <= height * (1 + 1e-12)
            k = (
                int(np.argmin(np.where(allowed, mu.area, np.inf)))
                if allowed.any()
                else int(np.argmin(mu.height))
            )
            degrees[i] = mu.degrees[k]
            job_time[i] = mu.height[k]
        return Jobs(degrees, job_time)


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
) -> Relaxation:
    """Lower bound of the step over plans of zigzag-split jobs (module docstring) and the menus
    that attain it. ``slots``: ranks (``peer``) or ranks x waves (``wave``); ``fixed_s`` is added
    to the bound (parameter collectives); ``min_step_s`` floors the busy part; ``pow2`` restricts
    degrees to powers of two (Megatron's CP groups). ``any_split``: over the exact zigzag splits
    of other strategies too, not only hdp's 128-token blocks (a bound for any strategy's plan;
    hdp plans with the relaxation of its own splits). ``alone``: a sequence that stays whole is
    as tall as it runs alone in a cell (dense layers at its own speed, their fixed cost paid), so
    one taller than the mean busy time of a rank gets a menu too: in ``peer`` sync a sequence
    that long is often alone on its rank (not a bound: a cell it shares costs less)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    packed = packed_time(cost, lens, cost.offload_capacity(sync))
    # Sequences that fit a rank and take less than the mean never gain from splitting (a split
    # covers at least the packed area, and every M is at least the mean): they stay whole.
    simple = float(packed.sum()) / max(slots, 1)
    splittable = (lens > capacity) | (packed > simple) | _split_saves_work(cost, lens)
    if alone:  # the mean busy time of a rank: its packed work and one cell's fixed cost
        fixed = float(cost.dense_time(np.ones(1))[0]) - cost.compute.least_dense_s_per_token(1)
        splittable |= np.asarray(cost.seq_time(lens)) > simple + fixed
    long_ids = np.flatnonzero(splittable)
    short = np.ones(lens.size, dtype=bool)
    short[long_ids] = False
    base_area = float(packed[short].sum())
    base_height = float(packed[short].max(initial=0.0))
    # Only node exchange needs the cut (Note [Menus end at the floor]); rank menus stay whole.
    floor_s = (
        menu_floor(least_time(cost, lens, cost.offload_capacity(sync)), slots)
        if cost.kv_exchange == "node"
        else 0.0
    )
    menus = length_menus(cost, lens[long_ids].tolist(), sync, capacity, pow2, floor_s, any_split)
    # Events: (height at which an option becomes allowed, its area), per sequence.
    ev_h, ev_area = [], []
    for j, mu in enumerate(menus):
        h, a = _bound_options(mu, float(packed[long_ids[j]]), pow2, any_split, alone)
        if not np.isfinite(h).any():
            raise ValueError(f"a sequence of {int(lens[long_ids[j]])} tokens fits no degree")
        ev_h.append(h)
        ev_area.append(a)
    if not menus:
        b = max(base_height, simple, min_step_s) + fixed_s
        return Relaxation(b, base_height, base_area, lens, long_ids, menus)
    value, m_star, area = _sweep(ev_h, ev_area, base_height, base_area, slots, min_step_s)
    return Relaxation(value + fixed_s, m_star, area, lens, long_ids, menus)


def _sweep(
    heights: list[np.ndarray],
    areas: list[np.ndarray],
    base_height: float,
    base_area: float,
    slots: int,
    min_step_s: float = 0.0,
) -> tuple[float, float, float]:
    """(least ``max(M, area / slots)``, its ``M``, its area) when each sequence takes its
    smallest-area option (``heights[j]``, ``areas[j]``) no taller than ``M``, beside work of
    ``base_area`` that is ``base_height`` tall: ``M`` swept over every option's height."""
    H, A = np.concatenate(heights), np.concatenate(areas)
    S = np.repeat(np.arange(len(heights)), [h.size for h in heights])
    order = np.lexsort((A, H))
    best_area = np.full(len(heights), np.inf)
    total, feasible = 0.0, 0
    best = (np.inf, 0.0, 0.0)
    for h, a, s in zip(H[order].tolist(), A[order].tolist(), S[order].tolist()):
        cur = best_area[s]
        if a < cur:
            if cur == np.inf:
                feasible += 1
                total += a
            else:
                total += a - cur
            best_area[s] = a
        if feasible == len(heights):
            m_here = max(h, base_height)  # the short sequences are as tall as base_height anyway
            value = max(m_here, (base_area + total) / slots, min_step_s)
            if value < best[0]:
                best = (value, m_here, base_area + total)
    return best


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
    return _sweep(heights, areas, base_height, base_area, slots)[0]


def _split_saves_work(cost: CostModel, lens: np.ndarray) -> np.ndarray:
    """Which sequences some zigzag split covers with less area than the whole sequence: those
    whose attention some equal split does faster (a split's members run the same dense work, at
    best the packed speed a whole sequence gets too). None on the GPU profiles but the longest
    sequences; where causal calls run slower per FLOP than full ones (the CPU profile's reference
    kernel computes a causal block's masked half too), most. Their menus must be priced for the
    bound to hold."""
    whole = cost.attn_time(np.zeros(lens.size), lens)
    return cost.least_attn_of(lens) < whole * (1 - 1e-9)


def _bound_options(
    mu: Menu, packed: float, pow2: bool, any_split: bool, alone: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(height s, area s) of every option a bound may give a sequence with menu ``mu``.

    The options are its menu entries: hdp's, or with ``any_split`` the bound's (either split,
    the faster). Degree 1 counts at its ``packed`` time, since whole on one rank it may share its
    cell as the short ones do (``alone``: its area only; its height is the menu's, alone in a
    cell). For each run of degrees the menu skips, a virtual option takes the
    smaller height and the smaller area of the two entries around it, so that a bound over the
    options covers every degree."""
    if any_split:
        degrees, h, a = mu.bound_degrees, mu.bound_height.copy(), mu.bound_area.copy()
    else:
        degrees, h, a = mu.degrees, mu.height.copy(), mu.area.copy()
    if h.size == 0:
        return h, a
    if degrees[0] == 1:
        a[0] = packed
        h[0] = h[0] if alone else packed
    gaps = np.flatnonzero(np.diff(degrees) > 1) if not pow2 else np.zeros(0, dtype=np.int64)
    # For bounds, the degrees past a cut menu's end (Note [Menus end at the floor]) at the menu's
    # least height (at most the floor, which no relaxation value goes below) and least tail area.
    tail_h = [float(np.min(h))] if any_split and np.isfinite(mu.tail_area) else []
    tail_a = [mu.tail_area] if tail_h else []
    uh, ua = (mu.ulysses_height, mu.ulysses_area) if any_split else (np.zeros(0), np.zeros(0))
    return np.concatenate([h, np.minimum(h[gaps], h[gaps + 1]), tail_h, uh]), np.concatenate(
        [a, np.minimum(a[gaps], a[gaps + 1]), tail_a, ua]
    )


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
    packed = packed_time(cost, lens, room)
    least = packed.copy()
    options = []
    for j, mu in enumerate(rel.menus):
        h, a = _bound_options(mu, float(packed[rel.long_ids[j]]), pow2, any_split=True)
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
    offload, each gathering and scattering parameters), plus the optimizer step."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    n, layers = cost.cluster.num_ranks, cost.model.layers
    if sync == "wave":
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
