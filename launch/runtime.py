"""The HDP training step: every rank a data-parallel replica (FSDP2 over all ranks, none for one
rank: it has nothing to shard and no one to reduce with), each wave of the plan run forward and
backward on the rank's packed tokens, gradients synchronised once per step, loss normalised by
the step's global token count.

Synchronisation modes (``Plan.sync``):

* ``wave``: parameters resharded after forward (ZeRO-3); every rank runs every wave of the plan,
  an empty one where it holds nothing, because each wave all-gathers the parameters; gradients are
  reduce-scattered as each wave's backward ends (accumulated sharded).
* ``peer``: parameters gathered on the first forward and kept until the step ends; each rank runs
  only its own waves, then one token-less pass in which every rank reduce-scatters its
  accumulated gradients (so no collective ever waits on a rank that is waiting for a P2P partner
  in another wave). Ranks wait only for their P2P attention partners, and for everyone at a plan
  barrier.

The loss of a wave is the sum of its token losses divided by the step's global label count (scaled
by the world size to undo FSDP's gradient averaging), so the reduced gradient equals that of the
whole global batch on one device.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from hdp.dataloader.loader import StepData

from .model import AttentionContext, Llama


@dataclass
class StepResult:
    losses: torch.Tensor  # [the step's global mean token loss, this rank's share], on the device
    busy_s: float  # this rank's forward/backward time
    waves_run: int
    # ``losses`` read to the host, once per step with the gradient norm (hdp.launch.update)
    loss: float = math.nan
    local_loss: float = math.nan


def shard_model(model: Llama, sync: str, mixed_precision: bool = False) -> Llama:
    """Apply FSDP2 ``fully_shard`` to every layer and the root, over the default process group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else None
    )
    kw = {"reshard_after_forward": sync == "wave"}
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _is_fsdp(model) -> bool:
    return hasattr(model, "set_requires_gradient_sync")


def run_waves(
    model: Llama, step: StepData, group=None, autocast_dtype: torch.dtype | None = None
) -> StepResult:
    """Forward and backward of every wave this rank runs in ``step``. Gradients accumulate in the
    parameters' ``.grad``; the caller steps the optimizer and reads the losses (nothing here
    waits for the device)."""
    plan = step.plan
    device = next(model.parameters()).device
    distributed = dist.is_initialized()
    barriers = set(plan.barriers)
    fsdp = _is_fsdp(model)
    peer = plan.sync == "peer"
    mine = (
        [w for w, wd in enumerate(step.waves) if wd.input_ids.numel() > 0]
        if peer
        else list(range(plan.num_waves))
    )
    # FSDP averages gradients over ranks; the losses are already normalised by the global token
    # count, so scale by the world size to make the reduced gradient the sum (gloo has no
    # pre-multiplied sum to switch the averaging off).
    grad_scale = float(dist.get_world_size(group)) if fsdp and distributed else 1.0
    total = torch.zeros((), dtype=torch.float64, device=device)
    t_busy = 0.0

    def forward_backward(ids, pos, labels, ctx) -> None:
        nonlocal total
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(ids, pos, ctx, labels) / max(step.loss_tokens, 1)
        (loss * grad_scale).backward()
        total += loss.detach().double()

    if fsdp and peer:
        # No collective may run while ranks are at different waves (a rank in a collective would
        # wait for one that waits for its P2P partner): gather every parameter now, at the same
        # point on every rank, and keep parameters and unsharded gradients across the waves.
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.unshard()
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
    for w in range(plan.num_waves):
        if w in barriers and distributed and peer:
            dist.barrier(group)
        if w not in mine:
            continue
        wd = step.waves[w]
        t0 = time.perf_counter()
        rank = dist.get_rank(group) if distributed else 0
        forward_backward(
            *(to_device(t, device) for t in (wd.input_ids, wd.position_ids, wd.labels)),
            AttentionContext(plan, w, group, float(plan.offload[w, rank])),
        )
        t_busy += time.perf_counter() - t0
    if fsdp and peer:
        # Every rank reduces its gradients in one token-less pass, at the same point of the step.
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        forward_backward(empty, empty, empty, AttentionContext(None, -1, group))
    local = total.clone()
    if distributed:
        dist.all_reduce(total, group=group)
    return StepResult(torch.stack([total, local]), t_busy, len(mine))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor of the batch) on ``device``; to a GPU from pinned memory without
    blocking the host, so the copy overlaps the work queued before it: a copy from pageable
    memory waits for the GPU stream. torch's pinned allocator keeps the staging buffer until the
    copy is done."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


def exit_without_teardown(code: int) -> NoReturn:
    """End a rank's process with ``code`` once its work is done and its process group destroyed:
    flush output and logs, then ``os._exit``, skipping the interpreter's teardown.

    Why: with ``torch.distributed.fsdp`` imported, torch keeps the default gloo group alive
    after ``destroy_process_group`` (its ``pt_gloo_runloop`` and ``gloo_tcp_loop`` threads still
    run). The interpreter's teardown then destroys it along with everything else, and now and then
    a rank that had finished aborts there ("terminate called without an active exception",
    SIGABRT, after its last step), so a launcher reports a finished run as failed. Files the run
    wrote are closed by then (metrics; checkpoints are saved synchronously)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or detached stream: nothing to flush
            pass
    logging.shutdown()
    os._exit(code)
