"""``hybridcp``: Megatron-LM's ``hybrid_context_parallel`` (megatron-core >= 0.16).

Per sequence, CP size = next power of two of ``ceil(L / max_seqlen_per_dp_cp_rank)``; groups of
consecutive ranks; the greedy ``BalancedCPScheduler`` (workload ``L^2 / cp``) forms *groups* of
sub-samples, each group a barrier-separated phase in which every rank runs its sub-samples one
after another, one micro-batch each, zigzag-split over its CP group (TE). Ranks wait only for their
CP partners inside a group (``peer`` sync) and for everyone at a group boundary (a barrier).

:class:`BalancedCPSchedule` below forms the groups: it reproduces megatron-core's own
``BalancedCPScheduler`` exactly (same bucketing, tie-breaking, trimming and empty-rank filling,
including its quirks; ``tests/test_hybridcp_megatron.py`` checks the two agree where megatron-core
is present), written for speed: groups always take the lowest free ranks and a group's members
always share one load, which makes the per-sequence scans O(1). It plans a step in a tenth
of megatron-core's time or less, so ``auto`` takes it even where megatron-core is
installed: the predictions are the same, and a table's planning times would otherwise depend on
what else is installed. ``implementation="megatron"`` runs megatron-core's own, to check.
"""

from __future__ import annotations

import heapq
import importlib.metadata
import warnings
from collections import deque
from dataclasses import replace
from math import ceil, log2

import numpy as np

from hdp import Plan

from .common import Context, PlanBuilder, PlanningError

NATIVE_SYNC = "peer"


class BalancedCPSchedule:
    """Megatron's greedy hybrid-CP grouping (behaviourally identical re-implementation)."""

    def __init__(self, max_seq_len_per_rank: int, total_gpus: int, delta: float = 0.05) -> None:
        self.cap = max_seq_len_per_rank
        self.total_gpus = total_gpus
        self.delta = delta

    def gpus_needed(self, seq_len: int) -> int:
        return max(1, 2 ** ceil(log2(seq_len / self.cap)))

    def workload(self, seq_len: int, cp_size: int | None = None) -> float:
        if cp_size is None:
            cp_size = self.gpus_needed(seq_len)
        return (seq_len * seq_len) / cp_size

    def _buckets(self, items: list[tuple[int, int]]) -> list[deque]:
        """As many buckets of consecutive items as there are distinct CP sizes, each near an equal
        share of the work (close at 1.1x the share, or to leave items for the buckets to come)."""
        k = len({self.gpus_needed(L) for _, L in items})
        target = sum(self.workload(L, self.gpus_needed(L)) for _, L in items) / k
        buckets: list[deque] = []
        cur: list[tuple[int, int]] = []
        cur_work = 0.0
        remaining_k = k
        for i, (sid, L) in enumerate(items):
            w = self.workload(L)
            # Megatron counts closed buckets twice here (len(buckets) grows as remaining_k falls).
            if cur and (
                cur_work + w > target * 1.1 or len(items) - i <= remaining_k - len(buckets)
            ):
                buckets.append(deque(cur))
                cur, cur_work = [], 0.0
                remaining_k -= 1
            cur.append((sid, L))
            cur_work += w
        if cur:
            buckets.append(deque(cur))
        return buckets

    def next_group(
        self, items: list[tuple[int, int]]
    ) -> tuple[list[list[int]], list[tuple[int, int]], list[list[int]]]:
        """One barrier-separated group: (lengths per GPU, leftover items, sample ids per GPU)."""
        n = self.total_gpus
        lens_per_gpu: list[list[int]] = [[] for _ in range(n)]
        ids_per_gpu: list[list[int]] = [[] for _ in range(n)]
        load = [0.0] * n
        if not items:
            return lens_per_gpu, [], ids_per_gpu
        buckets = self._buckets(items)
        gid_of = [-1] * n
        members: dict[int, list[int]] = {}
        size_of: dict[int, int] = {}
        by_size: dict[int, list[tuple[float, int]]] = {}  # heaps of (group load, gid)
        next_free = 0  # groups always take the lowest free ranks, so the free ranks are a suffix
        first_needed = None
        check_balance = False
        while buckets:
            pick = None
            for idx, bucket in enumerate(buckets):
                if not bucket:
                    continue
                need = self.gpus_needed(bucket[0][1])
                if by_size.get(need) or n - next_free >= need:
                    pick = idx
                    break
            if pick is None:
                break
            sid, L = buckets[pick][0]
            need = self.gpus_needed(L)
            if first_needed is None:
                first_needed = need
            if n - next_free >= need:
                # A new group of free ranks (load 0) always beats an existing one (load > 0).
                gid = len(members)
                chosen = list(range(next_free, next_free + need))
                next_free += need
                members[gid] = chosen
                size_of[gid] = need
                for r in chosen:
                    gid_of[r] = gid
                heap = by_size.setdefault(need, [])
            else:
                heap = by_size[need]
                while True:  # lazy heap: skip stale loads
                    gl, gid = heap[0]
                    if gl == load[members[gid][0]]:
                        break
                    heapq.heapreplace(heap, (load[members[gid][0]], gid))
                heapq.heappop(heap)
                chosen = members[gid]
            cost = self.workload(L)
            for r in chosen:
                lens_per_gpu[r].append(L)
                load[r] += cost
                ids_per_gpu[r].append(sid)
            heapq.heappush(heap, (load[chosen[0]], gid))
            buckets[pick].popleft()
            while buckets and not buckets[0]:
                buckets.pop(0)
            if need < first_needed:
                check_balance = True
            if check_balance and buckets and max(load) - min(load) <= self.delta * max(load):
                break
        leftovers = [item for b in buckets for item in b]
        self._trim(lens_per_gpu, ids_per_gpu, load, gid_of, members, leftovers)
        self._fill_empty(lens_per_gpu, ids_per_gpu, members, size_of)
        return lens_per_gpu, leftovers, ids_per_gpu

    def _trim(self, lens_per_gpu, ids_per_gpu, load, gid_of, members, leftovers) -> None:
        """Pop the last sub-sample of the most loaded group while that narrows the load spread."""
        while True:
            hi, lo = max(load), min(load)
            slack = hi - lo
            if slack <= self.delta * hi or lo == 0:
                return
            r_max = load.index(hi)
            if len(lens_per_gpu[r_max]) <= 1:
                return
            L = lens_per_gpu[r_max][-1]
            cost = self.workload(L)
            group = members[gid_of[r_max]]
            proj = load[:]
            for r in group:
                proj[r] -= cost
            if max(proj) - min(proj) >= slack:
                return
            sid = ids_per_gpu[r_max][-1]
            for r in group:
                lens_per_gpu[r].pop()
                load[r] -= cost
                ids_per_gpu[r].pop()
            leftovers.append((sid, L))

    def _fill_empty(self, lens_per_gpu, ids_per_gpu, members, size_of) -> None:
        """While ranks are idle, double the first smallest group (its first sample's lists are
        copied to the new members) and shift the work of later ranks right."""
        n = self.total_gpus
        while any(not x for x in lens_per_gpu):
            if not size_of:
                raise PlanningError(
                    "hybridcp: no sub-sample could be placed; increase the capacity per rank"
                )
            smallest = min(size_of.values())
            grow_to = min(smallest * 2, n)
            gid = next(g for g, s in size_of.items() if s == smallest)
            group = members[gid]
            extra = grow_to - smallest
            g_first, g_last = group[0], group[-1]
            empty = next(i for i, x in enumerate(lens_per_gpu) if not x)
            pushed_lens = lens_per_gpu[g_last + 1 : empty]
            pushed_ids = ids_per_gpu[g_last + 1 : empty]
            if g_last + extra + len(pushed_lens) >= n:
                raise PlanningError(
                    f"hybridcp: Megatron's scheduler cannot spread work over {n} ranks (not a "
                    "power of two?)"
                )
            new_lens: list[list[int]] = [[] for _ in range(n)]
            new_ids: list[list[int]] = [[] for _ in range(n)]
            new_lens[:g_first] = lens_per_gpu[:g_first]
            new_ids[:g_first] = ids_per_gpu[:g_first]
            for i in range(g_first, g_last + extra + 1):
                new_lens[i] = lens_per_gpu[g_last]
                new_ids[i] = ids_per_gpu[g_last]
            for i, (ls, ids) in enumerate(zip(pushed_lens, pushed_ids)):
                new_lens[g_last + extra + 1 + i] = ls
                new_ids[g_last + extra + 1 + i] = ids
            lens_per_gpu[:] = new_lens
            ids_per_gpu[:] = new_ids
            size_of[gid] = grow_to
            members[gid] = list(range(g_first, g_last + extra + 1))
            for other in size_of:
                if other > gid:
                    members[other] = [x + extra for x in members[other]]

    def groups(self, seq_lens: list[int]) -> list[list[list[int]]]:
        """Sample ids per GPU for every group, like ``get_groups_and_subsamples``."""
        items = sorted(enumerate(int(x) for x in seq_lens), key=lambda t: t[1], reverse=True)
        out = []
        while items:
            _, items, ids = self.next_group(items)
            out.append(ids)
        return out


class GroupOfSize:
    """Stands in for the DP x CP process group: Megatron's scheduler only asks for its size."""

    def __init__(self, n: int) -> None:
        self._n = n

    def size(self) -> int:
        return self._n


def megatron_groups(seq_lens: list[int], capacity: int, num_ranks: int) -> list[list[list[int]]]:
    """Sample ids per GPU for every group, from megatron-core's own ``BalancedCPScheduler``."""
    with (
        warnings.catch_warnings()
    ):  # megatron-core warns about missing TransformerEngine/Apex at import
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    sched = BalancedCPScheduler(capacity, GroupOfSize(num_ranks))
    _, id_groups = sched.get_groups_and_subsamples(
        [(i, int(L)) for i, L in enumerate(seq_lens)], None
    )
    return id_groups


def megatron_available() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.pipeline_parallel.hybrid_cp_schedule  # noqa: F401
    except Exception:
        return False
    return True


def plan_hybridcp(
    ctx: Context, implementation: str = "auto", max_tokens_per_rank: int | None = None
) -> Plan:
    """Plan with Megatron's scheduler (``implementation``: ``megatron``, megatron-core's own;
    ``ours`` or ``auto``, :class:`BalancedCPSchedule`) at ``max_seqlen_per_dp_cp_rank =
    max_tokens_per_rank`` (``None``: the capacity). ``plan.predicted["megatron_scheduler"]``
    says which ran (1.0: megatron-core's)."""
    if max_tokens_per_rank is not None:
        if max_tokens_per_rank > ctx.capacity:
            raise PlanningError(
                f"hybridcp: {max_tokens_per_rank} tokens per rank do not fit; memory holds "
                f"{ctx.capacity}"
            )
        ctx = replace(ctx, capacity=max_tokens_per_rank)
    lens = ctx.seq_lens
    n, cap = ctx.num_ranks, ctx.capacity
    positive = lens[lens > 0]
    if positive.size and max(1, 2 ** ceil(log2(int(positive.max()) / cap))) > n:
        raise PlanningError(
            f"hybridcp: a sequence of {int(positive.max())} tokens needs CP = "
            f"{max(1, 2 ** ceil(log2(int(positive.max()) / cap)))} ranks at {cap} tokens per rank, "
            f"but the cluster has {n}"
        )
    use_megatron = implementation == "megatron"
    if use_megatron and not megatron_available():
        raise PlanningError(
            "hybridcp: megatron-core is not installed (pip install 'hdp-llm[megatron]')"
        )
    nz = np.flatnonzero(lens > 0)
    if use_megatron:
        id_groups = megatron_groups(lens[nz].tolist(), cap, n)
    else:
        id_groups = BalancedCPSchedule(cap, n).groups(lens[nz].tolist())
    plan = plan_from_sample_id_groups(ctx, id_groups, nz, "hybridcp")
    plan.predicted["groups"] = float(len(id_groups))
    plan.predicted["megatron_scheduler"] = float(use_megatron)
    plan.predicted["max_tokens_per_rank"] = float(cap)
    return plan


def scheduler_name(plan: Plan) -> str:
    """Which scheduler formed a ``hybridcp`` plan's groups, in words for a table's reader."""
    if plan.predicted.get("megatron_scheduler"):
        try:
            version = " " + importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            version = ""
        return f"megatron-core{version}'s BalancedCPScheduler"
    return "hdp's copy of Megatron's BalancedCPScheduler"


def plan_from_sample_id_groups(
    ctx: Context,
    id_groups: list[list[list[int]]],
    seq_of_id: np.ndarray | None = None,
    strategy: str = "hybridcp",
) -> Plan:
    """The plan Megatron's ``hybrid_context_parallel_forward_backward`` executes for a schedule.

    ``id_groups[g][r]``: the sample ids rank ``r`` runs in group ``g``, in order, one micro-batch
    each, zigzag-split over the ranks that list the same id in that group (its CP group); a
    barrier separates groups. ``seq_of_id[i]``: the batch index of sample id ``i`` (default: the
    identity). Inside a group every rank runs its list in order and waits for its CP partners, so a
    sample's wave is the first at which it heads the remaining list of every rank that holds it;
    lists whose orders contradict each other would deadlock, and raise :class:`PlanningError`.
    """
    n = ctx.num_ranks
    if seq_of_id is None:
        seq_of_id = np.arange(ctx.seq_lens.size)
    builder = PlanBuilder(ctx, strategy)
    wave0 = 0
    seq_rows, wave_rows, member_rows = [], [], []
    for g, group in enumerate(id_groups):
        if len(group) != n:
            raise PlanningError(f"group {g} lists {len(group)} ranks, but there are {n}")
        holders: dict[int, list[int]] = {}
        for r, ids in enumerate(group):
            for sid in ids:
                holders.setdefault(sid, []).append(r)
        head = [0] * n
        left = sum(len(ids) for ids in group)
        wave = wave0
        while left:
            ready = {ids[head[r]] for r, ids in enumerate(group) if head[r] < len(ids)}
            ready = [
                sid
                for sid in sorted(ready)
                if all(head[r] < len(group[r]) and group[r][head[r]] == sid for r in holders[sid])
            ]
            if not ready:
                raise PlanningError(
                    f"group {g}: the ranks' sample orders contradict each other (the CP groups "
                    "would wait for each other forever)"
                )
            for sid in ready:
                seq_rows.append(int(seq_of_id[sid]))
                wave_rows.append(wave)
                member_rows.append(np.asarray(holders[sid], dtype=np.int64))
                for r in holders[sid]:
                    head[r] += 1
                    left -= 1
            wave += 1
        if wave0 > 0 and wave > wave0:
            builder.barriers.append(wave0)
        wave0 = wave
    builder.add_zigzag(seq_rows, wave_rows, member_rows)
    return builder.build()


def sample_id_groups_from_plan(plan: Plan, ids: np.ndarray) -> list[list[list[int]]]:
    """Megatron's ``sample_id_groups`` of a Megatron-form plan: one group per barrier-separated run
    of waves; each rank lists its sequences (as ``ids[seq]``) by wave, ties by sequence index, so
    the CP partners of a sequence list it in the same relative order."""
    n = plan.num_ranks
    bounds = [0, *sorted(b for b in plan.barriers if 0 < b < plan.num_waves), plan.num_waves]
    pairs = np.unique(
        np.stack([plan.wave, plan.seq, plan.rank], axis=1), axis=0
    )  # sorted by wave, seq
    groups: list[list[list[int]]] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        lists: list[list[int]] = [[] for _ in range(n)]
        for _, s, r in pairs[(pairs[:, 0] >= a) & (pairs[:, 0] < b)].tolist():
            if not lists[r] or lists[r][-1] != int(ids[s]):
                lists[r].append(int(ids[s]))
        if any(lists):
            groups.append(lists)
    return groups
