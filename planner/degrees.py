"""How long a sequence takes on ``d`` ranks, for many ``d`` at once, and the relaxation bound.

A sequence zigzag-split over ``d`` ranks (consecutive from a node boundary, ``ranks_per_node``
per node) is a *malleable job*. Its ranks start together and are held for the slowest member's
busy time ``T(d)``, the cost model's ``peer`` rule. In ``peer`` sync it covers an area
``d * T(d)`` of rank-time: cells holding a multi-rank shard hold nothing else. In ``wave`` sync it
covers at least its members' compute: a wave lasts as long as its slowest rank anyway, and whole
sequences may share a member's cell.

:func:`split_times` is the closed form of what :meth:`hdp.CostModel.evaluate` computes for such
a plan (``tests/test_planner_hdp.py`` checks the two agree). Take member ``i`` of ``d``, with
head ``h_i`` and tail ``t_i`` tokens. The tail chunks of members ``j > i`` lie before member
``i``'s, so it receives every other head and the tails of ``j > i``; it sends its head to all
``d - 1`` others and its tail to the ``i`` members ``j < i``. The closed form is vectorised over
all members of all (length, degree) pairs: one call prices a whole degree menu.

:func:`relaxation_bound` is the planner's own lower bound: choose one degree per sequence so
that ``max(M, area / ranks)`` is smallest, where ``M`` is the tallest job. The rectangles may be
cut (the area is divisible) but every job keeps its height. The sweep over every height in the
menus is exact over ``M``, so the bound is at least the LP relaxation of the malleable-job MILP
(:mod:`planner.dynamic.milp`) and at most any plan built from such jobs. Degrees the menu skips are
covered by the smaller height and smaller area of the two menu degrees around them.
:func:`step_bound` adds the parameter collectives and, in ``wave`` sync, takes the higher of it
and :func:`shelf_bound`, which accounts for the token room of the longest sequences' waves.

Note [Bounds price bytes, not messages]: the closed form counts a member's messages as its
``d - 1`` partners plus one per K/V block it receives, while a plan's exchange
(:meth:`hdp.Plan.exchange`) merges a member's adjacent pieces and may send fewer. A bound that
charged the closed form's per-message latency could then exceed a plan: a 2049-token sequence of
the tiny model split over 5 ranks ran 0.7% under it. So the entries bounds use (``Menu.bound_*``)
price the K/V traffic by its bytes alone, which every zigzag split of the sequence must move,
while hdp's own entries keep the latency that decides between its degrees.

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

Note [Menus end at the floor]: every relaxation value is at least the least work of the batch
spread over the slots (:func:`menu_floor` of :func:`least_time`), so below that height a job's
height no longer matters, only its area. A menu thus ends at the coarse degree where the height
first drops below the floor, and bounds give the degrees past it one option: that height and the
least area of the coarse degrees past it, walked until the area grows (the degrees between them
are covered as the menus' own gaps are). On the GPU profiles the area grows at once, but on the
CPU profile more members save more work (Note [Splits that save work]) and it may fall. In
``node`` exchange the heights of a long sequence fall up to the whole cluster; without this end
its menu would price every degree up to it. (``rank`` menus end where their heights stop falling,
well before.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from hdp import CostModel
from hdp.plan import BLOCK_TOKENS

from .common import blocks_fit, use_blocks
from .splits import menu_pricing, split_times, split_times_both, ulysses_options

SHELF_GIANTS = 4  # longest sequences :func:`shelf_bound` places in waves explicitly


def degree_menu(
    length: int, num_ranks: int, offload_capacity: int, ratio: float = 1.08, dense_up_to: int = 16
) -> np.ndarray:
    """Candidate degrees of one sequence: from the fewest ranks that can hold it (with offload),
    every ``d`` up to ``dense_up_to``, then every ``ratio``-th, and all ranks."""
    d = max(1, -(-length // max(offload_capacity, 1)))
    if d > num_ranks:
        return np.zeros(0, dtype=np.int64)
    out = [d]
    while d < num_ranks:
        d = d + 1 if d < dense_up_to else max(d + 1, int(round(d * ratio)))
        out.append(min(num_ranks, d))
    return np.asarray(out, dtype=np.int64)


_NONE = np.zeros(0)


@dataclass(frozen=True)
class Menu:
    """The priced degrees of one sequence length, arrays sorted by degree. ``degrees``, ``height``,
    ``area``, ``most_tokens``: a member's figures as ``hdp`` splits the sequence (128-token blocks),
    the feasible degrees up to the fastest. ``bound_*``: for bounds over every strategy's plans,
    the degrees that either split can hold, each at the faster of hdp's split and the exact
    zigzag split other strategies use, traffic priced by its bytes (Note [Bounds price bytes, not
    messages]), up to the fastest."""

    degrees: np.ndarray
    height: np.ndarray
    area: np.ndarray
    most_tokens: np.ndarray
    bound_degrees: np.ndarray
    bound_height: np.ndarray
    bound_area: np.ndarray
    tail_area: float = math.inf
    ulysses_height: np.ndarray = field(default_factory=lambda: _NONE)
    ulysses_area: np.ndarray = field(default_factory=lambda: _NONE)


@lru_cache(maxsize=4096)
def length_menu(
    cost: CostModel,
    length: int,
    sync: str,
    capacity: int,
    pow2: bool = False,
    floor_s: float = 0.0,
) -> Menu:
    """Priced degree menu of one length (cached per cost model, so repeated lengths are free):
    :func:`_zigzag_menu`, with the bound's :func:`ulysses_options` beside it. Megatron's form
    (``pow2``) is bounded over its own zigzag CP groups, so its menus have none."""
    menu = _zigzag_menu(cost, length, sync, capacity, pow2, floor_s)
    if pow2:
        return menu
    if cost.kv_exchange == "ulysses":  # hdp's head-parallel entries; bounds cover P2P plans too
        p2p = length_menu(cost.with_exchange("rank"), length, sync, capacity, pow2, floor_s)
        return replace(
            menu,
            bound_degrees=p2p.bound_degrees,
            bound_height=p2p.bound_height,
            bound_area=p2p.bound_area,
            tail_area=p2p.tail_area,
            ulysses_height=p2p.ulysses_height,
            ulysses_area=p2p.ulysses_area,
        )
    height, area = ulysses_options(cost, length, sync)
    return replace(menu, ulysses_height=height, ulysses_area=area)


def _zigzag_menu(
    cost: CostModel,
    length: int,
    sync: str,
    capacity: int,
    pow2: bool = False,
    floor_s: float = 0.0,
    bounds: bool = True,
) -> Menu:
    """Priced degree menu of one length split in zigzag shares. Degrees above the one with the
    smallest height are dropped: they are slower and larger. ``pow2``: powers of two only
    (Megatron's CP group sizes). ``floor_s``: a lower bound of the step (:func:`menu_floor`);
    the menu ends a little past the first degree no taller than it (Note [Menus end at the
    floor]). ``bounds`` False leaves the bound's entries unpriced (they repeat hdp's)."""
    off_cap = cost.offload_capacity(sync)
    times, most_ranks, in_blocks = menu_pricing(cost, pow2)

    def bound_entries(deg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _bound_entries(cost, length, sync, deg, pow2)

    def price(deg: np.ndarray, exact_too: bool = True) -> Menu:
        # Megatron (pow2) splits into exact shares; hdp by common.use_blocks, priced here in
        # blocks first and exactly where the blocks leave a member over the offload capacity.
        k, lengths = deg.size, np.full(deg.size, length)
        blocked = blocks_fit(length, deg) & in_blocks
        if not blocked.any():
            h, a, most = times(cost, lengths, deg, sync, 1)
            return _until_lowest(Menu(deg, h, a, most, deg, h, a))
        align = np.where(blocked, BLOCK_TOKENS, 1)
        exact = bound = None
        if exact_too:  # hdp's entries and the bound's from one pass over both splits
            parts, aligns = _blocks_then_exact(deg, align)
            timed, by_bytes = split_times_both(cost, np.full(2 * k, length), parts, sync, aligns)
            (h, a, most), exact = [x[:k] for x in timed], [x[k:] for x in timed]
            bound = [np.fmin(x[:k], x[k:]) for x in by_bytes[:2]]
        else:
            h, a, most = times(cost, lengths, deg, sync, align)
        over = blocked & ~use_blocks(length, deg, most, off_cap)
        if over.any():
            if exact is None:
                exact = times(cost, lengths, deg, sync, 1)
            h, a, most = (np.where(over, e, x) for x, e in zip((h, a, most), exact))
        return _until_lowest(Menu(deg, h, a, most, deg, *((h, a) if bound is None else bound)))

    if pow2:
        d_min = max(1, -(-length // max(capacity, 1)))
        deg = 1 << np.arange(int(np.ceil(np.log2(d_min))), int(np.log2(cost.cluster.num_ranks)) + 1)
        return price(deg.astype(np.int64))
    # A coarse pass finds where the height stops falling; the fine menu stops a little beyond.
    # Members hold at least one block: fewer tokens per member would leave the exact splits of
    # other strategies faster than every degree priced, and the bound would not be one.
    # One degree beyond the fewest that hold it: blocks can leave the fewest a block over the
    # capacity (1793 tokens on 3 ranks of 640: 641 on one).
    widest = min(most_ranks, max(1, length // BLOCK_TOKENS, -(-length // max(off_cap, 1)) + 1))
    candidates = degree_menu(length, widest, off_cap, ratio=1.5, dense_up_to=4)
    if candidates.size == 0:  # more ranks than the cluster has
        return price(candidates)
    coarse = price(candidates, exact_too=False)
    # (Where no 128-token split fits, the exact one may: price them all.)
    top, cut = widest, False
    if coarse.degrees.size:
        below = np.flatnonzero(coarse.height <= floor_s)
        if below.size:  # the fine menu's first degree below the floor is at most this one
            top = int(coarse.degrees[int(below[0])])
            cut = top < widest
        else:
            top = int(coarse.degrees[int(np.argmin(coarse.height))] * 1.5) + 1
    fine = degree_menu(length, min(widest, top), off_cap)
    # Heights jump where a job crosses into one more node (more K/V over the NIC), so the fastest
    # degree is often a whole number of nodes: add the node multiples around every fine degree.
    # The sweep's virtual options assume heights between two entries lie above the lower one,
    # which holds only with those multiples in the menu.
    rpn = cost.cluster.ranks_per_node
    nodes = np.concatenate([(fine // rpn) * rpn, -(-fine // rpn) * rpn])
    nodes = nodes[(nodes >= fine[0]) & (nodes <= fine[-1]) & (nodes > 0)]
    menu = price(np.unique(np.concatenate([fine, nodes])), exact_too=bounds)
    at_top = np.flatnonzero(menu.bound_degrees == top)
    if (
        not bounds or not cut or at_top.size == 0
    ):  # (past its lowest height a menu's area only grows)
        return menu
    return replace(
        menu,
        tail_area=_tail_area(
            bound_entries, float(menu.bound_area[at_top[0]]), candidates[candidates > top]
        ),
    )


def fastest_height(cost: CostModel, length: int, sync: str, capacity: int) -> float:
    """The least height of the degrees of :func:`length_menu` (``inf`` where none holds the
    length), without pricing the bound's entries."""
    heights = _zigzag_menu(cost, length, sync, capacity, bounds=False).height
    return float(heights.min()) if heights.size else math.inf


def _bound_entries(
    cost: CostModel, length: int, sync: str, deg: np.ndarray, pow2: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(height, area) of the bound's entries at degrees ``deg``: either split, by bytes alone."""
    k = deg.size
    align = np.where(blocks_fit(length, deg) & (not pow2), BLOCK_TOKENS, 1)
    parts, aligns = _blocks_then_exact(deg, align)
    h, a, _ = split_times(cost, np.full(2 * k, length), parts, sync, aligns, latency=False)
    return np.fmin(h[:k], h[k:]), np.fmin(a[:k], a[k:])


def _blocks_then_exact(deg: np.ndarray, align: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(parts, align) pricing each degree of ``deg`` twice in one call: split by ``align``, then
    exactly."""
    return np.concatenate([deg, deg]), np.concatenate([align, np.ones_like(align)])


def _tail_area(
    bound_entries: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    end_area: float,
    degrees: np.ndarray,
) -> float:
    """Least bound area of the coarse ``degrees`` past a menu's end (where it is ``end_area``),
    walked in order until the area grows again (Note [Menus end at the floor])."""
    least = last = end_area
    for d in degrees.tolist():
        height, area = bound_entries(np.array([d]))
        if not np.isfinite(height[0]) or area[0] >= last:
            return least
        least = last = float(area[0])
    return least


def menu_floor(work_s: np.ndarray, slots: int) -> float:
    """The work ``work_s`` spread evenly over ``slots``, rounded down to a quarter octave so that
    batches alike share cached menus: a lower bound of every relaxation value where ``work_s``
    is each sequence's :func:`least_time`."""
    simple = float(np.sum(work_s)) / max(slots, 1)
    return 0.0 if simple <= 0 else float(2.0 ** (math.floor(math.log2(simple) * 4) / 4))


def _until_lowest(mu: Menu) -> Menu:
    """Each set of entries (hdp's, the bound's) cut to the feasible ones up to its lowest height."""

    def keep(degrees: np.ndarray, height: np.ndarray) -> np.ndarray:
        ok = np.isfinite(height)
        return ok & (degrees <= degrees[ok][int(np.argmin(height[ok]))]) if ok.any() else ok

    k, b = keep(mu.degrees, mu.height), keep(mu.bound_degrees, mu.bound_height)
    return Menu(
        mu.degrees[k],
        mu.height[k],
        mu.area[k],
        mu.most_tokens[k],
        mu.bound_degrees[b],
        mu.bound_height[b],
        mu.bound_area[b],
    )


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


def work_area(cost: CostModel, rel: Relaxation, degree: np.ndarray, sync: str) -> float:
    """Rank-seconds of compute that any plan giving sequence ``i`` ``degree[i]`` ranks covers, at
    least: split sequences their area in ``rel``'s menus where it holds the degree, else (and whole
    ones) their packed time. Divided by the ranks it is a lower bound of such a plan's step (a
    wave lasts as long as its slowest rank, so at least as long as the mean)."""
    area = packed_time(cost, rel.seq_lens, cost.offload_capacity(sync))
    for i, mu in zip(rel.long_ids.tolist(), rel.menus):
        k = int(np.searchsorted(mu.degrees, degree[i]))
        if degree[i] > 1 and k < mu.degrees.size and mu.degrees[k] == degree[i]:
            area[i] = float(mu.area[k])
    return float(area.sum())


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

    def degrees_at(self, height: float, whole_s: np.ndarray, max_tokens: int | None = None) -> Jobs:
        """Each sequence's smallest-area menu degree no taller than ``height`` (the lowest one
        where none is), and its busy time; ``whole_s`` for the sequences that stay whole.
        ``max_tokens``: also holding at most that many tokens per member where a degree does."""
        degrees = np.ones(self.seq_lens.size, dtype=np.int64)
        job_time = np.array(whole_s, dtype=np.float64)
        for i, mu in zip(self.long_ids.tolist(), self.menus):
            allowed = mu.height <= height * (1 + 1e-12)
            if max_tokens is not None:
                capped = allowed & (mu.most_tokens <= max_tokens)
                allowed = capped if capped.any() else allowed
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
) -> Relaxation:
    """Lower bound of the step over plans of zigzag-split jobs (module docstring) and the menus
    that attain it. ``slots``: ranks (``peer``) or ranks x waves (``wave``); ``fixed_s`` is added
    to the bound (parameter collectives); ``min_step_s`` floors the busy part; ``pow2`` restricts
    degrees to powers of two (Megatron's CP groups). ``any_split``: over the exact zigzag splits
    of other strategies too, not only hdp's 128-token blocks (a bound for any strategy's plan;
    hdp plans with the relaxation of its own splits)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    packed = packed_time(cost, lens, cost.offload_capacity(sync))
    # Sequences that fit a rank and take less than the mean never gain from splitting (a split
    # covers at least the packed area, and every M is at least the mean): they stay whole.
    simple = float(packed.sum()) / max(slots, 1)
    splittable = (lens > capacity) | (packed > simple) | _split_saves_work(cost, lens)
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
    menus = tuple(
        length_menu(cost, int(lens[i]), sync, capacity, pow2, floor_s) for i in long_ids.tolist()
    )
    # Events: (height at which an option becomes allowed, the sequence, its area).
    ev_h, ev_seq, ev_area = [], [], []
    for j, mu in enumerate(menus):
        h, a = _bound_options(mu, float(packed[long_ids[j]]), pow2, any_split)
        if not np.isfinite(h).any():
            raise ValueError(f"a sequence of {int(lens[long_ids[j]])} tokens fits no degree")
        ev_h.append(h)
        ev_area.append(a)
        ev_seq.append(np.full(h.size, j))
    if not menus:
        b = max(base_height, simple, min_step_s) + fixed_s
        return Relaxation(b, base_height, base_area, lens, long_ids, menus)
    H = np.concatenate(ev_h)
    A = np.concatenate(ev_area)
    S = np.concatenate(ev_seq)
    order = np.lexsort((A, H))
    # Sweep M over the option heights, keeping each sequence's smallest allowed area.
    best_area = np.full(len(menus), np.inf)
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
        if feasible == len(menus):
            m_here = max(h, base_height)  # the short sequences are as tall as base_height anyway
            value = max(m_here, (base_area + total) / slots, min_step_s)
            if value < best[0]:
                best = (value, m_here, base_area + total)
    value, m_star, area = best
    return Relaxation(value + fixed_s, m_star, area, lens, long_ids, menus)


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
    mu: Menu, packed: float, pow2: bool, any_split: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(height s, area s) of every option a bound may give a sequence with menu ``mu``.

    The options are its menu entries: hdp's, or with ``any_split`` the bound's (either split,
    the faster). Degree 1 counts at its ``packed`` time, since whole on one rank it may share its
    cell as the short ones do. For each run of degrees the menu skips, a virtual option takes the
    smaller height and the smaller area of the two entries around it, so that a bound over the
    options covers every degree."""
    if any_split:
        degrees, h, a = mu.bound_degrees, mu.bound_height.copy(), mu.bound_area.copy()
    else:
        degrees, h, a = mu.degrees, mu.height.copy(), mu.area.copy()
    if h.size == 0:
        return h, a
    if degrees[0] == 1:
        h[0] = a[0] = packed
    gaps = np.flatnonzero(np.diff(degrees) > 1) if not pow2 else np.zeros(0, dtype=np.int64)
    # For bounds, the degrees past a cut menu's end (Note [Menus end at the floor]) at the menu's
    # least height (at most the floor, which no relaxation value goes below) and least tail area.
    tail_h = [float(np.min(h))] if any_split and np.isfinite(mu.tail_area) else []
    tail_a = [mu.tail_area] if tail_h else []
    uh, ua = (mu.ulysses_height, mu.ulysses_area) if any_split else (_NONE, _NONE)
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
    cost: CostModel, rel: Relaxation, sync: str, giants: int = SHELF_GIANTS, pow2: bool = False
) -> float:
    """``wave`` sync: a lower bound of the busy part of the step (s, collectives left out) that
    :func:`relaxation_bound` misses where one sequence dominates the batch.

    Take the ``giants`` sequences of largest least area. In any plan they lie in some waves. A
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
