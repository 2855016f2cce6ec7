"""Merging partial attention results of the same queries with log-sum-exp.

Two partial results ``(o1, lse1)`` and ``(o2, lse2)`` of the same query row over disjoint key sets
combine exactly as ``lse = logaddexp(lse1, lse2)``,
``o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse)``.
:class:`PartialAttention` keeps the running ``(out, lse)`` of all of a rank's query rows in fp32
(fp64 for fp64 inputs), so precision does not degrade with the number of blocks merged.
"""

from __future__ import annotations

import math

import torch

from .kernels import acc_dtype


class PartialAttention:
    """Running attention output of ``tokens`` query rows.

    ``out`` is ``[T, H, d]``, ``lse`` ``[H, T]``, both in the accumulation dtype.
    """

    def __init__(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.out, self.lse = out, lse

    @classmethod
    def empty(
        cls, tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> PartialAttention:
        """No keys seen yet: ``out = 0``, ``lse = -inf``."""
        ad = acc_dtype(dtype)
        out = torch.zeros(tokens, heads, head_dim, dtype=ad, device=device)
        return cls(out, torch.full((heads, tokens), -math.inf, dtype=ad, device=device))

    @classmethod
    def start(cls, out: torch.Tensor, lse: torch.Tensor) -> PartialAttention:
        """Begun by a first block that covers every query row, in order: merging it into an
        empty result would only copy it."""
        ad = acc_dtype(out.dtype)
        return cls(out.to(ad), lse.to(ad))

    def merge(self, rows: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold in a partial result for query ``rows`` (distinct indices): ``out`` ``[n, H, d]``,
        ``lse`` ``[H, n]``."""
        if rows.numel() == 0:
            return
        old_lse = self.lse[:, rows]
        part_lse = lse.to(self.lse.dtype)
        new_lse = torch.logaddexp(old_lse, part_lse)
        finite = torch.isfinite(new_lse)
        safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
        w_old = torch.where(finite, torch.exp(old_lse - safe), torch.zeros_like(new_lse)).T[
            ..., None
        ]
        w_new = torch.where(finite, torch.exp(part_lse - safe), torch.zeros_like(new_lse)).T[
            ..., None
        ]
        self.out[rows] = self.out[rows] * w_old + out.to(self.out.dtype) * w_new
        self.lse[:, rows] = new_lse
