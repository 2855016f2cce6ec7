"""Head-parallel plans of a whole batch, for hdp's search in ``ulysses`` exchange.

A head-parallel member attends over its whole sequence for ``1 / G`` of the heads, wherever its
tokens lie, so a group of ``G`` ranks is balanced at any length, and sequences that share the
group's waves share its micro-batches (the dense layers' fixed cost once, not once a sequence).
The relaxation's packing misses that: it gives a long sequence most ranks and puts the short
ones whole beside its shares, where they may overflow a rank's capacity.

:func:`head_group_plan` cuts the ranks into groups of at most one rank a head (as many as
:func:`head_group_counts` says: the search tries each), deals
the sequences to groups longest work first (LPT) and stacks each group's sequences into its
waves while every member stays within the capacity (a sequence that alone overflows it gets a
wave of its own and offloads). Sequences shorter than a group stay whole, on its least-filled
member.
"""

from __future__ import annotations

import numpy as np

from hdp import Plan

from ..common import Context, PlanBuilder
from ..splits import head_split_times


def head_group_counts(ctx: Context) -> list[int]:
    """How many groups to try: the fewest of at most one rank a head, twice as many and so on
    while a group still holds the longest sequence, and one group a node (a node's all-to-alls
    stay on NVLink)."""
    n, rpn = ctx.num_ranks, ctx.ranks_per_node
    least = max(1, -(-int(ctx.seq_lens.max(initial=1)) // ctx.offload_capacity))
    counts, c = [], -(-n // ctx.cost.model.heads)
    while n // c >= least and c <= n:
        counts.append(c)
        c *= 2
    if least <= rpn <= ctx.cost.model.heads and n % rpn == 0 and n // rpn not in counts:
        counts.append(n // rpn)
    return counts


def head_group_plan(ctx: Context, groups: int) -> Plan | None:
    """Every sequence of at least ``G`` tokens split over one of ``groups`` groups of
    ``G = N // groups`` ranks, in exact shares (module docstring); ``None`` where a rank would
    hold more than it can even with offload."""
    n = ctx.num_ranks
    g = n // groups
    lens = ctx.seq_lens
    split = lens >= g
    busy = ctx.whole_s.copy()
    if split.any():
        degree = np.full(int(split.sum()), g)
        busy[split] = head_split_times(ctx.cost, lens[split], degree, ctx.sync)[0]
    load = np.zeros(groups)
    wave_tokens: list[list[np.ndarray]] = [[] for _ in range(groups)]  # per wave: per member
    builder = PlanBuilder(ctx, "hdp")
    seq_ids, waves, members = [], [], []
    for i in np.argsort(-busy, kind="stable").tolist():
        k = int(np.argmin(load))
        load[k] += busy[i]
        ranks = np.arange(k * g, (k + 1) * g)
        L = int(lens[i])
        if L == 0:
            continue
        share = np.full(g, ctx.split(L, g).most_tokens if split[i] else 0, dtype=np.int64)
        if not split[i]:
            share[int(np.argmin(wave_tokens[k][0])) if wave_tokens[k] else 0] = L
        w = _first_fit(wave_tokens[k], share, ctx.capacity)
        if split[i]:
            seq_ids.append(i)
            waves.append(w)
            members.append(ranks)
        else:
            builder.add(np.array([w]), ranks[share > 0], np.array([i]), 0, np.array([L]))
    if seq_ids:
        builder.add_zigzag(seq_ids, waves, members, align=1)
    builder.offload_where_needed()
    plan = builder.build()
    return plan if plan.tokens_per_cell().max(initial=0) <= ctx.offload_capacity else None


def _first_fit(waves: list[np.ndarray], share: np.ndarray, capacity: int) -> int:
    """The first wave whose members all keep room for ``share`` (a new one where none does),
    with ``share`` added to it."""
    for w, tokens in enumerate(waves):
        if (tokens + share <= capacity).all():
            tokens += share
            return w
    waves.append(share.astype(np.int64).copy())
    return len(waves) - 1
