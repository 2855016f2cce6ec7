"""The knobs of the ``hdp`` search, in one place (see Note [The candidate families])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..common import option_flag


@dataclass(frozen=True)
class DynamicOptions:
    """What :func:`hdp.planner.dynamic.plan_dynamic` tries; the defaults are what ``plan_step``
    plans with.

    Heights are relative to the relaxation's ``M``; shares are of the offload capacity (tokens
    per rank per wave) unless said otherwise."""

    # What plans may do: ``free``; ``whole`` (every sequence on one rank, for trainers whose
    # attention cannot span ranks); ``megatron`` (:mod:`.megatron`).
    form: str = option_flag(
        "free",
        flag="--hdp-form",
        choices=("free", "whole", "megatron"),
        help="what hdp plans may do: free, whole (every sequence on one rank) or megatron "
        "(aligned power-of-two CP groups, what hdp.dataloader.megatron.HDPScheduler runs)",
    )

    # Relaxation heights placed in ``peer`` sync, and per wave in ``wave`` sync.
    height_factors: tuple[float, ...] = (1.0, 1.04, 1.12)
    # The Megatron form also tries lower heights: a job on all ranks there runs alone, so the
    # jobs after it must be fast rather than area-efficient.
    megatron_height_factors: tuple[float, ...] = (0.35, 0.5, 0.7, 1.0, 1.12)
    # ``wave`` sync, at the best height: most tokens per member of a split.
    token_shares: tuple[float, ...] = (0.25,)
    # ``wave`` sync, two tiers: the dense waves hold at most this share.
    cheap_wave_share: float = 0.4
    # ``wave`` sync, no stacking: a multi-rank job joins a wave that holds work only where that
    # raises the wave by at most this share of the job's time.
    stack_share: float = 0.05
    # ``wave`` sync, shelves: first-wave heights tried, and how many of the best are placed.
    shelf_heights: int = 64
    shelf_placed: int = 3
    # Skip a candidate that cannot beat the best step: ``wave`` sync by its work spread over the
    # ranks, ``peer`` by its tallest job (Note [Skipping by work]).
    skip_by_work: bool = True
    # ``peer`` sync: moves of whole sequences between ranks after placement.
    polish_moves: int = 20000
    # The MILP: ``None`` where it fits the time budget, else forced on or off.
    use_ilp: bool | None = None
    ilp_time_limit_s: float = 2.0
    # Family 7: the baselines' plans priced beside hdp's own (off: what hdp's search finds).
    rivals: bool = True
    # Called with every candidate placed and its placement (tests observe the search with it).
    on_place: Callable[[Any, Any], None] | None = None
