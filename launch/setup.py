"""A training run's set-up, one function per part: the ``auto`` flags resolved, the pricing (the
one cost model), the data and its loader, the model with its techniques, and the optimizer.
:func:`hdp.launch.train.train` calls them in that order.

Note [Recomputing the fewest layers]
------------------------------------
Without ``--activation-checkpointing`` or ``--no-activation-checkpointing``, a run recomputes
nothing where ``--max-seq`` fits the ranks without it. Where it does not, it recomputes the first
``k`` decoder layers only, ``k`` the fewest with which a step plans as it would with all but the
last recomputed: in the same sync mode, and with a rank's share of a step's tokens in as few
waves (:func:`fewest_checkpointed_layers`). Each layer kept whole saves a forward in backward
(about a quarter of its time) and costs memory for its activations: a layer's working set instead
of its input. The cost model prices both (Note [What a layer costs] in :mod:`hdp.compute`, the
memory in ``docs/cost_model.md``). Keeping the last layer whole never costs memory (its
activations are alive only as long as a recomputed layer's would be, and its input need not be
kept), so ``L - 1`` recomputed layers hold the most tokens; below it, fewer recomputed layers
always hold fewer, so a bisection finds ``k``.

The other way to fit keeps attention's output in the recomputed layers (Note [Selective
activation checkpointing] in :mod:`hdp.launch.model`): each recomputes only its dense work, and
holds q, k, v, the output and the LSE besides its input. It needs more layers recomputed, found by
the same bisection, or cannot fit at all. :func:`cheapest_recompute` takes the
cheaper of the two, priced on a rank's wave of the longest sequence: with long sequences the
attention a whole recompute repeats outweighs the dense work of the extra layers.

Worked example, llama-1b (16 layers) on one rank priced as an H100, ``--max-seq 64K
--tokens-per-step 128K``: without recompute a rank holds 33,536 tokens, less than one sequence.
With all 16 layers recomputed it holds 301,568, so a step takes one wave; with 13, 147,712 (one
wave); with 12, 117,120 (two). Recomputing 13 layers whole, the dense work of a step is priced
3.53 s instead of 3.65 s. Keeping attention, 15 layers fit a step in one wave; a layer of a
64K-token sequence then costs 290 ms, against 335 ms recomputed whole, so the run keeps
attention.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hdp import ClusterSpec, CostModel, GPUProfile, ModelSpec, format_size, gpu_preset, plural
from hdp.dataloader import (
    BatchStream,
    DataError,
    HDPDataLoader,
    SyntheticSource,
    load_tokenizer,
    open_source,
)
from hdp.planner import PlanningError, StepPricing, get_strategy
from hdp.planner.dynamic import DynamicOptions

from .attention_backend import (
    forced_attention_backend,
    priced_attention_backend,
    verify_attention_backend,
)
from .config import OptimizerConfig, RunConfig
from .memory import rank_profile
from .model import Llama
from .model_source import ModelSource
from .resume import Resume
from .runtime import shard_model
from .schedule import Schedule


def resolve_auto(
    config: RunConfig, *, spec: ModelSpec, world: int, per_node: int, device: torch.device, log
) -> RunConfig:
    """``config`` with what its ``auto`` defaults resolve to here: the attention backend that
    passed its first-use check (its kernels and its pricing alike), compiled layers on CUDA
    (Note [Compiled layers]), and activation checkpointing where ``--max-seq`` needs it (priced
    with the layers as they will run). Raises ValueError when a forced backend cannot run."""
    backend = verify_attention_backend(
        config.training.attention_backend, spec=spec, device=device, log=log
    )
    compiled = config.training.compile
    if compiled is None:
        compiled = device.type == "cuda"
    config = config.resolved(training={"attention_backend": backend, "compile": compiled})
    if config.training.fused_loss and device.type != "cuda":
        raise ValueError(
            f"--fused-loss runs Liger-Kernel's Triton kernels, on CUDA only, not on "
            f"{device.type}: leave it out"
        )
    given = config.planning.checkpointed_layers
    if given is not None and given > spec.layers:
        raise ValueError(
            f"--checkpointed-layers {given}: {spec.name} has {spec.layers} decoder layers"
        )
    if config.planning.activation_checkpointing is None:
        needed = checkpointing_needed(
            config, spec=spec, world=world, per_node=per_node, device=device
        )
        config = config.resolved(planning={"activation_checkpointing": needed})
        if needed:
            config = cheapest_recompute(
                config, spec=spec, world=world, per_node=per_node, device=device
            )
            layers = config.planning.checkpointed_layers
            kept = " (keeping attention)" if config.planning.keep_attention else ""
            log(
                f"activation checkpointing of {layers} of {spec.layers} layers{kept}: --max-seq "
                f"{config.data.max_seq} and --tokens-per-step "
                f"{format_size(config.data.tokens_per_step or 0)} need it on "
                f"{plural(world, 'rank')} (Note [Recomputing the fewest layers])"
            )
    return config


# Host bytes of one token of a rank's step: its id, label and position (int64 each).
HOST_BYTES_PER_TOKEN = 24


def check_host_memory(config: RunConfig, *, world: int, per_node: int) -> None:
    """ValueError unless a rank's share of a step's tokens, as the host tensors it reads them
    into, fits this machine's memory beside the node's other ranks (``--tokens-per-step 64G``
    on one rank would need 1.5 TB, and run minutes into a MemoryError)."""
    tokens = config.data.tokens_per_step or 0
    need = HOST_BYTES_PER_TOKEN * -(-tokens // world) * min(per_node, world)
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not reported here: nothing to check against
        return
    if need > memory:
        raise ValueError(
            f"--tokens-per-step {format_size(tokens)} on {plural(world, 'rank')}: the node's "
            f"ranks would hold {need / 2**30:,.0f} GiB of token ids, labels and positions, and "
            f"this machine has {memory / 2**30:,.0f} GiB: lower --tokens-per-step or add ranks"
        )


def build_pricing(
    config: RunConfig, *, spec: ModelSpec, world: int, per_node: int, device: torch.device
) -> StepPricing:
    """The pricing of what is trained (``spec``) on what (the ranks; ``--gpu-profile``,
    ``--gpu``, or the preset of the detected device), with the attention kernels that run."""
    if device.type == "cpu" and spec.dtype_bytes != 4:
        spec = replace(spec, dtype_bytes=4)  # fp32 on CPU
    planning = config.planning
    if planning.gpu_profile:
        gpu = GPUProfile.load(planning.gpu_profile)
    else:
        gpu = gpu_preset(planning.gpu or detect_gpu(device))
    gpu = rank_profile(gpu, device=device, local_ranks=per_node)
    cluster = ClusterSpec(world, min(planning.gpus_per_node or per_node, world), gpu)
    pricing = StepPricing.build(
        spec,
        cluster,
        attention_backend=priced_attention_backend(config.training.attention_backend, device, gpu),
        activation_checkpointing=planning.activation_checkpointing,
        checkpointed_layers=planning.checkpointed_layers,
        kept_attention=bool(planning.activation_checkpointing and planning.keep_attention),
        compiled=bool(config.training.compile),
        capacity=planning.capacity,
        sync=planning.sync,
        kv_exchange=planning.kv_exchange,
        own_runtimes=False,  # dist_attn runs every strategy's plans
    )
    return pricing.for_strategy(get_strategy(planning.strategy))


def checkpointing_needed(
    config: RunConfig, *, spec: ModelSpec, world: int, per_node: int, device: torch.device
) -> bool:
    """Whether ``--max-seq`` fits the ranks only with activation checkpointing (the default of
    ``--activation-checkpointing``: off, as it costs a forward, unless memory calls for it)."""
    without = config.resolved(planning={"activation_checkpointing": False})
    pricing = build_pricing(without, spec=spec, world=world, per_node=per_node, device=device)
    try:
        pricing.settle(get_strategy(config.planning.strategy), config.data.max_seq)
    except PlanningError:
        return True
    return False


def fewest_checkpointed_layers(
    config: RunConfig,
    *,
    spec: ModelSpec,
    world: int,
    per_node: int,
    device: torch.device,
    keep_attention: bool = False,
) -> int | None:
    """Note [Recomputing the fewest layers]: the fewest first layers to recompute (keeping
    attention's output where ``keep_attention``) such that a step plans as with all but the last
    fully recomputed (the most tokens a rank holds), in the same sync mode and as few waves;
    ``None`` where keeping attention in all but the last layer does not."""
    strategy = get_strategy(config.planning.strategy)
    share = -(-(config.data.tokens_per_step or 0) // world)  # a rank's tokens of a step
    pricing = build_pricing(config, spec=spec, world=world, per_node=per_node, device=device)

    def settled(layers: int, kept: bool) -> tuple[str, int] | None:
        cost = replace(pricing.cost, checkpointed_layers=layers, kept_attention=kept)
        try:
            _, sync, cap = replace(pricing, cost=cost).settle(strategy, config.data.max_seq)
        except PlanningError:
            return None
        return sync, -(-share // cap)

    most = max(spec.layers - 1, 1)
    every = settled(most, False)
    if every is None:
        return spec.layers  # planning says why once training plans
    # Keeping attention, the last layer recomputed holds its attention besides its working set, so
    # L - 1 layers hold the most tokens there too.
    if settled(most, keep_attention) != every:
        return None
    low, high = -1, most  # settled(high) == every; fewer layers hold fewer tokens
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if settled(mid, keep_attention) == every else (mid, high)
    return high


def cheapest_recompute(
    config: RunConfig, *, spec: ModelSpec, world: int, per_node: int, device: torch.device
) -> RunConfig:
    """``config`` with the cheaper of Note [Recomputing the fewest layers]'s two ways to fit:
    the fewest layers recomputed whole, or the fewest keeping attention's output (more layers,
    each recomputing only its dense work). Both are priced on a rank's wave of the longest
    sequence (its share of that sequence's attention where the sequence does not fit one rank),
    as many tokens for both: what the one holding fewer holds."""

    strategy = get_strategy(config.planning.strategy)
    options = []
    for keep in (False, True):
        layers = fewest_checkpointed_layers(
            config, spec=spec, world=world, per_node=per_node, device=device, keep_attention=keep
        )
        if layers is None:
            continue
        chosen = config.resolved(planning={"checkpointed_layers": layers, "keep_attention": keep})
        pricing = build_pricing(chosen, spec=spec, world=world, per_node=per_node, device=device)
        try:
            cap = pricing.settle(strategy, config.data.max_seq).capacity
        except PlanningError:  # planning says why once training plans
            cap = 0
        options.append((pricing.cost, cap, chosen))
    if len(options) == 1 or min(cap for _, cap, _ in options) == 0:
        return options[0][2]
    # Both priced on the same tokens: what the option holding fewer holds.
    held = min(min(config.data.max_seq, cap) for _, cap, _ in options)
    longest = np.array([config.data.max_seq], dtype=np.float64)

    def layer_s(cost: CostModel) -> float:
        attention = cost.attn_time(np.zeros(1), longest)[0] * held / longest[0]
        return float(attention + cost.compute.layer_time(np.array([float(held)]))[0])

    return min(options, key=lambda option: layer_s(option[0]))[2]


def detect_gpu(device: torch.device) -> str:
    """The GPU preset that prices plans on ``device``: ``cpu`` off the GPU, ``h100`` if unknown."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for key, preset in (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80g")):
        if key in name:
            return (
                "a100-40g"
                if preset == "a100-80g"
                and torch.cuda.get_device_properties(device).total_memory < 50e9
                else preset
            )
    return "h100"


def build_sources(config: RunConfig, source: ModelSource, vocab: int) -> list:
    """The ``--data`` sources (``text`` records read with the model source's tokenizer), or one
    synthetic corpus with a workload's lengths."""
    data = config.data
    if data.paths:
        tok = load_tokenizer(source.tokenizer)
        if source.tokenizer is not None and tok.vocab_size > vocab:
            raise DataError(
                f"tokenizer {source.tokenizer} has {tok.vocab_size} tokens, more than the "
                f"model's vocabulary of {vocab}"
            )
        return [open_source(p, tok, vocab, data.skip_bad_records) for p in data.paths]
    return [SyntheticSource(data.workload or "wlb-128k", data.synthetic_docs, vocab, data.seed)]


def build_data(config: RunConfig, source: ModelSource, *, vocab: int) -> tuple[list, BatchStream]:
    """The sources and the stream of global batches drawn from them."""
    sources = build_sources(config, source, vocab)
    data = config.data
    stream = BatchStream(
        [s.lengths for s in sources],
        data.tokens_per_step,
        data.max_seq,
        seed=data.seed,
        weights=list(data.weights) if data.weights is not None else None,
        truncate=data.truncate,
    )
    return sources, stream


def build_loader(
    config: RunConfig, *, sources: list, stream: BatchStream, pricing: StepPricing
) -> HDPDataLoader:
    """The loader that plans each global batch and hands this rank its shards' tokens. Its plans
    are priced by ``pricing``, what training runs (the attention backend verified, each rank's
    memory, the sync mode the model is built for), so a plan is optimised for the kernels that
    run and the metrics' two predictions come from one model."""
    planning = config.planning
    options = {}
    if planning.strategy == "hdp":
        given = DynamicOptions(
            plan_budget_s=planning.plan_budget, max_ranks_per_seq=planning.max_ranks_per_seq
        )
        options = {"hdp_options": given}
    return HDPDataLoader(
        sources,
        stream,
        pricing.cluster,
        pricing.model,
        planning.strategy,
        plan_ahead=planning.plan_ahead,
        pricing=pricing,
        plan_options=options,
    )


def build_model(
    config: RunConfig,
    *,
    cost: CostModel,
    sync: str,
    device: torch.device,
    source: ModelSource | None = None,
    resume: Resume | None = None,
    log: Callable[[str], None] = print,
) -> Llama:
    """The model on ``device``, with activation checkpointing, compile and FSDP2 as asked: random
    weights (the same on every rank), or, with ``--init-from``, built on the meta device, sharded,
    and filled from the checkpoint's files (Note [Loading a checkpoint into shards] in
    launch/hf_weights.py; not read when a checkpoint of the run is resumed instead). Raises
    :class:`hdp.launch.hf_weights.WeightsError` naming the file and tensor when the checkpoint does
    not fit."""
    checkpoint = source.checkpoint if source is not None else None
    torch.manual_seed(config.data.seed)  # identical initial weights on every rank, sharded below
    with torch.device("meta") if checkpoint is not None else nullcontext():
        model = Llama(
            cost.model,
            activation_checkpointing=bool(config.planning.activation_checkpointing),
            checkpointed_layers=config.planning.checkpointed_layers,
            loss_chunk_tokens=cost.loss_chunk_tokens,
            attention_backend=forced_attention_backend(config.training.attention_backend),
            keep_attention=config.planning.keep_attention,
            fused_loss=config.training.fused_loss,
        )
    if checkpoint is None:
        model.to(device)
    if config.training.compile:
        apply_compile(model)
    if dist.is_initialized() and dist.get_world_size() > 1:  # one rank has nothing to shard
        shard_model(model, sync, mixed_precision=device.type == "cuda")
    if checkpoint is not None:
        model.materialize(device)
        if resume is None:
            t0 = time.perf_counter()
            checkpoint.load_into(model)
            files = len({t.file for t in checkpoint.tensors.values()})
            log(
                f"loaded {checkpoint.directory} ({files} weight files) in "
                f"{time.perf_counter() - t0:.1f} s"
            )
    return model


def apply_compile(model: Llama) -> None:
    """``torch.compile`` each decoder layer around its attention, and the loss (Note [Compiled
    layers])."""
    model.compile_regions()


def build_optimizer(
    flags: OptimizerConfig, *, model: Llama, schedule: Schedule
) -> tuple[Optimizer, LRScheduler]:
    """AdamW (fused on GPUs) and its learning-rate ``schedule``."""
    params = list(model.parameters())
    # One fused kernel per step instead of loops of elementwise kernels, where every parameter
    # lives on a GPU (FSDP2's sharded parameters included); torch's default elsewhere.
    fused = True if params and all(p.is_cuda for p in params) else None
    optimizer = torch.optim.AdamW(
        params, lr=flags.lr, betas=(0.9, 0.95), weight_decay=flags.weight_decay, fused=fused
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
    return optimizer, scheduler


def apply_optimizer_flags(
    flags: OptimizerConfig, optimizer: Optimizer, scheduler: LRScheduler
) -> None:
    """Make this run's flags, not the checkpoint's, set the learning rate and weight decay.

    A checkpoint restores the optimizer's and schedule's saved ``lr``, ``initial_lr`` and
    ``weight_decay``; :func:`hdp.launch.resume.check_setup` refused any change the user did not
    allow, so what is applied here is either the same values or the ones allowed."""
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"] = flags.lr
        group["lr"] = flags.lr * factor
        group["weight_decay"] = flags.weight_decay
    scheduler.base_lrs = [flags.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


__all__ = [
    "apply_compile",
    "apply_optimizer_flags",
    "build_data",
    "build_loader",
    "build_model",
    "build_optimizer",
    "build_pricing",
    "build_sources",
    "checkpointing_needed",
    "cheapest_recompute",
    "detect_gpu",
    "resolve_auto",
]
