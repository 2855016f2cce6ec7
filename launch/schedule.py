"""The learning-rate schedule: linear warm-up, then cosine decay to 10% of ``--lr`` at the decay
horizon, then 10% on. Note [Warm-up, decay and extended runs].

Note [Warm-up, decay and extended runs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The horizon is ``--lr-decay-steps`` where given; else a resumed run keeps the horizon its
checkpoint saved, so extending a 20-step run with ``--steps 30 --resume`` continues its schedule
(as Megatron's ``--use-checkpoint-opt_param-scheduler`` does) and says so; else it is ``--steps``.
One rule joins the two phases, whether the horizon was given or implied: the warm-up ends at the
horizon at the latest. ``--steps 4`` with the default ``--warmup 10`` warms up over 4 steps, as
does ``--lr-decay-steps 4 --warmup 10``; both say so in one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hdp import plural

if TYPE_CHECKING:
    from .config import OptimizerConfig


@dataclass(frozen=True)
class Schedule:
    warmup: int  # steps of linear warm-up
    decay_steps: int  # the step where the cosine decay reaches 10% of --lr

    def factor(self, step: int) -> float:
        """The learning rate of ``step`` (0-based, as LambdaLR counts) over ``--lr``: training
        step ``warmup`` (1-based, as the log counts) is the peak, and ``decay_steps`` the first
        at 10%."""
        trained = step + 1
        if trained <= self.warmup:
            return trained / self.warmup
        progress = (trained - self.warmup) / max(1, self.decay_steps - self.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def run_schedule(
    optimizer: OptimizerConfig, steps: int, saved: dict | None, log: Callable[[str], None]
) -> Schedule:
    """The schedule of a run of ``steps`` steps from its optimizer's flags and, when it resumes,
    the ``saved`` schedule (``{"warmup", "decay_steps"}``), with one line for each choice a user
    would not assume."""
    if optimizer.lr_decay_steps is not None:
        horizon = optimizer.lr_decay_steps
        if saved and saved["decay_steps"] != horizon:
            log(
                f"the learning-rate decay now ends at step {horizon} (--lr-decay-steps), "
                f"not at step {saved['decay_steps']} as saved"
            )
    elif saved:
        horizon = saved["decay_steps"]
        if steps > horizon:
            log(
                f"continuing the saved schedule: its decay ends at step {horizon}, and steps after "
                "it train at 10% of --lr (pass --lr-decay-steps to decay to a later step)"
            )
    else:
        horizon = steps
    # A resumed run's warm-up is the one it ran (the flag is in the fingerprint): a moved
    # horizon must not start a warm-up again in the middle of a run.
    warmup = min(saved["warmup"] if saved else optimizer.warmup, horizon)
    if warmup < optimizer.warmup and not saved:
        log(
            f"warm-up of {plural(warmup, 'step')}, not --warmup {optimizer.warmup}: it ends where "
            f"the decay does, at step {horizon}"
        )
    return Schedule(warmup, horizon)


__all__ = ["Schedule", "run_schedule"]
