"""The cuDNN attention backend: schema checks, selection and fallbacks, and the varlen plumbing
(grouping, GQA, LSE layout, backward from the final out/lse) run on CPU against fake aten ops
written here with float64 math; the real ops against float64 SDPA where a CUDA GPU is present."""

import math

import pytest
import torch
import torch.nn.functional as F

from hdp import Plan
from hdp.attention import BackendUnavailable, dist_attn, get_backend, kernels, resolve_backend
from hdp.attention import cudnn as cudnn_mod
from hdp.attention.cudnn import CudnnBackend, Rows, bucket, check_schema, group_segments

_SEED = torch.zeros((), dtype=torch.int64)


def _masked_scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) * scale
    if causal:  # square blocks only: top-left and bottom-right alignment agree
        L = s.shape[-1]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s


def _check_dense(query, key, value, causal: bool) -> int:
    """What the backend must hand the op: dense (B, H, L, d) queries and (B, H_kv, L, d) keys and
    values, ``H % H_kv == 0``; returns the group size ``H / H_kv``."""
    B, H, Lq, d = query.shape
    assert key.dim() == 4 and key.shape[0] == B and key.shape[3] == d and H % key.shape[1] == 0
    assert value.shape == key.shape
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    assert not causal or Lq == key.shape[2], "causal calls must be square"
    SEEN_KV_HEADS.append(key.shape[1])
    return H // key.shape[1]


SEEN_KV_HEADS = []  # the KV head counts the fake ops were given


def fake_fwd(
    query,
    key,
    value,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    """The aten op's contract, computed with float64 SDPA and the explicit score matrix."""
    g = _check_dense(query, key, value, is_causal)
    assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask
    q = query.double()
    k, v = (t.double().repeat_interleave(g, 1) for t in (key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    lse = torch.logsumexp(_masked_scores(q, k, is_causal, scale), -1, keepdim=True)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    Lq, Lk = query.shape[2], key.shape[2]
    return out.to(query.dtype), lse.to(lse_dtype), None, None, Lq, Lk, _SEED, _SEED, None


def fake_bwd(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    """Gradients of the block given the final ``out`` and ``logsumexp`` of each row (float64)."""
    g = _check_dense(query, key, value, is_causal)
    B, H, Lq, _ = query.shape
    assert grad_out.shape == out.shape == query.shape
    assert logsumexp.shape == (B, H, Lq, 1) and logsumexp.dtype in (torch.float32, torch.float64)
    assert (max_q, max_k) == (Lq, key.shape[2]) and dropout_p == 0.0
    assert attn_bias is None and cum_seq_q is None and cum_seq_k is None
    q, o, do = (t.double() for t in (query, out, grad_out))
    k, v = (t.double().repeat_interleave(g, 1) for t in (key, value))
    p = torch.exp(_masked_scores(q, k, is_causal, scale) - logsumexp.double())
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq, dk = ds @ k * scale, ds.transpose(-1, -2) @ q * scale
    # Grouped heads: each KV head's gradient is the sum over the query heads it serves.
    dk, dv = (x.unflatten(1, (-1, g)).sum(2) for x in (dk, dv))
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(lens_q, lens_k, H, Hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), H, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lens_k), Hk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lens_k), Hk, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


# Repeated shapes both adjacent (16, 16) and apart (16 ... 16, 5 ... 5), an empty segment, and
# one unique shape.
CAUSAL_LENS = [16, 16, 5, 16, 0, 5, 32]
FULL_LENS_Q = [8, 8, 3, 8, 4, 3]
FULL_LENS_K = [24, 24, 7, 24, 0, 7]


def test_installed_schema_is_accepted_and_changes_are_caught():
    fwd = torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema
    bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default._schema
    check_schema(fwd, bwd)  # this torch's (2.13 here; 2.11's, recorded on the H100, is the same)
    text = str(fwd)
    later = torch._C.parse_schema(text.replace("float? scale=None", "float? scale=None, int w=0"))
    check_schema(later, bwd)  # a new keyword with a default: compatible
    for bad, why in (
        (text.replace("Tensor key,", "Tensor keys,"), "expected"),
        (text.replace("float? scale=None", "float? scale=None, int w"), "unknown arguments"),
        (text.replace(", *, float? scale=None", ""), "no keyword argument 'scale'"),
    ):
        with pytest.raises(RuntimeError, match=why):
            check_schema(torch._C.parse_schema(bad), bwd)


def test_grouping_keeps_equal_shapes_together():
    cu = _cu(CAUSAL_LENS).tolist()
    exact = group_segments(cu, cu, causal=True, buckets=False)
    assert [(g.len_q, g.q_starts) for g in exact] == [(16, [0, 16, 37]), (5, [32, 53]), (32, [58])]
    assert all(g.q_starts == g.k_starts for g in exact)
    padded = group_segments(cu, cu, causal=True)  # 5 -> 16: one group more, none less
    assert [(g.len_q, g.len_k, g.q_lens) for g in padded] == [
        (16, 16, [16, 16, 5, 16, 5]),
        (32, 32, [32]),
    ]
    full = group_segments(_cu(FULL_LENS_Q).tolist(), _cu(FULL_LENS_K).tolist(), causal=False)
    assert [(g.len_q, g.len_k, g.q_lens) for g in full] == [(16, 24, [8, 8, 8]), (16, 7, [3, 3])]
    loop = group_segments(cu, cu, causal=True, grouping=False)
    assert [(g.len_q, g.q_starts) for g in loop] == [
        (16, [0]),
        (16, [16]),
        (16, [32]),
        (16, [37]),
        (16, [53]),
        (32, [58]),
    ]
    with pytest.raises(ValueError, match="must be square"):
        group_segments([0, 4], [0, 5], causal=True)


def test_buckets_bound_the_shapes_and_the_padding():
    assert [bucket(n) for n in (1, 16, 17, 300, 512, 513, 1000, 8192, 8193)] == [
        16,
        16,
        32,
        304,
        512,
        544,
        1024,
        8192,
        8704,
    ]
    sizes = range(1, 1 << 18)
    assert all(n <= bucket(n) <= max(n + 15, n * 17 / 16) for n in sizes)
    assert len({bucket(n) for n in sizes}) < 400


def test_rows_are_views_where_they_can_be_and_padded_where_they_must():
    cpu = torch.device("cpu")
    x = torch.arange(60.0)[:, None]
    adjacent = Rows([0, 16], [16, 16], 16, cpu)
    assert adjacent.span == slice(0, 32) and adjacent.index is None
    assert adjacent.take(x).data_ptr() == x.data_ptr()  # a view
    apart = Rows([0, 16, 37], [16, 16, 16], 16, cpu)
    assert apart.span is None and apart.take(x)[2, :, 0].tolist() == list(range(37, 53))
    padded = Rows([3, 40], [2, 3], 4, cpu)
    dense = padded.take(x)
    assert dense[:, :, 0].tolist() == [[3, 4, 0, 0], [40, 41, 42, 0]]
    back = torch.zeros_like(x)
    padded.put(back, dense.reshape(-1, 1))
    assert back.nonzero()[:, 0].tolist() == [3, 4, 40, 41, 42]
    lse = torch.arange(120.0).view(2, 60)  # [H, T]: padding rows of the dense batch get 0
    assert padded.take(lse, dim=1)[1].tolist() == [[63, 64, 0, 0], [100, 101, 102, 0]]


@pytest.mark.parametrize(
    "buckets, native_gqa, grouping", [(True, True, True), (False, False, True), (True, True, False)]
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("H, Hk", [(4, 2), (2, 2)])
def test_fake_cudnn_matches_the_reference_in_float64(causal, H, Hk, buckets, native_gqa, grouping):
    lens_q = CAUSAL_LENS if causal else FULL_LENS_Q
    lens_k = CAUSAL_LENS if causal else FULL_LENS_K
    q, k, v = _inputs(lens_q, lens_k, H, Hk, 8, torch.float64)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    mq, mk, scale = max(lens_q), max(lens_k), 0.3
    be = CudnnBackend(fake_fwd, fake_bwd, buckets, native_gqa, grouping)
    ref = get_backend("reference")
    SEEN_KV_HEADS.clear()
    out, lse = be.forward(q, k, v, cu_q, cu_k, mq, mk, causal, scale)
    assert set(SEEN_KV_HEADS) == {Hk if native_gqa else H}
    want, want_lse = ref.forward(q, k, v, cu_q, cu_k, mq, mk, causal, scale)
    assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float64
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))  # rows without keys: -inf
    assert torch.allclose(out, want, atol=1e-12)
    assert torch.allclose(lse, want_lse, atol=1e-12)
    # Backward from a *final* out/lse that is not this block's own (as in dist_attn, where the
    # row also saw other key blocks): the kernel must use what it is given.
    g = torch.Generator().manual_seed(1)
    final_out = out + 0.1 * torch.randn(out.shape, generator=g, dtype=out.dtype)
    final_lse = torch.where(torch.isinf(lse), lse, lse + 0.5)
    do = torch.randn(out.shape, generator=g, dtype=out.dtype)
    got = be.backward(do, q, k, v, final_out, final_lse, cu_q, cu_k, mq, mk, causal, scale)
    wants = ref.backward(do, q, k, v, final_out, final_lse, cu_q, cu_k, mq, mk, causal, scale)
    for a, b in zip(got, wants):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-11)


def test_an_op_without_grouped_query_attention_gets_repeated_heads():
    def refuse(op):
        qi = 1 if op is fake_bwd else 0  # where the query is; the key follows it

        def call(*args, **kw):
            if args[qi].shape[1] != args[qi + 1].shape[1]:
                raise RuntimeError("cuDNN: number of heads of q and k differ")
            return op(*args, **kw)

        return call

    lens = [16, 9, 16]
    q, k, v = _inputs(lens, lens, 4, 1, 8, torch.float64)
    cu, m = _cu(lens), max(lens)
    be = CudnnBackend(refuse(fake_fwd), refuse(fake_bwd))
    with pytest.warns(UserWarning, match="refused 1 KV heads for 4 query heads"):
        out, lse = be.forward(q, k, v, cu, cu, m, m, True, 0.5)
    assert not be.native_gqa
    want, want_lse = get_backend("reference").forward(q, k, v, cu, cu, m, m, True, 0.5)
    assert torch.allclose(out, want, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)
    grads = be.backward(out, q, k, v, out, lse, cu, cu, m, m, True, 0.5)
    wants = get_backend("reference").backward(out, q, k, v, out, lse, cu, cu, m, m, True, 0.5)
    for a, b in zip(grads, wants):
        assert torch.allclose(a, b, atol=1e-11)


def test_a_call_the_op_refuses_runs_with_another_backend():
    def small_only(op, qi):
        def call(*args, **kw):
            if args[qi].shape[2] > 16:
                raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")
            return op(*args, **kw)

        return call

    lens = [16, 40, 16]
    q, k, v = _inputs(lens, lens, 2, 1, 8, torch.float64)
    cu, m = _cu(lens), max(lens)
    be = CudnnBackend(small_only(fake_fwd, 0), small_only(fake_bwd, 1))
    with pytest.warns(UserWarning, match="refused a call .*No valid execution plans"):
        out, lse = be.forward(q, k, v, cu, cu, m, m, True, 0.5)
    grads = be.backward(out, q, k, v, out, lse, cu, cu, m, m, True, 0.5)
    ref = get_backend("reference")
    want, want_lse = ref.forward(q, k, v, cu, cu, m, m, True, 0.5)
    assert torch.allclose(out, want, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)
    for a, b in zip(grads, ref.backward(out, q, k, v, out, lse, cu, cu, m, m, True, 0.5)):
        assert torch.allclose(a, b, atol=1e-11)
    assert len(be.refusals) == 2  # forward and backward, warned once
    assert be.native_gqa  # refused with repeated heads too: not about grouped-query attention


def test_fake_cudnn_in_bfloat16_keeps_the_dtypes():
    q, k, v = _inputs(CAUSAL_LENS, CAUSAL_LENS, 4, 1, 16, torch.bfloat16)
    cu, m = _cu(CAUSAL_LENS), max(CAUSAL_LENS)
    be = CudnnBackend(fake_fwd, fake_bwd)
    out, lse = be.forward(q, k, v, cu, cu, m, m, True, 0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want, want_lse = get_backend("reference").forward(
        q.double(), k.double(), v.double(), cu, cu, m, m, True, 0.25
    )
    assert (out.double() - want).abs().max() < 2e-2
    assert (lse.double() - want_lse).abs().max() < 1e-5
    dq, dk, dv = be.backward(torch.ones_like(q), q, k, v, out, lse, cu, cu, m, m, True, 0.25)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16 and dk.shape == k.shape


def test_dist_attn_with_the_cudnn_backend(monkeypatch):
    monkeypatch.setattr(kernels, "_BACKENDS", {"cudnn": CudnnBackend(fake_fwd, fake_bwd)})
    # Two sequences, each split in shards: diagonal blocks, local full blocks, equal shapes.
    plan = Plan.from_shards(
        [32, 24], 1, [[[(0, 0, 8), (1, 0, 8), (0, 8, 16), (1, 8, 16), (0, 16, 32), (1, 16, 24)]]]
    )
    q, k, v = _inputs([56], [56], 4, 2, 8, torch.float64)
    results = []
    for name in ("cudnn", "reference"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = dist_attn(*leaves, plan, 0, softmax_scale=0.4, backend=name)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    assert torch.allclose(results[0][0], results[1][0], atol=1e-12)
    for a, b in zip(results[0][1:], results[1][1:]):
        # dist_attn hands non-reference kernels the LSE in fp32 (what the real ops take).
        assert torch.allclose(a, b, atol=1e-6)


def _fresh(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(kernels, "_BACKENDS", {})
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: capability)


def test_selection_prefers_flash_and_takes_cudnn_only_without_it(monkeypatch):
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    _fresh(monkeypatch)
    monkeypatch.setattr(cudnn_mod, "cuda_unavailable", lambda: None)  # pretend: ops runnable
    assert kernels.candidate_names(cuda, bf16) == [
        "flash_attn",
        "torch_flash",
        "flash_attn_4",
        "cudnn",
        "reference",
    ]
    assert kernels.select_backend(cuda, bf16).name in ("flash_attn", "torch_flash")
    assert kernels.select_backend(cuda, torch.float32).name == "reference"
    assert kernels.select_backend(torch.device("cpu"), bf16).name == "reference"
    _fresh(monkeypatch, capability=(8, 0))  # Ampere: no cuDNN or FlashAttention-4 candidate
    assert {"cudnn", "flash_attn_4"}.isdisjoint(kernels.candidate_names(cuda, bf16))

    class NoFlash:
        def __init__(self):
            raise RuntimeError("no FlashAttention in this build")

    real = kernels._backend_class
    no_flash = {"flash_attn", "torch_flash", "flash_attn_4"}
    monkeypatch.setattr(kernels, "_backend_class", lambda n: NoFlash if n in no_flash else real(n))
    _fresh(monkeypatch)  # Hopper without FlashAttention: cuDNN
    assert kernels.select_backend(cuda, bf16).name == "cudnn"
    _fresh(monkeypatch)

    def mismatch(fwd, bwd):
        raise RuntimeError("unsupported cuDNN attention schema")

    monkeypatch.setattr(cudnn_mod, "check_schema", mismatch)  # nothing fast runs: the reference
    assert kernels.select_backend(cuda, torch.float16).name == "reference"


def test_a_forced_backend_that_cannot_run_is_one_clear_line(monkeypatch):
    _fresh(monkeypatch)
    cpu = torch.device("cpu")
    assert resolve_backend(None, cpu, torch.float32).name == "reference"
    assert resolve_backend("auto", cpu, torch.float32).name == "reference"
    assert resolve_backend("reference", cpu, torch.float32).name == "reference"
    with pytest.raises(ValueError, match="runs on CUDA in fp16/bf16, not on cpu in float32") as e:
        resolve_backend("cudnn", cpu, torch.float32)
    assert "\n" not in str(e.value) and "'auto' or 'reference'" in str(e.value)
    with pytest.raises(
        ValueError, match="choose flash_attn, torch_flash, flash_attn_4, cudnn, reference"
    ):
        resolve_backend("xformers", cpu, torch.float32)
    monkeypatch.setattr(cudnn_mod, "cuda_unavailable", lambda: "no CUDA GPU is visible")
    with pytest.raises(BackendUnavailable, match="'cudnn' is unavailable: no CUDA GPU") as e:
        resolve_backend("cudnn", torch.device("cuda"), torch.bfloat16)
    assert "\n" not in str(e.value) and "'auto'" in str(e.value)


def test_unsupported_head_dims_and_dtypes_are_refused():
    be = CudnnBackend(fake_fwd, fake_bwd)
    q = torch.zeros(4, 2, 12)
    cu = _cu([4])
    with pytest.raises(ValueError, match="head_dim 12 must be a multiple of 8"):
        be.forward(q, q, q, cu, cu, 4, 4, True, 1.0)
    be.dtypes = (torch.float16, torch.bfloat16)
    with pytest.raises(ValueError, match="fp16/bf16 only"):
        be.forward(
            torch.zeros(4, 2, 8),
            torch.zeros(4, 2, 8),
            torch.zeros(4, 2, 8),
            cu,
            cu,
            4,
            4,
            True,
            1.0,
        )


def _cudnn_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        return get_backend("cudnn")
    except BackendUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("native_gqa", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_cudnn_matches_float64_sdpa_per_segment(causal, native_gqa):
    _cudnn_or_skip()
    be = CudnnBackend(native_gqa=native_gqa)
    lens_q = [512, 512, 1, 127, 512, 300, 2048] if causal else [256, 256, 64, 1000, 256]
    lens_k = lens_q if causal else [1024, 1024, 8192, 3000, 1024]
    q, k, v = (t.cuda() for t in _inputs(lens_q, lens_k, 8, 2, 64, torch.bfloat16))
    cu_q, cu_k = _cu(lens_q).cuda(), _cu(lens_k).cuda()
    mq, mk = max(lens_q), max(lens_k)
    do = torch.randn_like(q)
    out, lse = be.forward(q, k, v, cu_q, cu_k, mq, mk, causal, 0.125)
    grads = be.backward(do, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal, 0.125)
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    want, want_lse = [], []
    for i in range(len(lens_q)):  # float64 SDPA per segment, KV heads repeated
        a, b, c, e = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        qs = leaves[0][a:b].transpose(0, 1)
        ks, vs = (t[c:e].repeat_interleave(4, 1).transpose(0, 1) for t in leaves[1:])
        want.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=0.125))
        want_lse.append(torch.logsumexp(_masked_scores(qs, ks, causal, 0.125), -1))
    want = torch.cat(want, 1).transpose(0, 1)
    want.backward(do.double())
    assert be.native_gqa == native_gqa, "the op refused 2 KV heads for 8 query heads"
    assert be.refusals == [], "the op refused calls, run by another backend"
    assert lse.shape == (8, q.shape[0]) and lse.dtype == torch.float32
    assert (out.double() - want).abs().max() < 2e-2
    assert (lse.double() - torch.cat(want_lse, 1)).abs().max() < 1e-2
    for got, leaf in zip(grads, leaves):
        ref = leaf.grad
        assert (got.double() - ref).abs().max() < 5e-2 * max(1.0, ref.abs().max().item())


def test_gpu_dist_attn_with_cudnn_matches_the_reference():
    _cudnn_or_skip()
    shards = [(0, 0, 1024), (1, 0, 1024), (0, 1024, 2048), (1, 1024, 3000), (0, 2048, 2100)]
    plan = Plan.from_shards([2100, 3000], 1, [[shards]])
    q, k, v = _inputs([5100], [5100], 8, 2, 64, torch.float64)
    do = torch.randn_like(q)
    results = []
    for name, dtype in (("cudnn", torch.bfloat16), ("reference", torch.float64)):
        leaves = [t.to("cuda", dtype).requires_grad_(True) for t in (q, k, v)]
        out = dist_attn(*leaves, plan, 0, softmax_scale=0.125, backend=name)
        (out * do.to("cuda", dtype)).sum().backward()
        results.append([out.detach().double()] + [t.grad.double() for t in leaves])
    for got, ref in zip(*results):
        assert (got - ref).abs().max() < 5e-2 * max(1.0, ref.abs().max().item())


def test_the_model_runs_the_backend_it_is_given(monkeypatch):
    """``Llama(attention_backend=...)`` reaches dist_attn: the fake cuDNN backend trains the tiny
    model (head_dim 16, GQA) to the reference backend's loss and gradients."""
    import numpy as np

    from hdp import model_preset
    from hdp.launch.model import AttentionContext, Llama

    monkeypatch.setattr(kernels, "_BACKENDS", {"cudnn": CudnnBackend(fake_fwd, fake_bwd)})
    lens = [40, 40, 24]
    plan = Plan.from_shards(lens, 1, [[[(0, 0, 40), (1, 0, 40), (2, 0, 24)]]])
    ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lens]))
    results = []
    for name in ("cudnn", "reference"):
        torch.manual_seed(0)
        model = Llama(model_preset("tiny"), attention_backend=name).double()
        assert all(layer.attn.backend == name for layer in model.layers)
        loss = model(ids, pos, AttentionContext(plan, 0), ids)
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):  # fp32 tolerance: dist_attn hands the LSE over in fp32
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6)


def test_training_refuses_a_forced_backend_that_cannot_run():
    from hdp import model_preset
    from hdp.launch.attention_backend import forced_attention_backend, verify_attention_backend

    def verify(name):
        return verify_attention_backend(name, spec=tiny, device=torch.device("cpu"), log=print)

    tiny = model_preset("tiny")
    assert forced_attention_backend(None) is None
    assert forced_attention_backend("auto") is None
    assert verify("reference") == verify("auto") == "reference"
    with pytest.raises(ValueError, match="--attention-backend cudnn: .* use 'auto' or 'reference'"):
        verify("cudnn")


def test_the_cost_model_prices_the_backend_that_will_run(monkeypatch):
    from hdp import gpu_preset
    from hdp.launch.attention_backend import priced_attention_backend

    cpu, h100 = torch.device("cpu"), gpu_preset("h100")
    assert priced_attention_backend("auto", cpu, gpu_preset("cpu")) == "reference"
    assert priced_attention_backend("auto", cpu, h100) is None  # no reference rows: default
    _fresh(monkeypatch)  # a Hopper GPU where cuDNN's ops run too
    monkeypatch.setattr(cudnn_mod, "cuda_unavailable", lambda: None)
    cuda = torch.device("cuda")
    assert priced_attention_backend("auto", cuda, h100) == "torch_flash"
    assert priced_attention_backend("cudnn", cuda, h100) == "cudnn"


def test_pretrain_flag(capsys):
    from hdp.launch.cli import main, parse_config

    assert parse_config([]).training.attention_backend == "auto"
    chosen = parse_config(["--attention-backend", "reference"]).training.attention_backend
    assert chosen == "reference"
    with pytest.raises(SystemExit):
        parse_config(["--attention-backend", "xformers"])
    assert (
        "unknown attention backend 'xformers': choose from auto, flash_attn"
        in capsys.readouterr().err
    )
    argv = ["--model", "tiny", "--steps", "1", "--max-seq", "512", "--tokens-per-step", "1K"]
    argv += ["--device", "cpu"]  # also where a GPU is present
    assert main(argv + ["--synthetic-docs", "50", "--attention-backend", "torch_flash"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "pretrain.py: error: --attention-backend torch_flash: attention backend 'torch_flash' "
        "runs on CUDA in fp16/bf16, not on cpu in float32: use 'auto' or 'reference'"
    ]
