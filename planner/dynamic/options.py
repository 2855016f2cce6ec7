"""The options of the ``hdp`` search (Note [One search] in :mod:`.search`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..common import knob_flag, option_flag, seconds_flag


@dataclass(frozen=True)
class DynamicOptions:
    """What :func:`hdp.planner.dynamic.plan_dynamic` may do and spend; the defaults are what
    ``plan_step`` plans with."""

    # What plans may do: ``free``; ``whole`` (every sequence on one rank, for trainers whose
    # attention cannot span ranks); ``megatron`` (:mod:`.megatron`).
    form: str = option_flag(
        "free",
        flag="--hdp-form",
        choices=("free", "whole", "megatron"),
        help="what hdp plans may do: free, whole (every sequence on one rank) or megatron "
        "(aligned power-of-two CP groups, what hdp.dataloader.megatron.HDPScheduler runs)",
    )
    # Seconds of one core the search may spend past its first plan, by its own estimates of
    # each placement's work (so plans do not depend on the machine's load), in levels (from
    # 0.05 s on, four times the budget never plans a slower step under one K/V exchange);
    # ``math.inf``: until nothing helps; ``None``: a 100th of the first plan's predicted step
    # and at least 0.05 s, so that the next step's plan is ready long before this one ends.
    plan_budget_s: float | None = seconds_flag(
        None,
        flag="--plan-budget",
        help="seconds of one core hdp's search may spend past its first plan, charged by "
        "estimates of each step's work so that plans do not depend on the machine's load "
        "(default: a 100th of the first plan's predicted step, at least 0.05 s); from 0.05 s "
        "on, four times the budget never plans a slower step (with --kv-exchange rank, node "
        "or ulysses)",
    )
    # A constraint of the search, not a cap on its effort: no sequence spans more ranks (a
    # Megatron-form CP group included); ``None``: as many as help.
    max_ranks_per_seq: int | None = knob_flag(
        flag="--max-ranks-per-seq",
        metavar="RANKS",
        help="hdp: the most ranks one sequence may span (its context-parallel group; default: "
        "as many as make it faster)",
    )
    # The search stops where the step is within this share of the bound.
    gap: float = 1e-3

    def __post_init__(self) -> None:
        if self.plan_budget_s is not None and not self.plan_budget_s >= 0:
            raise ValueError(
                f"plan_budget_s is {self.plan_budget_s}: give seconds of at least 0 (0: the "
                "first plan only; math.inf: search until nothing helps; None: the default)"
            )
        if self.max_ranks_per_seq is not None and self.max_ranks_per_seq < 1:
            raise ValueError(
                f"max_ranks_per_seq is {self.max_ranks_per_seq}: a sequence needs at least one "
                "rank (leave it unset for no limit)"
            )
