"""What the cost model predicts for one plan (:meth:`hdp.CostModel.evaluate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepReport:
    """What the cost model predicts for one plan. Per-cell arrays are ``[num_waves, num_ranks]``."""

    step_time_s: float
    lower_bound_s: float
    imbalance: float
    exposed_comm_s: float
    comm_bytes: float
    nic_bytes: float
    nvlink_bytes: float
    param_comm_bytes: float
    peak_mem_bytes: float
    mfu: float
    model_flops: float
    num_waves: int
    sync: str
    compute_s: np.ndarray
    busy_s: np.ndarray
    start_s: np.ndarray
    mem_bytes: np.ndarray
    tokens: np.ndarray
    plan_time_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def finish_s(self) -> np.ndarray:
        """When each rank's last busy cell ends (0 for a rank with none)."""
        return np.where(self.busy_s > 0, self.start_s + self.busy_s, 0.0).max(axis=0)

    def summary(self) -> dict[str, float]:
        """The scalar results, with the keys of ``hdp-sim --json``."""
        return {
            "step_time_s": self.step_time_s,
            "lower_bound_s": self.lower_bound_s,
            "imbalance": self.imbalance,
            "exposed_comm_s": self.exposed_comm_s,
            "comm_bytes": self.comm_bytes,
            "nic_bytes": self.nic_bytes,
            "nvlink_bytes": self.nvlink_bytes,
            "param_comm_bytes": self.param_comm_bytes,
            "peak_mem_bytes": self.peak_mem_bytes,
            "plan_time_s": self.plan_time_s,
            "mfu": self.mfu,
            "num_waves": float(self.num_waves),
            **self.extra,
        }
