"""``flexsp``: FlexSP (ASPLOS '25): sequences on power-of-two sequence-parallel groups chosen by
a MILP per step, over length buckets from dynamic programming, with a time limit.

1. Buckets: the sorted lengths are cut into at most ``MAX_BUCKETS`` runs by dynamic programming,
   minimising the attention overestimate ``sum (max_in_bucket^2 - L^2)``; a bucket is priced at
   its longest sequence.
2. MILP (pulp; HiGHS where installed, else CBC), for a step time ``M``: integers ``m_g`` (groups
   of ``g`` ranks, ``g`` a power of two that holds the bucket) and ``x_bg`` (sequences of bucket
   ``b`` on size-``g`` groups) with ``sum_g g m_g <= N``, ``sum_g x_bg = c_b``,
   ``sum_b x_bg t_bg <= m_g M`` and ``t_bg <= M`` where used. ``M`` is bisected (each test a small
   feasibility MILP; ``m_g M`` is what makes the joint problem bilinear). ``t_bg``: the cost
   model's time of one bucket sequence on ``g`` ranks as FlexSP runs it, Ulysses all-to-all
   (:mod:`hdp.ulysses`; ``g`` at most the largest power of two dividing the heads), or zigzag
   P2P with ``kv_exchange="rank"``.
3. Groups take aligned consecutive ranks, largest first; each size class spreads its sequences
   over its groups by LPT (for one micro-batch, to groups that still hold them: Note [FlexSP's
   micro-batches]); a group packs its sequences first-fit into micro-batches of at most
   ``g * capacity`` tokens and runs them one after another. FlexSP shards parameters with ZeRO-3
   and gathers them for every micro-batch, so its ranks run micro-batches in step (``wave``
   sync, the capacity of sharded parameters) where memory allows nothing else.

Note [FlexSP's micro-batches]
-----------------------------
In ``wave`` sync (ZeRO-3, how FlexSP runs) every micro-batch gathers the parameters again, so a
wave costs at least its collectives, and FlexSP's solver tries several micro-batch counts. One
solve for the whole batch balances the groups' time but not the waves: its groups pack their
sequences into as many waves as the fullest group needs. Where that is more than the fewest
micro-batches that hold the batch (``ceil(tokens / (ranks x capacity))``), the batch is also
dealt into that many micro-batches (longest first, to the one with the least work that has
room), each solved with the groups of each size holding, all together, their sequences' tokens
at once (FlexSP's memory constraint, counted per size, not per group) and placed on all ranks in
turn; the faster plan is kept. Each size's sequences then go to the least loaded of its groups
that still holds them in one micro-batch, so a group needs a second only where no group of its
size has room. Example: 64 A100s at 5,888 tokens each hold 377K tokens a wave; a 598K-token
batch of FlexSP's Wikipedia trace needs 2 micro-batches, where one solve packed 3, the third
with 0.6 s of compute but a wave's full parameter gathers and gradient reduce-scatter.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from hdp import Plan, ulysses

from .common import (
    Context,
    PlanBuilder,
    PlanningError,
    fewest_micro_batches,
    micro_batches,
    next_pow2,
)
from .solver import make_solver, solver_name
from .splits import split_times

NATIVE_SYNC = "wave"  # ZeRO-3, as its code runs
MAX_BUCKETS = 16
CUTS_PER_OCTAVE = 64  # bins of lengths within 1.1% of each other share a bucket
BISECTION_STEPS = 8
TIME_LIMIT_S = 10.0  # per feasibility MILP: a safety net; the node limit decides


def length_buckets(lengths: np.ndarray, max_buckets: int = MAX_BUCKETS) -> list[np.ndarray]:
    """Indices of ``lengths`` in at most ``max_buckets`` runs of the sorted order (DP on the
    attention overestimate of pricing every sequence at its bucket's longest). Runs are cut only
    between lengths of different :data:`CUTS_PER_OCTAVE` bins, so the DP is over a few hundred
    bins instead of every sequence; a bucket's overestimate is still exact."""
    order = np.argsort(lengths, kind="stable")
    L = lengths[order].astype(np.float64)
    n = L.size
    if n <= max_buckets:
        return [order[i : i + 1] for i in range(n)]
    sq = np.concatenate([[0.0], np.cumsum(L * L)])
    binned = np.floor(np.log2(np.maximum(L, 1.0)) * CUTS_PER_OCTAVE)
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(binned)) + 1, [n]])  # run boundaries
    # cost[i, j]: the overestimate of a bucket from cut i to cut j (i < j).
    first, last = cuts[:, None], cuts[None, :]
    top = L[np.maximum(last - 1, 0)] ** 2
    cost = (last - first) * top - (sq[last] - sq[first])
    cost = np.where(first < last, cost, np.inf)
    best = np.full(cuts.size, np.inf)
    best[0] = 0.0
    choice = np.zeros((max_buckets + 1, cuts.size), dtype=np.int64)
    layers = [best]
    for k in range(1, max_buckets + 1):
        total = layers[-1][:, None] + cost
        choice[k] = np.argmin(total, axis=0)
        layers.append(total[choice[k], np.arange(cuts.size)])
    k = int(np.argmin([layer[-1] for layer in layers[1:]])) + 1  # fewest buckets at the least
    out, j = [], cuts.size - 1
    for kk in range(k, 0, -1):
        i = int(choice[kk, j])
        out.append(order[cuts[i] : cuts[j]])
        j = i
    return [b for b in reversed(out) if b.size]


@dataclass
class _Groups:
    """The MILP's data: length buckets (indices into the batch), the group sizes, and the
    time of each (bucket, group size) pair allowed (the bucket's longest sequence on it)."""

    buckets: list[np.ndarray]
    sizes: list[int]
    time: dict[tuple[int, int], float]
    # Tokens a rank holds in one micro-batch, where the schedule must be one micro-batch (each
    # bucket's sequences counted at its longest); None: no such limit.
    room: int | None = None
    longest: tuple[int, ...] = ()

    @property
    def counts(self) -> list[int]:
        return [b.size for b in self.buckets]


def plan_flexsp(ctx: Context) -> Plan:
    lens, n, cap = ctx.seq_lens, ctx.num_ranks, ctx.capacity
    ids = np.flatnonzero(lens > 0)
    longest = int(lens.max(initial=0))
    if longest and next_pow2(-(-longest // cap)) > n:
        raise PlanningError(
            f"flexsp: a sequence of {longest} tokens needs a group of "
            f"{next_pow2(-(-longest // cap))} ranks (a power of two) at {cap} tokens each, "
            f"but the cluster has {n}"
        )
    sizes = [1 << k for k in range(int(np.log2(n)) + 1)]
    if ctx.cost.kv_exchange == "ulysses":
        most = ulysses.max_degree(ctx.cost.model)
        sizes = [g for g in sizes if g <= most]  # Ulysses splits heads evenly over a group
        if longest and next_pow2(-(-longest // cap)) > sizes[-1]:
            raise PlanningError(
                f"flexsp: a sequence of {longest} tokens needs a group of "
                f"{next_pow2(-(-longest // cap))} ranks at {cap} tokens each, but Ulysses splits "
                f"{ctx.cost.model.name}'s {ctx.cost.model.heads} heads evenly over at most "
                f"{most} ranks; use --kv-exchange rank (its placement with P2P attention) or a "
                "smaller --max-seq"
            )
    builder = PlanBuilder(ctx, "flexsp")
    _place(ctx, builder, 0, ids, *_solve(ctx, ids, sizes))
    plan = builder.build()
    if ctx.sync != "wave" or plan.num_waves <= 1:
        return plan
    # Note [FlexSP's micro-batches]
    fewest = fewest_micro_batches(ctx)
    parts = micro_batches(ctx, ids, fewest) if fewest < plan.num_waves else None
    if parts is None:
        return plan
    builder = PlanBuilder(ctx, "flexsp")
    wave = 0
    for part in parts:
        solved = _solve(ctx, part, sizes, one_wave=True)
        wave += _place(ctx, builder, wave, part, *solved, one_wave=True)
    split = builder.build()
    cost = ctx.cost
    return split if cost.evaluate(split).step_time_s < cost.evaluate(plan).step_time_s else plan


def _solve(ctx: Context, ids: np.ndarray, sizes: list[int], one_wave: bool = False) -> tuple:
    """Steps 1-2 for the sequences ``ids``: (buckets, schedule, group sizes); ``one_wave``: the
    groups of each size hold their sequences' tokens at once (one micro-batch)."""
    lens, n, cap = ctx.seq_lens, ctx.num_ranks, ctx.capacity
    buckets = length_buckets(lens[ids])
    longest = tuple(int(lens[ids[b]].max()) for b in buckets)
    time: dict[tuple[int, int], float] = {}
    for b, L in enumerate(longest):
        for g in sizes:
            if g >= next_pow2(-(-L // cap)):  # a short sequence may run on a larger group
                time[(b, g)] = _job_time(ctx, L, g)
    groups = _Groups(buckets, sizes, time, cap if one_wave else None, longest)
    sol = _bisect(groups, n, float(ctx.whole_s[ids].sum()) + 1.0)
    if sol is None:
        sol = _smallest_groups(groups, n)
    _spread_spare_ranks(groups, sol, n)
    return buckets, sol, sizes


def _job_time(ctx: Context, length: int, degree: int) -> float:
    """Busy time of one sequence on a group of ``degree`` ranks, as the cost model prices the
    plan's exchange: Ulysses all-to-all (:mod:`hdp.ulysses`), or zigzag P2P."""
    cost = ctx.cost
    if cost.kv_exchange != "ulysses" or degree == 1:
        return float(split_times(cost, np.array([length]), np.array([degree]), ctx.sync)[0][0])
    m = cost.model
    attn = float(cost.attn_time(np.zeros(1), np.array([length]))[0]) / degree
    comm = float(
        ulysses.comm_time(m, cost.cluster, length, degree, cost.compute.attention_recomputed)
    )
    dense = float(cost.dense_time(np.array([-(-length // degree)]))[0])
    return m.layers * (attn + comm) + dense


def _feasible(groups: _Groups, n: int, M: float, solver: str) -> dict[tuple[int, int], int] | None:
    """A schedule within ``M`` seconds: sequences per (bucket, size), and at ``(-1, size)`` the
    groups of each size; ``None`` if the MILP finds none."""
    import pulp

    sizes, counts, time = groups.sizes, groups.counts, groups.time
    prob = pulp.LpProblem("flexsp", pulp.LpMinimize)
    m = {g: prob.add_variable(f"m_{g}", 0, n // g, cat="Integer") for g in sizes}
    x = {
        k: prob.add_variable(f"x_{k[0]}_{k[1]}", 0, counts[k[0]], cat="Integer")
        for k, v in time.items()
        if v <= M
    }
    for b in range(len(groups.buckets)):
        row = [x[k] for k in x if k[0] == b]
        if not row:
            return None
        prob += pulp.lpSum(row) == counts[b]
    for g in sizes:
        load = [x[k] * time[k] for k in x if k[1] == g]
        if load:
            prob += pulp.lpSum(load) <= M * m[g]
        if groups.room is not None:
            held = [x[k] * groups.longest[k[0]] for k in x if k[1] == g]
            if held:
                prob += pulp.lpSum(held) <= groups.room * g * m[g]
    prob += pulp.lpSum(g * m[g] for g in sizes) <= n
    prob += pulp.lpSum([])  # feasibility only: the first schedule found will do
    status = prob.solve(make_solver(solver, TIME_LIMIT_S))
    if pulp.LpStatus[status] != "Optimal":
        return None
    sol = {k: int(round(v.value() or 0)) for k, v in x.items()}
    sol.update({(-1, g): int(round(m[g].value() or 0)) for g in sizes})
    return sol


def _bisect(groups: _Groups, n: int, hi: float) -> dict[tuple[int, int], int] | None:
    """The fastest feasible schedule found by bisection on the step time, from ``hi`` down."""
    name = solver_name()
    times = groups.time
    buckets = range(len(groups.buckets))
    lo = max(min(v for (b, _), v in times.items() if b == bb) for bb in buckets) if buckets else 0.0
    sol = None
    try:
        for _ in range(BISECTION_STEPS if groups.buckets else 0):
            mid = (lo + hi) / 2 if sol is not None else hi
            found = _feasible(groups, n, mid, name)
            if found is None:
                lo = mid
            else:
                sol, hi = found, mid
    except Exception as e:  # the solver failed: every bucket on its smallest group
        warnings.warn(
            f"flexsp: the MILP solver ({name}) failed ({e}); using the smallest groups",
            RuntimeWarning,
            stacklevel=3,
        )
        sol = None
    return sol


def _smallest_groups(groups: _Groups, n: int) -> dict[tuple[int, int], int]:
    """Every bucket on its smallest group, one group of each size used."""
    sol: dict[tuple[int, int], int] = {}
    for b in range(len(groups.buckets)):
        g = min(g for (bb, g) in groups.time if bb == b)
        sol[(b, g)] = sol.get((b, g), 0) + groups.counts[b]
    for g in groups.sizes:
        sol[(-1, g)] = 1 if any(k[1] == g and v for k, v in sol.items() if k[0] >= 0) else 0
    used = [g for g in groups.sizes if sol[(-1, g)]]
    if sum(used) > n:
        raise PlanningError(
            f"flexsp: the MILP found no schedule, and one group of each power of two size the "
            f"step needs ({', '.join(map(str, used))}) takes {sum(used)} of the {n} ranks; use "
            "more GPUs or a larger capacity"
        )
    return sol


def _spread_spare_ranks(groups: _Groups, sol: dict[tuple[int, int], int], n: int) -> None:
    """Spare ranks: one more group at a time to the size with the most work per group."""
    sizes, time = groups.sizes, groups.time
    load = {g: sum(v * time[k] for k, v in sol.items() if k[0] >= 0 and k[1] == g) for g in sizes}
    spare = n - sum(g * sol.get((-1, g), 0) for g in sizes)
    while True:
        fits = [
            g
            for g in sizes
            if g <= spare
            and load[g] > 0
            and sol.get((-1, g), 0) < sum(v for k, v in sol.items() if k[0] >= 0 and k[1] == g)
        ]
        if not fits:
            break
        g = max(fits, key=lambda g: load[g] / max(sol.get((-1, g), 0), 1))
        sol[(-1, g)] = sol.get((-1, g), 0) + 1
        spare -= g


def _member_share(length: int, g: int) -> int:
    """Tokens of a ``length``-token sequence one member of a group of ``g`` ranks holds: all of
    it alone, else its two zigzag chunks of ``ceil(length / 2g)``."""
    return length if g == 1 else 2 * -(-length // (2 * g))


def _deal(ctx: Context, seqs: list[int], groups: int, g: int, one_wave: bool) -> list[list[int]]:
    """``seqs`` dealt to ``groups`` groups of ``g`` ranks, longest work first to the least
    loaded group; ``one_wave``: to the least loaded one that still holds the sequence's share in
    one micro-batch, where any does (the MILP counts memory per size, not per group)."""
    lens, whole = ctx.seq_lens, ctx.whole_s
    load, used = np.zeros(groups), np.zeros(groups, dtype=np.int64)
    lists: list[list[int]] = [[] for _ in range(groups)]
    for i in sorted(seqs, key=lambda i: -whole[i]):
        share = _member_share(int(lens[i]), g)
        fits = np.flatnonzero(used + share <= ctx.capacity) if one_wave else np.empty(0, int)
        j = int(fits[np.argmin(load[fits])]) if fits.size else int(np.argmin(load))
        lists[j].append(i)
        load[j] += float(whole[i])
        used[j] += share
    return lists


def _place(
    ctx: Context,
    builder: PlanBuilder,
    wave0: int,
    ids,
    buckets,
    sol,
    sizes,
    one_wave: bool = False,
) -> int:
    """Step 3: the schedule's groups on ranks, their sequences in waves from ``wave0``; returns
    the number of waves used. ``one_wave``: the schedule was solved for one micro-batch."""
    lens, n, cap = ctx.seq_lens, ctx.num_ranks, ctx.capacity
    next_rank, waves_used = 0, 0
    rows_seq, rows_wave, rows_members = [], [], []
    for g in sorted(sizes, reverse=True):
        groups = sol.get((-1, g), 0)
        seqs = []
        for b, members in enumerate(buckets):
            k = sol.get((b, g), 0)
            if k:
                taken = [int(ids[i]) for i in members[:k]]
                buckets[b] = members[k:]
                seqs += taken
        if not seqs:
            continue
        groups = max(groups, 1)
        first = [next_rank + j * g for j in range(groups)]
        next_rank += groups * g
        lists = _deal(ctx, seqs, groups, g, one_wave)
        for j, seq_list in enumerate(lists):
            if g == 1:
                waves: list[int] = []
                for i in seq_list:
                    k = next(
                        (k for k, used in enumerate(waves) if used + lens[i] <= cap), len(waves)
                    )
                    if k == len(waves):
                        waves.append(0)
                    waves[k] += int(lens[i])
                    builder.add(wave0 + k, first[j], i, 0, int(lens[i]))
                waves_used = max(waves_used, len(waves))
            else:
                # The group's sequences packed first-fit (longest first) into micro-batches
                # whose zigzag shares (two chunks of ceil(L / 2g) per member) fit a member.
                room: list[int] = []
                for i in sorted(seq_list, key=lambda i: -int(lens[i])):
                    share = _member_share(int(lens[i]), g)
                    k = next((k for k, r in enumerate(room) if r >= share), len(room))
                    if k == len(room):
                        room.append(cap)
                    room[k] -= share
                    rows_seq.append(i)
                    rows_wave.append(wave0 + k)
                    rows_members.append(np.arange(first[j], first[j] + g, dtype=np.int64))
                waves_used = max(waves_used, len(room))
    if next_rank > n:
        raise PlanningError(f"flexsp: the groups need {next_rank} ranks, the cluster has {n}")
    if rows_seq:
        builder.add_zigzag(rows_seq, rows_wave, rows_members)
    # Split into micro-batches, each is solved alone: the info describes the largest.
    groups = float(sum(sol.get((-1, g), 0) for g in sizes))
    builder.info["buckets"] = max(builder.info.get("buckets", 0.0), float(len(buckets)))
    builder.info["groups"] = max(builder.info.get("groups", 0.0), groups)
    return waves_used
