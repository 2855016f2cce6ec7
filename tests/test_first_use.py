"""The first-use check of attention kernels: a backend that returns wrong values (or fails) is
never trained on unless forced, on CPU with fake backends standing in for the GPU kernels."""

import pytest
import torch

from hdp.attention import first_use, kernels
from hdp.attention.kernels import ReferenceBackend

CPU, FP32 = torch.device("cpu"), torch.float32
SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16}


class Named(ReferenceBackend):
    """The reference's values under another name: a GPU kernel that works."""

    def __init__(self, name: str):
        self.name = name


class WrongGradients(Named):
    """Forward right, dK half of what it should be: only the backward check catches it."""

    def backward(self, *args):
        dq, dk, dv = super().backward(*args)
        return dq, dk * 0.5, dv


class NanOnCausal(Named):
    """NaN where a document is causal, right elsewhere: a NaN must not be outweighed by the
    later, correct shard call."""

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, lse = super().forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        return (out * float("nan"), lse) if causal else (out, lse)


class Raises(Named):
    def forward(self, *args):
        raise RuntimeError("head_dim 96 is not supported")


@pytest.fixture
def fakes(monkeypatch):
    """The GPU backends are fakes on the CPU, tried in ``BACKEND_NAMES`` order."""
    installed = {}
    monkeypatch.setattr(kernels, "_BACKENDS", installed)
    monkeypatch.setattr(first_use, "_checked", {})
    monkeypatch.setattr(
        first_use, "candidate_names", lambda device, dtype: [*installed, "reference"]
    )
    return installed


def test_a_backend_with_wrong_gradients_is_passed_over_with_one_line(fakes):
    fakes.update(flash_attn=WrongGradients("flash_attn"), torch_flash=Named("torch_flash"))
    lines = []
    assert first_use.verified_backend(None, CPU, FP32, **SHAPE, log=lines.append) == "torch_flash"
    assert len(lines) == 1
    assert lines[0].startswith("warning: attention backend flash_attn failed its first-use check")
    assert "dK of the causal call is off by 0.5 of the largest reference value" in lines[0]


def test_a_backend_that_raises_is_passed_over_and_the_reference_closes_the_list(fakes):
    fakes.update(flash_attn=Raises("flash_attn"), cudnn=WrongGradients("cudnn"))
    lines = []
    assert first_use.verified_backend(None, CPU, FP32, **SHAPE, log=lines.append) == "reference"
    assert "it raised RuntimeError: head_dim 96 is not supported" in lines[0]
    assert "backend cudnn failed" in lines[1] and len(lines) == 2


def test_a_correct_backend_passes_silently_and_is_checked_once(fakes, monkeypatch):
    fakes.update(cudnn=Named("cudnn"))
    calls = []
    compare = first_use._compare
    monkeypatch.setattr(first_use, "_compare", lambda *a: calls.append(a) or compare(*a))
    for _ in range(3):
        assert first_use.verified_backend(None, CPU, FP32, **SHAPE, log=pytest.fail) == "cudnn"
    assert len(calls) == 1


def test_a_forced_backend_is_kept_with_a_warning(fakes, monkeypatch):
    fakes.update(cudnn=WrongGradients("cudnn"))
    monkeypatch.setattr(first_use, "resolve_backend", lambda name, device, dtype: fakes[name])
    lines = []
    assert first_use.verified_backend("cudnn", CPU, FP32, **SHAPE, log=lines.append) == "cudnn"
    assert lines[0].startswith("warning: attention backend cudnn differs from the reference")
    assert lines[0].endswith("used anyway, as --attention-backend asks")


def test_training_runs_on_the_backend_that_passed(fakes, tmp_path, capsys):
    from hdp.launch.cli import parse_config
    from hdp.launch.train import train

    fakes.update(flash_attn=WrongGradients("flash_attn"), cudnn=Named("cudnn"))
    args = parse_config(
        ["--model", "tiny", "--tokens-per-step", "2K", "--max-seq", "1K", "--steps", "1"]
    )
    assert train(args, rank=0, world=1, per_node=1, device=CPU) == 0
    out = capsys.readouterr().out
    assert out.count("first-use check") == 1 and "attention backend flash_attn failed" in out
    assert "done: steps 1-1" in out


def test_a_backend_with_nan_in_one_call_fails(fakes):
    fakes.update(cudnn=NanOnCausal("cudnn"))
    lines = []
    assert first_use.verified_backend(None, CPU, FP32, **SHAPE, log=lines.append) == "reference"
    assert "output of the causal call is not finite" in lines[0]
