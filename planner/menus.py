"""Degree menus: how long one sequence length takes on each of its useful degrees.

:func:`length_menus` prices each length's degrees once per cost model, with
:func:`hdp.planner.splits.split_times`: a coarse pass finds where the height stops falling, and a
fine menu, with the node multiples around it, ends a little beyond. Each entry has hdp's own figures
(128-token blocks, latency counted) and the bound's (the faster of either split, by bytes and
partners).
The relaxation and the bounds of :mod:`hdp.planner.degrees` sweep these menus.

Note [Bounds price bytes and partners]: the closed form counts a member's messages as its
``d - 1`` partners plus one per K/V block it receives. A plan's cell is priced a message per
peer it receives a piece from, plus one per block of the plan's own size
(:func:`hdp.traffic.kv_traffic`), and its split may differ from the closed form's: a bound
charging the blocks' messages ran 0.7% over a plan of a 2049-token sequence of the tiny model on
5 ranks. So the entries bounds use (``Menu.bound_*``) price the K/V traffic by its bytes, which
every zigzag split of the sequence must move, and a message from each partner that holds a token
before the member's last one (:func:`hdp.planner.splits.split_times` with ``latency`` False),
which every plan of the split receives: in zigzag shares every other member, since all heads
come before any tail (Note [A member's cell in a bound] in :mod:`hdp.planner.splits` has the
rest of an entry). Example (llama-7b, 1,024 H100s, ``node`` exchange): a 255,093-token sequence
is fastest on 224 ranks by hdp's own entries (1.83 s). By its bytes alone it would run 1.39 s on
544 ranks, each member waiting on 543 partners a layer; with a message from each, the bound's
least is 1.53 s, on 287.

Note [Menus end at the floor]: every relaxation value is at least the least work of the batch
spread over the slots (:func:`menu_floor` of :func:`hdp.planner.degrees.least_time`), so below that
height a job's height no longer matters, only its area. A menu thus ends at the coarse degree where
the height first drops below the floor, and bounds give the degrees past it one option: that height
and the least area of the coarse degrees past it, walked until the area grows (the degrees between
them are covered as the menus' own gaps are). On the GPU profiles the area grows at once, but on
the CPU profile more members save more work (Note [Splits that save work] in
:mod:`hdp.planner.degrees`) and it may fall. In ``node`` exchange the heights of a long sequence
fall up to the whole cluster; without this end its menu would price every degree up to it. (``rank``
menus end where their heights stop falling, well before.)

Note [Heights past a node]: a member's height is its share of the compute, falling as ``1 / d``,
plus the K/V traffic its attention does not hide, which grows as the attention shrinks, plus a
latency per partner, growing with ``d``: a convex curve once the job spans more than one node (the
step where its traffic first crosses the NIC breaks it within one node). So a menu's coarse pass
stops at two rises in a row past one node, and a 64K-token sequence that is fastest on 16 ranks is
not priced on the 500 that could each hold a block of it. ``tests/test_menus.py`` checks the
stopping point against pricing every coarse degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from hdp import CostModel
from hdp.plan import BLOCK_TOKENS

from .common import blocks_fit, megatron_group_sizes, use_blocks
from .splits import ZigzagJobs, menu_pricing, split_times, ulysses_options


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
    zigzag split other strategies use, traffic priced by its bytes and partners (Note [Bounds price
    bytes and partners]), up to the fastest."""

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


_MENUS: dict[tuple, dict[int, Menu]] = {}  # per cost model and settings: per length


def clear_menus() -> None:
    """Forget every cached menu (a benchmark's cold start: a training step's new lengths)."""
    _MENUS.clear()
    fastest_height.cache_clear()


_MOST_MENUS = 1 << 14  # cached menus kept, across cost models (a menu is a few hundred bytes)


def length_menus(
    cost: CostModel,
    lengths: list[int],
    sync: str,
    capacity: int,
    pow2: bool = False,
    floor_s: float = 0.0,
    bounds: bool = True,
    most_ranks: int | None = None,
) -> tuple[Menu, ...]:
    """Priced degree menus of ``lengths`` (cached per cost model, so repeated lengths are free;
    the others are priced together, a numpy pass per stretch of degrees rather than per length):
    :func:`_zigzag_menus`, with the bound's :func:`ulysses_options` beside them. Megatron's
    form (``pow2``) is bounded over its own zigzag CP groups, so its menus have none. The
    bound's entries (a head-parallel menu's are the P2P menu's) are priced only where
    ``bounds`` asks: hdp's own relaxation needs none. ``most_ranks``: no degree above it (hdp's
    ``--max-ranks-per-seq``)."""
    # (pow2 menus have the bound's entries all)
    key = (cost, sync, capacity, pow2, floor_s, most_ranks, bounds or pow2)
    # (A cost model's hash walks its fields: each key is hashed once, not once a length.)
    own, full = _MENUS.get(key, {}), _MENUS.get(key[:-1] + (True,), {})  # full: for either
    wanted = [int(x) for x in lengths]
    menus = {x: mu for x in set(wanted) if (mu := own.get(x) or full.get(x)) is not None}
    todo = sorted(set(wanted) - menus.keys())
    if todo:
        if sum(map(len, _MENUS.values())) + len(todo) > _MOST_MENUS:
            _MENUS.clear()
        new = dict(
            zip(todo, _new_menus(cost, todo, sync, capacity, pow2, floor_s, key[-1], most_ranks))
        )
        _MENUS.setdefault(key, {}).update(new)
        menus.update(new)
    return tuple(menus[x] for x in wanted)


def _new_menus(
    cost: CostModel,
    lengths: list[int],
    sync: str,
    capacity: int,
    pow2: bool,
    floor_s: float,
    bounds: bool,
    most_ranks: int | None = None,
) -> list[Menu]:
    heads = cost.kv_exchange == "ulysses" and not pow2
    menus = _zigzag_menus(
        cost, lengths, sync, capacity, pow2, floor_s, bounds and not heads, most_ranks
    )
    if pow2 or not bounds:
        return menus
    if heads:  # hdp's head-parallel entries; the bound's are the P2P menus'
        p2p = length_menus(cost.with_exchange("rank"), lengths, sync, capacity, pow2, floor_s)
        return [
            replace(
                menu,
                bound_degrees=p.bound_degrees,
                bound_height=p.bound_height,
                bound_area=p.bound_area,
                tail_area=p.tail_area,
                ulysses_height=p.ulysses_height,
                ulysses_area=p.ulysses_area,
            )
            for menu, p in zip(menus, p2p)
        ]
    return [
        replace(menu, ulysses_height=height, ulysses_area=area)
        for menu, (height, area) in zip(menus, ulysses_options(cost, lengths, sync))
    ]


def _zigzag_menus(
    cost: CostModel,
    lengths: list[int],
    sync: str,
    capacity: int,
    pow2: bool = False,
    floor_s: float = 0.0,
    bounds: bool = True,
    most_ranks: int | None = None,
) -> list[Menu]:
    """Priced degree menus of lengths split in zigzag shares. Degrees above the one with the
    smallest height are dropped: they are slower and larger. ``pow2``: only the CP group sizes
    Megatron builds (:func:`hdp.planner.common.megatron_group_sizes`), each priced until the
    heights rise for good. ``floor_s``: a lower bound of the step (:func:`menu_floor`); a menu
    ends a little past the first degree no taller than it (Note [Menus end at the floor]).
    ``bounds`` False leaves the bound's entries unpriced: they repeat hdp's and bound
    nothing. ``most_ranks``: no degree above it."""
    off_cap = cost.offload_capacity(sync)
    most_ranks = min(menu_pricing(cost, pow2)[1], most_ranks or cost.cluster.num_ranks)
    if pow2:
        sizes = np.asarray(megatron_group_sizes(cost.cluster.num_ranks), dtype=np.int64)
        sizes = sizes[sizes <= most_ranks]
        degrees = [sizes[sizes * max(capacity, 1) >= x] for x in lengths]
        return _coarse(cost, lengths, sync, degrees, 0.0, pow2=True)
    # A coarse pass finds where the height stops falling; the fine menu stops a little beyond.
    # Members hold at least one block: fewer tokens per member would leave the exact splits of
    # other strategies faster than every degree priced, and the bound would not be one.
    # One degree beyond the fewest that hold it: blocks can leave the fewest a block over the
    # capacity (1793 tokens on 3 ranks of 640: 641 on one).
    widest = [
        min(most_ranks, max(1, x // BLOCK_TOKENS, -(-x // max(off_cap, 1)) + 1)) for x in lengths
    ]
    candidates = [
        degree_menu(x, w, off_cap, ratio=1.5, dense_up_to=4) for x, w in zip(lengths, widest)
    ]
    coarse = _coarse(cost, lengths, sync, candidates, floor_s)
    fine = [
        _Fine.of(cost, *args, off_cap, floor_s, bounds)
        for args in zip(lengths, widest, candidates, coarse)
    ]
    priced = _priced_many(
        cost, lengths, [f.priced for f in fine], sync, pow2, bounds, [f.degrees.size for f in fine]
    )
    return [f.menu(cost, x, sync, *mu) for f, x, mu in zip(fine, lengths, priced)]


class _Fine(NamedTuple):
    """One length's fine menu: the degrees it prices, where the coarse pass put its end, and the
    coarse degrees past a cut end (Note [Menus end at the floor])."""

    degrees: np.ndarray  # the menu's own
    top: int
    past: np.ndarray

    @property
    def priced(self) -> np.ndarray:
        """The degrees priced: the first past the end with the menu (most tail walks stop
        there)."""
        return np.concatenate([self.degrees, self.past[:1]])

    @classmethod
    def of(
        cls,
        cost: CostModel,
        length: int,
        widest: int,
        candidates: np.ndarray,
        coarse: Menu,
        off_cap: int,
        floor_s: float,
        bounds: bool,
    ) -> _Fine:
        if candidates.size == 0:  # more ranks than the cluster has
            return cls(candidates, widest, candidates)
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
        # Heights jump where a job crosses into one more node (more K/V over the NIC), so the
        # fastest degree is often a whole number of nodes: add the node multiples around every
        # fine degree. The sweep's virtual options assume heights between two entries lie above
        # the lower one, which holds only with those multiples in the menu.
        rpn = cost.cluster.ranks_per_node
        nodes = np.concatenate([(fine // rpn) * rpn, -(-fine // rpn) * rpn])
        nodes = nodes[(nodes >= fine[0]) & (nodes <= fine[-1]) & (nodes > 0)]
        past = candidates[candidates > top] if cut and bounds else candidates[:0]
        return cls(np.unique(np.concatenate([fine, nodes])), top, past)

    def menu(
        self, cost: CostModel, length: int, sync: str, menu: Menu, last: tuple[float, float]
    ) -> Menu:
        """The menu (its entries up to the lowest height, :func:`_priced_many`), with the tail
        walked from ``last``, the bound's (height, area) at the first degree past the end."""
        at_top = np.flatnonzero(menu.bound_degrees == self.top)
        if self.past.size == 0 or at_top.size == 0:  # (past its lowest height areas only grow)
            return menu
        walk = _TailWalk(cost, length, sync, False, last)
        end_area = float(menu.bound_area[at_top[0]])
        return replace(menu, tail_area=walk.least_area(end_area, self.past))


def _priced_many(
    cost: CostModel,
    lengths: list[int],
    degrees: list[np.ndarray],
    sync: str,
    pow2: bool,
    with_bounds: bool,
    menu_sizes: list[int] | None = None,
) -> list:
    """:func:`_priced` of each length at its degrees, a pass per run of (length, degree) pairs
    whose jobs have about :data:`_PASS_MEMBERS` members in all: numpy's overhead per call is
    paid once a run, and a run's arrays stay in the CPU's cache (a long sequence's menu takes
    several). With ``menu_sizes``, each length's first that many entries cut to their lowest
    height (:func:`_until_lowest`), with the bound's (height, area) at its last degree:
    ``(menu, (height, area))`` per length."""
    sizes = np.array([d.size for d in degrees])
    flat_len = np.repeat(np.asarray(lengths, dtype=np.int64), sizes)
    flat_deg = np.concatenate(degrees).astype(np.int64)
    # A run ends with the pair that brings its members to the next multiple of _PASS_MEMBERS.
    members = np.cumsum(flat_deg)
    steps = np.arange(_PASS_MEMBERS, int(flat_deg.sum()), _PASS_MEMBERS)
    ends = np.unique([0, *(np.searchsorted(members, steps) + 1).tolist(), flat_deg.size])
    runs = [
        _priced(cost, flat_len[lo:hi], sync, flat_deg[lo:hi], pow2, with_bounds)
        for lo, hi in zip(ends[:-1], ends[1:])
    ] or [_priced(cost, flat_len, sync, flat_deg, pow2, with_bounds)]  # (no pairs at all)
    mu = Menu(*(np.concatenate([getattr(r, f) for r in runs]) for f in _ENTRY_FIELDS))
    if menu_sizes is None:
        return _split(mu, sizes, sizes)
    seg = np.repeat(np.arange(sizes.size), sizes)
    in_menu = np.arange(seg.size) - (np.cumsum(sizes) - sizes)[seg]
    in_menu = in_menu < np.asarray(menu_sizes)[seg]
    inside = Menu(*(getattr(mu, f)[in_menu] for f in _ENTRY_FIELDS))
    last = np.where(sizes > 0, np.cumsum(sizes) - 1, -1)  # (-1: none, the inf appended)
    tails = (np.append(x, np.inf)[last].tolist() for x in (mu.bound_height, mu.bound_area))
    cut = _until_lowest(inside, seg[in_menu], seg[in_menu], sizes.size)
    return list(zip(cut, zip(*tails)))


def _until_lowest(mu: Menu, own_seg: np.ndarray, bound_seg: np.ndarray, count: int) -> list[Menu]:
    """``count`` menus laid end to end in ``mu`` (``own_seg``, ``bound_seg``: the menu of each
    of hdp's and of the bound's entries, in order), each set of entries cut to the feasible
    ones up to its lowest height."""
    own = _lowest_kept(own_seg, mu.degrees, mu.height, count)
    bound = _lowest_kept(bound_seg, mu.bound_degrees, mu.bound_height, count)
    kept = Menu(*(getattr(mu, f)[own if k < 4 else bound] for k, f in enumerate(_ENTRY_FIELDS)))
    per_menu = [np.bincount(s[k], minlength=count) for s, k in ((own_seg, own), (bound_seg, bound))]
    return _split(kept, *per_menu)


def _split(mu: Menu, own: np.ndarray, bound: np.ndarray) -> list[Menu]:
    """``mu``'s entries as consecutive menus of ``own[k]`` of hdp's and ``bound[k]`` of the
    bound's entries each."""
    cuts = []
    for counts in (own, bound):
        ends = np.cumsum(counts).tolist()
        cuts.append(list(zip([0, *ends[:-1]], ends)))
    fields = [(getattr(mu, f), cuts[k >= 4]) for k, f in enumerate(_ENTRY_FIELDS)]
    return [Menu(*(x[a:b] for x, c in fields for a, b in (c[i],))) for i in range(len(own))]


def first_least(seg: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Of entries laid out menu after menu (``seg``: each entry's menu, in order), each menu's
    first entry of least ``key`` (what ``np.argmin`` picks one menu at a time), menu by menu."""
    if seg.size == 0:
        return seg
    order = np.lexsort((np.arange(seg.size), key, seg))
    return order[np.concatenate([[True], seg[order][1:] != seg[order][:-1]])]


def _lowest_kept(
    seg: np.ndarray, degrees: np.ndarray, height: np.ndarray, count: int
) -> np.ndarray:
    """Which entries of ``count`` menus (``seg``: each entry's, in order) to keep: the
    feasible ones up to the first of its menu's lowest height."""
    ok = np.isfinite(height)
    idx = np.flatnonzero(ok)
    first = idx[first_least(seg[idx], height[idx])]
    top = np.full(count, -1, dtype=np.int64)
    top[seg[first]] = degrees[first]
    return ok & (degrees <= top[seg])


_PASS_MEMBERS = 1 << 13


def _priced(
    cost: CostModel, length, sync: str, deg: np.ndarray, pow2: bool, with_bounds: bool
) -> Menu:
    """The menu of ``length`` (one, or one per degree) at degrees ``deg`` (every one,
    infeasible ones too); ``with_bounds`` False leaves the bound's entries unpriced (they repeat
    hdp's and bound nothing). Megatron (``pow2``) splits into exact shares; hdp by
    :func:`hdp.planner.common.use_blocks`, priced here in blocks first and exactly where the
    blocks leave a member over the offload capacity."""
    times, _, in_blocks = menu_pricing(cost, pow2)
    deg = np.asarray(deg, dtype=np.int64)
    k, lengths = deg.size, np.broadcast_to(np.asarray(length, dtype=np.int64), deg.shape)
    blocked = blocks_fit(lengths, deg) & in_blocks
    if not blocked.any():  # one split; the bound's entries price it by bytes and partners
        if not (with_bounds and times is split_times):
            h, a, most = times(cost, lengths, deg, sync, 1)
            return Menu(deg, h, a, most, deg, h, a)
        # (Megatron runs every share in a micro-batch of its own: so do its bound's entries.)
        jobs = ZigzagJobs.of(cost, lengths, deg, 1)
        h, a, most = jobs.times(sync, True)
        h_bytes, a_bytes, _ = jobs.times(sync, False, own_cells=pow2)
        return Menu(deg, h, a, most, deg, h_bytes, a_bytes)
    align = np.where(blocked, BLOCK_TOKENS, 1)
    room = cost.offload_capacity(sync)
    if not with_bounds:
        h, a, most = times(cost, lengths, deg, sync, align)
        over = blocked & ~use_blocks(lengths, deg, most, room)
        if over.any():
            exact = times(cost, lengths, deg, sync, 1)
            h, a, most = (np.where(over, e, x) for x, e in zip((h, a, most), exact))
        return Menu(deg, h, a, most, deg, h, a)
    # hdp's entries and the bound's from one pass over both splits: each degree split by
    # ``align``, then the blocked ones again exactly (the others are split so already). hdp's
    # entries price the exact split only where the blocks leave a member over the room.
    again = np.flatnonzero(blocked)
    jobs = ZigzagJobs.of(
        cost,
        np.concatenate([lengths, lengths[again]]),
        np.concatenate([deg, deg[again]]),
        np.concatenate([align, np.ones_like(again)]),
    )
    over = blocked & ~use_blocks(lengths, deg, jobs.most_tokens[:k], room)
    timed = jobs.only(np.concatenate([np.ones(k, dtype=bool), over[again]])).times(sync, True)
    h, a, most = (x[:k] for x in timed)
    for x, exact in zip((h, a, most), timed):
        x[over] = exact[k:]
    by_bytes = jobs.times(sync, False)
    bound = [x[:k] for x in by_bytes[:2]]
    for x, exact in zip(bound, by_bytes):
        x[again] = np.fmin(x[again], exact[k:])
    return Menu(deg, h, a, most, deg, *bound)


def _coarse(
    cost: CostModel,
    lengths: list[int],
    sync: str,
    candidates: list[np.ndarray],
    floor_s: float,
    pow2: bool = False,
) -> list[Menu]:
    """hdp's entries at each length's coarse ``candidates``, priced a stretch at a time (the
    first up to two nodes, each next one to four times its last degree; all lengths' stretches
    in one pass) until its heights reach the floor or rise for good past one node
    (:func:`_coarse_done`). A long sequence's menu ends far below the ranks that could hold a
    block each. ``pow2``: Megatron's menus, priced in exact shares with the bound's entries,
    until the bound's heights rise for good too (where a split saves attention work, past one
    block a member, to the end)."""
    rpn = cost.cluster.ranks_per_node
    parts: list[list[Menu]] = [[] for _ in lengths]
    past: list[list[float]] = [[] for _ in lengths]  # the heights priced past one node
    past_bound: list[list[float]] = [[] for _ in lengths]  # (pow2: the bound's too)
    if pow2:
        saves = split_saves_work(cost, np.asarray(lengths, dtype=np.int64)).tolist()
    start = [0] * len(lengths)
    end = [max(1, int(np.searchsorted(c, 2 * rpn, side="right"))) for c in candidates]
    live = [i for i, c in enumerate(candidates) if c.size]
    while live:
        stretches = [candidates[i][start[i] : end[i]] for i in live]
        priced = _priced_many(cost, [lengths[i] for i in live], stretches, sync, pow2, pow2)
        going = []
        for i, mu in zip(live, priced):
            parts[i].append(mu)
            past[i] += mu.height[mu.degrees > rpn].tolist()
            done = _coarse_done(mu.height, past[i], floor_s)
            if pow2:  # the bound's entries end at their own lowest height, often past hdp's
                past_bound[i] += mu.bound_height[mu.bound_degrees > rpn].tolist()
                done = done and _coarse_done(mu.bound_height, past_bound[i], floor_s)
                # Megatron splits exactly, to a token a rank: where splits save attention work
                # (the CPU profile's kernels), heights past one block a member may fall again,
                # so those are all priced.
                small = lengths[i] < BLOCK_TOKENS * int(mu.degrees[-1])
                done = done and not (small and saves[i])
            c = candidates[i]
            if end[i] < c.size and not done:
                start[i] = end[i]
                end[i] = max(end[i] + 1, int(np.searchsorted(c, 4 * c[end[i] - 1], side="right")))
                going.append(i)
        live = going
    if not parts:
        return []
    merged = [_merged(p) if p else _EMPTY for p in parts]
    everything = Menu(*(np.concatenate([getattr(m, f) for m in merged]) for f in _ENTRY_FIELDS))
    own = np.repeat(np.arange(len(merged)), [m.degrees.size for m in merged])
    bound = np.repeat(np.arange(len(merged)), [m.bound_degrees.size for m in merged])
    return _until_lowest(everything, own, bound, len(merged))


def _coarse_done(height: np.ndarray, past: list[float], floor_s: float) -> bool:
    """Whether a coarse pass may stop after a stretch priced at ``height``, with ``past`` the
    heights so far past one node: they reached the floor (the pass stops at the first stretch
    that does) or rose twice in a row, from where they only rise (Note [Heights past a
    node])."""
    return bool((height <= floor_s).any()) or (len(past) >= 3 and past[-1] > past[-2] > past[-3])


def _merged(parts: list[Menu]) -> Menu:
    """Menus of consecutive degrees as one (hdp's entries and the bound's alike)."""
    if len(parts) == 1:
        return parts[0]
    return Menu(*(np.concatenate([getattr(p, f) for p in parts]) for f in _ENTRY_FIELDS))


_ENTRY_FIELDS = (
    "degrees",
    "height",
    "area",
    "most_tokens",
    "bound_degrees",
    "bound_height",
    "bound_area",
)
_EMPTY = Menu(*(np.zeros(0, dtype=np.int64),) * 7)


@lru_cache(maxsize=1024)
def fastest_height(cost: CostModel, length: int, sync: str, capacity: int) -> float:
    """The least height of the degrees of :func:`length_menus` (``inf`` where none holds the
    length), without pricing the bound's entries."""
    heights = _zigzag_menus(cost, [length], sync, capacity, bounds=False)[0].height
    return float(heights.min()) if heights.size else math.inf


class _TailWalk(NamedTuple):
    """The bound's entries past a cut menu's end (Note [Menus end at the floor]), the first
    already priced."""

    cost: CostModel
    length: int
    sync: str
    pow2: bool
    first: tuple[float, float]  # (height, area) at the first degree past the end

    def least_area(self, end_area: float, degrees: np.ndarray) -> float:
        """Least bound area of the coarse ``degrees`` past the menu's end (where it is
        ``end_area``), walked in order until the area grows again."""
        least = last = end_area
        for k, d in enumerate(degrees.tolist()):
            if k == 0:
                height, area = self.first
            else:
                mu = _priced(self.cost, self.length, self.sync, np.array([d]), self.pow2, True)
                height, area = float(mu.bound_height[0]), float(mu.bound_area[0])
            if not math.isfinite(height) or area >= last:
                return least
            least = last = area
        return least


def split_saves_work(cost: CostModel, lens: np.ndarray) -> np.ndarray:
    """Which sequences some zigzag split covers with less area than the whole sequence: those
    whose attention some equal split does faster (a split's members run the same dense work, at
    best the packed speed a whole sequence gets too). None on the GPU profiles but the longest
    sequences; where causal calls run slower per FLOP than full ones (the CPU profile's reference
    kernel computes a causal block's masked half too), most. Their menus must be priced for the
    bound to hold."""
    whole = cost.attn_time(np.zeros(lens.size), lens)
    return cost.least_attn_of(lens) < whole * (1 - 1e-9)


def menu_floor(work_s: np.ndarray, slots: int) -> float:
    """The work ``work_s`` spread evenly over ``slots``, rounded down to a quarter octave so that
    batches alike share cached menus: a lower bound of every relaxation value where ``work_s``
    is each sequence's :func:`least_time`."""
    simple = float(np.sum(work_s)) / max(slots, 1)
    return 0.0 if simple <= 0 else float(2.0 ** (math.floor(math.log2(simple) * 4) / 4))
