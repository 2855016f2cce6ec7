"""``static``: the usual DP x CP mesh of Megatron-LM / TransformerEngine.

One context-parallel size for the whole job: the next power of two of ``max_seq / capacity`` (so
that a packed micro-batch of ``max_seq`` tokens fits), raised until every data-parallel replica
gets at least one micro-batch of the global batch (a user would not leave replicas idle).
Sequences are packed first-fit-decreasing into micro-batches of ``max_seq`` tokens (the model's
sequence length, counting TE's padding of each document to a multiple of ``2 * cp``: packing
counts it, compute does not); micro-batches go to the replica with the fewest tokens so far.
Inside a replica's CP group every sequence of the micro-batch is cut into ``2 * cp`` chunks and
rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i`` (zigzag load balance, TE's THD layout).
Megatron's distributed optimizer keeps parameters between micro-batches, so replicas run
independently (``peer``).

``ulysses`` is the same mesh as DeepSpeed-Ulysses runs it: the CP size is a sequence-parallel
size, at most the largest power of two dividing the heads (the all-to-all splits them evenly),
and attention exchanges by all-to-all (:mod:`hdp.ulysses`) instead of the ring.
"""

from __future__ import annotations

import heapq

import numpy as np

from hdp import Plan, ulysses

from .common import Context, PlanBuilder, PlanningError, next_pow2, zigzag_arrays

NATIVE_SYNC = "peer"


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Pack sequence indices into bins of at most ``capacity`` tokens (longest first, first bin
    with room). Returns the bins as index lists, in the order they were opened."""
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    room: list[int] = []
    # Bins sorted by remaining room would make this best-fit; first-fit over a short list of open
    # bins is what packing tools do. Full bins are dropped from the scan to keep it fast.
    open_idx: list[int] = []
    for i in order.tolist():
        L = int(lengths[i])
        placed = False
        for pos, b in enumerate(open_idx):
            if room[b] >= L:
                bins[b].append(i)
                room[b] -= L
                if room[b] < 64:
                    open_idx.pop(pos)
                placed = True
                break
        if not placed:
            bins.append([i])
            room.append(capacity - L)
            if room[-1] >= 64:
                open_idx.append(len(bins) - 1)
    return bins


def memory_size(ctx: Context, name: str = "static") -> int:
    """The smallest CP (SP) size at which a packed micro-batch of ``max_seq`` tokens fits, with
    TE's padding of each document to a multiple of ``2 * size``; PlanningError where the
    cluster (or, for ``ulysses``, the heads) cannot reach it."""
    n = ctx.num_ranks
    most = largest_size(ctx, name)
    cp_mem = next_pow2(ctx.max_seq / ctx.capacity)
    while cp_mem <= n and 2 * -(-ctx.max_seq // (2 * cp_mem)) > ctx.capacity:
        cp_mem *= 2
    if cp_mem > most:
        if most == n:
            limit, fix = f"the cluster has {n}", "use more GPUs or a smaller --max-seq"
        else:
            m = ctx.cost.model
            limit = f"Ulysses splits {m.name}'s {m.heads} heads evenly over at most {most}"
            fix = "use a smaller --max-seq or a larger --capacity"
        raise PlanningError(
            f"{name}: a packed micro-batch of max_seq = {ctx.max_seq} tokens needs a group of "
            f"{cp_mem} ranks at {ctx.capacity} tokens per rank, but {limit}; {fix}"
        )
    return cp_mem


def largest_size(ctx: Context, name: str = "static") -> int:
    """The largest CP size the cluster allows (SP size: Ulysses splits heads evenly)."""
    n = ctx.num_ranks
    return min(n, ulysses.max_degree(ctx.cost.model)) if name == "ulysses" else n


def plan_static(ctx: Context, name: str = "static", size: int | None = None) -> Plan:
    """The static mesh of ``name`` (``static``: Megatron's CP; ``ulysses``: DeepSpeed's SP), of
    CP (SP) ``size`` ranks, or where ``None`` the smallest at which every replica gets a
    micro-batch."""
    lens = ctx.seq_lens
    n = ctx.num_ranks
    most = largest_size(ctx, name)
    cp_mem = memory_size(ctx, name)
    if size is not None and (size & (size - 1) or not cp_mem <= size <= most):
        raise PlanningError(
            f"{name}: a group of {size} ranks does not run this batch: it must be a power of "
            f"two from {cp_mem} (a micro-batch of max_seq = {ctx.max_seq} tokens at "
            f"{ctx.capacity} tokens per rank) to {most}"
        )
    # Unless given, the smallest CP (>= the memory minimum) at which every replica gets a
    # micro-batch. Packing counts the padding (compute is not charged for it), so a rank never
    # holds more than budget / CP <= capacity tokens.
    cp = size or cp_mem
    while True:
        padded = -(-lens // (2 * cp)) * (2 * cp)
        bins = first_fit_decreasing(padded, max(ctx.max_seq, int(padded.max(initial=0))))
        if size is not None or n // cp <= len(bins) or 2 * cp > most:
            break
        cp *= 2
    dp = n // cp
    # Micro-batches to replicas: largest first, to the replica with the fewest tokens.
    bin_tokens = [int(padded[b].sum()) for b in bins]
    heap = [(0, g) for g in range(dp)]
    per_group: list[list[int]] = [[] for _ in range(dp)]
    for b in sorted(range(len(bins)), key=lambda i: -bin_tokens[i]):
        load, g = heapq.heappop(heap)
        per_group[g].append(b)
        heapq.heappush(heap, (load + bin_tokens[b], g))
    seq_ids, group_first, wave_of = [], [], []
    for g, bs in enumerate(per_group):
        for w, b in enumerate(bs):
            members = bins[b]
            seq_ids.extend(members)
            group_first.extend([g * cp] * len(members))
            wave_of.extend([w] * len(members))
    seq_ids_a = np.asarray(seq_ids, dtype=np.int64)
    builder = PlanBuilder(ctx, name)
    rank, seq, start, end = zigzag_arrays(
        seq_ids_a,
        lens[seq_ids_a],
        np.full(seq_ids_a.size, cp),
        first_rank=np.zeros(seq_ids_a.size, dtype=np.int64),
    )
    # zigzag_arrays placed every group at rank 0; shift each sequence to its replica's ranks.
    pos = np.empty(lens.size, dtype=np.int64)
    pos[seq_ids_a] = np.arange(seq_ids_a.size)
    first = np.asarray(group_first, dtype=np.int64)[pos[seq]]
    wave = np.asarray(wave_of, dtype=np.int64)[pos[seq]]
    builder.add(wave, rank + first, seq, start, end)
    builder.info = {"cp_size": float(cp), "dp_size": float(dp), "micro_batches": float(len(bins))}
    return builder.build()
