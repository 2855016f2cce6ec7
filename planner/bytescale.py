"""``bytescale``: ByteScale's hybrid data parallelism (arXiv 2502.21231), as we model it.

* Data-aware sharding: a sequence of ``L <= C`` tokens stays whole on one rank; a longer one is
  spread over exactly as many ranks as its memory needs (any number, not a power of two),
  zigzag-split, with ring-style P2P attention over the world communicator.
* Selective offload: a long sequence's ranks may hold more than ``C`` tokens by offloading part
  of their checkpointed activations to host memory; the offload ratio is the smallest that fits,
  and the number of ranks is the smallest whose offload copy still hides under the compute.
* Balance scheduler: sequences longest first; a long sequence goes to the ranks free earliest,
  in a micro-batch after each one's earlier ones, and starts when all of them are free (so a
  rank's time counts its waits); then each short sequence to the rank free earliest, best-fit
  into one of its micro-batches after its long ones (a new one when none has room), so no short
  sequence delays a long one's start. Ranks run different numbers of micro-batches (``peer``
  sync) and the loss is normalised by the step's global token count.
* ``C`` is what memory holds, or a smaller capacity a user sets (then nothing is offloaded): a
  smaller one spreads long sequences wider (Note [Tuning the baselines] in
  :mod:`hdp.planner.tuning`).
"""

from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np

from hdp import Plan

from .common import Context, PlanBuilder, PlanningError

NATIVE_SYNC = "peer"


def ranks_for(ctx: Context, length: int, offload: bool = True) -> tuple[int, float]:
    """(ranks, offload fraction) of a sequence: fewest ranks whose offload hides under compute
    (without ``offload``: ``ceil(length / capacity)``)."""
    cost = ctx.cost
    cap = ctx.capacity
    if length <= cap:
        return 1, 0.0
    if not offload:
        return -(-length // cap), 0.0
    cap_off = max(cost.offload_capacity(ctx.sync), cap)
    lo = -(-length // cap_off)
    hi = -(-length // cap)
    for d in range(lo, hi + 1):
        tokens = -(-length // d)
        frac = float(cost.offload_needed(np.array([tokens]), ctx.sync)[0])
        if frac <= 0:
            return d, 0.0
        if frac > 1:
            continue
        # Per-rank compute of a zigzag share: 1/d of the sequence's attention plus its dense part.
        compute = float(
            cost.model.layers * cost.attn_time(np.array([0]), np.array([length]))[0] / d
            + cost.dense_time(np.array([tokens]))[0]
        )
        if float(cost.offload_time(np.array([tokens]), np.array([frac]))[0]) <= compute:
            return d, frac
    return hi, 0.0


def _best_fit(used: list[int], cap: int, length: int, first: int) -> int:
    """The micro-batch of a rank (``used``: its tokens in each), from index ``first`` on, with
    the least room that still holds ``length`` tokens; a new one where none does."""
    best, best_room = -1, None
    for w in range(first, len(used)):
        room = cap - used[w]
        if room >= length and (best_room is None or room < best_room):
            best, best_room = w, room
    if best < 0:
        used.append(0)
        best = len(used) - 1
    return best


def plan_bytescale(ctx: Context, capacity: int | None = None) -> Plan:
    """ByteScale's plan with ``capacity`` tokens per rank (``None``: what memory holds). Below
    what memory holds a rank has room to spare, so nothing is offloaded."""
    offload = capacity is None or capacity >= ctx.capacity
    if capacity is not None:
        if capacity > ctx.capacity:
            raise PlanningError(
                f"bytescale: {capacity} tokens per rank do not fit; memory holds {ctx.capacity}"
            )
        ctx = replace(ctx, capacity=capacity)
    lens = ctx.seq_lens
    n, cap = ctx.num_ranks, ctx.capacity
    cost = ctx.cost
    # When each rank is free: the end of its chain of long sequences, waits for the other
    # members included, then of its short ones. The balance scheduler feeds the ranks that lag.
    ready = np.zeros(n)
    used: list[list[int]] = [[] for _ in range(n)]  # tokens in each of a rank's micro-batches
    builder = PlanBuilder(ctx, "bytescale")
    long_ids, long_members, long_waves = [], [], []
    short_heap: list[tuple[float, int]] | None = None
    placed_short: list[tuple[int, int, int]] = []  # (wave, rank, seq)
    for i in np.argsort(-lens, kind="stable").tolist():  # long sequences first
        L = int(lens[i])
        if L == 0:
            continue
        d, frac = ranks_for(ctx, L, offload)
        if d > n:
            raise PlanningError(
                f"bytescale: a sequence of {L} tokens needs {d} ranks (at most {cap} tokens each, "
                f"more with offload) but the cluster has {n}"
            )
        if d > 1 or frac > 0:
            members = np.sort(np.argsort(ready, kind="stable")[:d])
            wave = max(len(used[r]) for r in members.tolist())
            t = float(
                cost.model.layers * cost.attn_time(np.array([0]), np.array([L]))[0] / d
                + cost.dense_time(np.array([-(-L // d)]))[0]
            )
            ready[members] = ready[members].max() + t  # it starts when all of them are free
            for r in members.tolist():
                used[r].extend([0] * (wave + 1 - len(used[r])))
                used[r][wave] = -(-L // d)
                if frac > 0:
                    builder.offload[(wave, r)] = frac
            long_ids.append(i)
            long_members.append(members)
            long_waves.append(wave)
            continue
        if short_heap is None:  # short sequences after every long one, where they delay none
            first = [len(u) for u in used]
            short_heap = [(float(ready[r]), r) for r in range(n)]
            heapq.heapify(short_heap)
        _, r = heapq.heappop(short_heap)
        best = _best_fit(used[r], cap, L, first[r])
        used[r][best] += L
        ready[r] += ctx.whole_s[i]
        placed_short.append((best, r, i))
        heapq.heappush(short_heap, (float(ready[r]), r))
    if long_ids:
        builder.add_zigzag(long_ids, long_waves, long_members)
    if placed_short:
        w, r, s = (np.asarray(c, dtype=np.int64) for c in zip(*placed_short))
        builder.add(w, r, s, 0, lens[s])
    builder.info = {
        "capacity": float(ctx.capacity),
        "long_sequences": float(len(long_ids)),
        "offloading_cells": float(len(builder.offload)),
    }
    return builder.build()
