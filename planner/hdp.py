"""``hdp``: malleable-job degrees from the relaxation, node-aware placement, gaps filled.

1. Degrees (:mod:`planner.degrees`): every long sequence gets a menu of degrees priced by the
   cost model (compute at the kernel efficiency of its blocks, exposed K/V traffic over NVLink
   and the NIC, host offload where its members hold more than the capacity). The relaxation picks
   the height ``M`` minimising ``max(M, area / ranks)`` and, for each sequence, the smallest-area
   degree no taller than ``M``: so a sequence spans more ranks than its memory needs when that
   shortens the step, and fewer when more would only expose communication. Short sequences stay
   whole. Where the MILP of :mod:`planner.hdp_ilp` fits the time budget it chooses the degrees
   instead, warm-started from these.
2. Placement, tallest job first: a multi-rank job takes the least-loaded ranks of one node when it
   fits in a node (else the least-loaded whole nodes), blocks of 128 tokens in zigzag head/tail
   pairs; ``wave`` sync: in the wave whose height it raises least; ``peer`` sync: after
   everything already on its members.
3. Single-rank sequences, longest first: ``peer``: into the idle gaps before multi-rank jobs
   (the ranks of a job start together, so the less-loaded members wait), best fit, then LPT onto
   the least-loaded rank; then moves from the most to the least loaded rank while the maximum
   falls. Waves are then the fewest that keep each rank's order (lock-step levels). ``wave``:
   the cell with token room that raises its wave least; where that raise is positive, a cell
   that offloads part of its activations (host copy priced) may raise it less; a new wave only
   when it costs less than the raise. Then, on the cost model's own cell times, whole sequences
   move out of each wave's slowest cell while that lowers it.
4. ``form="whole"``: every sequence on one rank (step 3 alone), for trainers whose attention
   cannot span ranks (Megatron without hybrid CP: ``dataloader.megatron.PackedBatchIterator``).
5. ``form="megatron"``: degrees are powers of two on aligned groups of consecutive ranks
   (Megatron's hybrid-CP groups): barrier-separated groups, or one group of start-time-ordered
   lists (see :func:`plan_hdp_megatron`).

Several heights around ``M`` are placed (in ``wave`` sync also shelves down to a quarter of the
tallest job's fastest time, at the best height token-capped splits and a two-tier variant whose
cheapest whole sequences per token get waves of their own, and the best three *shelf*
candidates, :func:`shelf_candidates`); the cost model keeps the fastest plan, which reports its
gap to the bound (:func:`planner.degrees.step_bound`) in ``predicted["bound_s"]``. In ``wave``
sync the candidates go least work first, and one whose work alone
(:func:`planner.degrees.work_area` over the ranks) is not below the best step so far is not
placed.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hdp import Plan

from .common import Context, PlanBuilder, PlanningError, next_pow2, zigzag_arrays
from .degrees import BLOCK_ALIGN, Relaxation, relaxation_bound, step_bound, work_area

NATIVE_SYNC = "peer"
HEIGHT_FACTORS = (1.0, 1.04, 1.12)  # heights placed, relative to the relaxation's M
# The Megatron form also tries lower heights (wider, faster jobs): a job on all ranks there runs
# alone, so the jobs after it must be fast rather than area-efficient (byted-2m at 64 ranks:
# 81 s at M, 63 s at M / 2, bound 56 s).
MEGATRON_HEIGHT_FACTORS = (0.35, 0.5, 0.7, 1.0, 1.12)
TOKEN_SHARES = (
    0.25,
)  # ``wave`` sync: most tokens per member of a split, as a share of the offload capacity
CHEAP_WAVE_SHARE = (
    0.4  # ``wave`` sync, two tiers: the dense waves hold at most this share of the offload capacity
)
# ``wave`` sync, no stacking: a multi-rank job joins a wave that already holds work only if that
# raises the wave by at most this share of the job's time (else it opens a wave of its own).
STACK_SHARE = 0.05
# ``wave`` sync, shelf candidates: first-wave heights tried, and how many of them (the best by
# :func:`_estimate_wave_step`) are placed in full.
SHELF_HEIGHTS = 64
SHELF_PLACED = 3


def check_fits(ctx: Context) -> None:
    """Raise PlanningError when the longest sequence cannot be held by all ranks together."""
    longest = int(ctx.seq_lens.max(initial=0))
    off_cap = max(ctx.cost.offload_capacity(ctx.sync), ctx.capacity)
    if longest > off_cap * ctx.num_ranks:
        raise PlanningError(
            f"hdp: a sequence of {longest} tokens needs {-(-longest // off_cap)} ranks at {off_cap} tokens each "
            f"(with activation offload), but the cluster has {ctx.num_ranks}; use more GPUs or a smaller --max-seq"
        )


def plan_hdp(
    ctx: Context,
    form: str = "free",
    polish_moves: int = 20000,
    use_ilp: bool | None = None,
    ilp_time_limit_s: float = 2.0,
) -> Plan:
    """Plan with the relaxation's degrees (or the MILP's where it fits) at a few heights; keep
    the fastest by the cost model. ``use_ilp``: ``None`` = where it fits the budget. ``form``:
    ``free``, ``whole`` (every sequence on one rank: balanced placement alone, for trainers whose
    attention cannot span ranks) or ``megatron`` (:func:`plan_hdp_megatron`)."""
    from . import hdp_ilp

    if form == "megatron":
        return plan_hdp_megatron(ctx)
    if form not in ("free", "whole"):
        raise ValueError(f"unknown hdp form {form!r}: choose 'free', 'whole' or 'megatron'")
    check_fits(ctx)
    n, cap = ctx.num_ranks, ctx.capacity
    num_waves = num_waves_for(ctx)
    if form == "whole":  # every sequence on one rank: only the placement balances
        longest = int(ctx.seq_lens.max(initial=0))
        if longest > cap:
            raise PlanningError(
                f"hdp (whole form): a sequence of {longest} tokens does not fit one rank's "
                f"{cap} tokens; raise the capacity or use a form that splits sequences"
            )
        degree = np.ones(ctx.seq_lens.size, dtype=np.int64)
        plan = _place(
            ctx,
            num_waves,
            degree,
            np.asarray(ctx.cost.seq_time(ctx.seq_lens), dtype=np.float64),
            polish_moves,
        )
        plan.predicted["bound_s"] = float(step_bound(ctx.cost, ctx.seq_lens, ctx.sync, cap))
        return plan
    rel = relaxation_bound(ctx.cost, ctx.seq_lens, ctx.sync, cap, n)
    bound_s = float(step_bound(ctx.cost, ctx.seq_lens, ctx.sync, cap))
    heights = candidate_heights(rel, ctx.sync)
    candidates = [rel.degrees_at(h, ctx.cost) for h in heights]
    height_of = list(heights)  # the relaxation height of each candidate (None: another source)
    if ctx.sync == "wave" and num_waves > 1:  # also balance each wave as if area spread evenly
        per_wave = relaxation_bound(ctx.cost, ctx.seq_lens, ctx.sync, cap, n * num_waves)
        candidates += [per_wave.degrees_at(per_wave.height_s * f, ctx.cost) for f in HEIGHT_FACTORS]
        height_of += [None] * len(HEIGHT_FACTORS)
    info: dict[str, float] = {}
    if use_ilp or (use_ilp is None and hdp_ilp.fits_budget(rel, n)):
        choice = hdp_ilp.solve_degrees(
            rel, ctx.cost, ctx.sync, n, warm=candidates[0][0], time_limit_s=ilp_time_limit_s
        )
        info.update(choice.info)
        if choice.degrees is not None:
            candidates.insert(0, (choice.degrees, choice.job_time))
            height_of.insert(0, None)
    best: tuple[float, Plan] | None = None
    placed: list[tuple[np.ndarray, tuple, float, bool]] = []  # (degrees, variant, step s, stacked)
    work_of: dict[
        bytes, float
    ] = {}  # degrees -> work_area / ranks: the order, then every skip test

    def work_s(degree: np.ndarray) -> float:
        key = degree.tobytes()
        if key not in work_of:
            work_of[key] = work_area(ctx.cost, ctx.seq_lens, degree, ctx.sync, cap) / n
        return work_of[key]

    def place_variant(
        degree: np.ndarray,
        job_time: np.ndarray,
        cheap_share: float | None,
        stack_share: float | None,
        prune_at: float,
    ) -> tuple[float, bool]:
        """(step s, whether a job stacked) of one placement, placed once (a repeat returns what
        it got); ``inf`` without placing where (``wave`` sync) its work spread evenly over the
        ranks already takes ``prune_at`` seconds or more: it cannot be faster."""
        nonlocal best
        variant = (cheap_share, stack_share)
        for d, v, t, stacked in placed:
            if v == variant and np.array_equal(degree, d):
                return t, stacked
        if ctx.sync == "wave" and work_s(degree) >= prune_at:
            placed.append((degree, variant, math.inf, False))
            return math.inf, False
        plan = _place(ctx, num_waves, degree, job_time, polish_moves, cheap_share, stack_share)
        t = ctx.cost.evaluate(plan).step_time_s
        stacked = plan.predicted.get("stacked_jobs", 0.0) > 0
        placed.append((degree, variant, t, stacked))
        if best is None or t < best[0]:
            best = (t, plan)
        return t, stacked

    def place(
        degree: np.ndarray,
        job_time: np.ndarray,
        cheap_share: float | None = None,
        prune_at: float = math.inf,
    ) -> float:
        """Step time of a candidate (:func:`place_variant`). ``wave`` sync: where a multi-rank
        job joined a wave that already held work and raised it by more than ``STACK_SHARE`` of
        its time, also the variant in which such jobs open waves of their own (the job's cells
        then hold the wave's tallest load while the other ranks, often out of tokens, wait:
        llama-70b byted-2m at 64 ranks 2513 s -> 2390 s), and the faster of the two counts.
        Without such a job it is the same plan, so it is not placed."""
        t, stacked = place_variant(degree, job_time, cheap_share, None, prune_at)
        if stacked:
            t = min(t, place_variant(degree, job_time, cheap_share, STACK_SHARE, best[0])[0])
        return t

    times = [math.inf] * len(candidates)
    order = list(range(len(candidates)))
    if ctx.sync == "wave":
        # Least work first, so the candidates that cannot beat the best so far are skipped (at
        # 1024 ranks most of the fast, area-hungry shelves: 70B planning 1.5-2.7x faster). A height
        # candidate is skipped only against the best height candidate: the best height, which the
        # variants below start from, stays the one all of them placed would give.
        order.sort(key=lambda k: work_s(candidates[k][0]))
    for k in order:
        is_height = height_of[k] is not None
        best_height_s = min(
            (t for t, h in zip(times, height_of) if h is not None), default=math.inf
        )
        times[k] = place(
            *candidates[k], prune_at=best_height_s if is_height else (best[0] if best else math.inf)
        )
    if ctx.sync == "wave":
        # A wave's cells fill up with tokens before time when they hold long whole sequences
        # (a 180K-token sequence is cheap per token next to a shard of a 1M-token one). At the
        # best height, also (a) cap the tokens each member of a split holds, so more
        # sequences split and every cell gets a mix (llama-70b byted-2m at 256 ranks: 607 s ->
        # 593 s), and (b) give the cheapest whole sequences per token waves of their own, so the
        # dense waves keep token room (github-2m at 256 ranks: 329 s -> 321 s; a wave costs
        # only its collectives' tail where its compute hides them).
        off_cap = ctx.cost.offload_capacity(ctx.sync)
        _, h = min((t, h) for t, h in zip(times, height_of) if h is not None)
        for share in TOKEN_SHARES:
            place(*rel.degrees_at(h, ctx.cost, int(share * off_cap)), prune_at=best[0])
        place(*rel.degrees_at(h, ctx.cost), cheap_share=CHEAP_WAVE_SHARE, prune_at=best[0])

        # The longest jobs side by side in one tall wave, area-efficient, the rest fast (see
        # shelf_candidates; llama-70b byted-2m at 64 ranks: 2382 s -> 2299 s). Not where the
        # best plan is at the bound already.
        def hopeless(degree: np.ndarray) -> bool:  # place_variant would skip it
            return work_s(degree) >= best[0]

        if best[0] > bound_s * (1 + 1e-3):
            for degree, job_time in shelf_candidates(ctx, rel, num_waves, heights, hopeless)[
                :SHELF_PLACED
            ]:
                place_variant(degree, job_time, None, STACK_SHARE, best[0])
    plan = best[1]
    if ctx.sync == "wave":
        for _ in range(3):
            moved = _rebalance_wave(ctx, plan, ctx.cost.evaluate(plan).busy_s)
            if moved is None:
                break
            t = ctx.cost.evaluate(moved).step_time_s
            if t >= best[0]:
                break
            best, plan = (t, moved), moved
    plan.predicted.update(info)
    plan.predicted["bound_s"] = bound_s
    plan.predicted["relaxation_height_s"] = rel.height_s
    return plan


def candidate_heights(rel: Relaxation, sync: str) -> list[float]:
    """Job heights to place. ``peer``: around the relaxation's ``M``. ``wave``: a step is the sum
    of its waves' heights, so tall jobs must share waves side by side (shelves); from the
    shortest the tallest job can be (every job on its fastest degree: narrow shelves, more area)
    up to ``M`` (every job on its smallest area: wide shelves)."""
    if sync == "peer" or not rel.menus:
        return [rel.height_s * f for f in HEIGHT_FACTORS]
    floor = max(float(mu.height.min()) for mu in rel.menus)
    top = max(floor, rel.height_s)
    shelves = [float(h) for h in np.geomspace(floor, top, 4)] if top > floor * 1.01 else [floor]
    # Below the floor the tallest job stays at its fastest while the others get faster too, so
    # they stack under it in fewer, fuller waves (llama-70b github-2m at 64 ranks: 1400 s -> 1262 s).
    return [floor * 0.25, floor * 0.5] + shelves


def shelf_candidates(
    ctx: Context,
    rel: Relaxation,
    num_waves: int,
    heights: list[float],
    hopeless: Callable[[np.ndarray], bool] = lambda degree: False,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``wave`` sync: (degree, busy time s) candidates whose first wave is a *shelf*, best first
    by :func:`_estimate_wave_step` (with no stacking, the variant they are placed in).

    A height ``H1`` from the longest sequence's menu (above its fastest time): the
    longest sequences, longest first, each on the fewest ranks that keep it under ``H1``, join the
    shelf while their ranks fit; then the shelf's tallest job widens to its next menu degree while
    the ranks left allow. Every other sequence takes the relaxation's degrees at the two lowest
    candidate ``heights`` (fast, wide jobs: the waves after the shelf balance finely); candidates
    for which ``hopeless(degree)`` holds are left out before they are estimated. The single
    height of :func:`candidate_heights` cannot express this: at a height where the longest jobs are
    area-efficient, the next ones are that tall too and open tall waves that the whole sequences,
    out of tokens before time, cannot fill (llama-70b byted-2m at 64 ranks: five jobs of 0.7-1.2M
    tokens on one 1131 s shelf, a 2299 s step, where the best single height gives 2382 s)."""
    if not rel.menus:
        return []
    lens, cost, n = ctx.seq_lens, ctx.cost, ctx.num_ranks
    by_length = sorted(range(len(rel.menus)), key=lambda j: (-int(lens[rel.long_ids[j]]), j))
    first = rel.menus[by_length[0]]
    tall = np.sort(
        first.height[np.isfinite(first.height) & (first.height >= 1.02 * first.height.min())]
    )[::-1]
    if tall.size == 0:
        return []
    shelf_heights = tall[:: max(1, tall.size // SHELF_HEIGHTS)]
    whole = np.asarray(cost.seq_time(lens), dtype=np.float64)
    scored = []
    for top in shelf_heights.tolist():
        on_shelf: dict[int, int] = {}  # menu of a long sequence -> its entry
        width = 0
        for j in by_length:
            fits = np.flatnonzero(rel.menus[j].height <= top)
            if fits.size and width + int(rel.menus[j].degrees[fits[0]]) <= n:
                on_shelf[j] = int(fits[0])
                width += int(rel.menus[j].degrees[fits[0]])
        tallest = [(-float(rel.menus[j].height[k]), j) for j, k in on_shelf.items()]
        heapq.heapify(tallest)
        while tallest:
            j = tallest[0][1]
            mu, k = rel.menus[j], on_shelf[j]
            if k + 1 >= mu.degrees.size or width + int(mu.degrees[k + 1] - mu.degrees[k]) > n:
                break
            width += int(mu.degrees[k + 1] - mu.degrees[k])
            on_shelf[j] = k + 1
            heapq.heapreplace(tallest, (-float(mu.height[k + 1]), j))
        for rest in heights[:2]:
            degree, job_time = rel.degrees_at(rest, cost)
            for j, k in on_shelf.items():
                degree[rel.long_ids[j]] = rel.menus[j].degrees[k]
                job_time[rel.long_ids[j]] = rel.menus[j].height[k]
            if hopeless(degree):  # e.g. its work alone cannot beat the best plan so far
                continue
            estimate = _estimate_wave_step(ctx, num_waves, degree, job_time, whole, STACK_SHARE)
            scored.append((estimate, len(scored), degree, job_time))
    scored.sort(key=lambda c: c[:2])
    return [(degree, job_time) for _, _, degree, job_time in scored]


def _estimate_wave_step(
    ctx: Context,
    num_waves: int,
    degree: np.ndarray,
    job_time: np.ndarray,
    whole: np.ndarray,
    stack_share: float | None,
) -> float:
    """Step (s) a ``wave``-sync candidate would get, from its multi-rank jobs alone
    (:func:`_place_wave_jobs`): the waves' heights, plus the time of the sequences placed whole
    that the cells' spare time and token room cannot take (those as a fluid of their mean time per
    token), spread over the ranks. A tenth of a placement's cost; among 24-32 shelf candidates of
    four llama-70b batches at 64 ranks, the three it ranks best held the one placed best."""
    off_cap = max(ctx.cost.offload_capacity(ctx.sync), ctx.capacity)
    multi, single = _jobs_and_singles(ctx, degree, job_time, whole)
    layer = _place_wave_jobs(ctx, num_waves, multi, degree, job_time, off_cap, stack_share)
    height = layer.load.max(axis=1)
    fill_s = float(whole[single].sum())
    per_token = fill_s / max(int(ctx.seq_lens[single].sum()), 1)
    room = np.minimum(
        height[:, None] - layer.load, per_token * np.maximum(0, off_cap - layer.tokens)
    )
    return float(height.sum()) + max(0.0, fill_s - float(room.sum())) / ctx.num_ranks


def num_waves_for(ctx: Context) -> int:
    """Waves a ``wave``-sync plan aims at (90% full, so sequences pack); 1 in ``peer`` sync."""
    if ctx.sync != "wave":
        return 1
    return max(1, math.ceil(int(ctx.seq_lens.sum()) / (0.9 * ctx.num_ranks * ctx.capacity)))


def _pick_members(
    load_row: np.ndarray, d: int, rpn: int, eligible: np.ndarray
) -> np.ndarray | None:
    """``d`` ranks for one job: the least-loaded ranks of one node if ``d <= rpn``, else whole
    nodes with the smallest maximum load plus the least-loaded ranks of one more node."""
    n = load_row.size
    nodes = -(-n // rpn)
    padded = np.full(nodes * rpn, np.inf)
    padded[:n] = np.where(eligible, load_row, np.inf)
    grid = padded.reshape(nodes, rpn)
    order = np.argsort(grid, axis=1, kind="stable")
    sorted_loads = np.take_along_axis(grid, order, axis=1)
    if d <= rpn:
        score = sorted_loads[:, d - 1]
        k = int(np.argmin(score))
        if not np.isfinite(score[k]):
            return None
        return np.sort(k * rpn + order[k, :d])
    full, rem = divmod(d, rpn)
    node_max = sorted_loads[:, -1]
    by_max = np.argsort(node_max, kind="stable")
    chosen_nodes = by_max[:full]
    if not np.isfinite(node_max[chosen_nodes]).all():
        return None
    members = [np.arange(k * rpn, (k + 1) * rpn) for k in chosen_nodes]
    if rem:
        rest = by_max[full:]
        if rest.size == 0:
            return None
        score = sorted_loads[rest, rem - 1]
        k = int(rest[int(np.argmin(score))])
        if not np.isfinite(sorted_loads[k, rem - 1]):
            return None
        members.append(k * rpn + order[k, :rem])
    return np.sort(np.concatenate(members))


def _place(
    ctx: Context,
    num_waves: int,
    degree: np.ndarray,
    job_time: np.ndarray,
    polish_moves: int,
    cheap_share: float | None = None,
    stack_share: float | None = None,
) -> Plan:
    """Place sequences of the given degrees on ranks and waves (steps 2 and 3 of the module doc).
    ``wave`` sync: ``cheap_share``: waves of their own for the whole sequences that are cheapest
    per token, so the other waves hold at most that share of the offload capacity;
    ``stack_share``: see :func:`_place_wave`."""
    lens, cost, cap = ctx.seq_lens, ctx.cost, ctx.capacity
    off_cap = max(cost.offload_capacity(ctx.sync), cap)
    whole = np.asarray(cost.seq_time(lens), dtype=np.float64)
    multi, single = _jobs_and_singles(ctx, degree, job_time, whole)
    builder = PlanBuilder(ctx, "hdp")
    if ctx.sync == "wave" and cheap_share is not None:
        # Two tiers: the cheapest whole sequences per token (those that fill a cell's tokens long
        # before its time) go to waves of their own until the rest fits ``cheap_share`` of the
        # ranks' offload capacity in one wave, so the dense waves keep token room.
        by_density = single[np.argsort(whole[single] / lens[single], kind="stable")]
        excess = int(lens.sum()) - cheap_share * ctx.num_ranks * off_cap
        n_cheap = int(np.searchsorted(np.cumsum(lens[by_density]), excess)) + 1 if excess > 0 else 0
        is_cheap = np.zeros(lens.size, dtype=bool)
        is_cheap[by_density[:n_cheap]] = True
        cheap_mask = is_cheap[single]  # ``single`` keeps its longest-first order in both tiers
        keys = _place_wave(
            ctx,
            num_waves,
            multi,
            single[~cheap_mask],
            degree,
            job_time,
            whole,
            off_cap,
            stack_share,
        )
        cheap = single[cheap_mask]
        if cheap.size:
            _, _, cheap_rank, cheap_key, _ = _place_wave(
                ctx, 1, multi[:0], cheap, degree, job_time, whole, off_cap
            )
            after = max(max(keys[1], default=-1), int(keys[3].max(initial=-1))) + 1
            keys[2][cheap] = cheap_rank[cheap]
            keys[3][cheap] = cheap_key[cheap] + after
    elif ctx.sync == "wave":
        keys = _place_wave(
            ctx, num_waves, multi, single, degree, job_time, whole, off_cap, stack_share
        )
    else:
        keys = (*_place_peer(ctx, multi, single, degree, job_time, whole, off_cap, polish_moves), 0)
    multi_members, multi_key, single_rank, single_key, stacked = keys
    if (
        ctx.sync == "wave"
    ):  # waves: the distinct keys in order (the placers use sparse, ordered keys)
        uniq = np.unique(
            np.concatenate([np.asarray(multi_key, dtype=np.int64), single_key[single]])
        )
        multi_wave = np.searchsorted(uniq, np.asarray(multi_key, dtype=np.int64))
        single_wave = np.searchsorted(uniq, single_key[single])
    else:
        multi_wave, single_wave = _peer_levels(
            ctx.num_ranks, multi_members, multi_key, single_rank[single], single_key[single]
        )
    if multi.size:
        aligns = np.array(
            [_split(int(lens[i]), int(degree[i]), off_cap)[0] for i in multi.tolist()],
            dtype=np.int64,
        )
        builder.add_zigzag(multi, multi_wave, multi_members, align=aligns)
    if single.size:
        builder.add(single_wave, single_rank[single], single, 0, lens[single])
    builder.offload_where_needed()
    builder.info = {
        "multi_rank_sequences": float(multi.size),
        "max_degree": float(degree.max(initial=1)),
        "offloading_cells": float(len(builder.offload)),
        "stacked_jobs": float(stacked),
    }
    return builder.build()


def _jobs_and_singles(
    ctx: Context, degree: np.ndarray, job_time: np.ndarray, whole: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(jobs placed as blocks, tallest first: split sequences and whole ones that need offload to
    fit a rank; sequences placed whole on one rank, slowest first)."""
    lens = ctx.seq_lens
    job = (degree > 1) | (lens > ctx.capacity)
    multi = np.flatnonzero(job)
    multi = multi[np.argsort(-job_time[multi], kind="stable")]
    single = np.flatnonzero(~job & (lens > 0))
    return multi, single[np.argsort(-whole[single], kind="stable")]


def _peer_levels(
    n: int,
    multi_members: list[np.ndarray],
    multi_key: list[int],
    single_rank: np.ndarray,
    single_key: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``peer`` sync: the fewest waves that keep every rank's order of work (its keys) and give a
    multi-rank job one wave on all its members. Items in key order; each takes the first wave
    after the last one its ranks used. A rank's singles with one key share a cell. (One wave per
    distinct key would also be right, but at 16K ranks gives hundreds of mostly empty waves that
    every (waves x ranks) array of the cost model pays for.)"""
    next_free = np.zeros(n, dtype=np.int64)
    multi_wave = np.zeros(len(multi_key), dtype=np.int64)
    cell_id = single_rank * (int(single_key.max(initial=0)) + 1) + single_key
    _, first, cell_of = np.unique(cell_id, return_index=True, return_inverse=True)
    cell_rank, cell_key = single_rank[first], single_key[first]
    cell_wave = np.zeros(first.size, dtype=np.int64)
    # Jobs first on ties: a job's key is never equal to a single's (odd vs even multiples).
    order = sorted(
        [(int(k), 0, j) for j, k in enumerate(multi_key)]
        + [(int(k), 1, c) for c, k in enumerate(cell_key.tolist())]
    )
    for _, is_cell, j in order:
        if is_cell:
            r = int(cell_rank[j])
            cell_wave[j] = next_free[r]
            next_free[r] += 1
        else:
            members = multi_members[j]
            w = int(next_free[members].max())
            multi_wave[j] = w
            next_free[members] = w + 1
    return multi_wave, cell_wave[cell_of]


@lru_cache(maxsize=1 << 16)
def _split(length: int, parts: int, room: int) -> tuple[int, int]:
    """hdp's zigzag split of ``length`` tokens over ``parts`` ranks: (block size, tokens its fullest
    member holds). Blocks of 128 tokens where every share can hold two and the fullest member
    stays within ``room`` tokens (the offload capacity), else exact shares: the rule the menus
    (:func:`planner.degrees.length_menu`) are priced with."""

    def most(align: int) -> int:
        rank, _, start, end = zigzag_arrays(
            np.array([0]),
            np.array([length]),
            np.array([parts]),
            first_rank=np.array([0]),
            align=align,
        )
        return int(np.bincount(rank, weights=end - start).max())

    if length >= 2 * parts * BLOCK_ALIGN:
        blocked = most(BLOCK_ALIGN)
        if blocked <= room:
            return BLOCK_ALIGN, blocked
    return 1, most(1)


def _place_wave(ctx, num_waves, multi, single, degree, job_time, whole, off_cap, stack_share=None):
    """``wave`` sync: a step lasts the sum of its waves' slowest cells, so each job goes where it
    raises that sum least: multi-rank jobs first (:func:`_place_wave_jobs`), then whole sequences
    (:func:`_fill_waves`). Returns (members and wave of each job, rank and wave of each sequence,
    how many jobs joined a wave raising it by more than :data:`STACK_SHARE` of their time)."""
    layer = _place_wave_jobs(ctx, num_waves, multi, degree, job_time, off_cap, stack_share)
    single_rank, single_key = _fill_waves(ctx, layer, single, whole, off_cap)
    return layer.members, layer.wave, single_rank, single_key, layer.stacked


@dataclass
class JobLayer:
    """Multi-rank jobs placed in ``wave`` sync: per job (in placement order) its members and
    wave; per cell ``[waves, ranks]`` the tokens held and the load (s)."""

    members: list[np.ndarray]
    wave: list[int]
    tokens: np.ndarray
    load: np.ndarray
    stacked: int = 0

    def add_wave(self) -> None:
        self.tokens = np.vstack([self.tokens, np.zeros((1, self.tokens.shape[1]), dtype=np.int64)])
        self.load = np.vstack([self.load, np.zeros((1, self.load.shape[1]))])


def _place_wave_jobs(
    ctx, num_waves, multi, degree, job_time, off_cap, stack_share=None
) -> JobLayer:
    """Multi-rank jobs, tallest first: the wave whose height grows least (ties: the lowest, so
    tall jobs spread over waves and leave token room beside them), on the least-loaded ranks with
    token room, each member's load growing by the job's time (a cell's shards run together, layer
    by layer, so a wave lasts as long as its largest cell sum, as the cost model has it: members
    do not wait for the busiest one to start). ``stack_share``: not into a wave that already
    holds work where that raises it by more than this share of the job's time."""
    lens = ctx.seq_lens
    n, rpn = ctx.num_ranks, ctx.ranks_per_node
    layer = JobLayer([], [], np.zeros((num_waves, n), dtype=np.int64), np.zeros((num_waves, n)))
    for i in multi.tolist():
        L, d, t = int(lens[i]), int(degree[i]), float(job_time[i])
        per_rank = _split(L, d, off_cap)[1]
        best = None
        for w in range(layer.load.shape[0] + 1):
            if w == layer.load.shape[0]:
                if best is not None:
                    break
                layer.add_wave()
            load = layer.load[w]
            members = _pick_members(load, d, rpn, layer.tokens[w] + per_rank <= off_cap)
            if members is None:
                continue
            height = float(load.max())
            finish = float(load[members].max()) + t
            if stack_share is not None and height > 0 and finish - height > stack_share * t:
                continue
            score = (max(0.0, finish - height), height)
            if best is None or score < best[0]:
                best = (score, w, members)
        (raise_s, height), w, members = best
        layer.stacked += height > 0 and raise_s > STACK_SHARE * t
        layer.tokens[w, members] += per_rank
        layer.load[w, members] += t
        layer.members.append(members)
        layer.wave.append(w)
    return layer


def _fill_waves(ctx, layer: JobLayer, single, whole, off_cap) -> tuple[np.ndarray, np.ndarray]:
    """Whole sequences, longest first, onto the cells of ``layer`` (updated in place): a cell
    whose load stays under its wave's height (the least-loaded such), else the cell that raises
    its wave least (with offload where that raises it less: :func:`_offloaded_cell`); a new wave
    when that costs less than the raise. Returns each sequence's rank and wave (-1: not placed)."""
    lens = ctx.seq_lens
    n, cap = ctx.num_ranks, ctx.capacity
    tokens, load = layer.tokens, layer.load

    def add_wave() -> None:
        nonlocal tokens, load
        layer.add_wave()
        tokens, load = layer.tokens, layer.load

    single_rank = np.full(lens.size, -1, dtype=np.int64)
    single_key = np.full(lens.size, -1, dtype=np.int64)
    heights = [float(h) for h in load.max(axis=1)]
    heaps = [[(float(load[w, r]), r) for r in range(n)] for w in range(tokens.shape[0])]
    room_max = [int(cap - tokens[w].min()) for w in range(tokens.shape[0])]
    new_wave_s = (
        2 * ctx.cost.allgather_time() + ctx.cost.reduce_scatter_time()
    )  # a wave's collectives
    for h in heaps:
        heapq.heapify(h)
    for i in single.tolist():
        L, t = int(lens[i]), float(whole[i])
        best = None  # ((raise, new load), wave)
        for w, h in enumerate(heaps):
            if room_max[w] < L:
                continue
            # The wave's least-loaded cell with room: the heap's top unless it is full; after a
            # few full ones, a scan of the wave.
            skipped = []
            while (
                h
                and (h[0][0] != load[w, h[0][1]] or tokens[w, h[0][1]] + L > cap)
                and len(skipped) < 8
            ):
                item = heapq.heappop(h)
                if item[0] == load[w, item[1]]:  # not stale: full for this sequence only
                    skipped.append(item)
            for item in skipped:
                heapq.heappush(h, item)
            if h and h[0][0] == load[w, h[0][1]] and tokens[w, h[0][1]] + L <= cap:
                cell_load = h[0][0]
            else:
                cell_load = float(np.where(tokens[w] + L <= cap, load[w], np.inf).min())
            new_load = cell_load + t
            score = (max(0.0, new_load - heights[w]), new_load)
            if best is None or score < best[0]:
                best = (score, w)
        if (best is None or best[0][0] > 0) and off_cap > cap:
            # Every cell with room raises its wave (or none has room): a cell that offloads part
            # of its activations may raise it less.
            off = _offloaded_cell(ctx, tokens, load, heights, L, t, off_cap)
            if off is not None and (best is None or off[0][0] < best[0][0]):
                best = off
        if best is not None and best[0][0] >= new_wave_s + t:  # a new wave of its own costs less
            best = None
        if best is None:
            add_wave()
            heights.append(0.0)
            heaps.append([(0.0, r) for r in range(n)])
            room_max.append(cap)
            best = ((t, t), tokens.shape[0] - 1)
        w = best[1]
        fits = tokens[w] + L <= cap
        if len(best) > 2:  # an offloaded cell
            r = best[2]
        else:
            r = int(np.argmin(np.where(fits, load[w], np.inf)))
        tokens[w, r] += L
        room_max[w] = int(cap - tokens[w].min())
        load[w, r] += t if len(best) == 2 else best[0][1] - load[w, r]
        heights[w] = max(heights[w], float(load[w, r]))
        heapq.heappush(heaps[w], (float(load[w, r]), r))  # the old entry is now stale
        single_rank[i], single_key[i] = r, w
    return single_rank, single_key


def _rebalance_wave(
    ctx: Context, plan: Plan, busy: np.ndarray, moves_per_wave: int = 2000
) -> Plan | None:
    """``wave`` sync local search on a placed plan, by the cost model's own cell times ``busy``
    (``[waves, ranks]``; the placer's estimates miss how mixing a cell hides K/V traffic): while
    a wave's slowest cell holds a whole single-rank sequence that another cell can take (with the
    offload it then needs, its exposed host copy added) so that both end below the old maximum,
    move the one that lowers it most. ``None`` if nothing moved."""
    n, lens, cost = ctx.num_ranks, ctx.seq_lens, ctx.cost
    off_cap = max(cost.offload_capacity(ctx.sync), ctx.capacity)
    whole = np.asarray(cost.seq_time(lens), dtype=np.float64)
    holders = np.bincount(np.unique(plan.seq * n + plan.rank) // n, minlength=lens.size)
    movable = np.flatnonzero(
        (holders[plan.seq] == 1) & (plan.start == 0) & (plan.end == lens[plan.seq])
    )
    load = np.array(busy, dtype=np.float64)
    tokens = plan.tokens_per_cell().astype(np.int64)
    cells: dict[tuple[int, int], list[int]] = {}
    for k in movable.tolist():
        cells.setdefault((int(plan.wave[k]), int(plan.rank[k])), []).append(k)
    rank = plan.rank.copy()
    moved = False
    for w in range(plan.num_waves):
        for _ in range(moves_per_wave):
            hi = int(np.argmax(load[w]))
            top = float(load[w, hi])
            best = None
            for k in cells.get((w, hi), []):
                L, t = int(lens[plan.seq[k]]), float(whole[plan.seq[k]])
                target = _loads_with(ctx, tokens[w], load[w], L, t, off_cap)
                target[hi] = np.inf
                lo = int(np.argmin(target))
                new_max = max(top - t, float(target[lo]))
                if new_max < top - 1e-9 and (best is None or new_max < best[0]):
                    best = (new_max, k, lo, float(target[lo]))
            if best is None:
                break
            _, k, lo, lo_load = best
            L, t = int(lens[plan.seq[k]]), float(whole[plan.seq[k]])
            cells[(w, hi)].remove(k)
            cells.setdefault((w, lo), []).append(k)
            tokens[w, hi] -= L
            tokens[w, lo] += L
            load[w, hi] -= t
            load[w, lo] = lo_load
            rank[k] = lo
            moved = True
    if not moved:
        return None
    builder = PlanBuilder(ctx, plan.strategy)
    builder.add(plan.wave, rank, plan.seq, plan.start, plan.end)
    builder.offload_where_needed()
    builder.info = dict(plan.predicted)
    return builder.build()


def _loads_with(ctx, tokens, load, L, t, off_cap) -> np.ndarray:
    """Each cell's busy time once it also takes a sequence of ``L`` tokens and ``t`` seconds,
    offloading what it then must (its exposed host-copy time added); ``inf`` where even offload
    leaves no room. ``tokens``, ``load``: per-cell arrays of any shape."""
    cost = ctx.cost
    new_tokens = tokens + L
    ok = new_tokens <= off_cap
    frac = np.where(ok, cost.offload_needed(np.where(ok, new_tokens, 0), ctx.sync), 0.0)
    exposed = np.maximum(0.0, cost.offload_time(new_tokens, frac) - (load + t))
    return np.where(ok, load + t + exposed, np.inf)


def _offloaded_cell(ctx, tokens, load, heights, L, t, off_cap):
    """``wave`` sync: ``((raise, new load), wave, rank)`` of the cell that raises its wave least
    (then the least loaded) when it takes a sequence of ``L`` tokens and ``t`` seconds beyond the
    capacity (:func:`_loads_with`); ``None`` if no cell has room even with offload."""
    new_load = _loads_with(ctx, tokens, load, L, t, off_cap)
    if not np.isfinite(new_load).any():
        return None
    raise_by = np.maximum(0.0, new_load - np.asarray(heights)[:, None])
    # Least raise, then least load, then the first cell (a full sort of the cells costs 10x more).
    best = int(np.argmin(np.where(raise_by == raise_by.min(), new_load, np.inf)))
    w, r = np.unravel_index(best, raise_by.shape)
    return ((float(raise_by[w, r]), float(new_load[w, r])), int(w), int(r))


def _place_peer(ctx, multi, single, degree, job_time, whole, off_cap, polish_moves):
    """``peer`` sync. Keys order each rank's work: a multi-rank job placed ``k``-th has key
    ``(2k + 1) * S``; singles in the gap before it ``2k * S + j``; the tail after a rank's last job
    ``(2 K + 2) * S + j`` (``S`` exceeds any count of single waves)."""
    lens = ctx.seq_lens
    n, cap, rpn = ctx.num_ranks, ctx.capacity, ctx.ranks_per_node
    stride = int(lens.size) + 2
    rank_load = np.zeros(n)
    members_of, key_of = [], []
    gaps: list[
        tuple[float, int, int]
    ] = []  # (idle seconds, rank, job index k) before job k on rank
    for k, i in enumerate(multi.tolist()):
        L, d, t = int(lens[i]), int(degree[i]), float(job_time[i])
        if _split(L, d, off_cap)[1] > off_cap:
            raise PlanningError(f"hdp: sequence {i} ({L} tokens) does not fit {d} ranks")
        members = _pick_members(rank_load, d, rpn, np.ones(n, dtype=bool))
        start = float(rank_load[members].max())
        for r in members.tolist():
            if start - rank_load[r] > 0:
                gaps.append((start - float(rank_load[r]), r, k))
        rank_load[members] = start + t
        members_of.append(members)
        key_of.append((2 * k + 1) * stride)
    tail_key = (2 * len(members_of) + 2) * stride
    single_rank = np.full(lens.size, -1, dtype=np.int64)
    single_key = np.full(lens.size, -1, dtype=np.int64)
    # Gaps first, best fit: each single into the smallest gap it fills without delaying the job.
    room = sorted(gaps)
    gap_waves: dict[tuple[int, int], list[int]] = {}
    rest = []
    for i in single.tolist():
        t = float(whole[i])
        j = bisect.bisect_left(room, (t, -1, -1))
        if j == len(room):
            rest.append(i)
            continue
        left, r, k = room.pop(j)
        waves = gap_waves.setdefault((r, k), [])
        slot = _first_fit(waves, int(lens[i]), cap)
        single_rank[i], single_key[i] = r, 2 * k * stride + slot
        if left - t > 0:
            bisect.insort(room, (left - t, r, k))
    # The rest: LPT onto the least-loaded rank, after its last multi-rank job.
    tail_waves: list[list[int]] = [[] for _ in range(n)]
    heap = [(float(rank_load[r]), r) for r in range(n)]
    heapq.heapify(heap)
    for i in rest:
        _, r = heapq.heappop(heap)
        single_rank[i] = r
        rank_load[r] += whole[i]
        single_key[i] = tail_key + _first_fit(tail_waves[r], int(lens[i]), cap)
        heapq.heappush(heap, (float(rank_load[r]), r))
    if polish_moves and rest:
        _polish_peer(
            np.asarray(rest),
            lens,
            whole,
            rank_load,
            tail_waves,
            single_rank,
            single_key,
            tail_key,
            cap,
            polish_moves,
        )
    return members_of, key_of, single_rank, single_key


def _first_fit(waves: list[int], tokens: int, cap: int) -> int:
    """Index of the first wave (tokens used per wave) with room for ``tokens``; opens one if none."""
    k = next((k for k, used in enumerate(waves) if used + tokens <= cap), len(waves))
    if k == len(waves):
        waves.append(0)
    waves[k] += tokens
    return k


def _polish_peer(
    ids, lens, whole, rank_load, tail_waves, single_rank, single_key, tail_key, cap, moves
) -> None:
    """Move tail singles from the most to the least loaded rank while the maximum falls."""
    by_rank: dict[int, list[int]] = {}
    for i in ids.tolist():
        by_rank.setdefault(int(single_rank[i]), []).append(i)
    for _ in range(moves):
        hi = int(np.argmax(rank_load))
        lo = int(np.argmin(rank_load))
        gap = rank_load[hi] - rank_load[lo]
        # The largest sequence whose move lowers the pair's maximum.
        best = None
        for i in by_rank.get(hi, ()):
            if whole[i] < gap and (best is None or whole[i] > whole[best]):
                best = i
        if best is None:
            return
        L = int(lens[best])
        tail_waves[hi][int(single_key[best] - tail_key)] -= L
        by_rank[hi].remove(best)
        by_rank.setdefault(lo, []).append(best)
        rank_load[hi] -= whole[best]
        rank_load[lo] += whole[best]
        single_rank[best], single_key[best] = lo, tail_key + _first_fit(tail_waves[lo], L, cap)


def plan_hdp_megatron(ctx: Context) -> Plan:
    """``hdp`` restricted to what Megatron's hybrid context parallelism executes: each sequence
    whole on one rank or zigzag-split over an aligned power-of-two group of consecutive ranks
    (size ``2^i`` starting at a multiple of ``2^i``), no offload; each barrier-separated group
    partitions the ranks into such blocks, and a block runs its sequences one per micro-batch.

    Degrees come from the relaxation over power-of-two menus; a group gives each degree class
    blocks in proportion to its area (largest class first, so consecutive allocation keeps every
    block aligned), LPT inside a class; classes left without ranks wait for the next group."""
    lens, cost = ctx.seq_lens, ctx.cost
    n, cap = ctx.num_ranks, ctx.capacity
    longest = int(lens.max(initial=0))
    if longest > 0 and next_pow2(-(-longest // cap)) > n:
        raise PlanningError(
            f"hdp (megatron form): a sequence of {longest} tokens needs a CP group of "
            f"{next_pow2(-(-longest // cap))} ranks at {cap} tokens each, but the cluster has {n}"
        )
    rel = relaxation_bound(
        cost, lens, "peer" if ctx.sync == "peer" else ctx.sync, cap, n, pow2=True
    )
    best: tuple[float, Plan] | None = None
    seen: list[np.ndarray] = []
    choices = [rel.degrees_at(rel.height_s * f, cost) for f in MEGATRON_HEIGHT_FACTORS]
    at_m = choices[MEGATRON_HEIGHT_FACTORS.index(1.0)]
    # Jobs that take a quarter of the ranks or more keep their degree at M; the rest run faster
    # (wider) after them: two 1.7M-token sequences on 128 of 256 ranks each leave no room beside
    # them, so what follows must be short (byted-2m at 256 ranks: 134.9 s -> 98.6 s).
    wide = at_m[0] >= max(2, n // 4)
    for f in (0.15, 0.25, 0.35):
        low = rel.degrees_at(rel.height_s * f, cost)
        choices.append((np.where(wide, at_m[0], low[0]), np.where(wide, at_m[1], low[1])))
    for degree, job_time in choices:
        if any(np.array_equal(degree, d) for d in seen):
            continue
        seen.append(degree)
        for place in (_place_megatron, _place_megatron_one_group):
            plan = place(ctx, degree, job_time)
            t = cost.evaluate(plan).step_time_s
            if best is None or t < best[0]:
                best = (t, plan)
    # Megatron's own schedule is a candidate where it keeps to the form.
    from .hybridcp import plan_hybridcp

    theirs = plan_hybridcp(ctx, implementation="ours")
    t = cost.evaluate(theirs).step_time_s
    if t < best[0] and aligned_groups(theirs):  # its empty-rank filling can break alignment
        theirs.strategy = "hdp"
        theirs.predicted["from_balanced_cp_scheduler"] = 1.0
        best = (t, theirs)
    plan = best[1]
    plan.predicted["bound_s"] = float(step_bound(cost, lens, ctx.sync, cap, pow2=True))
    plan.predicted["relaxation_height_s"] = rel.height_s
    return plan


def aligned_groups(plan: Plan) -> bool:
    """Whether every sequence lies on one rank or on an aligned power-of-two group of consecutive
    ranks (size ``2^i`` starting at a multiple of ``2^i``)."""
    pairs = np.unique(plan.seq * plan.num_ranks + plan.rank)
    seq, rank = pairs // plan.num_ranks, pairs % plan.num_ranks
    first = np.searchsorted(seq, seq)  # index of each sequence's first (lowest) rank
    size = np.bincount(seq, minlength=plan.seq_lens.size)[seq]
    lowest = rank[first]
    return bool(
        ((size & (size - 1)) == 0).all()
        and (lowest % size == 0).all()
        and (rank - lowest == np.arange(seq.size) - first).all()
    )


def _place_megatron(ctx: Context, degree: np.ndarray, job_time: np.ndarray) -> Plan:
    lens = ctx.seq_lens
    n = ctx.num_ranks
    whole = np.asarray(ctx.cost.seq_time(lens), dtype=np.float64)
    time_of = np.where(degree > 1, job_time, whole)
    todo = [i for i in np.argsort(-time_of, kind="stable").tolist() if lens[i] > 0]
    builder = PlanBuilder(ctx, "hdp")
    rows_seq, rows_wave, rows_members = [], [], []
    wave0 = 0
    groups = 0
    while todo:
        classes: dict[int, list[int]] = {}
        for i in todo:
            classes.setdefault(int(degree[i]), []).append(i)
        area = {k: sum(float(time_of[i]) for i in ids) * k for k, ids in classes.items()}
        height = max(
            sum(area.values()) / n, max(float(time_of[ids[0]]) for ids in classes.values())
        )
        counts = _block_counts(area, {k: len(ids) for k, ids in classes.items()}, n, height)
        next_rank = 0
        left: list[int] = []
        for k in sorted(classes, reverse=True):
            m = counts.get(k, 0)
            if m == 0:
                left += classes[k]
                continue
            mine = [(next_rank + j * k, k) for j in range(m)]
            next_rank += m * k
            # LPT of the class's sequences over its blocks (each block's list is its micro-batches),
            # up to the group's height; what does not fit waits for the next group.
            heap = [(0.0, b) for b in range(len(mine))]
            lists: list[list[int]] = [[] for _ in mine]
            for i in classes[k]:
                load, b = heap[0]
                if load > 0 and load + float(time_of[i]) > height * 1.02:
                    left.append(i)
                    continue
                heapq.heapreplace(heap, (load + float(time_of[i]), b))
                lists[b].append(i)
            for (first, size), ids in zip(mine, lists):
                for slot, i in enumerate(ids):
                    rows_seq.append(i)
                    rows_wave.append(wave0 + slot)
                    rows_members.append(np.arange(first, first + size, dtype=np.int64))
        placed_waves = [w for w in rows_wave if w >= wave0]
        if groups > 0:
            builder.barriers.append(wave0)
        wave0 = max(placed_waves, default=wave0 - 1) + 1
        groups += 1
        if len(left) == len(todo):  # nothing placed: cannot happen once a class gets a block
            raise PlanningError("hdp (megatron form): no group could be formed")
        todo = left
    builder.add_zigzag(rows_seq, rows_wave, rows_members)
    builder.info = {"groups": float(groups), "max_degree": float(degree.max(initial=1))}
    return builder.build()


def _place_megatron_one_group(ctx: Context, degree: np.ndarray, job_time: np.ndarray) -> Plan:
    """The Megatron form as one group (no barrier): each rank runs its list of sub-samples in
    order and waits only for the CP partners of each; a rank may change CP size between its
    sub-samples. Lists are formed by simulating start times: multi-rank jobs, tallest first, on
    the aligned block whose busiest member frees first (the others idle until then); single-rank
    sequences, longest first, into the tightest idle gap they fit, else after the least-loaded
    rank's work. Every rank lists its items by start time, so partners meet in the same order
    and no CP group waits for another in a cycle."""
    from .hybridcp import plan_from_sample_id_groups

    lens, n = ctx.seq_lens, ctx.num_ranks
    whole = np.asarray(ctx.cost.seq_time(lens), dtype=np.float64)
    load = np.zeros(n)
    items: list[list[tuple[float, int]]] = [[] for _ in range(n)]  # per rank: (start, sequence)
    gaps: list[tuple[float, float, int]] = []  # (length, start, rank), sorted
    jobs = [
        i for i in np.argsort(-job_time, kind="stable").tolist() if degree[i] > 1 and lens[i] > 0
    ]
    for i in jobs:
        d = int(degree[i])
        starts = load.reshape(-1, d).max(axis=1) if n % d == 0 else np.array([load.max()])
        b = int(np.argmin(starts))
        members = range(b * d, (b + 1) * d) if n % d == 0 else range(n)
        t0 = float(starts[b])
        for r in members:
            if t0 - load[r] > 0:
                bisect.insort(gaps, (t0 - float(load[r]), float(load[r]), r))
            items[r].append((t0, i))
            load[r] = t0 + float(job_time[i])
    heap = [(float(load[r]), r) for r in range(n)]
    heapq.heapify(heap)
    for i in [
        i for i in np.argsort(-whole, kind="stable").tolist() if degree[i] <= 1 and lens[i] > 0
    ]:
        t = float(whole[i])
        k = bisect.bisect_left(gaps, (t, -1.0, -1))
        if k < len(gaps):
            length, start, r = gaps.pop(k)
            items[r].append((start, i))
            if length - t > 0:
                bisect.insort(gaps, (length - t, start + t, r))
            continue
        end, r = heapq.heappop(heap)
        items[r].append((end, i))
        heapq.heappush(heap, (end + t, r))
    lists = [[i for _, i in sorted(row)] for row in items]
    plan = plan_from_sample_id_groups(ctx, [lists], None, "hdp")
    plan.predicted.update({"groups": 1.0, "max_degree": float(degree.max(initial=1))})
    return plan


def _block_counts(
    area: dict[int, float], jobs: dict[int, int], n: int, height: float
) -> dict[int, int]:
    """Blocks per degree class for one group of ``n`` ranks lasting about ``height`` seconds:
    each class the blocks its area needs (at least one), largest class first while ranks last;
    spare ranks go one block at a time to the class with the most work per rank (never more
    blocks than sequences)."""
    counts: dict[int, int] = {}
    free = n
    for k in sorted(area, reverse=True):
        want = min(jobs[k], max(1, int(round(area[k] / (k * height)))))
        m = min(want, free // k)
        if m:
            counts[k] = m
            free -= m * k
    heap = [(-area[k] / (counts[k] * k), k) for k in counts]
    heapq.heapify(heap)
    while heap:
        _, k = heapq.heappop(heap)
        if k > free or counts[k] >= jobs[k]:
            continue
        counts[k] += 1
        free -= k
        heapq.heappush(heap, (-area[k] / (counts[k] * k), k))
    return counts


__all__ = ["NATIVE_SYNC", "plan_hdp", "plan_hdp_megatron"]
