"""A first-use check of attention kernels: Note [Checking a kernel before training on it].

Note [Checking a kernel before training on it]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The fastest backend on a GPU is a kernel library hdp did not write (cuDNN, FlashAttention),
reached through op schemas that change between torch releases, on GPUs hdp may never have run on.
A kernel that returns wrong values trains a worse model silently, so before a run trains on a
backend, :func:`verified_backend` runs it once on a small random case of the run's shape class
(device, dtype, query heads, K/V heads, head dim): two causal documents in one varlen call, and
one shard of queries against earlier keys, forward and backward. It compares the output and the
three gradients with the reference backend in float64 on the CPU, relative to the largest
reference value, within the tolerance of the dtype.

Worked example, bf16 on an H100, llama-7b (32 heads of 128): cuDNN is checked first; if its dQ
differs by 0.4 of the largest reference value (the tolerance is 0.05), the run logs one line and
checks flash_attn, then torch_flash, and trains on the first that matches on every rank (the
ranks agree with one all-reduce per backend tried); the reference closes the list.
``--attention-backend NAME`` is checked too, but never replaced: a mismatch is a warning. Each
shape class is checked once per process (well under a second on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from .kernels import (
    BACKEND_NAMES,
    BackendUnavailable,
    candidate_names,
    get_backend,
    resolve_backend,
)

# Largest |backend - reference| over the largest |reference|, per dtype: bf16 keeps 8 bits of
# mantissa, fp16 11; a kernel that is wrong is off by a sizeable part of its values.
TOLERANCE = {torch.bfloat16: 0.05, torch.float16: 0.01, torch.float32: 1e-4, torch.float64: 1e-9}
# (causal, query lengths, key lengths) of the calls checked: two documents, then one shard of
# queries against keys before them (not causal).
CASES = ((True, (96, 160), (96, 160)), (False, (64,), (128,)))

_checked: dict[tuple, str | None] = {}


def mismatch(
    name: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> str | None:
    """Why backend ``name`` differs from the reference on the small case of this shape class
    (one phrase), or ``None`` when it matches. Cached per process."""
    key = (name, str(device), dtype, heads, kv_heads, head_dim)
    if key not in _checked:
        try:
            _checked[key] = _compare(name, device, dtype, heads, kv_heads, head_dim)
        except Exception as e:  # noqa: BLE001 - any failure of a kernel is a failed check
            _checked[key] = f"it raised {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return _checked[key]


def _compare(name, device, dtype, heads, kv_heads, head_dim) -> str | None:
    backend, reference = get_backend(name), get_backend("reference")
    gen = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    worst, where = 0.0, ""
    for causal, lens_q, lens_k in CASES:
        shapes = [(sum(lens_q), heads), (sum(lens_k), kv_heads), (sum(lens_k), kv_heads)]
        q, k, v = (
            torch.randn(t, h, head_dim, generator=gen, dtype=torch.float64) for t, h in shapes
        )
        dout = torch.randn(sum(lens_q), heads, head_dim, generator=gen, dtype=torch.float64)
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
        sizes = (max(lens_q), max(lens_k), causal, scale)
        expected = _run(reference, (q, k, v, dout), cu_q, cu_k, sizes)
        on_device = [x.to(device, dtype) for x in (q, k, v, dout)]
        if not backend.host_lengths:
            cu_q, cu_k = cu_q.to(device), cu_k.to(device)
        got = _run(backend, on_device, cu_q, cu_k, sizes)
        for label, a, b in zip(("output", "dQ", "dK", "dV"), got, expected):
            error = (a.double().cpu() - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
            call = f"{label} of the {'causal' if causal else 'shard'} call"
            if not math.isfinite(error):
                return f"{call} is not finite"
            if error > worst:
                worst, where = error, call
    tolerance = TOLERANCE.get(dtype, 1e-4)
    if worst <= tolerance:
        return None
    return f"{where} is off by {worst:.3g} of the largest reference value (tolerance {tolerance})"


def _run(backend, tensors, cu_q, cu_k, sizes) -> tuple[torch.Tensor, ...]:
    q, k, v, dout = tensors
    out, lse = backend.forward(q, k, v, cu_q, cu_k, *sizes)
    lse = lse if backend.name == "reference" else lse.float()
    return (out, *backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, *sizes))


def verified_backend(
    forced: str | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    log: Callable[[str], None],
) -> str:
    """The backend a run trains on: ``forced`` (checked; a mismatch is a warning), or the first
    of :func:`candidate_names` that is available and matches the reference on every rank (a
    collective where there are several), each failure one line. Raises ValueError or
    BackendUnavailable when ``forced`` cannot run here."""
    shape_class = (heads, kv_heads, head_dim)
    shape = f"{str(dtype).removeprefix('torch.')}, {heads} heads / {kv_heads} K/V of {head_dim}"
    if forced is not None:
        name = resolve_backend(forced, device, dtype).name
        problem = None if name == "reference" else mismatch(name, device, dtype, *shape_class)
        if problem:
            log(
                f"warning: attention backend {name} differs from the reference on {device} "
                f"({shape}): {problem}; used anyway, as --attention-backend asks"
            )
        return name
    here = candidate_names(device, dtype)
    for name in BACKEND_NAMES:  # one order on every rank, whatever each rank's GPU offers
        try:
            available = name in here and get_backend(name) is not None
        except BackendUnavailable:
            available = False
        problem = None
        if available and name != "reference":
            problem = mismatch(name, device, dtype, *shape_class)
            if problem:
                log(
                    f"warning: attention backend {name} failed its first-use check on {device} "
                    f"({shape}): {problem}; trying the next backend"
                )
        # Every rank trains on the same backend: the first that runs and passes on all of them.
        if _on_every_rank(available and problem is None, device):
            return name
        if available and problem is None:
            log(f"attention backend {name} failed on another rank; trying the next backend")
    return "reference"


def _on_every_rank(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank (a collective where there are several)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


__all__ = ["TOLERANCE", "mismatch", "verified_backend"]
