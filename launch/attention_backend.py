"""The attention kernels a training run uses and prices: the backend ``--attention-backend``
forces or the fastest one here, checked once against the reference before the run trains on it
(:mod:`hdp.attention.first_use`), and the profile rows that price it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hdp import GPUProfile, ModelSpec
from hdp.attention import BackendUnavailable, resolve_backend
from hdp.attention.first_use import verified_backend


def training_dtype(device: torch.device) -> torch.dtype:
    """The dtype attention runs in: bf16 autocast on CUDA, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def forced_attention_backend(name: str | None) -> str | None:
    """The attention backend ``--attention-backend name`` forces, or ``None`` (``auto``): the
    fastest for the device and dtype."""
    return None if name in (None, "auto") else name


def verify_attention_backend(
    name: str | None, *, spec: ModelSpec, device: torch.device, log: Callable[[str], None]
) -> str:
    """The attention backend the run trains on, checked against the reference on a small case of
    the model's shape (Note [Checking a kernel before training on it]): ``name``, the one
    ``--attention-backend`` forces, or the fastest that passes. Raises ValueError, one line saying
    why and what to use, when the forced backend cannot run on ``device`` in the training dtype
    (bf16 autocast on CUDA, fp32 on CPU)."""
    name = forced_attention_backend(name)
    try:
        return verified_backend(
            name,
            device,
            training_dtype(device),
            heads=spec.heads,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            log=log,
        )
    except (ValueError, BackendUnavailable) as e:
        raise ValueError(f"--attention-backend {name}: {e}") from None


def priced_attention_backend(name: str | None, device: torch.device, gpu: GPUProfile) -> str | None:
    """The attention rows of ``gpu``'s profile that price the kernels ``dist_attn`` will run here
    (``name``: ``--attention-backend``; :meth:`hdp.profile.KernelTables.rows_for`), or ``None``
    for the profile's own backend: when the profile has no rows for them (a CPU run planned for a
    GPU preset) or the forced backend cannot run (:func:`check_attention_backend` reports that)."""
    try:
        backend = resolve_backend(forced_attention_backend(name), device, training_dtype(device))
    except (ValueError, BackendUnavailable):
        return None
    return gpu.tables.rows_for(backend.name)
