"""``HDPScheduler``: hdp's schedule in the form of megatron-core's ``BalancedCPScheduler``.

``get_groups_and_subsamples(sample_id_seqlens, config)`` returns ``(groups, sample_id_groups)``
with ``groups[g][r]`` the sub-sample lengths and ``sample_id_groups[g][r]`` the sub-sample ids
rank ``r`` of the DPxCP group runs in group ``g`` (in order, one micro-batch each). A sample
listed by several ranks of a group runs zigzag-split over them, always one of the CP groups
Megatron builds (:func:`hdp.planner.common.megatron_group_sizes`).

A training run must not stop because one batch is hard to schedule: where hdp's plan cannot be
made into a schedule Megatron runs, the scheduler falls back to Megatron's own schedule (where it
keeps to the groups Megatron builds) and then to one that always runs (every sub-sample on the
whole DPxCP group), and counts each fallback in :attr:`HDPScheduler.stats`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hdp import ClusterSpec, CostModel, Plan, gpu_preset, model_preset
from hdp.planner import PlanningError, StepPricing, get_strategy
from hdp.planner.common import Context, megatron_group_sizes
from hdp.planner.dynamic.megatron import megatron_cp_groups, padded_length, plan_megatron_form
from hdp.planner.hybridcp import (
    BalancedCPSchedule,
    plan_from_sample_id_groups,
    sample_id_groups_from_plan,
)


@dataclass
class SchedulerStats:
    """What :class:`HDPScheduler` did so far: schedules made, how many fell back and why (the
    first problem found, by source), and the source of the last one (``hdp``,
    ``balanced_cp_scheduler`` or ``whole_group``)."""

    schedules: int = 0
    fallbacks: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    last_source: str = ""


class HDPScheduler:
    """Drop-in for megatron-core's ``BalancedCPScheduler`` (see the module docstring).

    Args:
        max_seq_len_per_rank: tokens one rank holds at once (``config.max_seqlen_per_dp_cp_rank``).
        dp_cp_group: the DPxCP process group; only its ``size()`` is used.
        model, gpu, gpus_per_node: what the cost model prices (a preset name or a ``ModelSpec``;
            a GPU profile name; ranks per node, for the NVLink / NIC split).
        sync: ``"peer"`` (what Megatron's hybrid-CP schedule runs: ranks wait only for their CP
            partners inside a group) or ``"wave"``; default: peer where memory allows.
        token_multiple: sub-sample lengths on one rank must be a multiple of this (the
            tensor-parallel size under sequence parallelism); on ``k > 1`` ranks, of
            ``2k * token_multiple``. Priced as padding.

    After each call ``last_schedule_s`` is its wall time, :meth:`executed_plan` prices what
    Megatron will run, and :attr:`stats` counts fallbacks.
    """

    def __init__(
        self,
        max_seq_len_per_rank: int,
        dp_cp_group: Any,
        *,
        model: Any = "llama-7b",
        gpu: str = "h100",
        gpus_per_node: int = 8,
        sync: str | None = None,
        token_multiple: int = 1,
    ) -> None:
        self.max_seq_len_per_rank = int(max_seq_len_per_rank)
        if self.max_seq_len_per_rank <= 0:
            raise ValueError(
                f"max_seq_len_per_rank is {max_seq_len_per_rank}: set "
                "--max-seqlen-per-dp-cp-rank to the tokens one GPU holds in a micro-batch"
            )
        self.total_hdp_gpus = int(dp_cp_group.size())
        spec = model_preset(model) if isinstance(model, str) else model
        cluster = ClusterSpec(
            self.total_hdp_gpus, min(gpus_per_node, self.total_hdp_gpus), gpu_preset(gpu)
        )
        self.pricing = StepPricing.build(
            spec, cluster, capacity=self.max_seq_len_per_rank, sync=sync, kv_exchange="rank"
        )
        self.cost = self.pricing.cost
        self.token_multiple = max(1, int(token_multiple))
        self.last_schedule_s = 0.0
        self.stats = SchedulerStats()
        self._last: tuple | None = None

    def get_groups_and_subsamples(
        self, sample_id_seqlens: Sequence[tuple[int, int]], config: Any = None
    ) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
        """``(groups, sample_id_groups)`` as ``BalancedCPScheduler`` returns them; ``config`` is
        accepted for the same signature and not needed."""
        t0 = time.perf_counter()
        items = [(int(i), int(L)) for i, L in sample_id_seqlens if int(L) > 0]
        if not items:
            raise PlanningError("HDPScheduler: no sub-sample with a positive length to schedule")
        n, cap = self.total_hdp_gpus, self.max_seq_len_per_rank
        longest = max(L for _, L in items)
        if longest > n * cap:
            raise PlanningError(
                f"HDPScheduler: a sub-sample of {longest} tokens does not fit on all {n} DPxCP "
                f"ranks at {cap} tokens each: raise --max-seqlen-per-dp-cp-rank to at least "
                f"{-(-longest // n)} or use more GPUs"
            )
        length = dict(items)
        id_groups, source, sync = None, "", "peer"
        for source, make in (
            ("hdp", self._hdp),
            ("balanced_cp_scheduler", self._balanced),
            ("whole_group", self._whole_group),
        ):
            try:
                id_groups, sync = make(items)
                problem = schedule_problem(id_groups, length, n, cap)
            except Exception as e:  # noqa: BLE001 -- a failed source falls back; its reason is kept
                problem = f"{type(e).__name__}: {e}"
            if problem is None:
                break
            self.stats.fallbacks += source == "hdp"
            key = f"{source}: {problem.split(':')[0]}"
            self.stats.reasons[key] = self.stats.reasons.get(key, 0) + 1
        else:  # the whole-group schedule runs whenever every sub-sample fits on all ranks
            raise PlanningError(f"HDPScheduler: no schedule Megatron can run ({problem})")
        groups = [[[length[s] for s in ranks] for ranks in g] for g in id_groups]
        self.stats.schedules += 1
        self.stats.last_source = source
        self.last_schedule_s = time.perf_counter() - t0
        self._last = (items, id_groups, sync)
        return groups, id_groups

    def _hdp(self, items: list[tuple[int, int]]) -> tuple[list, str]:
        ids = np.array([i for i, _ in items], dtype=np.int64)
        lens = np.array([L for _, L in items], dtype=np.int64)
        megatron_form = get_strategy("hdp").options(form="megatron")
        cost, sync, cap = self.pricing.settle(get_strategy("hdp"), int(lens.max()), megatron_form)
        ctx = Context(
            seq_lens=lens,
            cost=cost,
            sync=sync,
            capacity=cap,
            max_seq=int(lens.max()),
            tokens_per_step=int(lens.sum()),
        )
        plan = plan_megatron_form(ctx, token_multiple=self.token_multiple)
        id_groups = sample_id_groups_from_plan(plan, ids)
        return _runnable(id_groups, dict(items), self.total_hdp_gpus), plan.sync

    def _balanced(self, items: list[tuple[int, int]]) -> tuple[list, str]:
        """Megatron's own schedule (hdp's exact re-implementation of ``BalancedCPScheduler``,
        checked against megatron-core by tests/test_hybridcp_megatron.py)."""
        lens = [L for _, L in items]
        local = BalancedCPSchedule(self.max_seq_len_per_rank, self.total_hdp_gpus).groups(lens)
        ids = [i for i, _ in items]
        return [[[ids[k] for k in ranks] for ranks in g] for g in local], "peer"

    def _whole_group(self, items: list[tuple[int, int]]) -> tuple[list, str]:
        """Every sub-sample on all ranks, longest first: one group, always runnable."""
        order = [i for i, _ in sorted(items, key=lambda t: -t[1])]
        return [[list(order) for _ in range(self.total_hdp_gpus)]], "peer"

    def executed_plan(self) -> Plan:
        """The plan Megatron executes for the last schedule, padding included, priced by the
        cost model (``predicted["step_time_s"]``); see :func:`megatron_plan`."""
        if self._last is None:
            raise RuntimeError("HDPScheduler.executed_plan: nothing scheduled yet")
        items, id_groups, sync = self._last
        return megatron_plan(self.cost, items, id_groups, sync, self.token_multiple)


def schedule_problem(
    id_groups: list[list[list[int]]], length: dict[int, int], n: int, cap: int
) -> str | None:
    """Why Megatron's ``hybrid_context_parallel_forward_backward`` could not run a schedule, or
    None: every group lists ``n`` ranks; each sample runs in one group on one CP group Megatron
    builds, holding at most ``cap`` tokens per rank; partners meet in the same order (no rank
    waits in a cycle); every rank has a sample in the last group."""
    if not id_groups:
        return "empty schedule: no group"
    sizes = set(megatron_group_sizes(n))
    cp_groups = {(g.start, len(g)) for k in sizes if k > 1 for g in megatron_cp_groups(n, k)}
    placed: set[int] = set()
    for g, group in enumerate(id_groups):
        if len(group) != n:
            return f"group of {len(group)} ranks: group {g} must list all {n}"
        holders: dict[int, list[int]] = {}
        for r, ids in enumerate(group):
            if len(set(ids)) != len(ids):
                return f"repeated sample: rank {r} lists one twice in group {g}"
        for r, ids in enumerate(group):
            for s in ids:
                holders.setdefault(s, []).append(r)
        for s, ranks in holders.items():
            k = len(ranks)
            if s in placed or s not in length:
                return f"misplaced sample: {s} is unknown or in two groups"
            placed.add(s)
            if k > 1 and (
                ranks != list(range(ranks[0], ranks[0] + k)) or (ranks[0], k) not in cp_groups
            ):
                return f"unbuilt CP group: sample {s} on ranks {ranks}"
            if length[s] > k * cap:
                return f"over capacity: sample {s} of {length[s]} tokens on {k} ranks"
        if not _lock_step(group, holders):
            return f"deadlock: the ranks' orders in group {g} contradict each other"
    if placed != set(length):
        return f"missing samples: {sorted(set(length) - placed)[:5]} are not scheduled"
    if not all(id_groups[-1]):
        return "idle rank in the last group: Megatron runs every rank's last sample there"
    return None


def _lock_step(group: list[list[int]], holders: dict[int, list[int]]) -> bool:
    """Whether ranks running their lists in order, each sample when all its holders reach it,
    finish."""
    pos = [0] * len(group)
    left = sum(len(ids) for ids in group)
    while left:
        heads = {group[r][pos[r]] for r in range(len(group)) if pos[r] < len(group[r])}
        ready = [
            s
            for s in heads
            if all(pos[q] < len(group[q]) and group[q][pos[q]] == s for q in holders[s])
        ]
        if not ready:
            return False
        for s in ready:
            for q in holders[s]:
                pos[q] += 1
                left -= 1
    return True


def megatron_plan(
    cost: CostModel,
    sample_id_seqlens: Sequence[tuple[int, int]],
    sample_id_groups: list[list[list[int]]],
    sync: str = "peer",
    token_multiple: int = 1,
) -> Plan:
    """The plan Megatron executes for a schedule (ours or ``BalancedCPScheduler``'s), priced by
    ``cost``: ``plan.predicted["step_time_s"]`` is its step time. Sequence ``k`` of the plan is
    the ``k``-th entry of ``sample_id_seqlens``, at the padded length Megatron runs it at
    (:func:`hdp.planner.dynamic.megatron.padded_length`); ``predicted["padding_tokens"]`` counts
    them."""
    ids = [int(i) for i, _ in sample_id_seqlens]
    lens = np.array([int(L) for _, L in sample_id_seqlens], dtype=np.int64)
    index_of = {i: k for k, i in enumerate(ids)}
    cp = np.ones(lens.size, dtype=np.int64)
    for group in sample_id_groups:
        count: dict[int, int] = {}
        for ranks in group:
            for s in ranks:
                count[s] = count.get(s, 0) + 1
        for s, k in count.items():
            cp[index_of[s]] = k
    padded = np.array(
        [padded_length(L, k, token_multiple) for L, k in zip(lens.tolist(), cp.tolist())],
        dtype=np.int64,
    )
    ctx = Context(
        seq_lens=padded,
        cost=cost,
        sync=sync,
        capacity=cost.capacity(sync),
        max_seq=int(padded.max()),
        tokens_per_step=int(padded.sum()),
    )
    local = [[[index_of[s] for s in ranks] for ranks in g] for g in sample_id_groups]
    plan = plan_from_sample_id_groups(ctx, local, None, "hdp")
    plan.predicted.update(cost.evaluate(plan).summary())
    plan.predicted["padding_tokens"] = float((padded - lens).sum())
    return plan


def _runnable(
    id_groups: list[list[list[int]]], length: dict[int, int], n: int
) -> list[list[list[int]]]:
    """Make a schedule one Megatron can run: its forward-backward runs the last sub-sample of the
    last group on every rank outside ``no_sync`` (to trigger the gradient reduction), so every rank
    needs a sub-sample in the last group.

    A rank with nothing at all takes a single-rank sample from the rank with the most work (a
    rank that keeps at least one); then trailing groups merge until the last group covers every
    rank. Merging drops a barrier: harmless, because every rank lists samples in the plan's wave
    order, so CP partners never wait for each other in a cycle."""
    groups = [[list(r) for r in g] for g in id_groups]
    holders: dict[int, set[int]] = {}
    for g in groups:
        for r, ids in enumerate(g):
            for s in ids:
                holders.setdefault(s, set()).add(r)
    work = [sum(length[s] ** 2 / len(holders[s]) for g in groups for s in g[r]) for r in range(n)]
    for r in range(n):
        if any(g[r] for g in groups):
            continue
        donors = [
            (work[d], d)
            for d in range(n)
            if sum(len(holders[s]) == 1 for g in groups for s in g[d]) >= 1
            and sum(len(g[d]) for g in groups) >= 2
        ]
        if not donors:
            raise PlanningError(
                f"HDPScheduler: {len(holders)} sub-samples cannot give each of {n} ranks one "
                "(Megatron's schedule needs a sub-sample on every rank): use more or longer samples"
            )
        _, d = max(donors)
        g_idx, s = max(
            ((gi, s) for gi, g in enumerate(groups) for s in g[d] if len(holders[s]) == 1),
            key=lambda t: (t[0], length[t[1]]),
        )
        groups[g_idx][d].remove(s)
        groups[-1][r].append(s)
        holders[s] = {r}
        work[d] -= length[s] ** 2
        work[r] += length[s] ** 2
    while len(groups) > 1 and not all(groups[-1]):
        last = groups.pop()
        groups[-1] = [a + b for a, b in zip(groups[-1], last)]
    return [g for g in groups if any(g)]
