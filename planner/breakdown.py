"""Where the slowest rank's step goes: attention, linear work, exposed communication, exposed
offload, idle waits, and the collectives and optimizer around them. ``hdp-sim`` prints it under
its table so that a reader can see why one strategy's step is longer than another's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from hdp import CostModel, Plan, StepReport

PARTS = ("attention", "linear", "exposed_comm", "offload", "idle", "collectives")


@dataclass(frozen=True)
class SlowestRank:
    """One rank's step time in parts that sum to it (seconds).

    Attributes:
        rank: the rank broken down; ``None`` for a mean over several steps (:meth:`mean`).
        step_s: the step time, which every rank shares: the step ends when the last one does.
        attention: the layers' attention kernels of the rank's cells.
        linear: the rest of its compute: GEMMs, norms, the LM head and loss.
        exposed_comm: K/V exchange time its compute does not hide.
        offload: host copies of offloaded activations its compute does not hide.
        idle: time it is not busy before the step's compute ends: waiting on the peers it shares
            a sequence with, on a barrier, on a wave's slowest rank (``wave`` sync), or at the
            end on the ranks still working.
        collectives: the rest of the step: the parameter all-gathers and gradient
            reduce-scatters not hidden by compute, and the optimizer step.
    """

    rank: int | None
    step_s: float
    attention: float
    linear: float
    exposed_comm: float
    offload: float
    idle: float
    collectives: float

    @property
    def parts(self) -> dict[str, float]:
        """Seconds of each part, in :data:`PARTS` order."""
        return {name: getattr(self, name) for name in PARTS}

    @property
    def dominant(self) -> str:
        """The largest part's name."""
        parts = self.parts
        return max(parts, key=parts.__getitem__)

    def shares(self) -> dict[str, float]:
        """Each part as a fraction of the step."""
        step = self.step_s
        return {k: v / step if step > 0 else 0.0 for k, v in self.parts.items()}

    def to_json(self) -> dict[str, float | int | str | None]:
        out: dict[str, float | int | str | None] = {"rank": self.rank, "step_s": self.step_s}
        out.update({f"{k}_s": v for k, v in self.parts.items()})
        out["dominant"] = self.dominant
        return out

    def describe(self, least_share: float = 0.01) -> str:
        """``slowest rank 12.345 s = attention 96%, linear 3%; dominant: attention``: the parts
        of at least ``least_share`` of the step."""
        shown = [
            f"{name.replace('_', ' ')} {100 * share:.0f}%"
            for name, share in self.shares().items()
            if share >= least_share
        ]
        return (
            f"slowest rank {self.step_s:.3f} s = {', '.join(shown)}; "
            f"dominant: {self.dominant.replace('_', ' ')}"
        )

    @staticmethod
    def mean(items: Sequence[SlowestRank]) -> SlowestRank:
        """The part-wise mean of several steps' breakdowns (its ``rank`` is ``None``: the
        slowest rank may differ from step to step)."""
        if not items:
            raise ValueError("mean of no breakdowns")
        values = {
            f.name: float(np.mean([getattr(b, f.name) for b in items]))
            for f in fields(SlowestRank)
            if f.name != "rank"
        }
        return SlowestRank(rank=None, **values)


def slowest_rank(
    plan: Plan, report: StepReport, cost: CostModel, rank: int | None = None
) -> SlowestRank:
    """Break down the step of ``plan`` (priced by ``cost`` into ``report``, as
    :func:`hdp.planner.plan_and_evaluate` returns them) on its slowest rank, or on ``rank``.

    The slowest rank is the one with the most busy time (compute, exposed K/V exchange and
    exposed offload over its waves). Under ``peer`` sync the step ends with the longest chain of
    groups, which may pass through several ranks, so no one rank's busy time need equal it; the
    busiest rank is the one whose own work comes closest to the step, so its parts say what
    costs the step, and a large idle part on it says the chain crosses ranks (waits, not work,
    set the step). Under ``wave`` sync it is the rank that is most often a wave's slowest.

    ``cost`` may be any of its K/V exchange variants (:meth:`CostModel.with_exchange`): the
    parts read here (attention, offload copies) do not depend on the exchange.
    """
    busy = np.asarray(report.busy_s, dtype=np.float64)
    compute = np.asarray(report.compute_s, dtype=np.float64)
    if rank is None:
        rank = int(np.argmax(busy.sum(axis=0)))
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank} is not one of the plan's {plan.num_ranks} ranks")
    attn_layer, _ = cost.cell_compute(plan)
    attention = float(cost.model.layers * attn_layer[:, rank].sum())
    own_compute = float(compute[:, rank].sum())
    off = np.maximum(0.0, cost.offload_time(report.tokens, plan.offload) - compute)
    offload = float(off[:, rank].sum())
    own_busy = float(busy[:, rank].sum())
    span = _compute_span(report, busy)
    return SlowestRank(
        rank=rank,
        step_s=report.step_time_s,
        attention=attention,
        linear=own_compute - attention,
        exposed_comm=own_busy - own_compute - offload,
        offload=offload,
        idle=span - own_busy,
        collectives=report.step_time_s - span,
    )


def _compute_span(report: StepReport, busy: np.ndarray) -> float:
    """Time of the step in which ranks compute: under ``wave`` sync each wave lasts as long as
    its busiest rank (an all-gather longer than that, and the gaps between waves, count as
    collectives); under ``peer`` sync, until the last cell ends."""
    if busy.size == 0:
        return 0.0
    if report.sync == "wave":
        return float(busy.max(axis=1).sum())
    return float((np.asarray(report.start_s) + busy).max())
