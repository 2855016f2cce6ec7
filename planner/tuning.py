"""Each baseline at its best at the setting: its own knobs searched, as its authors would.

Note [Tuning the baselines]
---------------------------
A baseline run with hdp's defaults is a strawman: ByteScale with the most tokens memory lets a
rank hold spreads a 2M-token sequence over the fewest ranks, and its step stops falling as GPUs
are added. Its authors would lower its capacity. So ``hdp-sim`` searches every knob of a baseline
that the user did not set (:meth:`Strategy.search_space`), once per setting, and keeps the
fastest over all the setting's steps (one value for the whole run, as a job is configured):

- ``static`` / ``ulysses``: the CP (SP) size: the smallest at which the replicas are as many
  as the micro-batches (a smaller one leaves replicas idle) and its double;
- ``hybridcp``: Megatron's ``max_seqlen_per_dp_cp_rank``, the capacity and its halvings;
- ``bytescale``: its tokens per rank, the capacity (offloading) and its halvings (not
  offloading: the rank has room);
- ``flexsp``: nothing: its MILP already chooses the group sizes of every step;
- ``hdp``: nothing: its planner searches per step.

Halvings stop where the cluster no longer holds a ``max_seq``-token sequence or at
:data:`~hdp.planner.strategies.SMALLEST_CAPACITY` tokens a rank. The search plans every global
batch of the setting with each value and prices it with the one cost model. Example: github-2m on
1,024 H100s holds 70,144 tokens a rank for a baseline (its dK/dV buffers are bf16), so
``bytescale`` tries 70,144 (with offload), 35,072, 17,536, 8,768, 4,384 and 2,192 tokens a rank;
a 2M-token sequence then spans from about 30 ranks (offloading) to 957.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hdp import Plan, StepReport

from . import plan_and_evaluate
from .common import Context, PlanningError
from .pricing import StepPricing
from .strategies import Strategy


@dataclass(frozen=True)
class Trial:
    """One value of the search: its knobs in words and its mean predicted step (or why it
    failed)."""

    value: str
    step_s: float | None
    error: str | None = None


@dataclass(frozen=True)
class Tuned:
    """The search's outcome: the fastest options with their plan and report of every batch,
    and every value tried."""

    options: Any
    planned: tuple[tuple[Plan, StepReport], ...]
    trials: tuple[Trial, ...]

    @property
    def searched(self) -> bool:
        return len(self.trials) > 1

    def summary(self, strategy: Strategy) -> str:
        """``CP size 64 (of 64: 180.0 s, 128: 229.3 s)``, for a reader of a table."""
        knob = strategy.knob(self.options)
        if knob is None:
            return ""
        tried = ", ".join(
            f"{t.value}: {t.step_s:.1f} s" if t.step_s is not None else f"{t.value}: fails"
            for t in self.trials
        )
        return f"{knob[0]} {knob[1]} (of {tried})"


def search_context(
    strategy: Strategy,
    pricing: StepPricing,
    lens: np.ndarray,
    options: Any,
    max_seq: int,
    tokens_per_step: int,
) -> Context:
    """The context ``strategy`` plans ``lens`` in (its exchange, sync and capacity), from which
    it names the values worth trying."""
    exchange = pricing.exchange(strategy, options)
    cost, sync, capacity = pricing.settle(strategy, int(lens.max(initial=0)), options, exchange)
    return Context(lens, cost, sync, capacity, max_seq, tokens_per_step)


def tune(
    strategy: Strategy,
    pricing: StepPricing,
    batches: list[tuple[np.ndarray, int | None]],
    options: Any,
    max_seq: int,
    progress: Callable[[str], None] | None = None,
    search: bool = True,
) -> Tuned:
    """Plan every batch (lengths, token budget or ``None`` for its own tokens) with every value
    of ``strategy``'s unset knobs (Note [Tuning the baselines]) and keep the value of the least
    mean step (without ``search``: ``options`` as given). PlanningError where no value plans them
    all (the first value's error, which says what to change)."""
    options = strategy.options(options)
    lens, budget = batches[0]
    ctx = search_context(strategy, pricing, lens, options, max_seq, budget or int(lens.sum()))
    best: tuple[float, Any, list[tuple[Plan, StepReport]]] | None = None
    trials: list[Trial] = []
    first_error: PlanningError | None = None
    space = strategy.search_space(ctx, options) if search else [options]
    for candidate in space:
        knob = strategy.knob(candidate)
        words = knob[1] if knob else "its rule"
        try:
            planned = [
                plan_and_evaluate(
                    lens,
                    pricing,
                    strategy.name,
                    max_seq=max_seq,
                    tokens_per_step=budget,
                    options=candidate,
                )
                for lens, budget in batches
            ]
        except PlanningError as e:
            first_error = first_error or e
            trials.append(Trial(words, None, str(e)))
            continue
        mean = float(np.mean([report.step_time_s for _, report in planned]))
        trials.append(Trial(words, mean))
        if progress and len(space) > 1:
            progress(
                f"{strategy.name:<9} at {knob[0] if knob else ''} {words}: mean step {mean:.2f} s"
            )
        if best is None or mean < best[0]:
            best = (mean, candidate, planned)
    if best is None:
        assert first_error is not None
        raise first_error
    return Tuned(best[1], tuple(best[2]), tuple(trials))
