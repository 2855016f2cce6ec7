"""The step's memory-bound work where it can be checked on CPU: batch copies,
the optimizer's fused kernel, and selective activation checkpointing."""

import torch

from hdp import model_preset
from hdp.launch.config import OptimizerConfig
from hdp.launch.model import Llama
from hdp.launch.runtime import to_device
from hdp.launch.schedule import Schedule
from hdp.launch.setup import build_optimizer


def test_batch_copies_and_the_optimizer_keep_cpu_runs_as_they_were():
    t = torch.arange(5)
    assert to_device(t, torch.device("cpu")) is t  # no pinning, no copy off the GPU
    model = Llama(model_preset("tiny"))
    flags = OptimizerConfig(lr=1e-3, warmup=1, lr_decay_steps=None, weight_decay=0.1, grad_clip=1)
    optimizer, _ = build_optimizer(flags, model=model, schedule=Schedule(1, 4))
    assert (
        optimizer.param_groups[0]["fused"] is None
    )  # fused only where every parameter is on a GPU


def test_selective_checkpointing_keeps_the_gradients_and_skips_attentions_recompute(
    monkeypatch,
):
    import numpy as np

    from hdp import Plan
    from hdp.attention import kernels
    from hdp.launch.model import AttentionContext

    calls = []

    class Counting(kernels.ReferenceBackend):
        def forward(self, *args):
            calls.append(1)
            return super().forward(*args)

    monkeypatch.setattr(kernels, "_BACKENDS", {"reference": Counting()})
    lens = [30, 45, 9]
    plan = Plan.from_shards(lens, 1, [[[(0, 0, 30), (1, 0, 20), (2, 0, 9), (1, 20, 45)]]])
    order = np.concatenate([np.arange(30), np.arange(20), np.arange(9), np.arange(20, 45)])
    ids = torch.randint(0, 512, (84,), generator=torch.Generator().manual_seed(0))
    pos = torch.from_numpy(order)
    results, forwards = [], []
    for ckpt, keep in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        model = Llama(
            model_preset("tiny"),
            activation_checkpointing=ckpt,
            attention_backend="reference",
            keep_attention=keep,
        ).double()
        calls.clear()
        loss = model(ids, pos, AttentionContext(plan, 0), ids)
        loss.backward()
        forwards.append(len(calls))
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # Per layer, dist_attn's kernel calls (diagonal and local full blocks): once without
    # checkpointing, twice with full checkpointing, once again when attention is kept.
    assert forwards[1] == 2 * forwards[0] and forwards[2] == forwards[0]
