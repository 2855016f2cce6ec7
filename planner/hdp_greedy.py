"""``hdp`` (heuristic): balance-driven degrees, node-aware placement, LPT over ranks and waves.

1. A target per-rank time ``M``: the lower bound of the step (``peer`` sync) or of one wave
   (``wave`` sync, ``W`` waves from the token count and the capacity), and a second, higher one
   that trades height against area (splitting costs kernel efficiency and communication); both
   are placed and the cost model keeps the faster plan.
2. Degree of each sequence: 1 when it fits a rank and its whole time is within ``M``; otherwise
   the fewest ranks ``d >= ceil(L / C)`` whose zigzag split (blocks aligned to 128 tokens) brings
   the slowest member's busy time -- compute plus exposed KV traffic, from the cost model --
   within ``M``; where no ``d`` does (communication-bound sequences), the ``d`` with the
   smallest busy time. So a long sequence may span more ranks than its memory needs, and fewer
   when more would only expose communication.
3. Placement, largest job first: a multi-rank job takes the least-loaded ranks of one node when it
   fits in a node (else the least-loaded whole nodes), in the first wave free on all of them; each
   single-rank sequence goes to the least-loaded rank (``peer``) or rank-wave cell (``wave``) with
   room, first fit.
4. Polish (``peer``): move single-rank sequences from the most to the least loaded rank while that
   lowers the maximum.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from hdp import Plan

from .common import Context, PlanBuilder, PlanningError, split_busy_time, zigzag_arrays

NATIVE_SYNC = "peer"
BLOCK_ALIGN = 128


def choose_degree(ctx: Context, length: int, target: float) -> int:
    """Fewest ranks bringing the split's busy time within ``target``; else the fastest split."""
    n, cap = ctx.num_ranks, ctx.capacity
    d_min = 1 if length <= cap else -(-length // cap)  # unaligned shares hold at most ceil(L / d)
    if d_min > n:
        raise PlanningError(f"hdp: a sequence of {length} tokens needs {d_min} ranks at {cap} tokens each, "
                            f"but the cluster has {n}; use more GPUs or a smaller --max-seq")
    t_min = split_busy_time(ctx.cost, length, d_min)
    if t_min <= target:
        return d_min
    best_d, best_t = d_min, t_min
    prev_t, rising = t_min, 0
    d = d_min
    lo = d_min  # largest d known to miss the target
    while d < n:
        d = min(n, max(d + 1, int(math.ceil(d * 1.25))))
        t = split_busy_time(ctx.cost, length, d)
        if t < best_t:
            best_d, best_t = d, t
        if t <= target:
            # Binary search between lo and d for the fewest ranks that still meet the target.
            hi = d
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if split_busy_time(ctx.cost, length, mid) <= target:
                    hi = mid
                else:
                    lo = mid
            return hi
        lo = d
        rising = rising + 1 if t >= prev_t else 0
        prev_t = t
        if rising >= 2:  # communication-bound: more ranks only expose more traffic
            break
    return best_d


def degrees_for(ctx: Context, whole: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
    """(degree, busy time) of every sequence for a per-rank target time."""
    lens, cap = ctx.seq_lens, ctx.capacity
    degree = np.ones(lens.size, dtype=np.int64)
    job_time = whole.copy()
    for i in np.flatnonzero((lens > cap) | (whole > target)).tolist():
        d = choose_degree(ctx, int(lens[i]), target)
        degree[i] = d
        job_time[i] = split_busy_time(ctx.cost, int(lens[i]), d)
    return degree, job_time


def choose_target(ctx: Context, whole: np.ndarray, bound: float, slots: int,
                  steps: int = 6) -> tuple[float, np.ndarray, np.ndarray]:
    """Per-rank target ``M`` balancing height against area.

    A low target spreads long sequences widely (their busy times fall, but splitting costs kernel
    efficiency and communication, so the total rank-time grows); a high one keeps them narrow.
    The step is at least ``max(M, max_i T_i, area / slots)``: starting from the lower bound, the
    target is bisected between it and the area bound that spreading to it implies, keeping the
    target with the smallest estimate."""

    def estimate(m: float):
        degree, job_time = degrees_for(ctx, whole, m)
        area = float((degree * job_time).sum()) / slots
        return max(m, float(job_time.max(initial=0.0)), area), degree, job_time

    best_est, best_deg, best_time = estimate(bound)
    best_m = bound
    lo, hi = bound, best_est
    for _ in range(steps if hi > lo * 1.01 else 0):
        mid = 0.5 * (lo + hi)
        est, deg, jt = estimate(mid)
        if est < best_est:
            best_est, best_deg, best_time, best_m = est, deg, jt, mid
        if est > mid:
            lo = mid  # the area (or a job) still exceeds the target: spread less
        else:
            hi = mid
    return best_m, best_deg, best_time


def member_tokens(length: int, parts: int, align: int) -> int:
    """Most tokens one member holds when ``length`` is zigzag-split over ``parts`` ranks."""
    rank, _, start, end = zigzag_arrays(np.array([0]), np.array([length]), np.array([parts]),
                                        first_rank=np.array([0]), align=align)
    return int(np.bincount(rank, weights=end - start).max())


def block_align(length: int, parts: int, cap: int) -> int:
    """128-token blocks where they fit the capacity, else exact shares (at most ceil(L / parts))."""
    return BLOCK_ALIGN if member_tokens(length, parts, BLOCK_ALIGN) <= cap else 1


def _pick_members(load_row: np.ndarray, d: int, rpn: int, eligible: np.ndarray) -> np.ndarray | None:
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


def plan_hdp_greedy(ctx: Context, polish_moves: int = 20000) -> Plan:
    """Place the degrees of two targets (the lower bound, and the height/area compromise of
    :func:`choose_target`) and keep the plan the cost model finds faster."""
    n, cap = ctx.num_ranks, ctx.capacity
    total = int(ctx.seq_lens.sum())
    num_waves = max(1, math.ceil(total / (0.9 * n * cap))) if ctx.sync == "wave" else 1
    whole = ctx.cost.seq_time(ctx.seq_lens)
    bound = ctx.cost.lower_bound(ctx.seq_lens) / num_waves
    candidates = [(bound, *degrees_for(ctx, whole, bound))]
    target, degree, job_time = choose_target(ctx, whole, bound, n * num_waves)
    if not np.array_equal(degree, candidates[0][1]):
        candidates.append((target, degree, job_time))
    plans = [_place(ctx, whole, num_waves, t, d, jt, polish_moves) for t, d, jt in candidates]
    if len(plans) == 1:
        return plans[0]
    times = [ctx.cost.evaluate(p).step_time_s for p in plans]
    return plans[int(np.argmin(times))]


def _place(ctx: Context, whole: np.ndarray, num_waves: int, target: float, degree: np.ndarray, job_time: np.ndarray,
           polish_moves: int) -> Plan:
    """Place sequences of the given degrees on ranks and waves (steps 3 and 4 of the module doc)."""
    lens = ctx.seq_lens
    n, cap, rpn = ctx.num_ranks, ctx.capacity, ctx.ranks_per_node
    wave_sync = ctx.sync == "wave"
    multi = np.flatnonzero(degree > 1)
    multi = multi[np.argsort(-job_time[multi], kind="stable")]
    single = np.flatnonzero((degree == 1) & (lens > 0))
    single = single[np.argsort(-job_time[single], kind="stable")]

    # Cells: tokens[w][r], load per cell (wave sync) or per rank (peer sync).
    tokens = np.zeros((num_waves, n), dtype=np.int64)
    has_multi = np.zeros((num_waves, n), dtype=bool)
    cell_load = np.zeros((num_waves, n))
    rank_load = np.zeros(n)

    def grow(w_needed: int) -> None:
        nonlocal tokens, has_multi, cell_load
        extra = w_needed - tokens.shape[0]
        if extra > 0:
            tokens = np.vstack([tokens, np.zeros((extra, n), dtype=np.int64)])
            has_multi = np.vstack([has_multi, np.zeros((extra, n), dtype=bool)])
            cell_load = np.vstack([cell_load, np.zeros((extra, n))])

    builder = PlanBuilder(ctx, "hdp")
    multi_members: list[np.ndarray] = []
    multi_wave: list[int] = []
    for i in multi.tolist():
        L, d, t = int(lens[i]), int(degree[i]), float(job_time[i])
        per_rank = member_tokens(L, d, block_align(L, d, cap))
        best = None
        for w in range(tokens.shape[0] + 1):
            grow(w + 1)
            if wave_sync:
                members = _pick_members(cell_load[w], d, rpn, tokens[w] + per_rank <= cap)
                if members is not None:
                    finish = float(cell_load[w, members].max()) + t
                    if best is None or finish < best[0]:
                        best = (finish, w, members)
                if tokens[w].max() == 0:
                    break  # later waves are empty too
            else:
                # Peer: the job runs after everything already on its members, so a member must be
                # free in this wave and hold no multi-rank job in a later one.
                free = (tokens[w] == 0) & ~has_multi[w:].any(axis=0)
                members = _pick_members(rank_load, d, rpn, free)
                if members is not None:
                    best = (float(rank_load[members].max()) + t, w, members)
                    break
        if best is None:
            raise PlanningError(f"hdp: no wave can hold sequence {i} ({L} tokens over {d} ranks)")
        finish, w, members = best
        grow(w + 1)
        tokens[w, members] += per_rank
        has_multi[w, members] = True
        cell_load[w, members] = finish
        rank_load[members] = np.maximum(rank_load[members], finish)
        multi_members.append(members)
        multi_wave.append(w)

    placed_wave = np.full(lens.size, -1, dtype=np.int64)
    placed_rank = np.full(lens.size, -1, dtype=np.int64)
    if wave_sync:
        heap = [(float(cell_load[w, r]), w, r) for w in range(tokens.shape[0]) for r in range(n)]
        heapq.heapify(heap)
        for i in single.tolist():
            L = int(lens[i])
            skipped = []
            while heap:
                item = heapq.heappop(heap)
                _, w, r = item
                if tokens[w, r] + L <= cap:
                    break
                skipped.append(item)
            else:
                grow(tokens.shape[0] + 1)
                w, r = tokens.shape[0] - 1, 0
                for rr in range(1, n):
                    heapq.heappush(heap, (0.0, w, rr))
            for item in skipped:
                heapq.heappush(heap, item)
            tokens[w, r] += L
            cell_load[w, r] += whole[i]
            placed_wave[i], placed_rank[i] = w, r
            heapq.heappush(heap, (float(cell_load[w, r]), w, r))
    else:
        first_short_wave = np.where(has_multi.any(axis=0), tokens.shape[0] - np.argmax(has_multi[::-1], axis=0), 0)
        rank_waves: list[list[int]] = [[0] * 0 for _ in range(n)]  # tokens of each short wave per rank
        heap = [(float(rank_load[r]), r) for r in range(n)]
        heapq.heapify(heap)
        for i in single.tolist():
            L = int(lens[i])
            _, r = heapq.heappop(heap)
            waves = rank_waves[r]
            k = next((k for k, used in enumerate(waves) if used + L <= cap), len(waves))
            if k == len(waves):
                waves.append(0)
            waves[k] += L
            rank_load[r] += whole[i]
            placed_rank[i], placed_wave[i] = r, int(first_short_wave[r]) + k
            heapq.heappush(heap, (float(rank_load[r]), r))
        if polish_moves:
            _polish_peer(lens, whole, rank_load, rank_waves, placed_rank, placed_wave, first_short_wave, cap, polish_moves)

    if multi.size:
        aligns = np.array([block_align(int(lens[i]), int(degree[i]), cap) for i in multi.tolist()], dtype=np.int64)
        rank, seq, start, end = zigzag_arrays(multi, lens[multi], degree[multi], ranks=multi_members, align=aligns)
        pos = np.empty(lens.size, dtype=np.int64)
        pos[multi] = np.arange(multi.size)
        builder.add(np.asarray(multi_wave, dtype=np.int64)[pos[seq]], rank, seq, start, end)
    if single.size:
        builder.add(placed_wave[single], placed_rank[single], single, 0, lens[single])
    builder.info = {"multi_rank_sequences": float(multi.size), "max_degree": float(degree.max(initial=1)),
                    "target_s": float(target)}
    return builder.build()


def _polish_peer(lens, whole, rank_load, rank_waves, placed_rank, placed_wave, first_short_wave, cap, moves) -> None:
    """Move single-rank sequences from the most to the least loaded rank while the maximum falls."""
    by_rank: dict[int, list[int]] = {}
    for i in np.flatnonzero(placed_rank >= 0).tolist():
        by_rank.setdefault(int(placed_rank[i]), []).append(i)
    for _ in range(moves):
        hi = int(np.argmax(rank_load))
        lo = int(np.argmin(rank_load))
        gap = rank_load[hi] - rank_load[lo]
        if gap <= 0 or not by_rank.get(hi):
            return
        # The largest sequence whose move lowers the pair's maximum.
        best = None
        for i in by_rank[hi]:
            t = whole[i]
            if t < gap and (best is None or t > whole[best]):
                best = i
        if best is None:
            return
        L = int(lens[best])
        waves_lo = rank_waves[lo]
        k = next((k for k, used in enumerate(waves_lo) if used + L <= cap), len(waves_lo))
        if k == len(waves_lo):
            waves_lo.append(0)
        waves_lo[k] += L
        rank_waves[hi][int(placed_wave[best] - first_short_wave[hi])] -= L
        by_rank[hi].remove(best)
        by_rank.setdefault(lo, []).append(best)
        rank_load[hi] -= whole[best]
        rank_load[lo] += whole[best]
        placed_rank[best], placed_wave[best] = lo, int(first_short_wave[lo]) + k
