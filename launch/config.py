"""A training run's configuration: frozen sections, parsed and validated once.

``parse_config(argv)`` reads ``pretrain.py``'s flags (and a ``--config`` TOML file) into a
:class:`RunConfig`, applies every rule between flags, and returns a value nothing changes
afterwards. Where training resolves an ``auto`` (the attention backend that passed its check,
activation checkpointing where memory needs it), it makes a new config with
:meth:`RunConfig.resolved`.

Each section is the argument group of the same name in :mod:`launch.flags`; a field is the flag
of the same name unless its ``dest`` metadata names another. Fields marked ``defines_run`` make up
the resume fingerprint (:meth:`RunConfig.fingerprint`): the setup a checkpoint continues.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hdp import GPUProfile, format_size
from hdp.profile import ProfileError
from planner import STRATEGIES, get_strategy

from .config_file import ConfigFileError, config_argv
from .flags import build_parser, section_dests
from .loggers import missing_package
from .model_source import model_source
from .stopping import kill_point

# Without --tokens-per-step a step holds this many tokens, or one --max-seq sequence if longer.
DEFAULT_TOKENS_PER_STEP = 64 << 10


def _flag(dest: str | None = None, *, defines_run: bool = False) -> Any:
    """A field whose value comes from the flag ``dest`` (default: the field's name)."""
    meta: dict[str, Any] = {"defines_run": defines_run}
    if dest is not None:
        meta["dest"] = dest
    return field(metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    """What is trained: a preset or a transformers config, a checkpoint to start from, RoPE."""

    name_or_config: str | None = _flag("model")  # a preset's name or a config.json path
    init_from: Path | None = _flag()
    rope_theta: float | None = _flag()
    rope_scaling: dict | None = _flag()


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how they form global batches."""

    paths: tuple[str, ...] = _flag("data")  # empty: a synthetic corpus
    workload: str | None = _flag()
    weights: tuple[float, ...] | None = _flag("data_weights", defines_run=True)
    tokenizer: Path | None = _flag()
    synthetic_docs: int = _flag()
    max_seq: int = _flag(defines_run=True)
    tokens_per_step: int = _flag(defines_run=True)
    truncate: bool = _flag(defines_run=True)
    skip_bad_records: bool = _flag()
    seed: int = _flag(defines_run=True)  # the data order's, and the initial weights'


@dataclass(frozen=True)
class TrainingConfig:
    """How steps run: how many, on what device and kernels, and what stops them."""

    steps: int = _flag()
    nan_policy: str = _flag()
    exit_signals: tuple[signal.Signals, ...] = _flag("exit_signal")
    compile: bool = _flag()
    attention_backend: str = _flag()  # "auto" until training resolves it
    device: str = _flag()


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule (Note [Warm-up, decay and extended runs])."""

    lr: float = _flag(defines_run=True)
    warmup: int = _flag(defines_run=True)
    lr_decay_steps: int | None = _flag()  # saved as the schedule instead: a run may extend it
    weight_decay: float = _flag(defines_run=True)
    grad_clip: float = _flag(defines_run=True)


@dataclass(frozen=True)
class PlanningConfig:
    """What the planner optimises for: its strategy, the machine it prices, the memory it plans."""

    strategy: str = _flag(defines_run=True)
    sync: str | None = _flag(defines_run=True)
    kv_exchange: str = _flag(defines_run=True)
    gpus_per_node: int | None = _flag(defines_run=True)  # as given: None follows torchrun
    capacity: int | None = _flag(defines_run=True)
    activation_checkpointing: bool | None = _flag(defines_run=True)  # None until resolved
    keep_attention: bool = _flag()
    gpu: str | None = _flag()
    gpu_profile: str | None = _flag()
    plan_ahead: int = _flag()


@dataclass(frozen=True)
class CheckpointingConfig:
    """Where checkpoints go, how often, and which one a run continues."""

    dir: Path | None = _flag("checkpoint_dir")
    save_every: int = _flag()
    resume: bool = _flag()  # also set by --resume-step
    resume_step: int | None = _flag()
    allow_changed_setup: bool = _flag()


@dataclass(frozen=True)
class OutputConfig:
    """What a run writes besides checkpoints: metrics rows, their loggers, progress lines."""

    metrics: Path | None = _flag()
    tensorboard: Path | None = _flag()
    wandb: str | None = _flag()
    log_every: int = _flag()


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "planning": PlanningConfig,
    "checkpointing": CheckpointingConfig,
    "output": OutputConfig,
}


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a training run, one frozen section per argument group."""

    model: ModelConfig
    data: DataConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    planning: PlanningConfig
    checkpointing: CheckpointingConfig
    output: OutputConfig

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
        (:func:`launch.resume.fingerprint` adds the model and the sources)."""
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


def from_namespace(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> RunConfig:
    """The sections of parsed flags, as given (no rule between flags applied)."""
    dests = section_dests(parser)
    values: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        wanted = {f.name: f.metadata.get("dest", f.name) for f in fields(cls)}
        if sorted(wanted.values()) != sorted(dests[name]):
            raise RuntimeError(  # a flag added to a group without its field, or the reverse
                f"section {name}: fields for {sorted(wanted.values())}, flags {sorted(dests[name])}"
            )
        values[name] = cls(**{f: getattr(ns, dest) for f, dest in wanted.items()})
    return RunConfig(**values)


def parse_config(argv: list[str] | None = None, *, prog: str = "pretrain.py") -> RunConfig:
    """The run's config from its flags (``sys.argv[1:]`` by default): a ``--config`` file's flags
    first, those given replacing them, then every rule between flags. A bad flag or combination
    exits with argparse's usage error (status 2), one line saying what to change."""
    p = build_parser(prog)
    argv = sys.argv[1:] if argv is None else list(argv)
    given, _ = p.parse_known_args(argv)  # --config first: its flags go before the others
    if given.config is not None:
        try:
            argv = config_argv(given.config, p, argv) + argv
        except ConfigFileError as e:
            p.error(str(e))
    config = from_namespace(p.parse_args(argv), p)
    try:
        return checked(config)
    except ValueError as e:
        p.error(str(e))


def checked(config: RunConfig) -> RunConfig:
    """``config`` with the defaults that depend on other flags filled in, once every rule between
    flags and against the environment holds; raises ValueError naming the flags otherwise."""
    data, planning, ck = config.data, config.planning, config.checkpointing
    resume = ck.resume or ck.resume_step is not None
    if resume and ck.dir is None:
        raise ValueError(
            f"{'--resume-step' if ck.resume_step else '--resume'} needs --checkpoint-dir"
        )
    if planning.keep_attention and planning.activation_checkpointing is False:
        raise ValueError("--keep-attention applies with --activation-checkpointing")
    if ck.allow_changed_setup and not resume:
        raise ValueError("--allow-changed-setup only applies with --resume")
    if planning.kv_exchange != "auto" and not get_strategy(planning.strategy).takes_kv_exchange:
        takers = [name for name in STRATEGIES if get_strategy(name).takes_kv_exchange]
        raise ValueError(
            f"--kv-exchange {planning.kv_exchange} applies to --strategy {' or '.join(takers)}: "
            "the baselines exchange K/V as their own systems do"
        )
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
    for flag in ("tensorboard", "wandb"):
        if getattr(config.output, flag) and (why := missing_package(flag)):
            raise ValueError(why)
    kill_point()
    model_source(config.model, config.data.tokenizer)
    if planning.gpu_profile:
        try:
            GPUProfile.load(planning.gpu_profile)
        except ProfileError as e:
            raise ValueError(str(e)) from None
    weights = tuple(data.weights) if data.weights is not None else None
    checkpointing = True if planning.keep_attention else planning.activation_checkpointing
    return config.resolved(
        data={"paths": paths, "tokens_per_step": tokens, "weights": weights},
        planning={"activation_checkpointing": checkpointing},
        checkpointing={"resume": resume},
    )


__all__ = [
    "DEFAULT_TOKENS_PER_STEP",
    "SECTIONS",
    "CheckpointingConfig",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "OutputConfig",
    "PlanningConfig",
    "RunConfig",
    "TrainingConfig",
    "checked",
    "from_namespace",
    "parse_config",
]
