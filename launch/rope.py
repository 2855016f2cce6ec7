"""Rotary position embeddings as transformers computes them, for every :class:`hdp.RoPE` kind.

Note [RoPE frequencies]
-----------------------
A head of ``d`` dimensions rotates its pair ``(x[i], x[i + d/2])`` by ``position * inv_freq[i]``
(the half-split layout of Hugging Face checkpoints, whose q/k weights are already permuted for it),
with ``inv_freq[i] = theta ** (-2i / d)``. The scaling kinds change ``inv_freq`` only:

* ``linear``: every frequency divided by ``factor`` (positions interpolated);
* ``llama3``: wavelengths ``2 pi / inv_freq`` longer than ``original / low_freq_factor`` divided
  by ``factor``, shorter than ``original / high_freq_factor`` kept, those between blended;
* ``yarn``: the same three bands set by how many turns a dimension makes over ``original``
  positions (``beta_fast``, ``beta_slow``), blended linearly, and cos and sin multiplied by
  ``attention_factor``.

Example: ``d = 4``, theta 10000 gives ``inv_freq = [1, 0.01]``; ``linear`` x2 gives
``[0.5, 0.005]``, so position 6 rotates its pairs by 3 and 0.03 radians. Each formula runs in
fp32 in transformers' order of operations, so a loaded checkpoint computes transformers' function.
"""

from __future__ import annotations

import math

import torch

from hdp import RoPE


def rope_frequencies(rope: RoPE, dim: int) -> tuple[torch.Tensor, float]:
    """(``inv_freq`` fp32 ``[dim / 2]``, the factor multiplying cos and sin) of ``rope`` for
    heads of ``dim`` dimensions (Note [RoPE frequencies])."""
    # On the CPU whatever the default device: a model built on the meta device still needs them.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    if rope.type == "yarn":
        return _yarn(rope, dim, exponents), rope.attention_factor
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        inv_freq = _llama3(rope, inv_freq)
    elif rope.type != "default":
        raise ValueError(f"unknown RoPE type {rope.type!r}")
    return inv_freq, 1.0


def _llama3(rope: RoPE, inv_freq: torch.Tensor) -> torch.Tensor:
    original, factor = rope.original_max_positions, rope.factor
    low, high = rope.low_freq_factor, rope.high_freq_factor
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(between, smoothed, scaled)


def _yarn(rope: RoPE, dim: int, exponents: torch.Tensor) -> torch.Tensor:
    base, original = rope.theta, rope.original_max_positions

    def correction_dim(turns: float) -> float:
        return (dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    pos_freqs = base**exponents
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


class RopeAngles:
    """cos and sin of one forward pass's positions (``[T, 1, head_dim / 2]``, scaled), computed
    once in fp32, kept in the dtype the layers rotate in and shared by every layer. Plain
    attributes, no cache: a compiled layer traces them as two tensors."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, head_dim]`` rotated, in ``x.dtype`` (as a transformers model of that
        dtype computes it; fp32 on the CPU)."""
        cos, sin = self.cos, self.sin
        if cos.dtype != x.dtype:  # angles made for another dtype: cast per call
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        d = x.shape[-1]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Rotary:
    """The angles queries and keys are rotated by; the frequencies are computed once per device
    (not a module buffer: a model built on the meta device needs nothing filled in)."""

    def __init__(self, rope: RoPE, dim: int) -> None:
        self.inv_freq, self.scale = rope_frequencies(rope, dim)
        self._on: dict[torch.device, torch.Tensor] = {}

    def angles(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> RopeAngles:
        """The cos and sin of ``position_ids`` ``[T]``, computed in fp32 and kept in ``dtype``
        (the dtype queries and keys are rotated in)."""
        inv = self._on.get(position_ids.device)
        if inv is None:
            inv = self._on[position_ids.device] = self.inv_freq.to(position_ids.device)
        ang = position_ids.to(torch.float32)[:, None] * inv[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return RopeAngles(cos.to(dtype), sin.to(dtype))
