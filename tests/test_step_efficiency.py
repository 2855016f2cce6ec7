"""The step's memory-bound work where it can be checked on CPU: batch copies,
the optimizer's fused kernel, and selective activation checkpointing."""

import pytest
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


def test_the_fused_rms_norm_is_transformers_rms_norm():
    """The CUDA path (torch's fused rms_norm, run here on the CPU) against transformers' order of
    operations, values and gradients; both normalise in at least fp32 (transformers' in fp32
    even for float64 input, hence the float64 tolerance)."""
    from hdp.launch.model import rms_norm

    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 2e-6)):
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(7, 3, 16, generator=g, dtype=torch.float64) * 3).to(dtype)
        w = (torch.randn(16, generator=g, dtype=torch.float64) + 1).to(dtype)
        outs = []
        for fused in (False, True):
            xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            y = rms_norm(xi, wi, 1e-5, fused=fused)
            y.pow(2).sum().backward()
            outs.append((y.detach(), xi.grad, wi.grad))
        for exact, fused in zip(*outs):
            torch.testing.assert_close(fused, exact, rtol=tol, atol=tol)


def test_rope_angles_once_per_pass_rotate_as_transformers_does():
    """cos and sin built once and applied in the tensor's dtype: in float32 bit-for-bit the
    per-call formula; in bfloat16 within bf16's rounding of it."""
    from hdp import RoPE
    from hdp.launch.rope import Rotary

    rotary = Rotary(RoPE(theta=500000.0), 16)
    pos = torch.tensor([0, 1, 2, 700, 3, 0, 9])
    x = torch.randn(7, 3, 16, generator=torch.Generator().manual_seed(1))
    ang = pos.float()[:, None] * rotary.inv_freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    want = torch.cat([x[..., :8] * cos - x[..., 8:] * sin, x[..., :8] * sin + x[..., 8:] * cos], -1)
    angles = rotary.angles(pos)
    assert torch.equal(angles.rotate(x), want)
    got = angles.rotate(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_fused_projections_train_as_the_separate_ones(monkeypatch):
    """The CUDA path's one GEMM for q/k/v and for gate/up (run here on the CPU, float64) against
    each projection on its own: the model's loss and every gradient, with and without biases."""
    import dataclasses

    from hdp import Plan
    from hdp.launch import model as model_module
    from hdp.launch.model import AttentionContext

    separate = model_module.project
    lens = [30, 45]
    plan = Plan.from_shards(lens, 1, [[[(0, 0, 30), (1, 0, 45)]]])
    ids = torch.randint(0, 512, (75,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(30), torch.arange(45)])
    for bias in (False, True):  # Llama; Qwen2's q/k/v and a biased MLP
        spec = dataclasses.replace(model_preset("tiny"), qkv_bias=bias, mlp_bias=bias)
        results = []
        for fused in (False, True):
            monkeypatch.setattr(
                model_module,
                "project",
                lambda x, lin, fused_=fused, **_: separate(x, lin, fused=fused_),
            )
            torch.manual_seed(0)
            model = Llama(spec, attention_backend="reference").double()
            for p in model.parameters():  # biases away from zero, so they count
                torch.nn.init.normal_(p, std=0.05)
            loss = model(ids, pos, AttentionContext(plan, 0), ids)
            loss.backward()
            results.append([loss.detach()] + [p.grad for p in model.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)


def test_compiled_layers_train_as_eager_ones_and_compile_once_for_any_length():
    """``--compile``'s regions around attention and its chunked loss (traced by torch's aot_eager
    backend here: the graph breaks and the decomposition are ours to check, the code generation
    is torch's), with full and selective checkpointing: the eager model's loss and gradients,
    and a wave of another length reuses the graphs."""
    from torch._dynamo.utils import counters

    from hdp import Plan
    from hdp.launch.model import AttentionContext

    def batch(lens):
        plan = Plan.from_shards(lens, 1, [[[(i, 0, n) for i, n in enumerate(lens)]]])
        ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(n) for n in lens])
        return ids, pos, AttentionContext(plan, 0), ids

    torch._dynamo.reset()
    for keep in (False, True):
        results = []
        for compiled in (False, True):
            torch.manual_seed(0)
            model = Llama(
                model_preset("tiny"),
                activation_checkpointing=True,
                attention_backend="reference",
                keep_attention=keep,
                loss_chunk_tokens=32,  # the loss in chunks, each compiled
            )
            if compiled:
                model.compile_regions(backend="aot_eager")
            loss = model(*batch([30, 45, 9]))
            loss.backward()
            results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
            if compiled:
                frames = counters["frames"]["ok"]
                model(*batch([70, 13])).backward()
                assert counters["frames"]["ok"] == frames  # no new graph for new lengths
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_recomputing_the_first_layers_only_keeps_the_gradients():
    """``checkpointed_layers=k``: the loss and gradients of the model without recompute
    (float64), and attention runs again in backward for those k layers only."""
    from hdp import Plan
    from hdp.attention import kernels
    from hdp.launch.model import AttentionContext

    calls = []

    class Counting(kernels.ReferenceBackend):
        def forward(self, *args):
            calls.append(1)
            return super().forward(*args)

    spec = model_preset("tiny")
    plan = Plan.from_shards([40, 21], 1, [[[(0, 0, 40), (1, 0, 21)]]])
    ids = torch.randint(0, 512, (61,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(40), torch.arange(21)])
    results, forwards = [], []
    for ckpt, layers in ((False, None), (True, 1), (True, spec.layers - 1), (True, None)):
        torch.manual_seed(0)
        model = Llama(
            spec,
            activation_checkpointing=ckpt,
            checkpointed_layers=layers,
            attention_backend="reference",
        ).double()
        original = kernels._BACKENDS
        kernels._BACKENDS = {"reference": Counting()}
        try:
            calls.clear()
            loss = model(ids, pos, AttentionContext(plan, 0), ids)
            loss.backward()
        finally:
            kernels._BACKENDS = original
        forwards.append(len(calls))
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)
    per_layer = forwards[0] // spec.layers
    assert forwards[1:] == [forwards[0] + per_layer * k for k in (1, spec.layers - 1, spec.layers)]


def test_the_fewest_recomputed_layers_are_those_a_scan_finds():
    """The bisection of Note [Recomputing the fewest layers] against a scan of every layer
    count: the fewest from which on, up to L - 1, every count plans as L - 1 does; and a step
    that L - 1 holds in fewer waves than L (llama-1b on one rank, 302K tokens) takes L - 1's."""
    from hdp.launch.config import DataConfig, PlanningConfig, RunConfig, TrainingConfig, checked
    from hdp.launch.setup import build_pricing, fewest_checkpointed_layers
    from hdp.planner import PlanningError, get_strategy

    spec = model_preset("llama-1b")
    device = torch.device("cuda", 0)  # priced as the --gpu preset; nothing runs on it
    cases = ((64, 128, 1), (64, 1024, 4), (256, 512, 8), (16, 64, 2), (64, 302, 1), (128, 128, 1))
    cases += ((144, 144, 1),)  # keeping attention fits with L - 1 layers, not with L
    for max_seq, tokens, world in cases:
        config = checked(
            RunConfig(
                data=DataConfig(max_seq=max_seq << 10, tokens_per_step=tokens << 10),
                training=TrainingConfig(attention_backend="torch_flash"),
                planning=PlanningConfig(gpu="h100", activation_checkpointing=True),
            )
        )

        def outcome(k, config=config, world=world):
            with_k = config.resolved(planning={"checkpointed_layers": k})
            pricing = build_pricing(with_k, spec=spec, world=world, per_node=world, device=device)
            try:
                settled = pricing.settle(get_strategy("hdp"), config.data.max_seq)
            except PlanningError:
                return None
            share = -(-config.data.tokens_per_step // world)
            return settled.sync, -(-share // settled.capacity)

        most = spec.layers - 1
        every = outcome(most)
        assert every[1] <= outcome(spec.layers)[1]  # never more waves than recomputing all
        scan = min(
            k for k in range(most + 1) if all(outcome(j) == every for j in range(k, most + 1))
        )
        found = fewest_checkpointed_layers(
            config, spec=spec, world=world, per_node=world, device=device
        )
        assert found == scan, (max_seq, tokens, world)
        # Keeping attention: the same, where L - 1 layers keeping it plan as L - 1 recomputed whole.
        kept = config.resolved(planning={"keep_attention": True})
        scan = [
            k for k in range(most + 1) if all(outcome(j, kept) == every for j in range(k, most + 1))
        ]
        found = fewest_checkpointed_layers(
            config, spec=spec, world=world, per_node=world, device=device, keep_attention=True
        )
        assert found == (min(scan) if scan else None), (max_seq, tokens, world)


def test_kept_attention_costs_the_memory_dist_attn_saves():
    """With attention kept, what autograd saves outside the checkpointed regions grows by
    dist_attn's q, k, v, output and LSE: per token and layer, the cost model's difference
    between keeping attention and recomputing it whole."""
    from dataclasses import replace

    import numpy as np

    from hdp import ClusterSpec, CostModel, Plan, gpu_preset
    from hdp.launch.model import AttentionContext

    spec = replace(model_preset("tiny"), dtype_bytes=4)  # fp32 on the CPU
    lens = [30, 45, 9]
    plan = Plan.from_shards(lens, 1, [[[(i, 0, n) for i, n in enumerate(lens)]]])
    ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])
    saved = []
    for keep in (False, True):
        model = Llama(spec, activation_checkpointing=True, keep_attention=keep)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t, storages=storages, params=params):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, pos, AttentionContext(plan, 0), ids)
        saved.append(sum(storages.values()))
    gpu = replace(gpu_preset("h100"), activation_memory_scale=1.0)
    per_token = [
        CostModel(spec, ClusterSpec(1, 1, gpu), kept_attention=keep).ckpt_bytes_per_token
        for keep in (False, True)
    ]
    assert saved[1] - saved[0] == np.float64(per_token[1] - per_token[0]) * sum(lens)


def _kept_bytes_rank(rank: int, world: int, plan_json: str) -> None:
    """On each rank of a head-parallel plan: what autograd saves outside the checkpointed
    regions grows, with attention kept, by the cost model's kept bytes in ``ulysses``
    exchange."""
    from dataclasses import replace

    from hdp import ClusterSpec, CostModel, Plan, gpu_preset
    from hdp.launch.model import AttentionContext

    plan = Plan.from_json(plan_json)
    spec = replace(model_preset("tiny"), dtype_bytes=4)
    mine = plan.rank == rank
    ids = torch.randint(
        0, 512, (int(plan.seq_lens.sum()),), generator=torch.Generator().manual_seed(0)
    )
    pos = torch.cat(
        [torch.arange(int(a), int(b)) for a, b in zip(plan.start[mine], plan.end[mine])]
    )
    local = ids[: pos.numel()]
    saved = []
    for keep in (False, True):
        torch.manual_seed(0)
        model = Llama(spec, activation_checkpointing=True, keep_attention=keep)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t, storages=storages, params=params):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(local, pos, AttentionContext(plan, 0), local)
        saved.append(sum(storages.values()))
    gpu = replace(gpu_preset("h100"), activation_memory_scale=1.0)
    cluster = ClusterSpec(world, world, gpu)
    per_token = [
        CostModel(spec, cluster, kv_exchange="ulysses", kept_attention=keep).ckpt_bytes_per_token
        for keep in (False, True)
    ]
    assert saved[1] - saved[0] == (per_token[1] - per_token[0]) * pos.numel()


def test_kept_attention_costs_what_head_parallel_members_save():
    """A sequence on two head-parallel ranks: each member keeps its own output besides the one
    its layer keeps, as the cost model counts in ``ulysses`` exchange."""
    from hdp import Plan
    from hdp.testing.ranks import run_ranks

    plan = Plan.from_shards([48], 2, [[[(0, 0, 24)], [(0, 24, 48)]]]).with_exchange("ulysses")
    run_ranks(_kept_bytes_rank, 2, plan.to_json())


def test_offloaded_layers_copy_what_the_cost_model_prices(monkeypatch):
    """Every layer offloaded (``AttentionContext.offload`` 1): the bytes its saved tensors copy
    to the host, counted at each copy as ``save_on_cpu`` makes them, are the cost model's
    offloaded bytes per token and layer, with attention kept or recomputed whole."""
    from contextlib import contextmanager
    from dataclasses import replace

    from hdp import ClusterSpec, CostModel, Plan, gpu_preset
    from hdp.launch.model import AttentionContext

    copied = []

    @contextmanager
    def counting_save_on_cpu(pin_memory=False):
        def pack(t):
            copied.append(t.untyped_storage().nbytes() if t.dim() else 0)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", counting_save_on_cpu)
    spec = replace(model_preset("tiny"), dtype_bytes=4)  # fp32 on the CPU
    lens = [30, 45, 9]
    plan = Plan.from_shards(lens, 1, [[[(i, 0, n) for i, n in enumerate(lens)]]])
    ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])
    gpu = replace(gpu_preset("h100"), activation_memory_scale=1.0)
    for keep in (False, True):
        model = Llama(spec, activation_checkpointing=True, keep_attention=keep)
        copied.clear()
        model(ids, pos, AttentionContext(plan, 0, offload=1.0), ids)
        cost = CostModel(spec, ClusterSpec(1, 1, gpu), kept_attention=keep)
        assert sum(copied) == cost.offloaded_bytes_per_token * sum(lens), keep


def _liger_stand_in(monkeypatch):
    """``liger_kernel.transformers.functional`` with the package's parameter names (no
    ``**kwargs``), computing the cross-entropy of the full logits."""
    import sys
    import types

    import torch.nn.functional as F

    def liger_fused_linear_cross_entropy(
        input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
        lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
        return_z_loss=False, accum_dtype=None,
    ):  # fmt: skip
        logits = F.linear(input, weight).float()
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)


def test_the_fused_loss_is_called_as_liger_kernel_takes_it(monkeypatch):
    """``--fused-loss``'s wiring (labels, the ignored index, the sum, the token-less pass) against
    the chunked loss, float64 on the CPU through a stand-in with Liger-Kernel's parameter names."""
    from hdp import Plan
    from hdp.dataloader import IGNORE_INDEX
    from hdp.launch.model import AttentionContext

    _liger_stand_in(monkeypatch)
    plan = Plan.from_shards([40, 21], 1, [[[(0, 0, 40), (1, 0, 21)]]])
    ids = torch.randint(0, 512, (61,), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[[0, 39, 60]] = IGNORE_INDEX
    pos = torch.cat([torch.arange(40), torch.arange(21)])
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = Llama(
            model_preset("tiny"), attention_backend="reference", loss_chunk_tokens=16,
            fused_loss=fused,
        ).double()  # fmt: skip
        loss = model(ids, pos, AttentionContext(plan, 0), labels)
        empty = torch.zeros(0, dtype=torch.int64)
        (loss + model(empty, empty, AttentionContext(None, -1), empty)).backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):  # both losses in fp32: summed in chunks, or at once
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_liger_kernels_fused_loss_matches_the_chunked_loss_on_a_gpu():
    pytest.importorskip("liger_kernel", reason="liger-kernel not installed")
    from hdp.launch.model import token_loss_sum

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(5000, 256, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(32000, 256, device="cuda", generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, 32000, (5000,), device="cuda", generator=g)
    results = []
    for fused in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused:
                from hdp.launch.model import fused_token_loss_sum

                loss = fused_token_loss_sum(h, w, labels)
            else:
                loss = token_loss_sum(torch.nn.functional.linear(h, w).float(), labels)
        loss.backward()
        results.append((loss.detach(), h.grad.clone(), w.grad.clone()))
        h.grad = w.grad = None
    for a, b in zip(*results):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)
