"""One optimizer step and the checks that keep non-finite values out of the weights.

Note [Non-finite updates]
-------------------------
A step can go wrong in two places. Its loss or gradient norm may not be finite (bad data, a
diverging run): then the optimizer does not step at all (:func:`train_step`). Or the loss and the
gradients are finite but the update itself overflows the weights (a decay or a learning rate
far too high): the weights are checked after every update, by one multi-tensor
max-abs reduction over each rank's own shards (:func:`weights_finite`) whose flag travels in the
step's existing gather of what the ranks measured. No checkpoint is saved between the update and
that check, so a non-finite weight never reaches a checkpoint: ``--nan-policy stop`` stops there,
and ``--nan-policy skip`` puts back the weights and the optimizer state from before the update.
That needs them kept, so under ``skip`` each rank copies its shards and their optimizer state to
host memory before every update (:class:`Before`): a cost the cost model does not price. For
example, under ``skip`` a rank holding 100M parameters of AdamW copies 1.6 GB to the host each
step; under ``stop`` (the default) nothing is copied.
"""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hdp.attention import COMM
from hdp.dataloader.loader import StepData

from .checkpoint import local_part
from .memory import PeakMemory
from .model import Llama
from .runtime import StepResult, run_waves


def weights_finite(model: Llama) -> torch.Tensor:
    """Whether every weight this rank holds is finite: a 0-dim tensor on the weights' device,
    read without waiting for the device (the caller gathers it)."""
    local = [local_part(p.detach()) for p in model.parameters()]
    local = [t for t in local if t.numel()]
    device = next(model.parameters()).device
    if not local:
        return torch.ones((), device=device)
    # The max-abs norm overflows for no finite value, unlike the 2-norm.
    norms = torch._foreach_norm(local, float("inf"))
    return torch.stack([n.float() for n in norms]).isfinite().all().float()


class Before:
    """This rank's weights and optimizer state as they were before an update, in host memory,
    to put back where the update made a weight non-finite (Note [Non-finite updates])."""

    def __init__(self, model: Llama, optimizer: Optimizer) -> None:
        self.weights = [local_part(p.detach()).to("cpu", copy=True) for p in model.parameters()]
        self.state = {
            id(p): {k: _copy(v) for k, v in state.items()} for p, state in optimizer.state.items()
        }

    def restore(self, model: Llama, optimizer: Optimizer) -> None:
        with torch.no_grad():
            for p, saved in zip(model.parameters(), self.weights):
                local_part(p.detach()).copy_(saved)
            for p in list(optimizer.state):
                saved = self.state.get(id(p))
                if saved is None:  # its state was made by this update: as if it never ran
                    del optimizer.state[p]
                    continue
                for k, v in saved.items():
                    if isinstance(v, torch.Tensor):
                        local_part(optimizer.state[p][k]).copy_(v)
                    else:
                        optimizer.state[p][k] = v


def _copy(value):
    return local_part(value).to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


@dataclass
class Update:
    """What one :func:`train_step` did."""

    result: StepResult
    grad_norm: float
    stepped: bool  # the optimizer stepped (the loss and the gradient norm were finite)
    weights_finite: torch.Tensor  # this rank's flag after the update, 0-dim, on the device
    before: Before | None  # under --nan-policy skip: what the update overwrote


def train_step(
    data: StepData,
    *,
    model: Llama,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    grad_clip: float,
    autocast: torch.dtype | None,
    memory: PeakMemory,
    keep_before: bool = False,
    kill: bool = False,
) -> Update:
    """One optimizer step on ``data``: not when the loss or the gradient norm is not finite (the
    same on every rank: both are global), so that no non-finite value reaches the weights from
    there; ``keep_before``: copy what the update overwrites first (Note [Non-finite updates])."""
    COMM.reset()
    memory.start_step()
    res = run_waves(model, data, autocast_dtype=autocast)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), grad_clip if grad_clip > 0 else float("inf")
    )
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    # The step's one wait for the device: whether to step needs the loss and the norm.
    read = torch.cat([res.losses, norm.detach().reshape(1).to(res.losses)]).tolist()
    res = replace(res, loss=read[0], local_loss=read[1])
    grad_norm = read[2]
    stepped = math.isfinite(res.loss) and math.isfinite(grad_norm)
    before = None
    if stepped:
        before = Before(model, optimizer) if keep_before else None
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return Update(res, grad_norm, stepped, weights_finite(model), before)


__all__ = ["Before", "Update", "train_step", "weights_finite"]
