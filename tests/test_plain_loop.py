"""scripts/plain_loop.py on CPU: hdp's model with one varlen call per layer, a short run, and the
comparison with an hdp metrics file."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

from hdp import Plan, model_preset
from hdp.launch.model import AttentionContext, Llama

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    """``scripts/NAME.py`` as the module ``name``, as it imports when run from scripts/ (its
    dataclasses look their module up; plain_loop imports its sibling minimal_llama)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


minimal_llama = _script("minimal_llama")
plain_loop = _script("plain_loop")


def test_the_plain_model_is_hdps_model():
    """Same weights, same batch: the plain loop's model gives hdp's loss and gradients."""
    from hdp.attention import get_backend

    lens = [37, 64, 5]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lens]))
    plan = Plan.from_shards(lens, 1, [[[(s, 0, n) for s, n in enumerate(lens)]]])
    spec = model_preset("tiny")
    results = []
    for plain in (True, False):
        torch.manual_seed(0)
        if plain:
            model = plain_loop.plain_model(spec, get_backend("reference"), 4096).double()
            ctx = plain_loop.Packed(cu, max(lens))
        else:
            model = Llama(spec, activation_checkpointing=True).double()
            ctx = AttentionContext(plan, 0)
        loss = model(ids, pos, ctx, ids)
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_minimal_model_computes_hdps_function():
    """The torch-only yardstick is the same decoder: with hdp's weights laid out in its fused
    projections, its loss and gradients equal hdp's (float64 weights, default RoPE; both take
    the cross-entropy of fp32 logits, which bounds the agreement)."""
    lens = [37, 64, 5]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lens]))
    spec = model_preset("tiny")
    torch.manual_seed(0)
    ref = Llama(spec).double()
    mini = plain_loop.minimal_model(spec).double()
    with torch.no_grad():
        mini.embed.weight.copy_(ref.embed.weight)
        mini.norm.weight.copy_(ref.norm.weight)
        mini.head.weight.copy_(ref.lm_head.weight)
        for block, layer in zip(mini.blocks, ref.layers):
            a, mlp = layer.attn, layer.mlp
            block.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            block.o.weight.copy_(a.o_proj.weight)
            block.attn_norm.weight.copy_(layer.attn_norm.weight)
            block.mlp_norm.weight.copy_(layer.mlp_norm.weight)
            block.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            block.down.weight.copy_(mlp.down_proj.weight)
    plan = Plan.from_shards(lens, 1, [[[(s, 0, n) for s, n in enumerate(lens)]]])
    want = ref(ids, pos, AttentionContext(plan, 0), ids)
    got = mini(ids, pos, plain_loop.Packed(cu, max(lens)), ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    want.backward()
    got.backward()
    layer, block = ref.layers[0], mini.blocks[0]
    q_rows = layer.attn.q_proj.weight.shape[0]
    for mine, theirs in (
        (mini.embed.weight.grad, ref.embed.weight.grad),
        (block.down.weight.grad, layer.mlp.down_proj.weight.grad),
        (block.qkv.weight.grad[:q_rows], layer.attn.q_proj.weight.grad),
    ):
        assert (mine - theirs).norm() <= 1e-5 * theirs.norm()


def test_a_short_cpu_run_of_the_minimal_loop(capsys):
    argv = ["--device", "cpu", "--model", "tiny", "--max-seq", "256", "--tokens-per-step", "512"]
    argv += ["--steps", "1", "--synthetic-docs", "50", "--impl", "minimal"]
    assert plain_loop.main(argv) == 0
    out = capsys.readouterr().out
    assert "plain loop (minimal)" in out and "minimal loop:" in out


def test_a_short_cpu_run_prints_tokens_per_second_and_mfu(tmp_path, capsys):
    metrics = tmp_path / "hdp.jsonl"
    rows = [{"step": i, "tokens": 1000, "tokens_per_s": 500.0, "mfu": 0.01} for i in (1, 2, 3)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--device", "cpu", "--model", "tiny", "--max-seq", "256", "--tokens-per-step", "512"]
    argv += ["--steps", "1", "--synthetic-docs", "50", "--compare", str(metrics)]
    assert plain_loop.main(argv) == 0
    out = capsys.readouterr().out
    assert "attention reference, fp32" in out and "step     1  loss" in out
    assert "plain loop: " in out and "MFU" in out
    assert "hdp:                500 tokens/s  MFU  1.00%  (steps 3-3)" in out
    assert "hdp / plain:" in out


def test_a_forced_gpu_backend_on_cpu_is_one_line(capsys):
    argv = ["--device", "cpu", "--model", "tiny", "--attention-backend", "torch_flash"]
    assert plain_loop.main(argv + ["--max-seq", "256", "--tokens-per-step", "512"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "runs on CUDA in fp16/bf16" in err
