"""A Llama decoder as a user writes it first, in torch alone: the independent yardstick of hdp's
step speed on one GPU (``scripts/plain_loop.py --impl minimal``).

Nothing here comes from hdp: ``nn.RMSNorm``, one fused q/k/v projection and one fused gate/up
projection, RoPE with cos and sin built once per batch and applied in the compute dtype (plain
theta; a scaled RoPE costs the same), causal varlen attention over the packed sequences
(``torch.ops.aten._flash_attention_forward`` on CUDA, which autograd differentiates; per-sequence
SDPA elsewhere), each layer recomputed in backward, and the loss over chunks of
``LOSS_CHUNK`` tokens whose logits are recomputed in backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_CHUNK = 8192
IGNORE_INDEX = -100


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, d]`` rotated in the half-split layout of Hugging Face checkpoints."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_varlen(q, k, v, cu: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """Causal attention of each packed sequence (``cu``: int32 offsets) over itself."""
    if q.is_cuda:
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale
        )[0]
        return out
    groups = q.shape[1] // k.shape[1]
    parts = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
    return torch.cat([p.transpose(0, 1) for p in parts])


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attn_norm = nn.RMSNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin, cu, max_len: int) -> torch.Tensor:
        T, h, hk, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(self.attn_norm(x)).split([h * d, hk * d, hk * d], dim=-1)
        q, k = rotate(q.view(T, h, d), cos, sin), rotate(k.view(T, hk, d), cos, sin)
        out = causal_varlen(q, k, v.view(T, hk, d), cu, max_len, d**-0.5)
        x = x + self.o(out.reshape(T, h * d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class MinimalLlama(nn.Module):
    """``forward(input_ids, position_ids, packed, labels)``: the summed next-token loss of the
    packed sequences (``packed.cu``, ``packed.max_len``), as hdp's ``Llama`` returns it."""

    def __init__(self, *, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, theta, eps):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            Block(hidden, heads, kv_heads, head_dim, ffn, eps) for _ in range(layers)
        )
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.head = nn.Linear(hidden, vocab, bias=False)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids, position_ids, packed, labels) -> torch.Tensor:
        x = self.embed(input_ids)
        angles = position_ids.float()[:, None] * self.inv_freq.float()[None, :]  # fp32, as HF
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled() else x.dtype
        cos, sin = (f(angles)[:, None, :].to(dtype) for f in (torch.cos, torch.sin))
        for block in self.blocks:
            x = checkpoint(block, x, cos, sin, packed.cu, packed.max_len, use_reentrant=False)
        h = self.norm(x)
        total = h.new_zeros((), dtype=torch.float32)
        for a in range(0, h.shape[0], LOSS_CHUNK):
            b = a + LOSS_CHUNK
            total = total + checkpoint(self._loss, h[a:b], labels[a:b], use_reentrant=False)
        return total

    def _loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(h).float()
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
