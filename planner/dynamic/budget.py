"""The search's budget: seconds of one core, charged by estimates of each step's work.

Estimates, not the clock, so that a plan depends only on the batch and the options, never on
how busy the machine is. Each is a sum of the work a step does (ranks scanned per job, sequences
placed, shards priced, ...) times seconds per item fitted on the bench's batches by
``scripts/fit_budget.py`` (llama-7b and llama-70b, 64 to 16,384 ranks); ``docs/benchmarks.md``
says how closely the search then keeps to its budget. Work that only the step itself reveals is
counted as it is done and charged after it: in ``wave`` sync with offload, how many sequences
searched every cell for one that offloads (for llama-70b nearly all of them, most of a
placement's time), estimated beforehand as the last placement's count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..common import Context
from .groups import most_members

if TYPE_CHECKING:
    from hdp import Plan

    from .local import Work

# The default budget is the first plan's predicted step over this, and at least LEAST_S (also
# the least first level of a larger budget).
STEP_SHARE = 100
LEAST_S = 0.05


@dataclass
class Budget:
    """What the search may still spend (s), charged by estimates, not by the clock. Seeds
    (roundings past the first, the MILP's degrees, group layouts) may spend half of the total;
    the local search has the rest. The total grows a level at a time
    (:func:`.search.level_budgets`)."""

    left_s: float
    total_s: float = field(init=False)
    seeds_s: float = 0.0  # what seeds spent
    refused: bool = False  # whether it refused something since this was last reset

    def __post_init__(self) -> None:
        self.total_s = self.left_s

    def grow(self, seconds: float) -> None:
        """The next level: ``seconds`` more to spend."""
        self.total_s += seconds
        self.left_s += seconds

    def record(self, plan: Plan, budget_s: float | None = None) -> None:
        """Say in ``plan.predicted`` what the search had (``budget_s``: by default the total,
        which falls short of the budget where the search stopped before its last level) and
        charged (``search_s``) past its first plan."""
        plan.predicted["budget_s"] = self.total_s if budget_s is None else budget_s
        plan.predicted["search_s"] = max(0.0, self.total_s - self.left_s)

    @classmethod
    def for_step(cls, given_s: float | None, step_s: float) -> Budget:
        """``given_s``, or where ``None`` the default of :class:`~.options.DynamicOptions` for a
        plan whose first placement steps ``step_s``."""
        return cls(max(LEAST_S, step_s / STEP_SHARE) if given_s is None else given_s)

    @staticmethod
    def placement_s(ctx: Context, jobs: int, shards: int, waves: int, searches: float) -> float:
        """Estimated seconds of one placement of ``jobs`` multi-rank jobs, ``shards`` shards in
        all, in a plan of about ``waves`` waves, and its pricing: ``peer`` sync picks each job's
        nodes among all ranks; ``wave`` sync tries each job on every wave's ranks, each
        sequence on every wave, and for ``searches`` sequences every cell for one that
        offloads (``predicted["offload_searches"]`` of a plan placed so)."""
        n, seqs = ctx.num_ranks, ctx.seq_lens.size
        if ctx.sync == "peer":
            return 1.2e-3 + 5.8e-8 * n * (1 + waves) + 1.5e-8 * jobs * n + 1.9e-6 * shards
        placed = 9.3e-4 + 5.3e-8 * jobs * waves * n + 1.22e-6 * seqs * waves + 3.7e-6 * shards
        return placed + 3.9e-5 * searches

    @staticmethod
    def first_plan_s(
        ctx: Context, jobs: int, shards: int, waves: int, searches: float, degrees: int
    ) -> float:
        """Estimated seconds of a second search's first plan (``auto``'s head-parallel one) for
        a plan of ``jobs`` multi-rank jobs, ``shards`` shards, about ``waves`` waves and
        ``searches`` offload searches: the menus of its jobs, each up to ``degrees`` members,
        and a placement."""
        placed = Budget.placement_s(ctx, jobs, shards, waves, searches)
        seqs = ctx.seq_lens.size
        if ctx.sync == "peer":
            return placed + 1.27e-5 * jobs * degrees + 9.4e-7 * seqs
        return placed + 3.5e-6 * jobs * degrees + 6.4e-6 * seqs

    @staticmethod
    def first_plan_work(ctx: Context, plan: Plan) -> tuple[int, int, int, float, int]:
        """The terms of :meth:`first_plan_s` for a first plan of ``ctx`` like ``plan``: its
        multi-rank jobs, shards, waves and offload searches (none where a group layout made
        it), and the most members a job has in ``ctx``."""
        jobs = int((np.bincount(plan.seq, minlength=plan.seq_lens.size) > 1).sum())
        searches = plan.predicted.get("offload_searches", 0.0)
        return jobs, plan.num_shards, plan.num_waves, searches, most_members(ctx)

    @staticmethod
    def layout_s(ctx: Context, shards: int, groups: int = 1) -> float:
        """Estimated seconds of one group layout of at most ``shards`` shards and its pricing
        over all ranks; on ``groups`` equal groups, the deal by their waves
        (:func:`.groups.group_plan`) looks at more groups for each sequence the more there
        are."""
        seqs, n = ctx.seq_lens.size, ctx.num_ranks
        return 4e-6 * seqs + 2.75e-6 * shards + 2.5e-6 * seqs * math.log2(groups) + 2e-7 * n

    @staticmethod
    def megatron_pricing_s(ctx: Context, shards: int) -> float:
        """Estimated seconds of pricing one Megatron-form layout of ``shards`` sub-samples as
        Megatron runs it (:func:`.megatron.price`)."""
        if ctx.sync == "peer":
            return 1.4e-3 + 2.7e-7 * ctx.num_ranks + 5e-6 * shards
        return 1.7e-3 + 6e-6 * shards

    @staticmethod
    def move_s(ctx: Context, work: Work) -> float:
        """Estimated seconds of the moves of :mod:`.local` that did ``work``: the plan's cells
        built and the moved plan priced, then per search, per sequence tried and per cell
        priced for it."""
        seqs = ctx.seq_lens.size
        if ctx.sync == "wave":
            fixed = 2.3e-4 + 4.1e-7 * work.shards
            return fixed + 3.8e-4 * work.searches + 4.7e-8 * work.cells
        fixed = 3.7e-7 * seqs + 1.1e-7 * work.shards
        return fixed + 1.9e-4 * work.searches + 1e-4 * work.tried + 2.3e-8 * work.cells

    @staticmethod
    def milp_s(counts: int) -> float:
        """Estimated seconds of the MILP (:func:`.milp.solve_degrees`) with ``counts`` count
        variables: building and solving it with HiGHS."""
        return 2e-3 + 3e-4 * counts

    @staticmethod
    def regroup_trial_s(plan: Plan) -> float:
        """Estimated seconds of one trial of :func:`.regroup.regroup` from ``plan`` (``peer``
        sync): a layout of its sequences stacked, built and priced."""
        cells = plan.num_waves * plan.num_ranks
        return 6.8e-4 + 2.2e-6 * plan.seq_lens.size + 1.1e-6 * plan.num_shards + 5.5e-6 * cells

    def spend(self, seconds: float, seed: bool = False) -> None:
        self.left_s -= seconds
        if seed:
            self.seeds_s += seconds

    def affords(self, seconds: float, seed: bool = False) -> bool:
        """Whether ``seconds`` more fit, for a seed within the seeds' half."""
        ok = seconds <= self.left_s and (not seed or self.seeds_s + seconds <= self.total_s / 2)
        self.refused |= not ok
        return ok
