"""Attention kernels against independent references; GPU backends skip without CUDA."""

import math

import pytest
import torch
import torch.nn.functional as F

from hdp.attention import BackendUnavailable, PartialAttention, get_backend, kernels, select_backend


def sdpa_segments(q, k, v, cu_q, cu_k, causal, scale):
    """Per segment, float64: output and log-sum-exp from the explicit score matrix."""
    outs, lses = [], []
    H, Hk = q.shape[1], k.shape[1]
    for a, b, c, e in zip(
        cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()
    ):
        qq = q[a:b].double().transpose(0, 1)
        kk = k[c:e].double().repeat_interleave(H // Hk, 1).transpose(0, 1)
        vv = v[c:e].double().repeat_interleave(H // Hk, 1).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) * scale
        if causal:
            s = s.masked_fill(
                torch.ones(b - a, e - c, dtype=torch.bool).triu(1 + (e - c) - (b - a)), -math.inf
            )
        lses.append(torch.logsumexp(s, -1))
        outs.append(
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale).transpose(
                0, 1
            )
            if causal
            else (torch.softmax(s, -1) @ vv).transpose(0, 1)
        )
    return torch.cat(outs), torch.cat(lses, 1)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_crosses_chunk_boundaries(monkeypatch, causal):
    monkeypatch.setattr(kernels, "Q_CHUNK", 7)
    monkeypatch.setattr(kernels, "K_CHUNK", 5)
    torch.manual_seed(0)
    lens_q = [1, 13, 40] if causal else [3, 13, 40]
    lens_k = lens_q if causal else [9, 1, 30]
    q = torch.randn(sum(lens_q), 4, 8, dtype=torch.float64)
    k = torch.randn(sum(lens_k), 2, 8, dtype=torch.float64)
    v = torch.randn(sum(lens_k), 2, 8, dtype=torch.float64)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    be = get_backend("reference")
    out, lse = be.forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, 0.3)
    want_out, want_lse = sdpa_segments(q, k, v, cu_q, cu_k, causal, 0.3)
    assert torch.allclose(out, want_out, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)
    # Backward against autograd through the explicit reference.
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    o, _ = sdpa_segments(qr, kr, vr, cu_q, cu_k, causal, 0.3)
    do = torch.randn_like(o)
    o.backward(do)
    dq, dk, dv = be.backward(
        do, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), causal, 0.3
    )
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert torch.allclose(got, want, atol=1e-11)


@pytest.mark.parametrize("heads", [1, 2, 4, 8, 32, 64, 128])
def test_cpu_blocks_stay_small_and_gpu_blocks_large(heads):
    # Note [Reference attention blocks on a CPU]: a CPU block's fp32 scores stay under the budget
    # (heap-allocated, no page faults per op); a GPU keeps the large blocks.
    q, k = kernels.chunks(heads, torch.device("cpu"))
    assert k == 2 * q and q & (q - 1) == 0
    assert heads * q * k <= kernels.CPU_BLOCK_SCORES
    assert heads * (2 * q) * (2 * k) > kernels.CPU_BLOCK_SCORES or q == kernels.Q_CHUNK
    assert kernels.chunks(heads, torch.device("meta")) == (kernels.Q_CHUNK, kernels.K_CHUNK)


def test_rows_without_keys_and_float32():
    be = get_backend("reference")
    q = torch.randn(5, 2, 4)
    k = torch.randn(3, 2, 4)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 3], dtype=torch.int32)  # first segment: no keys
    out, lse = be.forward(q, k, k, cu_q, cu_k, 3, 3, False, 0.5)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert (out[:2] == 0).all() and torch.isinf(lse[:, :2]).all()
    want, want_lse = sdpa_segments(
        q[2:], k, k, torch.tensor([0, 3]), torch.tensor([0, 3]), False, 0.5
    )
    assert torch.allclose(out[2:].double(), want, atol=1e-6)


def test_partial_attention_merge_is_exact():
    torch.manual_seed(1)
    q = torch.randn(6, 2, 4, dtype=torch.float64)
    k = torch.randn(10, 2, 4, dtype=torch.float64)
    be = get_backend("reference")
    cu6, cu10 = (torch.tensor([0, n], dtype=torch.int32) for n in (6, 10))
    whole, whole_lse = be.forward(q, k, k, cu6, cu10, 6, 10, False, 1.0)
    rows = torch.arange(6)
    parts = []
    for a, b in ((0, 4), (4, 10)):
        cu = torch.tensor([0, b - a], dtype=torch.int32)
        parts.append(be.forward(q, k[a:b], k[a:b], cu6, cu, 6, b - a, False, 1.0))
    acc = PartialAttention.empty(6, 2, 4, torch.float64, q.device)
    for o, lse in parts:
        acc.merge(rows, o, lse)
    started = PartialAttention.start(*parts[0])  # the first block covers every row
    started.merge(rows, *parts[1])
    for got in (acc, started):
        assert torch.allclose(got.out, whole, atol=1e-13)
        assert torch.allclose(got.lse, whole_lse, atol=1e-13)


def test_cpu_selects_the_reference():
    assert select_backend(torch.device("cpu"), torch.bfloat16).name == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("xformers")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("name", ["cudnn", "torch_flash", "flash_attn", "flash_attn_4"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_backends_match_the_reference(name, causal):
    try:
        be = get_backend(name)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    torch.manual_seed(0)
    lens = [1, 127, 300, 2048]
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(T, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = be.forward(q, k, v, cu, cu, max(lens), max(lens), causal, 0.125)
    want, want_lse = get_backend("reference").forward(
        q.double(), k.double(), v.double(), cu, cu, max(lens), max(lens), causal, 0.125
    )
    assert lse.shape == (8, T) and lse.dtype == torch.float32
    assert (out.double() - want).abs().max() < 2e-2
    assert (lse.double() - want_lse).abs().max() < 1e-2
    do = torch.randn_like(q)
    dq, dk, dv = be.backward(do, q, k, v, out, lse, cu, cu, max(lens), max(lens), causal, 0.125)
    rq, rk, rv = get_backend("reference").backward(
        do.double(),
        q.double(),
        k.double(),
        v.double(),
        want,
        want_lse,
        cu,
        cu,
        max(lens),
        max(lens),
        causal,
        0.125,
    )
    for got, ref in ((dq, rq), (dk, rk), (dv, rv)):
        assert (got.double() - ref).abs().max() < 5e-2 * max(1.0, ref.abs().max().item())


def _fake_flash_attn_4(monkeypatch, *, with_lse: bool = True):
    """A stand-in for ``flash_attn.cute.interface`` with the package's parameter names (no
    ``**kwargs``: a misnamed argument fails), computing with the reference backend."""
    import sys
    import types

    ref = kernels.ReferenceBackend()

    def fwd(
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        softmax_scale=None,
        causal=False,
        return_lse=False,
    ):
        out, lse = ref.forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
        )
        return out, (lse if return_lse else None), None, None, None

    def bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=None,
        causal=False,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        deterministic=False,
    ):
        grads = ref.backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal, softmax_scale,
        )  # fmt: skip
        return (*grads, None)

    if not with_lse:
        fwd = lambda q, k, v, cu_seqlens_q=None: None  # noqa: E731 - an older release's shape
    interface = types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    monkeypatch.setattr(kernels, "_BACKENDS", {})


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_4_is_called_by_its_parameter_names(monkeypatch, causal):
    """The FlashAttention-4 backend against the reference (float64, CPU), through a stand-in for
    the package that takes the real one's parameter names and returns its tuples."""
    _fake_flash_attn_4(monkeypatch)
    be = get_backend("flash_attn_4")
    lens = [1, 17, 40]
    T = sum(lens)
    cu = torch.tensor([0, 1, 18, 58], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    out, lse = be.forward(q, k, v, cu, cu, 40, 40, causal, 0.25)
    want, want_lse = kernels.ReferenceBackend().forward(q, k, v, cu, cu, 40, 40, causal, 0.25)
    assert torch.equal(out, want) and lse.shape == (4, T)
    torch.testing.assert_close(lse, want_lse.float())
    do = torch.randn(T, 4, 16, generator=g, dtype=torch.float64)
    got = be.backward(do, q, k, v, want, want_lse, cu, cu, 40, 40, causal, 0.25)
    ref = kernels.ReferenceBackend().backward(
        do, q, k, v, want, want_lse, cu, cu, 40, 40, causal, 0.25
    )
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_flash_attention_4_release_without_the_needed_parameters_is_unavailable(monkeypatch):
    _fake_flash_attn_4(monkeypatch, with_lse=False)
    with pytest.raises(BackendUnavailable, match="takes no .*return_lse"):
        get_backend("flash_attn_4")
