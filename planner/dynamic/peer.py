"""``peer`` sync placement: each rank runs its own list of work, multi-rank jobs start together.

Multi-rank jobs, tallest first, take the least-loaded ranks (node-aware) after everything already
on them; the less-loaded members wait, and those idle gaps take whole sequences first (best fit).
The rest go longest first onto the least-loaded rank. Waves are the fewest that keep each rank's
order (lock-step levels).
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from ..common import Context, PlanningError
from .candidates import Assignment, Candidate, NodeLoads


def place_peer(ctx: Context, multi: np.ndarray, single: np.ndarray, cand: Candidate) -> Assignment:
    """Keys order each rank's work: a multi-rank job placed ``k``-th has key ``(2k + 1) * S``;
    whole sequences in the gap before it ``2k * S + j``; the tail after a rank's last job
    ``(2 K + 2) * S + j`` (``S`` exceeds any count of single waves)."""
    lens, n, rpn = ctx.seq_lens, ctx.num_ranks, ctx.ranks_per_node
    off_cap = ctx.offload_capacity
    stride = int(lens.size) + 2
    rank_load = np.zeros(n)
    assignment = Assignment(
        [], [], np.full(lens.size, -1, np.int64), np.full(lens.size, -1, np.int64)
    )
    gaps: list[tuple[float, int, int]] = []  # (idle seconds, rank, job k) before job k on rank
    nodes = NodeLoads(rank_load, rpn)
    most = ctx.splits(lens[multi], cand.degree[multi])[1]
    if (most > off_cap).any():
        i = int(multi[np.argmax(most > off_cap)])
        raise PlanningError(
            f"hdp: sequence {i} ({lens[i]} tokens) does not fit {cand.degree[i]} ranks"
        )
    degrees, times = cand.degree[multi].tolist(), cand.job_time[multi].tolist()
    for k, (d, t) in enumerate(zip(degrees, times)):
        members = nodes.pick(d)
        before = rank_load[members]
        start = float(before.max())
        for r, load in zip(members.tolist(), before.tolist()):
            if start - load > 0:
                gaps.append((start - load, r, k))
        rank_load[members] = start + t
        nodes.set(members, start + t)
        assignment.job_members.append(members)
        assignment.job_key.append((2 * k + 1) * stride)
    rest = _fill_gaps(ctx, assignment, single, sorted(gaps), stride)
    tail_key = (2 * len(assignment.job_members) + 2) * stride
    tail_waves: dict[int, list[int]] = {}  # tokens per tail wave of each rank
    # The rest: LPT onto the least-loaded rank, after its last multi-rank job.
    heap = list(zip(rank_load.tolist(), range(n)))
    heapq.heapify(heap)
    whole_s, tokens, ranks, slots = ctx.packed_s.tolist(), lens.tolist(), [], []
    for i in rest:
        load, r = heap[0]
        heapq.heapreplace(heap, (load + whole_s[i], r))
        ranks.append(r)
        slots.append(_first_fit(tail_waves.setdefault(r, []), tokens[i], ctx.capacity))
    assignment.single_rank[rest] = ranks
    assignment.single_key[rest] = tail_key + np.asarray(slots, dtype=np.int64)
    return assignment


def _fill_gaps(
    ctx: Context,
    assignment: Assignment,
    single: np.ndarray,
    room: list[tuple[float, int, int]],
    stride: int,
) -> list[int]:
    """Each whole sequence, longest first, into the smallest idle gap before a job that it fills
    without delaying the job (``room``: the gaps, sorted); returns the sequences no gap takes."""
    gap_waves: dict[tuple[int, int], list[int]] = {}
    whole_s, tokens = ctx.packed_s.tolist(), ctx.seq_lens.tolist()
    rest, placed, ranks, keys = [], [], [], []
    for i in single.tolist():
        t = whole_s[i]
        j = bisect.bisect_left(room, (t, -1, -1))
        if j == len(room):
            rest.append(i)
            continue
        left, r, k = room.pop(j)
        waves = gap_waves.setdefault((r, k), [])
        placed.append(i)
        ranks.append(r)
        keys.append(2 * k * stride + _first_fit(waves, tokens[i], ctx.capacity))
        if left - t > 0:
            bisect.insort(room, (left - t, r, k))
    assignment.single_rank[placed], assignment.single_key[placed] = ranks, keys
    return rest


def _first_fit(waves: list[int], tokens: int, cap: int) -> int:
    """Index of the first of ``waves`` (tokens used) with room for ``tokens``; opens one if none."""
    for k, used in enumerate(waves):
        if used + tokens <= cap:
            waves[k] = used + tokens
            return k
    waves.append(tokens)
    return len(waves) - 1


def peer_levels(
    n: int,
    job_members: list[np.ndarray],
    job_key: np.ndarray,
    single_rank: np.ndarray,
    single_key: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The fewest waves that keep every rank's order of work (its keys) and give a multi-rank
    job one wave on all its members: items in key order, each in the first wave after the last
    one its ranks used; a rank's whole sequences with one key share a cell. (One wave per
    distinct key would be right too, but gives 16K ranks hundreds of mostly empty waves, and
    every (waves x ranks) array of the cost model pays for them.)"""
    next_free = np.zeros(n, dtype=np.int64)
    job_wave = np.zeros(len(job_key), dtype=np.int64)
    cell_id = single_rank * (int(single_key.max(initial=0)) + 1) + single_key
    _, first, cell_of = np.unique(cell_id, return_index=True, return_inverse=True)
    cell_rank, cell_key = single_rank[first], single_key[first]
    cell_wave = np.zeros(first.size, dtype=np.int64)
    # Jobs first on ties: a job's key is never equal to a single's (odd vs even multiples).
    order = sorted(
        [(int(k), 0, j) for j, k in enumerate(job_key)]
        + [(int(k), 1, c) for c, k in enumerate(cell_key.tolist())]
    )
    for _, is_cell, j in order:
        if is_cell:
            r = int(cell_rank[j])
            cell_wave[j] = next_free[r]
            next_free[r] += 1
        else:
            members = job_members[j]
            w = int(next_free[members].max())
            job_wave[j] = w
            next_free[members] = w + 1
    return job_wave, cell_wave[cell_of]
