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
_spec = importlib.util.spec_from_file_location("plain_loop", ROOT / "scripts" / "plain_loop.py")
plain_loop = importlib.util.module_from_spec(_spec)
sys.modules["plain_loop"] = plain_loop  # its dataclass looks its module up
_spec.loader.exec_module(plain_loop)


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
