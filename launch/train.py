"""The training loop, read top to bottom in :func:`train`.

Set-up is one function per part: the pricing (the one cost model), the data, the loader, the
model with its techniques, the optimizer, and the restore of a checkpoint (``build_*`` and
:func:`restore`).
Each step runs :func:`train_step` and gathers what the ranks measured (:mod:`launch.metrics`).
Then it writes one metrics record and checkpoints when due.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from attention import COMM
from dataloader import (
    BatchStream,
    DataError,
    HDPDataLoader,
    SyntheticSource,
    load_tokenizer,
    open_source,
)
from dataloader.loader import StepData
from hdp import ClusterSpec, CostModel, GPUProfile, ModelSpec, gpu_preset, plural
from planner import PlanningError, StepPricing, get_strategy

from . import checkpoint
from .attention_backend import (
    forced_attention_backend,
    priced_attention_backend,
    verify_attention_backend,
)
from .checkpoint import CheckpointError
from .loggers import Loggers, NoLoggers
from .memory import PeakMemory, rank_profile
from .metrics import (
    Heartbeat,
    Predicted,
    data_line,
    first_step_line,
    gather_stats,
    metrics_record,
    predict,
    step_line,
)
from .model import Llama
from .model_source import ModelSource, model_source
from .resume import Resume, find_resume, fingerprint
from .runtime import StepResult, run_waves, shard_model
from .schedule import Schedule, run_schedule
from .stopping import StopOnSignal, Stopped


@dataclass
class Totals:
    """What the run has counted since step 0, resumes included: tokens trained, and tokens
    ``--truncate`` cut from the documents trained (the metrics rows' ``truncated_tokens`` sum)."""

    trained_tokens: int = 0
    truncated_tokens: int = 0
    skipped_updates: int = 0  # steps whose update ``--nan-policy skip`` dropped


@dataclass
class Run:
    """Everything the step loop uses, built by :func:`train`."""

    args: object
    rank: int
    world: int
    device: torch.device
    cost: CostModel
    hf_files: dict[str, bytes]  # a checkpoint's hf/ folder (:meth:`ModelSource.hf_files`)
    sources: list
    loader: HDPDataLoader
    model: Llama
    optimizer: Optimizer
    scheduler: LRScheduler
    schedule: Schedule
    setup: dict  # the fingerprint saved with each checkpoint
    totals: Totals
    log: Callable[[str], None]
    memory: PeakMemory
    stop: StopOnSignal


def train(args, *, rank: int, world: int, per_node: int, device: torch.device) -> int:
    """Train as the flags of ``pretrain.py`` say. Returns the exit code: 0 (also when stopped by
    a signal, with the step in hand saved), 2 for a bad setup, 3 for a non-finite step."""
    with StopOnSignal(args.exit_signal, rank=rank, device=device) as stop:
        return _train(args, rank=rank, world=world, per_node=per_node, device=device, stop=stop)


def _train(
    args, *, rank: int, world: int, per_node: int, device: torch.device, stop: StopOnSignal
) -> int:
    log = rank0_log(rank)
    memory = PeakMemory(device)  # before anything big is built
    try:
        source = model_source(args)
        args = resolve_auto(
            args, spec=source.spec, world=world, per_node=per_node, device=device, log=log
        )
    except ValueError as e:
        log(f"pretrain.py: error: {e}")
        return 2
    pricing = build_pricing(args, spec=source.spec, world=world, per_node=per_node, device=device)
    cost, spec, cluster = pricing.cost, pricing.model, pricing.cluster
    try:
        # Every step plans in the sync mode the model is built for, the one --max-seq needs.
        _, sync, cap = pricing.settle(get_strategy(args.strategy), args.max_seq)
        pricing = replace(pricing, sync=sync)
        sources, stream = build_data(args, source, vocab=spec.vocab)
        setup = fingerprint(args, sources, vocab=spec.vocab, model=source.fingerprint())
        resume = find_resume(args, setup, log)
        model = build_model(
            args, cost=cost, sync=sync, device=device, source=source, resume=resume, log=log
        )
    except (PlanningError, DataError, ValueError, CheckpointError) as e:
        log(f"pretrain.py: error: {e}")
        return 2
    loader = build_loader(args, sources=sources, stream=stream, pricing=pricing)
    schedule = run_schedule(args, resume.schedule if resume else None, log)
    optimizer, scheduler = build_optimizer(args, model=model, schedule=schedule)
    run = Run(
        args,
        rank,
        world,
        device,
        cost,
        source.hf_files(args.max_seq),
        sources,
        loader,
        model,
        optimizer,
        scheduler,
        schedule,
        setup,
        Totals(),
        log,
        memory,
        stop,
    )
    start = restore(run, resume)
    params = sum(p.numel() for p in model.parameters())
    log(
        f"{spec.name} ({spec.architecture}, RoPE {spec.rope.describe()}): "
        f"{params / 1e6:.1f}M parameters on {world} x {device.type} "
        f"({cluster.gpu.name} profile), {sync} sync, capacity {cap} tokens per rank per wave, "
        f"strategy {args.strategy}, {args.tokens_per_step} tokens/step, max_seq {args.max_seq}"
    )
    log(data_line(sources, args.max_seq))
    loggers = Loggers(args, start, setup, log) if rank == 0 else NoLoggers()
    t_run = time.perf_counter()
    try:
        stopped = run_steps(run, start, loggers, t_run)
    except CheckpointError as e:
        log(f"pretrain.py: error: {e}")
        return 2
    except Diverged as e:
        log(f"pretrain.py: error: {e}")
        return 3
    finally:
        loader.close()
        loggers.close()
    seconds = time.perf_counter() - t_run
    log(stopped.line(args.checkpoint_dir) if stopped else done_line(run, start, seconds))
    return 0


def resolve_auto(
    args, *, spec: ModelSpec, world: int, per_node: int, device: torch.device, log
) -> argparse.Namespace:
    """The flags with what their ``auto`` defaults resolve to here: the attention backend that
    passed its first-use check (its kernels and its pricing alike), and activation checkpointing
    where ``--max-seq`` needs it. Raises ValueError when a forced backend cannot run."""
    backend = verify_attention_backend(args, spec=spec, device=device, log=log)
    args = argparse.Namespace(**{**vars(args), "attention_backend": backend})
    if args.activation_checkpointing is None:
        args.activation_checkpointing = checkpointing_needed(
            args, spec=spec, world=world, per_node=per_node, device=device
        )
        if args.activation_checkpointing:
            log(
                f"activation checkpointing on: --max-seq {args.max_seq} needs it on "
                f"{plural(world, 'rank')}"
            )
    return args


def done_line(run: Run, start: int, seconds: float) -> str:
    """The run's last line: its steps and time, and the token accounting of all its steps
    (resumes included): read = trained + skipped in sources, and what was truncated."""
    t, sources = run.totals, run.sources
    return (
        f"done: steps {start + 1}-{run.args.steps} in {seconds:.1f} s; "
        f"tokens trained {t.trained_tokens:,} (all steps), "
        f"skipped in sources {sum(s.skipped_tokens for s in sources):,} "
        f"({sum(s.skipped_documents for s in sources):,} documents), "
        f"truncated {t.truncated_tokens:,}"
        + (f"; updates skipped (non-finite) {t.skipped_updates}" if t.skipped_updates else "")
    )


def run_steps(run: Run, start: int, loggers: Loggers, t_run: float) -> Stopped | None:
    """Steps ``start + 1`` to ``--steps``: train, measure, log, checkpoint when due; after each
    step, stop with it saved when some rank received an exit signal. ``t_run``: when the run's
    steps began (``time.perf_counter``), for the ETA."""
    args, cost, totals = run.args, run.cost, run.totals
    autocast = torch.bfloat16 if run.device.type == "cuda" else None
    kill_at = kill_point()
    received = run.stop.agreed()  # during set-up: nothing trained, nothing to save
    if received:
        return Stopped(received, start, saved=False, before_training=True)
    for step_idx in range(start, args.steps):
        t0 = time.perf_counter()
        data = next(run.loader)
        if step_idx == start and run.rank == 0:
            run.log(first_step_line(cost, data, step_idx + 1))
        predicted_s = data.plan.predicted.get("step_time_s", 0.0)
        lr = run.scheduler.get_last_lr()[0]  # the rate this step trains at
        with Heartbeat(run.log, step_idx + 1, predicted_s) if run.rank == 0 else nullcontext():
            res, grad_norm, stepped = train_step(
                data,
                model=run.model,
                optimizer=run.optimizer,
                scheduler=run.scheduler,
                grad_clip=args.grad_clip,
                autocast=autocast,
                kill=kill_at == (run.rank, step_idx + 1),
                memory=run.memory,
            )
        totals.skipped_updates += not stepped
        step_time = time.perf_counter() - t0
        stats = gather_stats(res, world=run.world, device=run.device, memory=run.memory)
        totals.trained_tokens += data.tokens
        totals.truncated_tokens += data.truncated_tokens
        peak = step_time * run.world * cost.cluster.gpu.peak_flops
        record = metrics_record(
            data,
            res,
            step=step_idx + 1,
            step_time=step_time,
            stats=stats,
            lr=lr,
            grad_norm=grad_norm,
            update_skipped=not stepped,
            skipped_updates=totals.skipped_updates,
            mfu=cost.model_flops(data.plan.seq_lens) / peak,
            trained=totals.trained_tokens,
            predicted=predict(cost, data) if run.rank == 0 else Predicted([], [], []),
            vocab=cost.model.vocab,
        )
        loggers.write(record)
        if (step_idx + 1) % args.log_every == 0 or not stepped:
            done, elapsed = step_idx + 1 - start, time.perf_counter() - t_run
            run.log(
                step_line(record, data, elapsed=elapsed, left=args.steps - start - done, done=done)
            )
        if not stepped and args.nan_policy == "stop":
            raise Diverged(nonfinite_line(run, res, grad_norm, step_idx + 1))
        step = step_idx + 1
        received = run.stop.agreed() if step < args.steps else None
        if checkpoint_due(args, step) or (received and args.checkpoint_dir):
            save_checkpoint(run, step)
        if received:
            return Stopped(received, step, saved=bool(args.checkpoint_dir))
    return None


def save_checkpoint(run: Run, step: int) -> None:
    """Checkpoint after ``step``, with the data position, the totals and the setup; one line
    saying where, how large and how long it took."""
    t0 = time.perf_counter()
    state = {
        "data": run.loader.sync_state(),
        "accounting": asdict(run.totals),
        "schedule": asdict(run.schedule),
        "fingerprint": run.setup,
    }
    path = checkpoint.save(
        run.args.checkpoint_dir,
        step,
        run.model,
        run.optimizer,
        run.scheduler,
        state,
        files=run.hf_files,
    )
    if run.rank == 0:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        run.log(f"saved {path} ({size / 1e6:,.1f} MB) in {time.perf_counter() - t0:.1f} s")


def build_pricing(
    args, *, spec: ModelSpec, world: int, per_node: int, device: torch.device
) -> StepPricing:
    """The pricing of what is trained (``spec``) on what (the ranks; ``--gpu-profile``,
    ``--gpu``, or the preset of the detected device), with the attention kernels that run."""
    if device.type == "cpu" and spec.dtype_bytes != 4:
        spec = replace(spec, dtype_bytes=4)  # fp32 on CPU
    if args.gpu_profile:
        gpu = GPUProfile.load(args.gpu_profile)
    else:
        gpu = gpu_preset(args.gpu or detect_gpu(device))
    gpu = rank_profile(gpu, device=device, local_ranks=per_node)
    cluster = ClusterSpec(world, min(args.gpus_per_node or per_node, world), gpu)
    return StepPricing.build(
        spec,
        cluster,
        attention_backend=priced_attention_backend(args, device, gpu),
        activation_checkpointing=args.activation_checkpointing,
        capacity=args.capacity,
        sync=args.sync,
        # dist_attn runs P2P exchanges: flexsp's placement runs with rank exchange.
        kv_exchange=args.kv_exchange if args.strategy == "hdp" else "rank",
    )


def checkpointing_needed(
    args, *, spec: ModelSpec, world: int, per_node: int, device: torch.device
) -> bool:
    """Whether ``--max-seq`` fits the ranks only with activation checkpointing (the default of
    ``--activation-checkpointing``: off, as it costs a forward, unless memory calls for it)."""
    without = argparse.Namespace(**{**vars(args), "activation_checkpointing": False})
    pricing = build_pricing(without, spec=spec, world=world, per_node=per_node, device=device)
    try:
        pricing.settle(get_strategy(args.strategy), args.max_seq)
    except PlanningError:
        return True
    return False


def rank0_log(rank: int) -> Callable[[str], None]:
    """A ``print`` that only rank 0 does, flushed so torchrun's output interleaves in order."""

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    return log


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


def build_sources(args, source: ModelSource, vocab: int) -> list:
    """The ``--data`` sources (``text`` records read with the model source's tokenizer), or one
    synthetic corpus with a workload's lengths."""
    if args.data:
        tok = load_tokenizer(source.tokenizer)
        if source.tokenizer is not None and tok.vocab_size > vocab:
            raise DataError(
                f"tokenizer {source.tokenizer} has {tok.vocab_size} tokens, more than the "
                f"model's vocabulary of {vocab}"
            )
        return [open_source(p, tok, vocab, args.skip_bad_records) for p in args.data]
    return [SyntheticSource(args.workload or "wlb-128k", args.synthetic_docs, vocab, args.seed)]


def build_data(args, source: ModelSource, *, vocab: int) -> tuple[list, BatchStream]:
    """The sources and the stream of global batches drawn from them."""
    sources = build_sources(args, source, vocab)
    stream = BatchStream(
        [s.lengths for s in sources],
        args.tokens_per_step,
        args.max_seq,
        seed=args.seed,
        weights=args.data_weights,
        truncate=args.truncate,
    )
    return sources, stream


def build_loader(
    args, *, sources: list, stream: BatchStream, pricing: StepPricing
) -> HDPDataLoader:
    """The loader that plans each global batch and hands this rank its shards' tokens. Its plans
    are priced by ``pricing``, what training runs (the attention backend verified, each rank's
    memory, the sync mode the model is built for), so a plan is optimised for the kernels that
    run and the metrics' two predictions come from one model."""
    return HDPDataLoader(
        sources,
        stream,
        pricing.cluster,
        pricing.model,
        args.strategy,
        plan_ahead=args.plan_ahead,
        pricing=pricing,
    )


def build_model(
    args,
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
    :class:`launch.hf_weights.WeightsError` naming the file and tensor when the checkpoint does
    not fit."""
    checkpoint = source.checkpoint if source is not None else None
    torch.manual_seed(args.seed)  # identical initial weights on every rank, sharded below
    with torch.device("meta") if checkpoint is not None else nullcontext():
        model = Llama(
            cost.model,
            activation_checkpointing=args.activation_checkpointing,
            loss_chunk_tokens=cost.loss_chunk_tokens,
            attention_backend=forced_attention_backend(args),
            # Note [Selective activation checkpointing] in launch/model.py: opt-in, as the cost
            # model's memory estimate assumes full checkpointing (absent flag: full).
            keep_attention=getattr(args, "keep_attention", False),
        )
    if checkpoint is None:
        model.to(device)
    if args.compile:
        apply_compile(model)
    if dist.is_initialized():
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
    """``torch.compile`` each decoder layer's MLP. Attention runs eager: its P2P exchanges change
    with every plan."""
    for layer in model.layers:
        layer.mlp.compile()


def build_optimizer(args, *, model: Llama, schedule: Schedule) -> tuple[Optimizer, LRScheduler]:
    """AdamW (fused on GPUs) and its learning-rate ``schedule``."""
    params = list(model.parameters())
    # One fused kernel per step instead of loops of elementwise kernels, where every parameter
    # lives on a GPU (FSDP2's sharded parameters included); torch's default elsewhere.
    fused = True if params and all(p.is_cuda for p in params) else None
    optimizer = torch.optim.AdamW(
        params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=fused
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
    return optimizer, scheduler


def apply_optimizer_flags(args, optimizer: Optimizer, scheduler: LRScheduler) -> None:
    """Make this run's flags, not the checkpoint's, set the learning rate and weight decay.

    A checkpoint restores the optimizer's and schedule's saved ``lr``, ``initial_lr`` and
    ``weight_decay``; :func:`launch.resume.check_setup` refused any change the user did not allow,
    so what is applied here is either the same values or the ones allowed."""
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"] = args.lr
        group["lr"] = args.lr * factor
        group["weight_decay"] = args.weight_decay
    scheduler.base_lrs = [args.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def restore(run: Run, resume: Resume | None) -> int:
    """Load the checkpoint :func:`find_resume` chose into the run; returns the step to start
    from (0 without one)."""
    if resume is None:
        return 0
    checkpoint.load(resume.path, run.model, run.optimizer, run.scheduler)
    apply_optimizer_flags(run.args, run.optimizer, run.scheduler)
    if resume.data_state is not None:
        run.loader.load_state_dict(resume.data_state)
    run.totals = Totals(resume.trained_tokens, resume.truncated_tokens, resume.skipped_updates)
    run.log(f"resumed from {resume.path} at step {resume.step}")
    return resume.step


def kill_point() -> tuple[int, int]:
    """(rank, step) from ``HDP_KILL_AT=RANK:STEP``, for resilience tests: that rank SIGKILLs
    itself in the middle of that step (after its forward/backward, before the optimizer step).
    Raises ValueError naming the variable when it is not two integers."""
    text = os.environ.get("HDP_KILL_AT", "").strip()
    if not text:
        return -1, -1
    try:
        kill_rank, kill_step = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"HDP_KILL_AT={text!r}: expected RANK:STEP, e.g. 1:5") from None
    return kill_rank, kill_step


def train_step(
    data: StepData,
    *,
    model: Llama,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    grad_clip: float,
    autocast: torch.dtype | None,
    memory: PeakMemory,
    kill: bool = False,
) -> tuple[StepResult, float, bool]:
    """One optimizer step on ``data``; returns the waves' result, the gradient norm and whether
    the optimizer stepped: not when the loss or the gradient norm is not finite (the same on
    every rank: both are global), so that no non-finite value reaches the weights."""
    COMM.reset()
    memory.start_step()
    res = run_waves(model, data, autocast_dtype=autocast)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    grad_norm = float(
        torch.nn.utils.clip_grad_norm_(
            model.parameters(), grad_clip if grad_clip > 0 else float("inf")
        )
    )
    stepped = math.isfinite(res.loss) and math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return res, grad_norm, stepped


class Diverged(Exception):
    """A step whose loss or gradient norm is not finite, under ``--nan-policy stop``."""


def nonfinite_line(run: Run, res: StepResult, grad_norm: float, step: int) -> str:
    """What stopped the run: the step, the value, and the first rank whose own tokens gave a
    non-finite loss (a collective: every rank sees the same global values and calls it)."""
    mine = torch.tensor([res.local_loss], dtype=torch.float64, device=run.device)
    ranks = [mine]
    if dist.is_initialized():
        ranks = [torch.zeros_like(mine) for _ in range(run.world)]
        dist.all_gather(ranks, mine)
    bad = [r for r, t in enumerate(ranks) if not math.isfinite(t.item())]
    if not math.isfinite(res.loss):
        what = f"loss {res.loss} at step {step}" + (f" (first on rank {bad[0]})" if bad else "")
    else:
        what = f"gradient norm {grad_norm} at step {step} (the loss, {res.loss:.4f}, is finite)"
    return (
        f"non-finite {what}: stopped before its update, which no checkpoint holds; lower --lr, "
        "check the data and the initial weights, or pass --nan-policy skip to drop such updates"
    )


def checkpoint_due(args, step: int) -> bool:
    """Whether to checkpoint after ``step``: every ``--save-every`` steps and at the end."""
    return bool(args.checkpoint_dir) and (
        bool(args.save_every and step % args.save_every == 0) or step == args.steps
    )
