"""A training run's configuration: frozen sections of typed fields, each with its default.

A leaf: it imports nothing from :mod:`hdp.launch`, so a :class:`RunConfig` can be built in a
test without argparse (``RunConfig(planning=PlanningConfig(sync="wave"))``), and every other
module of the launcher may read it. :func:`hdp.launch.cli.parse_config` reads ``pretrain.py``'s
flags (and a ``--config`` TOML file) into one, applies :func:`checked` and the checks against
the environment, and returns a value nothing changes afterwards. Where training resolves an
``auto`` (the attention backend that passed its check, activation checkpointing where memory
needs it), it makes a new config with :meth:`RunConfig.resolved`.

Each section is the argument group of the same name in :mod:`hdp.launch.flags`; a field is the
flag of the same name unless its ``dest`` metadata names another. A field typed as a ``Literal``
takes only its values, checked when a section is built (:func:`choices`): the flags take their
choices from here. Fields marked ``defines_run`` make up the resume fingerprint
(:meth:`RunConfig.fingerprint`): the setup a checkpoint continues.
"""

from __future__ import annotations

import functools
import signal
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from hdp import format_size

# Without --tokens-per-step a step holds this many tokens, or one --max-seq sequence if longer.
DEFAULT_TOKENS_PER_STEP = 64 << 10

# The values of the string settings. Strategy and AttentionBackend repeat the names of
# hdp.planner.STRATEGIES and hdp.BACKEND_NAMES, which tests/test_run_config.py holds equal: the
# config reads no planner or kernel module.
Strategy = Literal["static", "ulysses", "hybridcp", "bytescale", "flexsp", "hdp"]
Sync = Literal["wave", "peer"]
KVExchange = Literal["auto", "rank", "node", "ulysses"]
NanPolicy = Literal["stop", "skip"]
AttentionBackend = Literal[
    "auto", "flash_attn", "torch_flash", "flash_attn_4", "cudnn", "reference"
]
Device = Literal["auto", "cuda", "cpu"]


def _flag(default: Any, dest: str | None = None, *, defines_run: bool = False) -> Any:
    """A field whose value comes from the flag ``dest`` (default: the field's name)."""
    meta: dict[str, Any] = {"defines_run": defines_run}
    if dest is not None:
        meta["dest"] = dest
    return field(default=default, metadata=meta)


def flag_name(f) -> str:
    """The command-line flag of a section's field: ``--kv-exchange``."""
    return "--" + f.metadata.get("dest", f.name).replace("_", "-")


@functools.cache
def _literal_fields(cls: type) -> dict[str, tuple[Any, ...]]:
    """{field: its allowed values} for the fields of ``cls`` typed ``Literal[...]`` (or
    ``Literal[...] | None``, where ``None`` is allowed too)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        allowed = ()
        for part in typing.get_args(hint) if _is_union(hint) else (hint,):
            if typing.get_origin(part) is Literal:
                allowed += typing.get_args(part)
            elif part is type(None):
                allowed += (None,)
        if any(v is not None for v in allowed):
            out[name] = allowed
    return out


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def choices(cls: type, name: str) -> tuple[str, ...]:
    """The values the field ``name`` of section ``cls`` takes (``None`` left out): the flag's
    ``choices``."""
    return tuple(v for v in _literal_fields(cls)[name] if v is not None)


class _Section:
    """A config section: its ``Literal`` fields are checked when it is built, here and nowhere
    else, with a ValueError naming the flag and the values it takes."""

    def __post_init__(self) -> None:
        for f in fields(self):
            allowed = _literal_fields(type(self)).get(f.name)
            value = getattr(self, f.name)
            if allowed is not None and value not in allowed:
                names = ", ".join(str(v) for v in allowed if v is not None)
                raise ValueError(f"{flag_name(f)}: {value!r} is not one of {names}")


@dataclass(frozen=True)
class ModelConfig(_Section):
    """What is trained: a preset or a transformers config, a checkpoint to start from, RoPE."""

    name_or_config: str | None = _flag(None, "model")  # a preset's name or a config.json path
    init_from: Path | None = _flag(None)
    rope_theta: float | None = _flag(None)
    rope_scaling: dict | None = _flag(None)


@dataclass(frozen=True)
class DataConfig(_Section):
    """Where the tokens come from and how they form global batches."""

    paths: tuple[str, ...] = _flag((), "data")  # empty: a synthetic corpus
    workload: str | None = _flag(None)
    weights: tuple[float, ...] | None = _flag(None, "data_weights", defines_run=True)
    tokenizer: Path | None = _flag(None)
    synthetic_docs: int = _flag(20000)
    max_seq: int = _flag(16 << 10, defines_run=True)
    tokens_per_step: int | None = _flag(None, defines_run=True)  # None until checked
    truncate: bool = _flag(False, defines_run=True)
    skip_bad_records: bool = _flag(False)
    seed: int = _flag(0, defines_run=True)  # the data order's, and the initial weights'


@dataclass(frozen=True)
class TrainingConfig(_Section):
    """How steps run: how many, on what device and kernels, and what stops them."""

    steps: int = _flag(20)
    nan_policy: NanPolicy = _flag("stop")
    exit_signals: tuple[signal.Signals, ...] = _flag(
        (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1), "exit_signal"
    )
    compile: bool | None = _flag(None)  # None until resolved: on CUDA, off on CPU
    fused_loss: bool = _flag(False)
    attention_backend: AttentionBackend = _flag("auto")  # "auto" until training resolves it
    device: Device = _flag("auto")


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    """AdamW and its learning-rate schedule (Note [Warm-up, decay and extended runs])."""

    lr: float = _flag(3e-4, defines_run=True)
    warmup: int = _flag(10, defines_run=True)
    lr_decay_steps: int | None = _flag(None)  # saved as the schedule instead: a run may extend it
    weight_decay: float = _flag(0.1, defines_run=True)
    grad_clip: float = _flag(1.0, defines_run=True)


@dataclass(frozen=True)
class PlanningConfig(_Section):
    """What the planner optimises for: its strategy, the machine it prices, the memory it plans."""

    strategy: Strategy = _flag("hdp", defines_run=True)
    sync: Sync | None = _flag(None, defines_run=True)  # None: peer where memory allows
    kv_exchange: KVExchange = _flag("auto", defines_run=True)
    gpus_per_node: int | None = _flag(None, defines_run=True)  # as given: None follows torchrun
    capacity: int | None = _flag(None, defines_run=True)
    activation_checkpointing: bool | None = _flag(None, defines_run=True)  # None until resolved
    checkpointed_layers: int | None = _flag(None)  # None: every layer, or resolved with the above
    keep_attention: bool = _flag(False)
    gpu: str | None = _flag(None)
    gpu_profile: str | None = _flag(None)
    plan_ahead: int = _flag(2)
    plan_budget: float | None = _flag(None)  # hdp's search, seconds; None: its default
    max_ranks_per_seq: int | None = _flag(None)  # hdp: None, as many as help


@dataclass(frozen=True)
class CheckpointingConfig(_Section):
    """Where checkpoints go, how often, and which one a run continues."""

    dir: Path | None = _flag(None, "checkpoint_dir")
    save_every: int = _flag(0)
    resume: bool = _flag(False)  # also set by --resume-step
    resume_step: int | None = _flag(None)
    allow_changed_setup: bool = _flag(False)


@dataclass(frozen=True)
class OutputConfig(_Section):
    """What a run writes besides checkpoints: metrics rows, their loggers, progress lines."""

    metrics: Path | None = _flag(None)
    tensorboard: Path | None = _flag(None)
    wandb: str | None = _flag(None)
    log_every: int = _flag(1)


@dataclass(frozen=True)
class LauncherConfig(_Section):
    """How ``hdp-train`` starts its ranks itself (Note [Who starts the ranks] in
    :mod:`hdp.launch.launcher`); unused by a rank that torchrun or ``srun`` started."""

    nproc_per_node: int | None = _flag(None)  # None: this process is the one rank
    nnodes: int | None = _flag(None)  # None: 1, or Slurm's node count under srun
    node_rank: int | None = _flag(None)  # None: 0, or Slurm's node id under srun
    rdzv_endpoint: str | None = _flag(None)  # HOST[:PORT] of node 0
    log_dir: Path | None = _flag(None)


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "planning": PlanningConfig,
    "checkpointing": CheckpointingConfig,
    "output": OutputConfig,
    "launcher": LauncherConfig,
}


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a training run, one frozen section per argument group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    def resolved(self, **sections: dict[str, Any]) -> RunConfig:
        """A copy with some fields of some sections replaced, e.g.
        ``config.resolved(planning={"activation_checkpointing": True})``."""
        return replace(
            self,
            **{name: replace(getattr(self, name), **changes) for name, changes in sections.items()},
        )

    def fingerprint(self) -> dict[str, dict[str, Any]]:
        """{section: {field: value}} of the fields that define the run (tuples as lists, as a
        checkpoint's metadata keeps them): the flags part of the resume fingerprint
        (:func:`hdp.launch.resume.fingerprint` adds the model and the sources)."""
        out: dict[str, dict[str, Any]] = {}
        for name in SECTIONS:
            section = getattr(self, name)
            kept = {
                f.name: _plain(getattr(section, f.name))
                for f in fields(section)
                if f.metadata["defines_run"]
            }
            if kept:
                out[name] = kept
        return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def checked(config: RunConfig) -> RunConfig:
    """``config`` with the defaults that depend on other flags filled in, once every rule between
    its flags holds; raises ValueError naming the flags otherwise. (The rules that need the
    planner or the machine are :func:`hdp.launch.cli.check_environment`'s.)"""
    data, planning, ck = config.data, config.planning, config.checkpointing
    resume = ck.resume or ck.resume_step is not None
    if resume and ck.dir is None:
        raise ValueError(
            f"{'--resume-step' if ck.resume_step else '--resume'} needs --checkpoint-dir"
        )
    if planning.keep_attention and planning.activation_checkpointing is False:
        raise ValueError("--keep-attention applies with --activation-checkpointing")
    if planning.checkpointed_layers is not None and planning.activation_checkpointing is False:
        raise ValueError(
            "--checkpointed-layers applies with activation checkpointing, which "
            "--no-activation-checkpointing turns off"
        )
    if ck.allow_changed_setup and not resume:
        raise ValueError("--allow-changed-setup only applies with --resume")
    _check_launcher(config.launcher)
    tokens = data.tokens_per_step
    if tokens is None:
        tokens = max(DEFAULT_TOKENS_PER_STEP, data.max_seq)
    elif data.max_seq > tokens:
        raise ValueError(
            f"--max-seq ({format_size(data.max_seq)}) exceeds --tokens-per-step "
            f"({format_size(tokens)}): a sequence must fit in one global batch; "
            "raise --tokens-per-step or leave it out"
        )
    paths = tuple(data.paths or ())
    if data.weights is not None and len(paths) != len(data.weights):
        raise ValueError(
            f"--data-weights has {len(data.weights)} weights for {len(paths)} --data sources: "
            "give one per --data"
        )
    weights = tuple(data.weights) if data.weights is not None else None
    checkpointing = planning.activation_checkpointing
    if planning.keep_attention or planning.checkpointed_layers is not None:
        checkpointing = True
    return config.resolved(
        data={"paths": paths, "tokens_per_step": tokens, "weights": weights},
        planning={"activation_checkpointing": checkpointing},
        checkpointing={"resume": resume},
    )


def _check_launcher(launcher: LauncherConfig) -> None:
    if launcher.nproc_per_node is None:
        given = [
            flag_name(f)
            for f in fields(launcher)
            if f.name != "nproc_per_node" and getattr(launcher, f.name) is not None
        ]
        if given:
            raise ValueError(f"{', '.join(given)} applies only with --nproc-per-node")
        return
    if launcher.nnodes is not None and launcher.node_rank is not None:
        if launcher.node_rank >= launcher.nnodes:
            raise ValueError(
                f"--node-rank {launcher.node_rank} is not below --nnodes {launcher.nnodes}: "
                "nodes count from 0"
            )


__all__ = [
    "DEFAULT_TOKENS_PER_STEP",
    "LauncherConfig",
    "SECTIONS",
    "CheckpointingConfig",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "OutputConfig",
    "PlanningConfig",
    "RunConfig",
    "TrainingConfig",
    "AttentionBackend",
    "Device",
    "KVExchange",
    "NanPolicy",
    "Strategy",
    "Sync",
    "checked",
    "choices",
    "flag_name",
]
