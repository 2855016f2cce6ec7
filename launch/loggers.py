"""Where rank 0 writes each step's metrics record: the ``--metrics`` JSONL file, TensorBoard
(``--tensorboard DIR``, with the optional ``tensorboard`` package) and Weights & Biases
(``--wandb PROJECT``, where ``wandb`` is installed). Every numeric field becomes a scalar of the
same name; a per-rank list becomes one scalar per rank (``busy_s/rank0``, ...)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .resume import open_metrics

if TYPE_CHECKING:
    from .config import OutputConfig

NEEDS = {"tensorboard": "tensorboard", "wandb": "wandb"}


def missing_package(flag: str) -> str | None:
    """Why ``--tensorboard`` or ``--wandb`` cannot run here (its package is not installed), as one
    line saying what to install, or ``None``."""
    package = NEEDS[flag]
    if importlib.util.find_spec(package) is None:
        return f"--{flag} needs the {package} package: pip install {package}"
    return None


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers by name; lists of numbers one per rank; text and flags left out."""
    out = {}
    for key, value in record.items():
        if isinstance(value, bool) or key == "step":
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, list):
            for rank, v in enumerate(value):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{key}/rank{rank}"] = float(v)
    return {k: v for k, v in out.items() if math.isfinite(v)}


class Loggers:
    """The metrics sinks of rank 0 (none elsewhere), written once per step."""

    def __init__(
        self,
        output: OutputConfig,
        start: int,
        setup: dict,
        log: Callable[[str], None],
        checkpoint_dir: Path | None = None,
    ):
        """``start``: the step the run resumes from; ``setup``: its fingerprint, W&B's config;
        ``checkpoint_dir``: names the W&B run, so a resumed run continues its curves."""
        self._file = open_metrics(output.metrics, start, log)
        self._tensorboard = self._wandb = None
        if output.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(output.tensorboard), purge_step=start + 1)
            log(f"TensorBoard: tensorboard --logdir {output.tensorboard}")
        if output.wandb:
            import wandb

            folder = checkpoint_dir
            run_id = (
                hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16] if folder else None
            )
            self._wandb = wandb.init(project=output.wandb, id=run_id, config=setup, resume="allow")

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # a killed run keeps the steps it finished
        step = record["step"]
        if self._tensorboard:
            for name, value in scalars(record).items():
                self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()
        if self._wandb:
            self._wandb.log(scalars(record), step=step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tensorboard:
            self._tensorboard.close()
        if self._wandb:
            self._wandb.finish()


class NoLoggers(Loggers):
    """What ranks other than 0 write: nothing."""

    def __init__(self) -> None:
        self._file = self._tensorboard = self._wandb = None


__all__ = ["Loggers", "NoLoggers", "missing_package", "scalars"]
