"""The kernel tables of ``hdp-calibrate measure``, timed with the kernels the runtime calls.

Every time is one forward plus backward call (``torch.autograd.grad`` of the op's output with a
random output gradient, so nothing accumulates into ``.grad``) in the run dtype (bf16 on CUDA, fp32
on CPU), repeated after warm-up until its fastest repeats agree or its time limit is spent (Note
[Repeating a row until its spread is small] in :mod:`hdp.profile_quality`): the row's time is the
median of its three fastest repeats, and its spread goes into the profile beside it. On CUDA each
repeat is timed with CUDA events; on CPU with ``time.perf_counter``.

Rows (columns as in ``hdp.profile/1``):

* attention: ``backend.forward`` then ``backend.backward`` of :mod:`hdp.attention.kernels` on one
  varlen call: ``b`` causal documents of ``a`` tokens, or ``a`` queries against ``b`` keys with no
  mask (one segment).
* gemm: ``F.linear(x [tokens, in], w [out, in])`` and both backward products.
* memory_bound: ``rmsnorm`` (:class:`hdp.launch.model.RMSNorm`), ``swiglu``
  (:class:`hdp.launch.model.SwiGLU`), ``residual_add`` (``x + y``), ``rope`` (the rotation of
  ``[tokens, width / head_dim, head_dim]`` by angles made once, as a forward pass shares them
  between layers), ``cross_entropy`` (a chunk's loss on its ``[tokens, vocab]`` logits) and
  ``cast`` (fp32 to the run dtype; on CPU, where the run
  dtype is fp32, a cast to bf16 and back), each on ``[tokens, width]``.
* optimizer: one AdamW step over ``params`` fp32 parameters (tensors of at most 16M elements,
  gradients set): fused on CUDA, foreach otherwise.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from hdp import ModelSpec, Plan, RoPE
from hdp.attention.kernels import AttentionBackend
from hdp.profile_quality import RepeatRule, spread, typical

from .model import AttentionContext, DecoderLayer, RMSNorm, SwiGLU, token_loss_sum
from .rope import Rotary

# Kernel names as a profile spells them.
MEMORY_OPS = ("rmsnorm", "swiglu", "residual_add", "rope", "cast", "cross_entropy")
# Tensors of [tokens x width] one forward + backward of each op holds at its peak, roughly:
# (in the run dtype, in fp32).
_MEMORY_OP_COPIES = {
    "rmsnorm": (4, 3),
    "swiglu": (7, 0),
    "residual_add": (5, 0),
    "rope": (3, 6),
    "cast": (2, 2),
    "cross_entropy": (2, 3),
}
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
K, M = 1 << 10, 1 << 20


def geometric(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    """``lo, lo * factor, ...`` up to ``hi``, and ``hi`` itself."""
    out = [lo]
    while out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    if out[-1] != hi:
        out.append(hi)
    return tuple(out)


FULL_REPEATS = RepeatRule(limit_s=2.0, max_repeats=100)
# --quick: fewer points, and a quarter of the time per row to reach the same spread target.
QUICK_REPEATS = RepeatRule(limit_s=0.5, max_repeats=50)


@dataclass(frozen=True)
class Grids:
    """What one run measures: sizes per table, and how long each point may take."""

    tokens: tuple[int, ...]  # gemm and memory_bound rows
    causal_lengths: tuple[int, ...]  # attention "causal": document length a
    causal_budget: int  # tokens of one causal call (b = budget // a, at least 1)
    full_q: tuple[int, ...]  # attention "full": query tokens
    full_k: tuple[int, ...]  # attention "full": key tokens
    optimizer_params: tuple[int, ...]
    layer_tokens: tuple[int, ...]  # decoder-layer points for layer_overhead_s
    collective_bytes: tuple[int, ...]
    copy_bytes: int  # the copy that measures memory bandwidth
    probe_gemm: tuple[int, int, int]  # (tokens, in, out) of one large GEMM for peak_flops
    repeats: RepeatRule = FULL_REPEATS


def grids_for(device_type: str, quick: bool) -> Grids:
    """The grids of a run on ``device_type`` (``cpu`` or ``cuda``), ``quick`` or full. CUDA full:
    documents 128..128K, blocks of 128..32K queries x 8K..256K keys, GEMMs and memory-bound ops
    on 1K..64K tokens (designed for under 5 minutes on an H100 for three models)."""
    if device_type == "cuda" and quick:
        return Grids(
            tokens=(1 * K, 8 * K, 64 * K),
            causal_lengths=(512, 8 * K, 128 * K),
            causal_budget=64 * K,
            full_q=(512, 8 * K),
            full_k=(8 * K, 128 * K),
            optimizer_params=(8 * M, 512 * M),
            layer_tokens=(128, 256, 512),
            collective_bytes=(M, 16 * M, 256 * M),
            copy_bytes=1 << 30,
            probe_gemm=(16 * K, 8 * K, 8 * K),
            repeats=QUICK_REPEATS,
        )
    if device_type == "cuda":
        return Grids(
            tokens=geometric(1 * K, 64 * K),
            causal_lengths=geometric(128, 128 * K),
            causal_budget=64 * K,
            full_q=geometric(128, 32 * K, 4),
            full_k=geometric(8 * K, 256 * K, 4),
            optimizer_params=geometric(M, 512 * M, 8),
            layer_tokens=(128, 256, 512),
            collective_bytes=geometric(M, 1 << 30, 4),
            copy_bytes=1 << 30,
            probe_gemm=(16 * K, 8 * K, 8 * K),
        )
    if quick:
        return Grids(
            tokens=(256, 1 * K, 4 * K),
            causal_lengths=(128, 512, 2 * K),
            causal_budget=4 * K,
            full_q=(128, 1 * K),
            full_k=(1 * K, 4 * K),
            optimizer_params=(M, 4 * M),
            layer_tokens=(16, 32, 64),
            collective_bytes=(64 * K, M, 8 * M),
            copy_bytes=64 * M,
            probe_gemm=(2 * K, 512, 512),
            repeats=QUICK_REPEATS,
        )
    return Grids(
        tokens=geometric(256, 16 * K),
        causal_lengths=geometric(64, 4 * K),
        causal_budget=8 * K,
        full_q=geometric(64, 2 * K, 4),
        full_k=geometric(512, 16 * K, 4),
        optimizer_params=geometric(M, 64 * M, 4),
        layer_tokens=(16, 32, 64, 128),
        collective_bytes=geometric(16 * K, 64 * M, 4),
        copy_bytes=256 * M,
        probe_gemm=(4 * K, 1 * K, 1 * K),
    )


class Progress(Protocol):
    """Where a :class:`Bench` tells how far it is, so that the run can report it
    (``hdp-calibrate measure`` prints a line at least every 15 s)."""

    def repeat(self) -> None:
        """One repeat was timed."""

    def row(self) -> None:
        """One row is done: timed, or skipped."""


@dataclass(frozen=True)
class Timing:
    """A row's time (the median of its fastest repeats), its spread and how many repeats."""

    seconds: float
    spread: float
    repeats: int


@dataclass
class Rows:
    """A table's rows and, in the same order, their spreads."""

    rows: list[list] = field(default_factory=list)
    spread: list[float] = field(default_factory=list)

    def add(self, row: list, timing: Timing | None) -> None:
        """``row`` with its time appended, unless it was skipped (``timing`` None)."""
        if timing is not None:
            self.rows.append([*row, sig(timing.seconds)])
            self.spread.append(round(timing.spread, 4))


@dataclass
class Bench:
    """Times calls on one device and dtype; ``memory_limit`` bounds the bytes of one point."""

    device: torch.device
    dtype: torch.dtype
    grids: Grids
    memory_limit: float
    progress: Progress | None = None

    @property
    def elem(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def randn(self, *shape: int, grad: bool = False, dtype: torch.dtype | None = None):
        t = torch.randn(*shape, device=self.device, dtype=dtype or self.dtype)
        return t.requires_grad_(grad)

    def once(self, fn: Callable[[], object]) -> float:
        """Seconds of one call of ``fn`` (CUDA events on CUDA)."""
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def timing(self, fn: Callable[[], object]) -> Timing:
        """``fn`` timed by the grids' repeat rule after warm-up: one call, and a second if the
        first was quick (lazy initialisation, autotuning)."""
        rule = self.grids.repeats
        self.sync()
        if self.once(fn) < rule.limit_s / 8:
            self.once(fn)
        times: list[float] = []
        while not rule.finished(times):
            times.append(self.once(fn))
            if self.progress is not None:
                self.progress.repeat()
        if self.progress is not None:
            self.progress.row()
        return Timing(typical(times, rule.k), spread(times, rule.k), len(times))

    def seconds(self, fn: Callable[[], object]) -> float:
        """Seconds of one call of ``fn``, by :meth:`timing`."""
        return self.timing(fn).seconds

    def point(self, what: str, nbytes: float, build: Callable[[], Callable[[], object]]):
        """The :class:`Timing` of the call ``build()`` returns, or ``None`` (with a note on stderr)
        where its ``nbytes`` exceed the memory limit or the device runs out of memory."""
        if nbytes > self.memory_limit:
            note(f"skipped {what}: needs ~{nbytes / 2**30:.1f} GiB")
            return self._skipped()
        timing = None
        try:
            timing = self.timing(build())
        except _OOM:
            note(f"skipped {what}: out of memory")
            self._skipped()
        # Here, after the handler, the failed call's tensors are free: return them to the device.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return timing

    def _skipped(self) -> None:
        if self.progress is not None:
            self.progress.row()


def note(text: str) -> None:
    print(f"hdp-calibrate: {text}", file=sys.stderr, flush=True)


def sig(x: float) -> float:
    """``x`` to 6 significant digits (JSON stays short; timings are not that precise)."""
    return float(f"{x:.6g}")


def _unique(items: Iterable) -> list:
    return list(dict.fromkeys(items))


def _grad_call(out_fn: Callable[[], torch.Tensor], inputs: tuple, grad: torch.Tensor):
    """Forward and backward of ``out_fn`` with respect to ``inputs``."""
    return lambda: torch.autograd.grad(out_fn(), inputs, grad)


# --------------------------------------------------------------------------------- attention


def attention_shapes(models: Iterable[ModelSpec]) -> list[tuple[int, int, int]]:
    """Distinct ``(heads, kv_heads, head_dim)`` of the models."""
    return _unique((m.heads, m.kv_heads, m.head_dim) for m in models)


def _attention_call(bench: Bench, backend: AttentionBackend, shape, q_lens, k_lens, causal):
    heads, kv_heads, d = shape

    def build():
        q, dout = (bench.randn(sum(q_lens), heads, d) for _ in range(2))
        k, v = (bench.randn(sum(k_lens), kv_heads, d) for _ in range(2))
        cu_q, cu_k = (
            torch.tensor(np.cumsum([0, *lens]).tolist(), dtype=torch.int32, device=bench.device)
            for lens in (q_lens, k_lens)
        )
        mq, mk, scale = max(q_lens), max(k_lens), 1.0 / math.sqrt(d)

        def call():
            out, lse = backend.forward(q, k, v, cu_q, cu_k, mq, mk, causal, scale)
            return backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal, scale)

        return call

    nbytes = (3 * sum(q_lens) * heads + 4 * sum(k_lens) * kv_heads) * d * bench.elem
    if bench.device.type == "cpu":  # the reference kernel's fp32 score chunks
        nbytes += 8 * heads * min(max(q_lens), 1024) * min(max(k_lens), 2048) * 4
    return nbytes, build


def _attention_points(g: Grids) -> list[tuple[str, int, int]]:
    """``(kind, a, b)`` of one attention shape's rows."""
    points = [("causal", a, max(1, g.causal_budget // a)) for a in g.causal_lengths]
    return points + [("full", a, b) for a in g.full_q for b in g.full_k]


def attention_rows(bench: Bench, backend: AttentionBackend, shapes) -> Rows:
    """Causal documents of each length (``b`` of them, ``a * b`` about the token budget) and full
    blocks on the ``full_q x full_k`` grid, for each attention shape."""
    out = Rows()
    for shape in shapes:
        for kind, a, b in _attention_points(bench.grids):
            causal = kind == "causal"
            q_lens, k_lens = ([a] * b, [a] * b) if causal else ([a], [b])
            nbytes, build = _attention_call(bench, backend, shape, q_lens, k_lens, causal)
            timing = bench.point(f"attention {kind} {shape} a={a} b={b}", nbytes, build)
            out.add([backend.name, kind, *shape, a, b], timing)
    return out


# --------------------------------------------------------------------------------- GEMMs


def linear_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """``(in, out)`` of every linear layer of :mod:`hdp.launch.model`: q, k/v and o projections,
    gate/up and down projections, the LM head."""
    h, q_out, kv_out = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    return [(h, q_out), (h, kv_out), (q_out, h), (h, spec.ffn), (spec.ffn, h), (h, spec.vocab)]


def gemm_timing(bench: Bench, tokens: int, n_in: int, n_out: int) -> Timing | None:
    def build():
        x = bench.randn(tokens, n_in, grad=True)
        w = (bench.randn(n_out, n_in) / math.sqrt(n_in)).requires_grad_(True)
        return _grad_call(lambda: F.linear(x, w), (x, w), bench.randn(tokens, n_out))

    nbytes = 2 * (tokens * n_in + tokens * n_out + n_in * n_out) * bench.elem
    return bench.point(f"gemm {tokens}x{n_in}x{n_out}", nbytes, build)


def gemm_shapes(models: Iterable[ModelSpec]) -> list[tuple[int, int]]:
    """The distinct ``(in, out)`` of the models' linear layers."""
    return _unique(s for m in models for s in linear_shapes(m))


def gemm_rows(bench: Bench, models: Iterable[ModelSpec]) -> Rows:
    out = Rows()
    for n_in, n_out in gemm_shapes(models):
        for t in bench.grids.tokens:
            out.add([t, n_in, n_out], gemm_timing(bench, t, n_in, n_out))
    return out


# --------------------------------------------------------------------------------- memory-bound


def memory_widths(models: Iterable[ModelSpec]) -> list[tuple[str, int, int]]:
    """``(op, width, head_dim)``: hidden for rmsnorm, residual_add and cast, ffn for swiglu,
    heads x head_dim for rope, vocab for cross_entropy."""
    out = []
    for m in models:
        widths = {"rmsnorm": m.hidden, "swiglu": m.ffn, "residual_add": m.hidden}
        widths |= {"rope": m.heads * m.head_dim, "cast": m.hidden, "cross_entropy": m.vocab}
        out += [(op, widths[op], m.head_dim) for op in MEMORY_OPS]
    return _unique(out)


def _memory_op(bench: Bench, op: str, width: int, tokens: int, head_dim: int):
    """``(forward function, inputs)`` of one memory-bound op as launch/model.py runs it."""
    if op == "rmsnorm":
        norm = RMSNorm(width).to(bench.device, bench.dtype)
        x = bench.randn(tokens, width, grad=True)
        return (lambda: norm(x)), (x, norm.weight)
    if op == "swiglu":
        g, u = (bench.randn(tokens, width, grad=True) for _ in range(2))
        return (lambda: SwiGLU.apply(g, u)), (g, u)
    if op == "residual_add":
        x, y = (bench.randn(tokens, width, grad=True) for _ in range(2))
        return (lambda: x + y), (x, y)
    if op == "rope":
        x = bench.randn(tokens, width // head_dim, head_dim, grad=True)
        pos = torch.arange(tokens, device=bench.device)
        angles = Rotary(RoPE(), head_dim).angles(pos, bench.dtype)
        return (lambda: angles.rotate(x)), (x,)
    if op == "cast":
        x = bench.randn(tokens, width, grad=True, dtype=torch.float32)
        if bench.dtype == torch.float32:  # CPU: no narrower run dtype; a bf16 round trip
            return (lambda: x.to(torch.bfloat16).to(torch.float32)), (x,)
        return (lambda: x.to(bench.dtype)), (x,)
    if op == "cross_entropy":  # one chunk of the loss after its LM head, as the model runs it
        logits = bench.randn(tokens, width, grad=True)
        labels = torch.randint(0, width, (tokens,), device=bench.device)
        return (lambda: token_loss_sum(logits.float(), labels)), (logits,)
    raise ValueError(f"unknown memory-bound op {op!r}")


def memory_rows(bench: Bench, models: Iterable[ModelSpec]) -> Rows:
    out = Rows()
    for op, width, head_dim in memory_widths(models):
        for t in bench.grids.tokens:

            def build(op=op, width=width, t=t, head_dim=head_dim):
                fwd, inputs = _memory_op(bench, op, width, t, head_dim)
                out = fwd()
                return _grad_call(fwd, inputs, torch.randn_like(out))

            copies, fp32_copies = _MEMORY_OP_COPIES[op]
            nbytes = t * width * (copies * bench.elem + fp32_copies * 4)
            out.add([op, width, t], bench.point(f"{op} {t}x{width}", nbytes, build))
    return out


# --------------------------------------------------------------------------------- optimizer


def _adamw(params: list[torch.Tensor], device: torch.device) -> torch.optim.Optimizer:
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(params, lr=1e-6, fused=True)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(params, lr=1e-6, foreach=True)


def optimizer_rows(bench: Bench) -> Rows:
    out = Rows()
    for n in bench.grids.optimizer_params:

        def build(n=n):
            chunk = 16 * M
            params = [
                torch.nn.Parameter(torch.randn(min(chunk, n - i), device=bench.device))
                for i in range(0, n, chunk)
            ]
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            return _adamw(params, bench.device).step

        out.add([n], bench.point(f"optimizer {n} params", 20 * n, build))
    return out


def planned_rows(grids: Grids, models: Iterable[ModelSpec], device_type: str) -> dict[str, int]:
    """How many rows each table will time, and ``scalars`` how many timings the scalars take
    (:func:`layer_overhead`, :func:`best_gemm_rate`, :func:`copy_bandwidth` and on CUDA
    :func:`pcie_bandwidth`): what progress is counted in."""
    models = list(models)
    return {
        "attention": len(attention_shapes(models)) * len(_attention_points(grids)),
        "gemm": len(gemm_shapes(models)) * len(grids.tokens),
        "memory_bound": len(memory_widths(models)) * len(grids.tokens),
        "optimizer": len(grids.optimizer_params),
        "scalars": len(grids.layer_tokens) + 2 + (2 if device_type == "cuda" else 0),
    }


# --------------------------------------------------------------------------------- scalars


def layer_overhead(bench: Bench, spec: ModelSpec) -> float:
    """Seconds of one :class:`hdp.launch.model.DecoderLayer` forward + backward that do not scale
    with tokens: the intercept of a least-squares line through a few small token counts (one
    rank, one sequence, ``dist_attn`` without a process group), at least 0."""
    rule = bench.grids.repeats
    rule = replace(rule, min_repeats=10, max_repeats=max(20, rule.max_repeats))
    bench = replace(bench, grids=replace(bench.grids, repeats=rule))
    layer = DecoderLayer(spec).to(bench.device, bench.dtype)
    params = tuple(layer.parameters())
    tokens, secs = [], []
    for t in bench.grids.layer_tokens:

        def build(t=t):
            ctx = AttentionContext(Plan.from_shards([t], 1, [[[(0, 0, t)]]]), 0)
            x = bench.randn(t, spec.hidden, grad=True)
            rotary = Rotary(spec.rope, spec.head_dim)
            rope = rotary.angles(torch.arange(t, device=bench.device), bench.dtype)
            return _grad_call(
                lambda: layer(x, rope, ctx), (x, *params), bench.randn(t, spec.hidden)
            )

        timing = bench.point(f"decoder layer of {spec.name}, {t} tokens", 0, build)
        if timing is not None:
            tokens.append(t)
            secs.append(timing.seconds)
    if len(tokens) < 2:
        return min(secs, default=0.0)
    return max(0.0, float(np.polyfit(tokens, secs, 1)[1]))


def copy_bandwidth(bench: Bench) -> float:
    """Bytes per second of a large device-to-device copy (read plus write)."""
    n = bench.grids.copy_bytes // 4
    src = torch.empty(n, device=bench.device)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * n * 4 / bench.seconds(lambda: dst.copy_(src))


def pcie_bandwidth(bench: Bench) -> float:
    """CUDA: bytes per second of the slower direction of a pinned host <-> device copy."""
    n = min(bench.grids.copy_bytes, 256 * M) // 4
    host = torch.empty(n, pin_memory=True)
    dev = torch.empty(n, device=bench.device)
    h2d = bench.seconds(lambda: dev.copy_(host, non_blocking=True))
    d2h = bench.seconds(lambda: host.copy_(dev, non_blocking=True))
    return n * 4 / max(h2d, d2h)


def best_gemm_rate(bench: Bench, rows: list[list]) -> float:
    """Highest FLOP/s (6 tokens x in x out per forward + backward) among the gemm rows and one
    large GEMM (``Grids.probe_gemm``)."""
    t, n_in, n_out = bench.grids.probe_gemm
    timing = gemm_timing(bench, t, n_in, n_out)
    probe = [[t, n_in, n_out, timing.seconds]] if timing is not None else []
    return max((6.0 * t * i * o / s for t, i, o, s in rows + probe), default=0.0)
