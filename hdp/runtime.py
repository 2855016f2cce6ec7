"""The HDP training step: every rank a data-parallel replica (FSDP2 over all ranks), each wave of
the plan run forward and backward on the rank's packed tokens, gradients synchronised once per
step, loss normalised by the step's global token count.

Synchronisation modes (``Plan.sync``):

* ``wave``: parameters resharded after forward (ZeRO-3); every rank runs every wave of the plan,
  an empty one where it holds nothing, because each wave all-gathers the parameters; gradients are
  reduce-scattered as each wave's backward ends (accumulated sharded).
* ``peer``: parameters gathered on the first forward and kept until the step ends; each rank runs
  only its own waves (at least one, possibly empty, so that it joins the gather and the reduce);
  gradients are reduce-scattered once, in the rank's last wave. Ranks wait only for their P2P
  attention partners, and for everyone at a plan barrier.

The loss of a wave is the sum of its token losses divided by the step's global label count (scaled
by the world size to undo FSDP's gradient averaging), so the reduced gradient equals that of the
whole global batch on one device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .model import AttentionContext, Llama, token_loss_sum


@dataclass
class StepResult:
    loss: float  # global mean token loss of the step
    busy_s: float  # this rank's forward/backward time
    waves_run: int


def shard_model(model: Llama, sync: str, mixed_precision: bool = False) -> Llama:
    """Apply FSDP2 ``fully_shard`` to every layer and the root, over the default process group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kw = {"reshard_after_forward": sync == "wave"}
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _is_fsdp(model) -> bool:
    return hasattr(model, "set_requires_gradient_sync")


def run_waves(model: Llama, step, group=None, autocast_dtype: torch.dtype | None = None) -> StepResult:
    """Forward and backward of every wave this rank runs in ``step`` (a dataloader ``StepData``).
    Gradients accumulate in the parameters' ``.grad``; the caller steps the optimizer."""
    plan = step.plan
    device = next(model.parameters()).device
    distributed = dist.is_initialized()
    barriers = set(plan.barriers)
    if plan.sync == "wave":
        mine = list(range(plan.num_waves))
    else:
        mine = [w for w, wd in enumerate(step.waves) if wd.input_ids.numel() > 0] or [0]
    last = mine[-1]
    fsdp = _is_fsdp(model)
    # FSDP averages gradients over ranks; the losses are already normalised by the global token
    # count, so scale by the world size to make the reduced gradient the sum (gloo has no
    # pre-multiplied sum to switch the averaging off).
    grad_scale = float(dist.get_world_size(group)) if fsdp and distributed else 1.0
    total = torch.zeros((), dtype=torch.float64, device=device)
    t_busy = 0.0
    for w in range(plan.num_waves):
        if w in barriers and distributed and plan.sync == "peer":
            dist.barrier(group)
        if w not in mine:
            continue
        wd = step.waves[w]
        if fsdp and plan.sync == "peer":
            model.set_requires_gradient_sync(w == last)
            model.set_reshard_after_backward(w == last)
        t0 = time.perf_counter()
        ctx = AttentionContext(plan, w, group)
        ids, pos, labels = (t.to(device) for t in (wd.input_ids, wd.position_ids, wd.labels))
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(ids, pos, ctx)
        loss = token_loss_sum(logits, labels) / max(step.loss_tokens, 1)
        (loss * grad_scale).backward()
        total += loss.detach().double()
        t_busy += time.perf_counter() - t0
    if distributed:
        dist.all_reduce(total, group=group)
    return StepResult(float(total), t_busy, len(mine))
