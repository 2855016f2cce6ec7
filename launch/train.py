"""The training loop, read top to bottom in :func:`train`.

Set-up is one function per part (:mod:`hdp.launch.setup`): the pricing (the one cost model), the
data, the loader, the model with its techniques, the optimizer; then the restore of a checkpoint
(:func:`restore`).
Each step runs :func:`train_step` and gathers what the ranks measured (:mod:`hdp.launch.metrics`).
Then it writes one metrics record and checkpoints when due.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hdp import CostModel
from hdp.dataloader import (
    DataError,
    HDPDataLoader,
)
from hdp.planner import PlanningError, get_strategy

from . import checkpoint
from .checkpoint import CheckpointError
from .config import CheckpointingConfig, RunConfig
from .lock import DirectoryLock, LockHeld
from .loggers import Loggers, NoLoggers
from .memory import PeakMemory
from .metrics import (
    Heartbeat,
    Predicted,
    RankStats,
    data_line,
    first_step_line,
    gather_stats,
    metrics_record,
    predict,
    step_line,
)
from .model import Llama
from .model_source import model_source
from .resume import Resume, find_resume, fingerprint
from .runtime import StepResult
from .schedule import Schedule, run_schedule
from .setup import (
    apply_optimizer_flags,
    build_data,
    build_loader,
    build_model,
    build_optimizer,
    build_pricing,
    check_host_memory,
    resolve_auto,
)
from .stopping import StopOnSignal, Stopped, kill_point
from .update import Update, train_step


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

    config: RunConfig
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


def train(
    config: RunConfig,
    *,
    rank: int,
    world: int,
    per_node: int,
    device: torch.device,
    prog: str = "pretrain.py",
) -> int:
    """Train as ``config`` says. Returns the exit code: 0 (also when stopped by a signal, with
    the step in hand saved), 2 for a bad setup (one line, ``prog: error: ...``), 3 for a
    non-finite step."""
    with StopOnSignal(config.training.exit_signals, rank=rank, device=device) as stop:
        try:
            with _holding(config.checkpointing.dir, rank):
                return _train(
                    config,
                    rank=rank,
                    world=world,
                    per_node=per_node,
                    device=device,
                    stop=stop,
                    prog=prog,
                )
        except LockHeld as e:
            rank0_log(rank)(f"{prog}: error: {e}")
            return 2


@contextmanager
def _holding(directory, rank: int):
    """The checkpoint directory's lock for the run (Note [The checkpoint directory's lock]):
    rank 0 takes it before any checkpoint is read or written; every rank raises
    :class:`LockHeld` where it could not."""
    if directory is None:
        yield
        return
    lock, problem = None, None
    if rank == 0:
        try:
            lock = DirectoryLock(directory, rank0_log(rank)).__enter__()
        except LockHeld as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot lock --checkpoint-dir {directory}: {e.strerror}"
    problem = checkpoint.agree(problem)
    if problem:
        raise LockHeld(problem)
    try:
        yield
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def _train(
    config: RunConfig,
    *,
    rank: int,
    world: int,
    per_node: int,
    device: torch.device,
    stop: StopOnSignal,
    prog: str,
) -> int:
    log = rank0_log(rank)

    def error(e: Exception) -> None:
        log(f"{prog}: error: {e}")

    memory = PeakMemory(device)  # before anything big is built
    try:
        source = model_source(config.model, config.data.tokenizer)
        if source.checkpoint is not None and source.checkpoint.untied_head:
            log(
                f"warning: {source.checkpoint.directory}: config.json ties the LM head to the "
                "embedding, but lm_head.weight holds other values: training them apart, as "
                "transformers loads it (set tie_word_embeddings to false to say so)"
            )
        check_host_memory(config, world=world, per_node=per_node)
        config = resolve_auto(
            config, spec=source.spec, world=world, per_node=per_node, device=device, log=log
        )
        pricing = build_pricing(
            config, spec=source.spec, world=world, per_node=per_node, device=device
        )
        cost, spec = pricing.cost, pricing.model
        # Every step plans in the sync mode the model is built for, the one --max-seq needs.
        _, sync, cap = pricing.settle(get_strategy(config.planning.strategy), config.data.max_seq)
        pricing = replace(pricing, sync=sync)
        sources, stream = build_data(config, source, vocab=spec.vocab)
        setup = fingerprint(config, sources, vocab=spec.vocab, model=source.fingerprint())
        resume = find_resume(config.checkpointing, config.training.steps, setup, log)
        model = build_model(
            config, cost=cost, sync=sync, device=device, source=source, resume=resume, log=log
        )
    except (PlanningError, DataError, ValueError, CheckpointError) as e:
        error(e)
        return 2
    loader = build_loader(config, sources=sources, stream=stream, pricing=pricing)
    saved_schedule = resume.schedule if resume else None
    schedule = run_schedule(config.optimizer, config.training.steps, saved_schedule, log)
    optimizer, scheduler = build_optimizer(config.optimizer, model=model, schedule=schedule)
    run = Run(
        config,
        rank,
        world,
        device,
        cost,
        source.hf_files(config.data.max_seq),
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
    log(run_line(run, sync=sync, capacity=cap))
    log(data_line(sources, config.data.max_seq))
    return run_all(run, start, error)


def run_all(run: Run, start: int, error: Callable[[Exception], None]) -> int:
    """Steps ``start + 1`` on with the run's loggers, and its last line; the exit code."""
    config = run.config
    loggers = (
        Loggers(config.output, start, run.setup, run.log, config.checkpointing.dir)
        if run.rank == 0
        else NoLoggers()
    )
    t_run = time.perf_counter()
    try:
        stopped = run_steps(run, start, loggers, t_run)
    except CheckpointError as e:
        error(e)
        return 2
    except Diverged as e:
        error(e)
        return 3
    finally:
        run.loader.close()
        loggers.close()
    seconds = time.perf_counter() - t_run
    run.log(stopped.line(config.checkpointing.dir) if stopped else done_line(run, start, seconds))
    return 0


def run_line(run: Run, *, sync: str, capacity: int) -> str:
    """The run's first line: the model, the ranks, and what the planner plans with."""
    spec, config = run.cost.model, run.config
    params = sum(p.numel() for p in run.model.parameters())
    return (
        f"{spec.name} ({spec.architecture}, RoPE {spec.rope.describe()}): "
        f"{params / 1e6:.1f}M parameters on {run.world} x {run.device.type} "
        f"({run.cost.cluster.gpu.name} profile), {sync} sync, capacity {capacity} tokens per rank "
        f"per wave, strategy {config.planning.strategy}, {config.data.tokens_per_step} "
        f"tokens/step, max_seq {config.data.max_seq}, recomputing "
        f"{run.cost.recomputed_layers} of {spec.layers} layers"
        f"{' but their attention' if run.cost.kept_attention else ''}"
        f"{', compiled' if config.training.compile else ''}"
    )


def done_line(run: Run, start: int, seconds: float) -> str:
    """The run's last line: its steps and time, and the token accounting of all its steps
    (resumes included): read = trained + skipped in sources, and what was truncated."""
    t, sources = run.totals, run.sources
    return (
        f"done: steps {start + 1}-{run.config.training.steps} in {seconds:.1f} s; "
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
    training, cost, totals = run.config.training, run.cost, run.totals
    grad_clip, log_every = run.config.optimizer.grad_clip, run.config.output.log_every
    ck = run.config.checkpointing
    autocast = torch.bfloat16 if run.device.type == "cuda" else None
    kill_at = kill_point()
    received = run.stop.agreed()  # during set-up: nothing trained, nothing to save
    if received:
        return Stopped(received, start, saved=False, before_training=True)
    for step_idx in range(start, training.steps):
        t0 = time.perf_counter()
        data = next(run.loader)
        if step_idx == start and run.rank == 0:
            run.log(first_step_line(cost, data, step_idx + 1))
        predicted_s = data.plan.predicted.get("step_time_s", 0.0)
        lr = run.scheduler.get_last_lr()[0]  # the rate this step trains at
        with Heartbeat(run.log, step_idx + 1, predicted_s) if run.rank == 0 else nullcontext():
            update = train_step(
                data,
                model=run.model,
                optimizer=run.optimizer,
                scheduler=run.scheduler,
                grad_clip=grad_clip,
                autocast=autocast,
                keep_before=training.nan_policy == "skip",
                kill=kill_at == (run.rank, step_idx + 1),
                memory=run.memory,
            )
        res, grad_norm = update.result, update.grad_norm
        step_time = time.perf_counter() - t0
        stats, overflowed = measured(run, update)
        stepped = update.stepped and not overflowed
        totals.skipped_updates += not stepped
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
        if (step_idx + 1) % log_every == 0 or not stepped:
            done, elapsed = step_idx + 1 - start, time.perf_counter() - t_run
            run.log(
                step_line(
                    record, data, elapsed=elapsed, left=training.steps - start - done, done=done
                )
            )
        if step_idx == start and training.compile:
            run.log(compile_line())
        if overflowed and training.nan_policy == "stop":
            raise Diverged(overflow_line(run.config, step_idx + 1))
        if not stepped and training.nan_policy == "stop":
            raise Diverged(nonfinite_line(run, res, grad_norm, step_idx + 1))
        step = step_idx + 1
        received = run.stop.agreed() if step < training.steps else None
        if checkpoint_due(ck, training.steps, step) or (received and ck.dir):
            save_checkpoint(run, step)
        if received:
            return Stopped(received, step, saved=bool(ck.dir))
    return None


def compile_line() -> str:
    """How long the first step spent in ``torch.compile`` (Note [Compiled layers])."""
    try:  # torch's own account, forward and backward graphs; private, so optional
        from torch._dynamo.utils import calculate_time_spent

        seconds = calculate_time_spent()["total_wall_time"]
    except (ImportError, AttributeError, KeyError):
        return "torch.compile: the decoder layers compiled in the first step"
    return f"torch.compile: {seconds:.1f} s of the first step compiling the decoder layers"


def measured(run: Run, update: Update) -> tuple[RankStats, bool]:
    """What the ranks measured in the step, and whether its update made a weight non-finite
    on some rank: then, under ``--nan-policy skip``, the update is undone here (Note
    [Non-finite updates])."""
    stats = gather_stats(
        update.result,
        world=run.world,
        device=run.device,
        memory=run.memory,
        weights_finite=update.weights_finite,
    )
    overflowed = update.stepped and not stats.weights_finite
    if overflowed and update.before is not None:
        update.before.restore(run.model, run.optimizer)
    return stats, overflowed


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
        run.config.checkpointing.dir,
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


def rank0_log(rank: int) -> Callable[[str], None]:
    """A ``print`` that only rank 0 does, flushed so torchrun's output interleaves in order."""

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    return log


def restore(run: Run, resume: Resume | None) -> int:
    """Load the checkpoint :func:`find_resume` chose into the run; returns the step to start
    from (0 without one)."""
    if resume is None:
        return 0
    checkpoint.load(resume.path, run.model, run.optimizer, run.scheduler)
    apply_optimizer_flags(run.config.optimizer, run.optimizer, run.scheduler)
    if resume.data_state is not None:
        run.loader.load_state_dict(resume.data_state)
    run.totals = Totals(resume.trained_tokens, resume.truncated_tokens, resume.skipped_updates)
    run.log(f"resumed from {resume.path} at step {resume.step}")
    return resume.step


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


def overflow_line(config: RunConfig, step: int) -> str:
    """What stopped a run whose update made a weight non-finite although the loss and the
    gradients were finite."""
    opt = config.optimizer
    return (
        f"the update of step {step} made weights non-finite (the loss and the gradient norm "
        f"were finite): stopped before any checkpoint holds them; lower --lr ({opt.lr:g}) or "
        f"--weight-decay ({opt.weight_decay:g}), or pass --nan-policy skip to drop such updates"
    )


def checkpoint_due(ck: CheckpointingConfig, steps: int, step: int) -> bool:
    """Whether to checkpoint after ``step`` of ``steps``: every ``--save-every`` steps and at the
    end."""
    return bool(ck.dir) and (bool(ck.save_every and step % ck.save_every == 0) or step == steps)
