"""Plans of a whole batch on equal rank groups, for hdp's search (family 6).

The relaxation's packing gives a long sequence most ranks and puts the short ones whole beside
its shares. Two things it misses, which a system like FlexSP exploits, are cheap to build here:

- Sequences that share a group's waves share its micro-batches, so the dense layers' fixed cost
  is paid once, not once a sequence. Equal jobs stacked on the same ranks as separate waves pay
  it each time.
- On a profile where a split saves work (the CPU's reference attention), every sequence split
  over a large group beats the relaxation's mix of degrees, which cannot all fit side by side.

A head-parallel member (``ulysses`` exchange) attends over its whole sequence for ``1 / G`` of
the heads wherever its tokens lie, so such a group is balanced at any length; a P2P group runs
zigzag shares.

:func:`group_plan` cuts the ranks into groups of ``G`` ranks (as many as :func:`group_counts`
says: the search tries each), deals the sequences to groups longest work first (LPT) and stacks
each group's sequences into its waves while every member stays within the capacity (a sequence
that alone overflows it gets a wave of its own and offloads). Sequences that do not split stay
whole, on the least-filled member of their group's first wave with room.
"""

from __future__ import annotations

import numpy as np

from hdp import Plan, ulysses

from ..common import Context, PlanBuilder, zigzag_shares
from ..splits import head_split_times, split_times


def group_counts(ctx: Context) -> list[int]:
    """How many groups to try: the fewest (one, or in ``ulysses`` exchange as few as have at
    most one rank a head), twice as many and so on while a group still holds the longest
    sequence, and one group a node (a node's traffic stays on NVLink)."""
    n, rpn = ctx.num_ranks, ctx.ranks_per_node
    least = max(1, -(-int(ctx.seq_lens.max(initial=1)) // ctx.offload_capacity))
    most = ulysses.most_members(ctx.cost.model, n) if ctx.cost.kv_exchange == "ulysses" else n
    counts, c = [], -(-n // most)
    while n // c >= least and c <= n:
        counts.append(c)
        c *= 2
    if least <= rpn <= most and n % rpn == 0 and n // rpn not in counts:
        counts.append(n // rpn)
    return counts


def group_splits(ctx: Context, g: int) -> list[tuple[np.ndarray, bool]]:
    """Which sequences a group of ``g`` ranks splits, and whether in exact shares, one per
    variant to try: head-parallel, every sequence of at least ``g`` tokens, exactly; P2P, that
    too (for the profiles where splits save work), and only those a rank cannot hold, in hdp's
    usual shares (:meth:`~planner.common.Context.split`)."""
    lens = ctx.seq_lens
    if ctx.cost.kv_exchange == "ulysses":
        return [(lens >= g, True)]
    return [(lens >= g, True), (lens > ctx.capacity, False)]


def group_plan(ctx: Context, groups: int, split: np.ndarray, exact: bool) -> Plan | None:
    """Every sequence in ``split`` split over one of ``groups`` groups of ``G = N // groups``
    ranks (in exact shares, or hdp's usual ones), the others whole (module docstring); ``None``
    where a rank would hold more than it can even with offload."""
    g = ctx.num_ranks // groups
    lens = ctx.seq_lens
    split = split & (lens >= g)
    ids = np.flatnonzero(split)
    head_parallel = ctx.cost.kv_exchange == "ulysses"
    align = np.array(
        [1 if exact else ctx.split(int(lens[i]), g).align for i in ids.tolist()], dtype=np.int64
    )
    busy = ctx.whole_s.copy()
    held = np.zeros((ids.size, g), dtype=np.int64)  # tokens of each split sequence per member
    if ids.size:
        degree = np.full(ids.size, g)
        if head_parallel:
            busy[ids] = head_split_times(ctx.cost, lens[ids], degree, ctx.sync)[0]
        else:
            busy[ids] = split_times(ctx.cost, lens[ids], degree, ctx.sync, align)[0]
        _, _, head, tail = zigzag_shares(lens[ids], degree, align)
        held = (head + tail).reshape(ids.size, g)
        if head_parallel:  # exact shares; count the fullest member's on each
            held[:] = held.max(axis=1, keepdims=True)
    row = np.full(lens.size, -1)
    row[ids] = np.arange(ids.size)
    load = np.zeros(groups)
    wave_tokens: list[list[np.ndarray]] = [[] for _ in range(groups)]  # per wave: per member
    jobs: tuple[list, list, list] = ([], [], [])  # split sequences: ids, waves, members
    whole: tuple[list, list, list] = ([], [], [])  # whole ones: waves, ranks, ids
    for i in np.argsort(-busy, kind="stable").tolist():
        k = int(np.argmin(load))
        load[k] += busy[i]
        if lens[i] == 0:
            continue
        if split[i]:
            jobs[0].append(i)
            jobs[1].append(_first_fit(wave_tokens[k], held[row[i]], ctx.capacity))
            jobs[2].append(np.arange(k * g, (k + 1) * g))
        else:
            wave, member = _first_room(wave_tokens[k], int(lens[i]), ctx.capacity, g)
            whole[0].append(wave)
            whole[1].append(k * g + member)
            whole[2].append(i)
    builder = PlanBuilder(ctx, "hdp")
    if jobs[0]:
        builder.add_zigzag(jobs[0], jobs[1], jobs[2], align=align[row[jobs[0]]])
    if whole[0]:
        seqs = np.array(whole[2], dtype=np.int64)
        builder.add(np.array(whole[0]), np.array(whole[1]), seqs, 0, lens[seqs])
    builder.offload_where_needed()
    plan = builder.build()
    return plan if plan.tokens_per_cell().max(initial=0) <= ctx.offload_capacity else None


def _first_room(waves: list[np.ndarray], length: int, capacity: int, g: int) -> tuple[int, int]:
    """(wave, member) for a whole sequence in a group of ``g``: the least-filled member of the
    first wave where it keeps room for ``length`` tokens (a new wave where none does), with the
    tokens added."""
    for w, tokens in enumerate(waves):
        member = int(np.argmin(tokens))
        if tokens[member] + length <= capacity:
            tokens[member] += length
            return w, member
    waves.append(np.zeros(g, dtype=np.int64))
    waves[-1][0] = length
    return len(waves) - 1, 0


def _first_fit(waves: list[np.ndarray], share: np.ndarray, capacity: int) -> int:
    """The first wave whose members all keep room for ``share`` (a new one where none does),
    with ``share`` added to it."""
    for w, tokens in enumerate(waves):
        if (tokens + share <= capacity).all():
            tokens += share
            return w
    waves.append(share.astype(np.int64).copy())
    return len(waves) - 1
