"""Checkpoints with ``torch.distributed.checkpoint``: sharded model and optimizer states, plus the
step, the LR schedule, the dataloader position and each rank's RNG state, so a resumed run trains
on exactly the tokens the uninterrupted run would have.

Layout: ``DIR/step_00000042/`` (DCP shards and ``train_state.json``) and ``DIR/latest`` (the name of
the newest complete checkpoint, written last, so a run killed while saving resumes from the
previous one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(folder: str | Path, step: int, model, optimizer, scheduler, data_state: dict) -> Path:
    """Save everything needed to continue after ``step`` optimizer steps (a collective)."""
    folder = Path(folder)
    path = folder / f"step_{step:08d}"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, path / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        meta = {"step": step, "scheduler": scheduler.state_dict(), "data": data_state}
        tmp = path / "train_state.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, path / "train_state.json")
    _barrier()
    if _rank() == 0:
        tmp = folder / "latest.tmp"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, folder / "latest")
    _barrier()
    return path


def latest(folder: str | Path) -> Path | None:
    """The newest complete checkpoint in ``folder``, or ``None``."""
    marker = Path(folder) / "latest"
    if not marker.exists():
        return None
    path = Path(folder) / marker.read_text().strip()
    return path if (path / "train_state.json").exists() else None


def load(path: str | Path, model, optimizer, scheduler) -> tuple[int, dict]:
    """Restore a checkpoint saved by :func:`save`; returns (step, dataloader state)."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    meta = json.loads((path / "train_state.json").read_text())
    scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / f"rng_rank{_rank()}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved
        rng = torch.load(rng_file)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return int(meta["step"]), meta["data"]


__all__ = ["latest", "load", "save"]
