"""Attention kernels behind one interface: packed variable-length blocks in, ``(out, lse)`` out.

Every backend computes, for ``n`` independent segments described by cumulative lengths
``cu_q``/``cu_k`` (int32, ``n + 1`` entries), softmax attention of the segment's queries over the
segment's keys:

* ``q``: ``[Tq, H, d]``; ``k``, ``v``: ``[Tk, H_kv, d]`` with ``H % H_kv == 0`` (grouped-query
  attention: query head ``h`` uses KV head ``h // (H / H_kv)``);
* ``causal``: every segment is a diagonal block (``len_q == len_k``, query ``i`` sees keys
  ``<= i``); otherwise every segment is a full block (keys entirely before the queries);
* returns ``out`` ``[Tq, H, d]`` in ``q.dtype`` and ``lse`` ``[H, Tq]`` (log-sum-exp of the scaled
  scores of each query row; fp32, or fp64 for fp64 inputs). A row with no keys has
  ``lse = -inf`` and ``out = 0``.

``backward(dout, q, k, v, out, lse, ...)`` returns ``(dq, dk, dv)`` of the segment given the
*final* ``out`` and ``lse`` of each query row (over all its key blocks), so partial gradients of a
row's blocks add up to the row's exact gradient.

Backends: ``cudnn`` (cuDNN's fused attention through torch's aten ops, CUDA, fp16/bf16; in
:mod:`hdp.attention.cudnn`), ``flash_attn`` (the package, CUDA, fp16/bf16), ``flash_attn_4``
(FlashAttention-4, the ``flash-attn-4`` package, Hopper and later, fp16/bf16), ``torch_flash``
(``torch.ops.aten._flash_attention_forward/_backward``, CUDA, fp16/bf16) and ``reference``
(pure torch, any device and dtype, exact, memory-bounded: queries and keys are processed in chunks,
never an ``L x L`` matrix).
"""

from __future__ import annotations

import inspect
import math
from typing import Protocol

import torch

from hdp import BACKEND_NAMES

# The reference backend's largest blocks: query rows x key rows (on a GPU; smaller on a CPU).
Q_CHUNK = 1024
K_CHUNK = 2048
# Most fp32 scores of one block on a CPU (4 MiB; Note [Reference attention blocks on a CPU]).
CPU_BLOCK_SCORES = 1 << 20


def chunks(heads: int, device: torch.device) -> tuple[int, int]:
    """Query and key rows of the reference backend's blocks for ``heads`` query heads: at most
    ``Q_CHUNK`` x ``K_CHUNK``; on a CPU also at most ``CPU_BLOCK_SCORES`` scores, keys twice the
    queries, powers of two.

    Note [Reference attention blocks on a CPU]
    ------------------------------------------
    Every op of a block allocates a temporary as large as its scores. glibc serves allocations
    of 32 MiB and more with a fresh ``mmap``, so blocks of 1024 x 2048 rows (32 MiB for four heads)
    page-fault on every op: the kernel's share of the time was larger than the arithmetic's, and
    varied from run to run. Blocks of at most 4 MiB come from the heap and stay in cache
    (``docs/benchmarks.md`` has the timings). A GPU's caching allocator has neither problem, and
    larger blocks mean fewer launches there.
    """
    if device.type != "cpu":
        return Q_CHUNK, K_CHUNK
    rows = 1 << (math.isqrt(CPU_BLOCK_SCORES // (2 * max(1, heads))).bit_length() - 1)
    rows = max(16, rows)
    return min(Q_CHUNK, rows), min(K_CHUNK, 2 * rows)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / merge dtype: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, without waiting for the
    stream (torch synchronises the stream after a copy from pageable memory)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class AttentionBackend(Protocol):
    name: str
    # Whether the backend reads ``cu_q``/``cu_k`` only on the host (as Python lists): callers then
    # pass host tensors, and a GPU call does not wait for the stream to copy them back.
    host_lengths: bool

    def forward(
        self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q: int,
        max_k: int,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _scores(
    qc, kc, a: int, b: int, c: int, e: int, shift: int, causal: bool, scale: float
) -> torch.Tensor:
    """Scaled scores ``[H_kv, G, b - a, e - c]`` of query rows a..b against key rows c..e of a
    segment; causal masks key ``j > i + shift`` with ``-inf``."""
    s = torch.einsum("qhgd,khd->hgqk", qc, kc) * scale
    if causal:
        qi = torch.arange(a, b, device=qc.device)[:, None]
        kj = torch.arange(c, e, device=qc.device)[None, :]
        s = s.masked_fill(kj > qi + shift, -math.inf)
    return s


def _key_blocks(
    k, v, k0: int, nk: int, b: int, shift: int, causal: bool, ad: torch.dtype, size: int
):
    """Chunks ``(c, e, k, v)`` of ``size`` keys of a segment that query rows before ``b`` see."""
    k_stop = min(nk, b + shift) if causal else nk
    for c in range(0, k_stop, size):
        e = min(k_stop, c + size)
        yield c, e, k[k0 + c : k0 + e].to(ad), v[k0 + c : k0 + e].to(ad)


class ReferenceBackend:
    """Exact pure-torch attention for any device and dtype, chunked to bound memory."""

    name = "reference"
    host_lengths = True

    @staticmethod
    def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cq) - 1):
            yield cq[i], cq[i + 1], ck[i], ck[i + 1]

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        T, H, d = q.shape
        hk = k.shape[1]
        g = H // hk
        ad = acc_dtype(q.dtype)
        out = torch.zeros(T, H, d, dtype=ad, device=q.device)
        q_chunk, k_chunk = chunks(H, q.device)
        lse = torch.full((H, T), -math.inf, dtype=ad, device=q.device)
        for q0, q1, k0, k1 in self._segments(cu_q, cu_k):
            nq, nk = q1 - q0, k1 - k0
            if nq == 0 or nk == 0:
                continue
            shift = nk - nq  # causal: query i sees keys j <= i + shift (bottom-right aligned)
            for a in range(0, nq, q_chunk):
                b = min(nq, a + q_chunk)
                qc = q[q0 + a : q0 + b].to(ad).view(b - a, hk, g, d)
                m = torch.full((hk, g, b - a), -math.inf, dtype=ad, device=q.device)
                s_sum = torch.zeros((hk, g, b - a), dtype=ad, device=q.device)
                acc = torch.zeros((hk, g, b - a, d), dtype=ad, device=q.device)
                for c, e, kc, vc in _key_blocks(k, v, k0, nk, b, shift, causal, ad, k_chunk):
                    s = _scores(qc, kc, a, b, c, e, shift, causal, scale)
                    m_new = torch.maximum(m, s.amax(dim=-1))
                    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    p = torch.exp(s - safe[..., None])
                    alpha = torch.exp(m - safe)
                    s_sum = s_sum * alpha + p.sum(dim=-1)
                    acc = acc * alpha[..., None] + torch.einsum("hgqk,khd->hgqd", p, vc)
                    m = m_new
                rows = slice(q0 + a, q0 + b)
                has = s_sum > 0
                o = torch.where(
                    has[..., None],
                    acc / torch.where(has, s_sum, torch.ones_like(s_sum))[..., None],
                    acc,
                )
                out[rows] = o.permute(2, 0, 1, 3).reshape(b - a, H, d)
                l_ = torch.where(
                    has,
                    m + torch.log(torch.where(has, s_sum, torch.ones_like(s_sum))),
                    torch.full_like(m, -math.inf),
                )
                lse[:, rows] = l_.reshape(H, b - a)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        T, H, d = q.shape
        hk = k.shape[1]
        g = H // hk
        ad = acc_dtype(q.dtype)
        dq = torch.zeros(T, H, d, dtype=ad, device=q.device)
        q_chunk, k_chunk = chunks(H, q.device)
        dk = torch.zeros(k.shape, dtype=ad, device=q.device)
        dv = torch.zeros(v.shape, dtype=ad, device=q.device)
        for q0, q1, k0, k1 in self._segments(cu_q, cu_k):
            nq, nk = q1 - q0, k1 - k0
            if nq == 0 or nk == 0:
                continue
            shift = nk - nq
            for a in range(0, nq, q_chunk):
                b = min(nq, a + q_chunk)
                rows = slice(q0 + a, q0 + b)
                qc = q[rows].to(ad).view(b - a, hk, g, d)
                doc = dout[rows].to(ad).view(b - a, hk, g, d)
                # D = rowsum(dO * O) with the final output.
                D = (doc * out[rows].to(ad).view(b - a, hk, g, d)).sum(-1).permute(1, 2, 0)
                L = lse[:, rows].to(ad).reshape(hk, g, b - a)
                L = torch.where(
                    torch.isinf(L), torch.full_like(L, math.inf), L
                )  # rows without keys: p = 0
                dqc = torch.zeros((b - a, hk, g, d), dtype=ad, device=q.device)
                for c, e, kc, vc in _key_blocks(k, v, k0, nk, b, shift, causal, ad, k_chunk):
                    s = _scores(qc, kc, a, b, c, e, shift, causal, scale)
                    p = torch.exp(s - L[..., None])
                    dv[k0 + c : k0 + e] += torch.einsum("hgqk,qhgd->khd", p, doc)
                    dp = torch.einsum("qhgd,khd->hgqk", doc, vc)
                    ds = p * (dp - D[..., None])
                    dqc += torch.einsum("hgqk,khd->qhgd", ds, kc) * scale
                    dk[k0 + c : k0 + e] += torch.einsum("hgqk,qhgd->khd", ds, qc) * scale
                dq[rows] = dqc.reshape(b - a, H, d)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TorchFlashBackend:
    """PyTorch's built-in FlashAttention-2 varlen kernels (CUDA; fp16/bf16)."""

    name = "torch_flash"
    host_lengths = False

    def __init__(self) -> None:
        fwd = torch.ops.aten._flash_attention_forward.default._schema
        bwd = torch.ops.aten._flash_attention_backward.default._schema
        fwd_args = [a.name for a in fwd.arguments]
        bwd_args = [a.name for a in bwd.arguments]
        expected_fwd = [
            "query",
            "key",
            "value",
            "cum_seq_q",
            "cum_seq_k",
            "max_q",
            "max_k",
            "dropout_p",
            "is_causal",
            "return_debug_mask",
        ]
        expected_bwd = [
            "grad_out",
            "query",
            "key",
            "value",
            "out",
            "logsumexp",
            "cum_seq_q",
            "cum_seq_k",
            "max_q",
            "max_k",
            "dropout_p",
            "is_causal",
        ]
        if (
            fwd_args[: len(expected_fwd)] != expected_fwd
            or bwd_args[: len(expected_bwd)] != expected_bwd
            or "scale" not in fwd_args
            or "scale" not in bwd_args
        ):
            raise RuntimeError(
                f"unsupported aten flash attention schema in torch {torch.__version__}: "
                f"{fwd} / {bwd}"
            )
        self._bwd_rng_args = bwd_args[
            len(expected_bwd) : bwd_args.index("scale")
        ]  # rng_state, unused (2.3+)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        if q.shape[0] == 0 or k.shape[0] == 0:
            return ReferenceBackend().forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        res = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        return res[0], res[1].float()

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rng = [torch.empty(2, dtype=torch.int64, device=q.device), torch.empty(0, device=q.device)][
            : len(self._bwd_rng_args)
        ]
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out,
            lse.contiguous(),
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            causal,
            *rng,
            scale=scale,
        )
        return dq, dk, dv


class FlashAttnBackend:
    """The ``flash_attn`` package's varlen kernels (CUDA; fp16/bf16)."""

    name = "flash_attn"
    host_lengths = False

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface as fai

        self._fwd = fai._flash_attn_varlen_forward
        self._bwd = fai._flash_attn_varlen_backward
        self._fwd_params = set(inspect.signature(self._fwd).parameters)
        self._bwd_params = set(inspect.signature(self._bwd).parameters)

    def _window(self, params: set[str]) -> dict:
        if "window_size_left" in params:
            return {"window_size_left": -1, "window_size_right": -1}
        return {"window_size": (-1, -1)} if "window_size" in params else {}

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        if q.shape[0] == 0 or k.shape[0] == 0:
            return ReferenceBackend().forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        kw = dict(
            dropout_p=0.0, softmax_scale=scale, causal=causal, **self._window(self._fwd_params)
        )
        for opt, val in (("softcap", 0.0), ("alibi_slopes", None), ("return_softmax", False)):
            if opt in self._fwd_params:
                kw[opt] = val
        res = self._fwd(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        return res[0], res[1].float()

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if q.shape[0] == 0 or k.shape[0] == 0:
            return dq.zero_(), dk.zero_(), dv.zero_()
        kw = dict(
            dropout_p=0.0, softmax_scale=scale, causal=causal, **self._window(self._bwd_params)
        )
        for opt, val in (
            ("softcap", 0.0),
            ("alibi_slopes", None),
            ("deterministic", True),
            ("rng_state", None),
        ):
            if opt in self._bwd_params:
                kw[opt] = val
        self._bwd(
            dout.contiguous(),
            q,
            k,
            v,
            out,
            lse.contiguous(),
            dq,
            dk,
            dv,
            cu_q,
            cu_k,
            max_q,
            max_k,
            **kw,
        )
        return dq, dk, dv


class FlashAttn4Backend:
    """FlashAttention-4's varlen kernels (the ``flash-attn-4`` package, CuTe DSL, compiled at
    first use; CUDA compute capability 9.0 and later, fp16/bf16). Its beta releases add
    parameters: every argument is passed by the name the package gives it, and a release that
    lacks one of them is unavailable rather than called wrongly."""

    name = "flash_attn_4"
    host_lengths = False
    _NEEDED = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale")

    def __init__(self) -> None:
        from flash_attn.cute import interface

        self._fwd = interface._flash_attn_fwd
        self._bwd = interface._flash_attn_bwd
        for fn, extra in ((self._fwd, ("return_lse",)), (self._bwd, ("deterministic",))):
            missing = set(self._NEEDED + extra) - set(inspect.signature(fn).parameters)
            if missing:
                raise RuntimeError(
                    f"flash-attn-4's {fn.__name__} takes no {', '.join(sorted(missing))}: "
                    "install a release that does"
                )

    def _lengths(self, cu_q, cu_k, max_q, max_k, causal, scale) -> dict:
        return dict(
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            softmax_scale=scale,
            causal=causal,
        )

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        if q.shape[0] == 0 or k.shape[0] == 0:
            return ReferenceBackend().forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        res = self._fwd(
            q, k, v, return_lse=True, **self._lengths(cu_q, cu_k, max_q, max_k, causal, scale)
        )
        return res[0], res[1].float()  # lse: [heads, tokens] for varlen inputs

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        res = self._bwd(
            q,
            k,
            v,
            out,
            dout.contiguous(),
            lse.contiguous(),
            deterministic=True,  # its default sums dQ (and GQA's dK/dV) with atomics
            **self._lengths(cu_q, cu_k, max_q, max_k, causal, scale),
        )
        return res[0], res[1], res[2]  # later releases add a sink's gradient


_BACKENDS: dict[str, AttentionBackend] = {}
# BACKEND_NAMES (from hdp, which names profile rows by it) is the order ``auto`` prefers them
# in (see :func:`candidate_names`): every rank tries them in it.
_HALF = (torch.float16, torch.bfloat16)


class BackendUnavailable(RuntimeError):
    """A known backend that cannot run in this torch or on this machine; the message says why."""


def _backend_class(name: str):
    if name == "cudnn":
        from .cudnn import CudnnBackend  # the module builds on this one's helpers

        return CudnnBackend
    return {
        "reference": ReferenceBackend,
        "torch_flash": TorchFlashBackend,
        "flash_attn": FlashAttnBackend,
        "flash_attn_4": FlashAttn4Backend,
    }.get(name)


def get_backend(name: str) -> AttentionBackend:
    """A backend by name, one of :data:`BACKEND_NAMES`. Raises ValueError for an unknown name and
    :class:`BackendUnavailable` (one line: why) for a backend this environment cannot run."""
    if name not in _BACKENDS:
        cls = _backend_class(name)
        if cls is None:
            raise ValueError(
                f"unknown attention backend {name!r}: choose {', '.join(BACKEND_NAMES)}"
            )
        try:
            _BACKENDS[name] = cls()
        except (ImportError, RuntimeError, AttributeError) as e:
            why = " ".join(str(e).split()) or type(e).__name__
            raise BackendUnavailable(
                f"attention backend {name!r} is unavailable: {why}; use 'auto' (the first "
                "backend that runs here) or another backend"
            ) from e
    return _BACKENDS[name]


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA ``device`` (a function, so tests can pretend)."""
    return torch.cuda.get_device_capability(device)


def candidate_names(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The backends for ``device`` and ``dtype`` in the order ``auto`` tries them, the reference
    last: on CUDA with fp16/bf16, the ``flash_attn`` package, then PyTorch's FlashAttention, then
    on Hopper and later (compute capability 9.0+) FlashAttention-4, then cuDNN. PyTorch's always
    runs on CUDA, so ``auto`` reaches the last two only where torch lacks its kernels: they run by
    name until a GPU's measurements put them first.

    cuDNN's kernels are faster on a shape they have seen, but torch builds a cuDNN graph for every
    new (batch, length) shape, and training's packed batches bring new shapes at every step: on
    packed batches with new lengths each step it ran many times slower than FlashAttention's
    varlen kernels, which take any lengths in one launch (``docs/benchmarks.md``). So cuDNN is
    chosen only by name, or where neither FlashAttention runs."""
    gpu = device.type == "cuda" and dtype in _HALF
    hopper = gpu and cuda_capability(device) >= (9, 0)
    hopper_only = ("flash_attn_4", "cudnn")
    return [
        n for n in BACKEND_NAMES if n == "reference" or (gpu and (n not in hopper_only or hopper))
    ]


def select_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The first of :func:`candidate_names` available here (its ops exist and match the expected
    schema)."""
    for name in candidate_names(device, dtype):
        try:
            return get_backend(name)
        except BackendUnavailable:
            continue
    return get_backend("reference")


def resolve_backend(name: str | None, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend ``dist_attn`` runs for ``device`` and ``dtype``: :func:`select_backend`'s for
    ``None`` or ``"auto"``, else the named one, checked to run there. Raises ValueError (unknown
    name, or a backend for other devices or dtypes) or :class:`BackendUnavailable`, one line
    each, saying what to use instead."""
    if name is None or name == "auto":
        return select_backend(device, dtype)
    if name != "reference" and _backend_class(name) is not None:
        if device.type != "cuda" or dtype not in _HALF:
            raise ValueError(
                f"attention backend {name!r} runs on CUDA in fp16/bf16, not on {device.type} in "
                f"{str(dtype).removeprefix('torch.')}: use 'auto' or 'reference'"
            )
    return get_backend(name)
