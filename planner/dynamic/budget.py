"""The search's budget: seconds of one core, charged by estimates of each step's work.

Estimates, not the clock, so that a plan depends only on the batch and the options, never on
how busy the machine is. They are fitted on the bench's batches (llama-7b and llama-70b, 64 to
16,384 ranks) within a factor of two of the measured time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common import Context
from .candidates import num_waves_for

# Seconds of one core per unit of :meth:`Budget.placement_s`'s work estimate (a placement and
# its pricing), fitted on the bench's batches at 64-16,384 ranks.
SECONDS_PER_UNIT = 1e-7
# The default budget is the first placement's predicted step over this (at least 0.2 s).
STEP_SHARE = 100


@dataclass
class Budget:
    """What the search may still spend (s), charged by estimates, not by the clock. Seeds
    (roundings past the first, the MILP's degrees, group layouts) may spend half of it; the
    local search has the rest."""

    left_s: float
    total_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.total_s = self.left_s

    @classmethod
    def for_step(cls, given_s: float | None, step_s: float) -> Budget:
        """``given_s``, or where ``None`` the default of :class:`~.options.DynamicOptions` for a
        plan whose first placement steps ``step_s``."""
        return cls(max(0.2, step_s / STEP_SHARE) if given_s is None else given_s)

    def placement_s(self, ctx: Context, jobs: int, shards: int = 0) -> float:
        """Estimated seconds of one placement and its pricing: every rank for each multi-rank
        job (``wave`` sync: every cell for each sequence), and the shards the cost model
        prices."""
        n, seqs, waves = ctx.num_ranks, ctx.seq_lens.size, num_waves_for(ctx)
        units = n * (jobs + waves) // 2 + 10 * (seqs + shards)
        if ctx.sync == "wave":
            units += seqs * waves * n // 3
        return units * SECONDS_PER_UNIT

    def layout_s(self, ctx: Context, shards: int) -> float:
        """Estimated seconds of one group layout of ``shards`` shards and its pricing: every
        member of every split sequence priced in closed form, then by the cost model."""
        return (10 * ctx.seq_lens.size + 60 * shards) * SECONDS_PER_UNIT

    def move_s(self, ctx: Context, waves: int) -> float:
        """Estimated seconds of one move of :mod:`.local` in a plan of ``waves`` waves: in
        ``wave`` sync every cell looked at once and a few sequences tried against a few cells
        of each wave; in ``peer`` sync every sequence of a rank's tail (a rank's share of the
        batch) against every cell."""
        if ctx.sync == "wave":
            units = waves * (ctx.num_ranks + 600) + 1000
        else:
            units = 3 * ctx.seq_lens.size * waves + 20_000
        return units * SECONDS_PER_UNIT

    def trial_s(self, shards: int) -> float:
        """Estimated seconds of one trial of :func:`.local.exact_moves`: a plan of ``shards``
        shards (cells counted as shards) built and priced."""
        return (20_000 + 20 * shards) * SECONDS_PER_UNIT

    def spend(self, seconds: float) -> None:
        self.left_s -= seconds

    def affords(self, seconds: float, seed: bool = False) -> bool:
        """Whether ``seconds`` more fit, for a seed within its half."""
        return seconds <= self.left_s - (self.total_s / 2 if seed else 0.0)
