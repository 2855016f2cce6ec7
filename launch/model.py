"""A Llama-style decoder whose attention is :func:`hdp.attention.dist_attn`.

RMSNorm, rotary position embeddings computed from ``position_ids`` (positions inside each
sequence, so RoPE is exact wherever a sequence's tokens live; scaled as :mod:`hdp.launch.rope`
says), SwiGLU MLP, grouped-query attention, tied or untied embeddings, and what Mistral, Qwen2 and
Qwen3 add (biases, per-head q/k RMSNorm); shapes from a :class:`hdp.ModelSpec`, which can come from
a Hugging Face ``config.json`` (:mod:`hdp.launch.hf_weights` loads its weights). A forward pass
takes one rank's packed tokens of one wave (``[T]``) and the plan that says where the rest of each
sequence is.

Note [Selective activation checkpointing]
-----------------------------------------
Full activation checkpointing keeps each layer's input and runs the whole layer again in
backward, attention included: its P2P exchange and a second attention forward, the most expensive
part of a long sequence's layer. ``keep_attention`` checkpoints the two cheap regions around
attention instead (RMSNorm, the projections and RoPE before it; the output projection, the
residual and the MLP after it) and keeps what attention's backward needs anyway: its q, k, v, its
output and log-sum-exp (``dist_attn`` saves them). Backward then recomputes the two regions and
never attention. The price is memory: per token and layer, q, k, v and the output
(``2 * (heads + kv_heads) * head_dim`` values) and the fp32 LSE beside the layer's input. The
cost model counts them (``CostModel.kept_attention``), and a run that leaves
``--activation-checkpointing`` to its default keeps attention where that is the cheaper way to
fit (Note [Recomputing the fewest layers] in :mod:`hdp.launch.setup`).

Note [Compiled layers]
----------------------
``--compile`` (the default on CUDA) compiles each decoder layer in two regions, the work before
attention (norm, q/k/v, RoPE) and the work after it (output projection, residuals, norm, MLP),
with ``dynamic=True``: a wave's token count changes every step, and one graph per region serves
them all. Attention itself stays eager between them (:func:`hdp.attention.dist_attn`: its P2P
exchanges follow each step's plan, a Python object no graph can hold). The regions are the ones
selective checkpointing recomputes, so both compose, and so do full checkpointing (the recompute
runs the compiled code again) and FSDP2 (its hooks wrap the layer's call, outside the regions).
The loss of a chunk (its LM head and cross-entropy) compiles too, so the compiler can fuse the
fp32 cast of the logits into the cross-entropy rather than write an fp32 copy of them. For
example, llama-1b has 16 layers: 33 compiled regions, each compiled once for forward and once for
backward in the first step, whose line says how long compiling took.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hdp import ModelSpec, Plan
from hdp.attention import dist_attn
from hdp.dataloader import IGNORE_INDEX

from .rope import RopeAngles, Rotary


@dataclass
class AttentionContext:
    """Where this rank's tokens sit: the step's plan, the wave, the process group. ``plan=None``
    marks a token-less pass (no attention partners)."""

    plan: Plan | None
    wave: int
    group: object = None
    offload: float = 0.0  # fraction of layers whose saved activations go to host memory


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension: torch's fused kernel on CUDA (one kernel instead of
    seven), transformers' own order of operations elsewhere (exact on the CPU)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, fused=x.is_cuda)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, fused: bool) -> torch.Tensor:
    """``x / rms(x) * weight``. ``fused``: torch's ``rms_norm`` in ``x``'s dtype (it computes
    in fp32 inside; autocast would run it on an fp32 copy); otherwise in fp32, cast to ``x``'s
    dtype, then scaled, as transformers computes it."""
    if fused:
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def project(x: torch.Tensor, linears: tuple[nn.Linear, ...], *, fused: bool) -> list[torch.Tensor]:
    """Each of ``linears`` applied to ``x``. ``fused``: one GEMM over their weights laid end to
    end, its output split (views): one kernel where there were several, each too narrow to fill
    a GPU. The weights stay separate parameters, so checkpoints and Hugging Face names are those
    of the unfused model; the copy of the weights it costs is small beside the GEMM over a
    wave's tokens."""
    if not fused:
        return [linear(x) for linear in linears]
    weight = torch.cat([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat(biases)
    return list(F.linear(x, weight, bias).split([lin.out_features for lin in linears], dim=-1))


class Attention(nn.Module):
    """Grouped-query self-attention through :func:`hdp.attention.dist_attn`; ``backend`` names its
    kernels (``None``: the fastest for the device and dtype,
    :func:`hdp.attention.select_backend`). Its layer calls it in parts, :meth:`qkv`,
    :meth:`attend` and ``o_proj``, so the parts around attention can be compiled and recomputed
    apart from it (Note [Compiled layers])."""

    def __init__(self, spec: ModelSpec, backend: str | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        h, hd = spec.hidden, spec.head_dim
        self.q_proj = nn.Linear(h, spec.heads * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.kv_heads * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.kv_heads * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.heads * hd, h, bias=spec.o_bias)
        if spec.qk_norm:  # Qwen3: each head's q and k normalised before RoPE
            self.q_norm = RMSNorm(hd, spec.norm_eps)
            self.k_norm = RMSNorm(hd, spec.norm_eps)

    def qkv(self, x: torch.Tensor, rope: RopeAngles):
        """Queries and keys (rotated) and values of ``x``: ``[T, heads or kv_heads, head_dim]``."""
        T, s = x.shape[0], self.spec
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), fused=x.is_cuda)
        q, k = q.view(T, s.heads, s.head_dim), k.view(T, s.kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # v's own storage: a view would keep the fused output, q and k included, as long as v.
        v = v.contiguous().view(T, s.kv_heads, s.head_dim)
        return rope.rotate(q), rope.rotate(k), v

    def attend(self, q, k, v, ctx: AttentionContext) -> torch.Tensor:
        """The attention output ``[T, heads, head_dim]`` of the rank's tokens."""
        if ctx.plan is None:  # token-less pass: keep every weight in the graph, talk to nobody
            return q * 0 + (k.sum() + v.sum()) * 0
        return dist_attn(q, k, v, ctx.plan, ctx.wave, ctx.group, backend=self.backend)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden, spec.ffn, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(spec.hidden, spec.ffn, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.ffn, spec.hidden, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, (self.gate_proj, self.up_proj), fused=x.is_cuda)
        return self.down_proj(SwiGLU.apply(gate, up))


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` keeping only ``gate`` and ``up`` for backward, which recomputes
    ``silu(gate)``: autograd of the two ops would keep it too, another ``ffn`` values per token
    and layer. Backward runs the ops autograd would, so the gradients are the same bits."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, attention_backend: str | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.attn = Attention(spec, attention_backend)
        self.mlp_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.mlp = MLP(spec)
        self.keep_attention = False  # selective checkpointing (set by Llama)

    def forward(self, x: torch.Tensor, rope: RopeAngles, ctx: AttentionContext) -> torch.Tensor:
        if self.keep_attention and self.training and torch.is_grad_enabled():
            return self._selective(x, rope, ctx)
        q, k, v = self.before_attention(x, rope)
        return self.after_attention(x, self.attn.attend(q, k, v, ctx))

    def _selective(self, x: torch.Tensor, rope: RopeAngles, ctx) -> torch.Tensor:
        """The layer with everything but attention recomputed in backward (Note [Selective
        activation checkpointing])."""
        q, k, v = checkpoint(self.before_attention, x, rope, use_reentrant=False)
        out = self.attn.attend(q, k, v, ctx)
        return checkpoint(self.after_attention, x, out, use_reentrant=False)

    def before_attention(self, x: torch.Tensor, rope: RopeAngles):
        """The layer up to attention: its norm, q/k/v projections and RoPE."""
        return self.attn.qkv(self.attn_norm(x), rope)

    def after_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer after attention: output projection, residual, norm, MLP, residual."""
        x = x + self.attn.o_proj(out.reshape(x.shape[0], out.shape[1] * out.shape[2]))
        return x + self.mlp(self.mlp_norm(x))

    def compile_regions(self, backend: str = "inductor") -> None:
        """``torch.compile`` the layer around attention (Note [Compiled layers])."""
        for name in ("before_attention", "after_attention"):
            region = torch.compile(getattr(self, name), dynamic=True, backend=backend)
            setattr(self, name, region)


class Llama(nn.Module):
    """``forward(input_ids [T], position_ids [T], ctx) -> logits [T, vocab]`` (fp32 logits), or with
    ``labels [T]`` (next tokens, ``IGNORE_INDEX`` ignored) the summed cross-entropy, a scalar.

    The loss path never holds more than ``loss_chunk_tokens`` rows of logits: each chunk's LM head
    and cross-entropy are recomputed in backward (with a 128K vocabulary, 32K tokens of fp32 logits
    alone are 16 GiB). The cost model's memory estimate assumes the same chunk
    (``CostModel.loss_chunk_tokens``). ``attention_backend`` forces the attention kernels
    (:data:`hdp.attention.BACKEND_NAMES`; ``None``: chosen per device and dtype). With
    ``activation_checkpointing``, the first ``checkpointed_layers`` layers (all by default) are
    recomputed in backward, and ``keep_attention`` recomputes everything of theirs but attention
    (Note [Selective activation checkpointing]).
    """

    def __init__(
        self,
        spec: ModelSpec,
        activation_checkpointing: bool = False,
        loss_chunk_tokens: int = 4096,
        attention_backend: str | None = None,
        keep_attention: bool = False,
        checkpointed_layers: int | None = None,
        fused_loss: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.fused_loss = fused_loss
        self.activation_checkpointing = activation_checkpointing
        self.keep_attention = activation_checkpointing and keep_attention
        # The first layers are the recomputed ones: the others' backward, which frees their
        # activations, comes first (Note [Recomputing the fewest layers] in launch/setup.py).
        every = spec.layers if checkpointed_layers is None else checkpointed_layers
        self.checkpointed_layers = every if activation_checkpointing else 0
        self.loss_chunk_tokens = loss_chunk_tokens
        # transformers' padding row gets no gradient; a checkpoint's must stay as trained.
        self.embed = nn.Embedding(spec.vocab, spec.hidden, padding_idx=spec.padding_idx)
        self.rotary = Rotary(spec.rope, spec.head_dim)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, attention_backend) for _ in range(spec.layers)
        )
        self.norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        for layer in self.layers[: self.checkpointed_layers]:
            layer.keep_attention = self.keep_attention
        if spec.tied_embeddings:
            self.lm_head.weight = self.embed.weight
        if not self.embed.weight.is_meta:  # a model built on meta gets its values loaded
            self.reset_parameters()

    def materialize(self, device: torch.device) -> None:
        """Storage on ``device`` for a model built on the meta device (values undefined until a
        checkpoint fills them). ``to_empty`` gives each module a new parameter off the meta device,
        which unties a tied LM head; it is tied again here."""
        self.to_empty(device=device)
        if self.spec.tied_embeddings and self.lm_head.weight is not self.embed.weight:
            self.lm_head.weight = self.embed.weight

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        ctx: AttentionContext,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        # The residual stream in the compute dtype, as FSDP's bf16 parameters give it on more
        # ranks: autocast alone would keep it in fp32, and every norm would save an fp32 input.
        x = x.to(compute_dtype(x))
        rope = self.rotary.angles(position_ids, x.dtype)  # once for every layer
        # Selective offload: the first ``offload`` share of the recomputed layers (of all, without
        # checkpointing) keep what backward needs (with checkpointing, just their inputs) in host
        # memory, copied back when backward comes.
        held = self.checkpointed_layers if self.activation_checkpointing else len(self.layers)
        offloaded = round(ctx.offload * held)
        for i, layer in enumerate(self.layers):
            with (
                torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda)
                if i < offloaded
                else nullcontext()
            ):
                recompute = i < self.checkpointed_layers and not self.keep_attention
                if recompute and self.training:
                    x = checkpoint(layer, x, rope, ctx, use_reentrant=False)
                else:
                    x = layer(x, rope, ctx)
        h = self.norm(x)
        if labels is None:
            return self.lm_head(h).float()
        if self.fused_loss and h.shape[0] > 0:  # a token-less pass keeps the head in the graph
            return fused_token_loss_sum(h, self.lm_head.weight, labels)
        if h.shape[0] <= self.loss_chunk_tokens:  # one chunk: its logits are the budgeted buffer
            return self._chunk_loss(h, labels)
        total = None
        for a in range(0, h.shape[0], self.loss_chunk_tokens):
            b = a + self.loss_chunk_tokens
            part = checkpoint(self._chunk_loss, h[a:b], labels[a:b], use_reentrant=False)
            total = part if total is None else total + part
        return total

    def _chunk_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(self.lm_head(h).float(), labels)

    def compile_regions(self, backend: str = "inductor") -> None:
        """``torch.compile`` each layer around its attention, and a chunk's loss (Note
        [Compiled layers])."""
        for layer in self.layers:
            layer.compile_regions(backend)
        self._chunk_loss = torch.compile(self._chunk_loss, dynamic=True, backend=backend)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the layers compute in: autocast's where it is on, else ``x``'s."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def fused_token_loss_sum(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """:func:`token_loss_sum` of ``h @ weight.T`` by Liger-Kernel's fused linear cross-entropy:
    the logits are never written out, and the gradients of ``h`` and ``weight`` are computed in
    forward, so nothing is recomputed (``--fused-loss``). Both run in the compute dtype."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    dtype = compute_dtype(h)
    loss = liger_fused_linear_cross_entropy(
        h.to(dtype).contiguous(),
        weight.to(dtype),
        labels,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    loss = loss[0] if isinstance(loss, tuple) else loss  # releases that also return a z-loss
    return loss.float()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over labelled tokens (``IGNORE_INDEX`` ignored), fp32."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
