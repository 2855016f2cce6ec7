"""cuDNN's fused attention (``torch.ops.aten._scaled_dot_product_cudnn_attention`` and its
``_backward``) behind the packed variable-length interface of :mod:`hdp.attention.kernels`.

The aten ops take dense ``(B, H, L, d)`` tensors: every batch element has the same query and key
length, and key heads equal query heads. :class:`CudnnBackend` turns one packed varlen call into
one dense call per distinct (bucketed) segment shape (Note [cuDNN varlen by grouping]).

Note [cuDNN varlen by grouping]
-------------------------------
A call's segments are independent: segment ``i``'s queries attend only to segment ``i``'s keys.
Segments of the same shape can therefore be stacked as the batch dimension of one dense call, and
the result is exactly that of one call per segment: the kernel treats batch elements
independently.

Shapes are also *bucketed*, because torch builds a cuDNN graph for every new shape (tens to
hundreds of milliseconds each, reported for torch's and other projects' cuDNN attention), and the
lengths of a packed batch's documents rarely repeat: one graph per raw length would be built
again and again. Each length is rounded up to a bucket (:func:`bucket`: a multiple of 16 below
512, at most 15 rows more; above, 16-32 buckets per octave, under 6.25% more rows), so a run
meets a few hundred lengths (under 400 up to 256K tokens). A graph is built per (batch, length)
pair, though, and the batch of a grouped call (how many blocks share a bucket) changes with the
data: on batches whose lengths change at every step the builds never stop, which is why ``auto``
prefers FlashAttention (:func:`hdp.attention.kernels.candidate_names`). The padding is exact where
it is applied:

* causal diagonal blocks (square) are padded at the end of both queries and keys: a real query
  ``i < L`` sees keys ``j <= i < L`` only, so padded keys never reach it;
* full blocks are padded in their queries only: padded query rows are dropped. Their keys keep
  their exact length (padding keys would need a mask; the shapes of full blocks do vary);
* backward: padded rows carry ``q = 0``, ``dO = 0``, ``O = 0`` and ``lse = 0``, so their scores are
  0, their probabilities ``exp(0 - 0) = 1`` (finite) and ``dS = P * (dP - rowsum(dO * O)) = 0``:
  they add nothing to dK, dV or any real row's dQ.

``dist_attn``'s calls are where grouping pays: the causal diagonal blocks and the full blocks of a
rank are often of similar sizes, so a call over many blocks becomes a few launches, where one
launch per block would leave small blocks latency-bound. A call whose segments all differ
degenerates to the loop over segments. A group whose segments already have the bucket's length
and are adjacent in the packed tensor is a view (no copy); otherwise its rows are gathered into
the padded batch (about the bytes ``dist_attn`` already gathers per call, small against the
attention FLOPs of blocks of 512 tokens and more). ``grouping=False`` makes every call that loop,
one launch per segment: ``scripts/bench_attention.py --backends`` times it (``cudnn_loop``) beside
the grouped calls on calls of many equal blocks, which is the measurement that decides.

Layout: a packed ``[T, H, d]`` tensor's rows of a group are ``[B, L, H, d]``, passed to the op
as its ``transpose(1, 2)``: ``(B, H, L, d)`` with the strides of the BSHD layout that model code
calling ``scaled_dot_product_attention`` after ``view(B, L, H, d).transpose(1, 2)`` produces.
The op's output follows the query's layout; its log-sum-exp is ``(B, H, L_q, 1)`` in fp32.
Backward gets the *final* output and log-sum-exp of every query row (over all of its key blocks,
as the merge in ``dist_attn`` needs), in the same layout as the forward's inputs.

Grouped-query attention: the ops take ``H_kv`` key/value heads for ``H`` query heads where
``H % H_kv == 0`` (cuDNN's own grouped-query support, accepted by torch's cuDNN attention since
pytorch/pytorch#150337; dK/dV come back with ``H_kv`` heads), so K/V are passed as they are. The
recorded H100 probe only ran ``H_kv == H``: should the op refuse other head counts, the backend
warns once and from then on repeats K/V heads to the query heads, summing the repeated heads'
dK/dV back in fp32 (``native_gqa=False`` asks for that from the start).

Refusals: a call the op refuses (a RuntimeError other than running out of memory: an
unsupported shape or configuration) runs with PyTorch's FlashAttention instead, with a warning
the first time its reason is seen, so one shape cuDNN cannot take does not stop a run; the
GPU tests require that nothing was refused.

Causal masks: aten's cuDNN attention aligns the causal mask top-left when ``L_q != L_k``, while
the interface of :mod:`hdp.attention.kernels` is bottom-right aligned. That difference never arises
here: causal calls only ever carry diagonal blocks, which are square (checked per segment) and
stay square when padded.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kernels import acc_dtype, to_device

FWD_ARGS = (
    "query",
    "key",
    "value",
    "attn_bias",
    "compute_log_sumexp",
    "dropout_p",
    "is_causal",
    "return_debug_mask",
)
BWD_ARGS = (
    "grad_out",
    "query",
    "key",
    "value",
    "out",
    "logsumexp",
    "philox_seed",
    "philox_offset",
    "attn_bias",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "dropout_p",
    "is_causal",
)
# Head dimensions the probe measured and cuDNN's SDPA supports on every architecture it runs on.
MAX_HEAD_DIM = 128


def check_schema(fwd, bwd) -> None:
    """Raise RuntimeError unless the ops' schemas (``torch._C.FunctionSchema``) are the ones this
    backend calls: these positional arguments in this order, a keyword ``scale``, and anything
    further only with a default (what a later torch may add compatibly)."""
    problems = []
    for schema, expected, outputs in ((fwd, FWD_ARGS, 2), (bwd, BWD_ARGS, 3)):
        positional = [a for a in schema.arguments if not a.kwarg_only]
        keyword = [a for a in schema.arguments if a.kwarg_only]
        names = tuple(a.name for a in positional[: len(expected)])
        if names != expected:
            problems.append(f"{schema.name} takes {names}, expected {expected}")
        extra = positional[len(expected) :] + [a for a in keyword if a.name != "scale"]
        required = [a.name for a in extra if not a.has_default_value()]
        if required:
            problems.append(f"{schema.name} requires unknown arguments {required}")
        if "scale" not in {a.name for a in keyword}:
            problems.append(f"{schema.name} has no keyword argument 'scale'")
        if len(schema.returns) < outputs:
            problems.append(f"{schema.name} returns {len(schema.returns)} values")
    if problems:
        raise RuntimeError(
            f"unsupported cuDNN attention schema in torch {torch.__version__}: "
            + "; ".join(problems)
        )


def bucket(n: int) -> int:
    """``n`` rounded up to its shape bucket: a multiple of 16 below 512, else of ``2**(b - 5)``
    for an ``n`` of ``b`` bits (16-32 buckets per octave; Note [cuDNN varlen by grouping])."""
    step = max(16, 1 << max(0, n.bit_length() - 5))
    return -(-n // step) * step


@dataclass
class Group:
    """Segments of one call that run as one dense batch of ``len_q`` x ``len_k`` (bucketed): their
    first query and key rows and their own lengths."""

    len_q: int
    len_k: int
    q_starts: list[int]
    k_starts: list[int]
    q_lens: list[int]
    k_lens: list[int]


def group_segments(
    cu_q: list[int], cu_k: list[int], causal: bool, buckets: bool = True, grouping: bool = True
) -> list[Group]:
    """The call's non-empty segments grouped by their dense shape, in order of first appearance:
    causal blocks padded to ``bucket(len)`` both ways, full blocks padded in their queries only
    (``buckets=False``: exact shapes; ``grouping=False``: one group per segment, the loop that
    grouping is measured against; Note [cuDNN varlen by grouping])."""
    groups: dict[tuple[int, ...], Group] = {}
    for i in range(len(cu_q) - 1):
        nq, nk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if nq == 0 or nk == 0:
            continue  # no keys: out = 0, lse = -inf, as initialised
        if causal and nq != nk:
            raise ValueError(
                f"cudnn backend: causal segment {i} is {nq} x {nk}; causal blocks must be square"
            )
        pq = bucket(nq) if buckets else nq
        pk = pq if causal else nk
        g = groups.setdefault((pq, pk) if grouping else (pq, pk, i), Group(pq, pk, [], [], [], []))
        g.q_starts.append(cu_q[i])
        g.k_starts.append(cu_k[i])
        g.q_lens.append(nq)
        g.k_lens.append(nk)
    return list(groups.values())


class Rows:
    """A group's rows: in the packed tensor, ``len(starts)`` runs of ``lens`` rows; in the dense
    batch, run ``b`` at rows ``b * n`` to ``b * n + lens[b]``, zeros after it. A slice of the
    packed tensor when the runs fill their ``n`` rows and are adjacent, else two indices."""

    def __init__(self, starts: list[int], lens: list[int], n: int, device) -> None:
        self.batch, self.n = len(starts), n
        self.padded = any(m != n for m in lens)
        adjacent = not self.padded and all(b - a == n for a, b in zip(starts[:-1], starts[1:]))
        self.span = slice(starts[0], starts[0] + self.batch * n) if adjacent else None
        self.index = self.dense = None
        if self.span is None:
            self.index = torch.cat([torch.arange(s, s + m) for s, m in zip(starts, lens)])
            self.index = to_device(self.index, device)
        if self.padded:
            runs = [torch.arange(b * n, b * n + m) for b, m in enumerate(lens)]
            self.dense = to_device(torch.cat(runs), device)

    def take(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``x``'s rows along ``dim`` as the dense batch (0: ``[B, n, ...]``; 1, for ``[H, T]``:
        ``[H, B, n]``), padding rows zero."""
        if self.span is not None:
            part = x[self.span] if dim == 0 else x[:, self.span]
        else:
            part = x.index_select(dim, self.index)
        if self.padded:
            shape = list(x.shape)
            shape[dim] = self.batch * self.n
            part = x.new_zeros(shape).index_copy_(dim, self.dense, part)
        shape = list(part.shape)
        shape[dim : dim + 1] = [self.batch, self.n]
        return part.reshape(shape)

    def put(self, dst: torch.Tensor, value: torch.Tensor, dim: int = 0) -> None:
        """Write the dense batch's real rows (``value``, rows flattened along ``dim``) into
        ``dst``'s rows."""
        if self.padded:
            value = value.index_select(dim, self.dense)
        if self.span is None:
            dst.index_copy_(dim, self.index, value)
        elif dim == 0:
            dst[self.span] = value
        else:
            dst[:, self.span] = value


def _kv_grad(x: torch.Tensor, hk: int, ad: torch.dtype) -> torch.Tensor:
    """dK or dV from the op, ``(B, H or H_kv, L, d)``, as ``[B, L, H_kv, d]``: repeated heads
    summed in ``ad`` (fp32), KV heads passed as they were left as they are (no copy)."""
    x = _dense(x)
    return x if x.shape[2] == hk else x.to(ad).unflatten(2, (hk, -1)).sum(3)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``[B, L, H, d]`` rows as the op's ``(B, H, L, d)`` (BSHD strides)."""
    return x.transpose(1, 2)


def _heads(x: torch.Tensor, heads: int, native: bool) -> torch.Tensor:
    """``[B, L, H_kv, d]`` as it is (``native``) or repeated to ``[B, L, heads, d]``: KV head ``j``
    serves query heads ``j * G .. j * G + G - 1`` (``G = heads / H_kv``)."""
    B, L, hk, d = x.shape
    if native or hk == heads:
        return x.contiguous()
    return x[:, :, :, None, :].expand(B, L, hk, heads // hk, d).reshape(B, L, heads, d)


class CudnnBackend:
    """cuDNN fused attention (CUDA; fp16/bf16; head_dim a multiple of 8, at most 128) over packed
    variable-length segments (Note [cuDNN varlen by grouping]).

    ``fwd``/``bwd`` replace the aten ops (for tests: an independent implementation of the same
    contract on CPU); without them the backend needs torch's CUDA kernel of the ops and cuDNN."""

    name = "cudnn"
    host_lengths = True  # shapes are grouped on the host (Note [cuDNN varlen by grouping])

    def __init__(
        self,
        fwd: Callable | None = None,
        bwd: Callable | None = None,
        buckets: bool = True,
        native_gqa: bool = True,
        grouping: bool = True,
    ) -> None:
        self.buckets, self.native_gqa, self.grouping = buckets, native_gqa, grouping
        aten = torch.ops.aten
        try:
            ops = (
                aten._scaled_dot_product_cudnn_attention,
                aten._scaled_dot_product_cudnn_attention_backward,
            )
        except AttributeError:
            raise RuntimeError(
                f"torch {torch.__version__} has no aten cuDNN attention ops"
            ) from None
        check_schema(ops[0].default._schema, ops[1].default._schema)
        if fwd is None or bwd is None:
            why = cuda_unavailable()
            if why:
                raise RuntimeError(why)
        self._fwd = fwd or ops[0]
        self._bwd = bwd or ops[1]
        self.dtypes = (torch.float16, torch.bfloat16) if fwd is None else None
        self.refusals: list[str] = []

    def _check(self, q: torch.Tensor) -> None:
        d = q.shape[-1]
        if self.dtypes is not None and q.dtype not in self.dtypes:
            raise ValueError(f"cudnn backend: {q.dtype} is not supported (fp16/bf16 only)")
        if d % 8 or d > MAX_HEAD_DIM:
            raise ValueError(
                f"cudnn backend: head_dim {d} must be a multiple of 8 and at most {MAX_HEAD_DIM}"
            )

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        self._check(q)
        try:
            return self._forward(q, k, v, cu_q, cu_k, causal, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            return self._refused(e, q).forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        self._check(q)
        args = (q, k, v, out, lse, cu_q, cu_k)
        try:
            return self._backward(dout, *args, causal, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            return self._refused(e, q).backward(dout, *args, max_q, max_k, causal, scale)

    def _refused(self, e: RuntimeError, q: torch.Tensor):
        """The backend that runs a call the cuDNN op refused: PyTorch's FlashAttention on a GPU
        where it runs, else the reference; a warning names the reason the first time it is seen
        (:attr:`refusals` keeps every one, for tests). Backward may so run with another backend
        than forward: every backend's backward needs only the final out and LSE."""
        from .kernels import BackendUnavailable, get_backend

        why = " ".join(str(e).split())[:300]
        if why not in self.refusals:
            warnings.warn(
                f"cudnn backend: the op refused a call ({why}); running it with another backend",
                stacklevel=3,
            )
        self.refusals.append(why)
        for name in ("torch_flash", "reference") if q.is_cuda else ("reference",):
            try:
                return get_backend(name)
            except BackendUnavailable:
                continue
        raise e

    def _forward(self, q, k, v, cu_q, cu_k, causal, scale):
        T, H, d = q.shape
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        groups = group_segments(cu_q.tolist(), cu_k.tolist(), causal, self.buckets, self.grouping)
        out = torch.zeros_like(q)
        lse = torch.full((H, T), -math.inf, dtype=acc_dtype(q.dtype), device=q.device)
        for g in groups:
            qr = Rows(g.q_starts, g.q_lens, g.len_q, q.device)
            kr = Rows(g.k_starts, g.k_lens, g.len_k, q.device)

            def call(native: bool, qr=qr, kr=kr):
                kb, vb = (_heads(kr.take(x), H, native) for x in (k, v))
                args = (_dense(qr.take(q)), _dense(kb), _dense(vb), None, True, 0.0, causal)
                return self._fwd(*args, False, scale=scale)

            res = self._gqa(call, k.shape[1], H)
            qr.put(out, _dense(res[0]).reshape(-1, H, d))
            # (B, H, L, 1) -> [H, B * L]
            qr.put(lse, res[1][..., 0].transpose(0, 1).reshape(H, -1).to(lse.dtype), dim=1)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
        H, d, hk = q.shape[1], q.shape[2], k.shape[1]
        ad = acc_dtype(q.dtype)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dout, out = dout.contiguous(), out.contiguous()
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
        for g in group_segments(cu_q.tolist(), cu_k.tolist(), causal, self.buckets, self.grouping):
            qr = Rows(g.q_starts, g.q_lens, g.len_q, q.device)
            kr = Rows(g.k_starts, g.k_lens, g.len_k, q.device)
            # [H, B, L] -> (B, H, L, 1), the layout the forward returned (fp32 for fp16/bf16);
            # padding rows get lse 0 (Note [cuDNN varlen by grouping]).
            lse_b = qr.take(lse, dim=1).permute(1, 0, 2)[..., None].to(ad).contiguous()
            dense_q = [_dense(qr.take(x)) for x in (dout, q, out)]

            def call(native: bool, g=g, kr=kr, lse_b=lse_b, dense_q=dense_q):
                kb, vb = (_dense(_heads(kr.take(x), H, native)) for x in (k, v))
                do_b, q_b, o_b = dense_q
                args = (do_b, q_b, kb, vb, o_b, lse_b, seed, seed, None, None, None)
                grads = self._bwd(*args, g.len_q, g.len_k, 0.0, causal, scale=scale)[:3]
                return grads[0], *(_kv_grad(x, hk, ad) for x in grads[1:])

            gq, gk, gv = self._gqa(call, hk, H)
            qr.put(dq, _dense(gq).reshape(-1, H, d).to(dq.dtype))
            kr.put(dk, gk.reshape(-1, hk, d).to(dk.dtype))
            kr.put(dv, gv.reshape(-1, hk, d).to(dv.dtype))
        return dq, dk, dv

    def _gqa(self, call: Callable[[bool], tuple], hk: int, heads: int) -> tuple:
        """``call(native)``: with ``hk`` KV heads passed as they are (cuDNN's native grouped-query
        attention) while the op takes them, else repeated to ``heads``. A call refused with
        ``H_kv`` heads that runs with repeated ones switches this backend to repeating for good;
        one refused both ways raises the first refusal (it was not about the heads)."""
        if hk == heads or not self.native_gqa:
            return call(False)
        try:
            return call(True)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            try:
                result = call(False)
            except RuntimeError:
                raise e from None
            warnings.warn(
                f"cudnn backend: the op refused {hk} KV heads for {heads} query heads "
                f"({' '.join(str(e).split())[:200]}); repeating KV heads from now on",
                stacklevel=2,
            )
            self.native_gqa = False
            return result


def cuda_unavailable() -> str | None:
    """Why the real cuDNN ops cannot run here, or ``None``."""
    if not torch.cuda.is_available():
        return "cudnn attention needs a CUDA GPU; none is visible"
    if not torch.backends.cudnn.is_available():
        return f"torch {torch.__version__} was built without cuDNN"
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::_scaled_dot_product_cudnn_attention", "CUDA"
    )
    if not has_kernel:
        return f"torch {torch.__version__} has no CUDA kernel for cuDNN attention"
    return None
