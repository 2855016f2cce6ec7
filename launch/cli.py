"""The training command: ``launch/pretrain.py`` under torchrun, or ``hdp-train`` once installed.

:func:`main` parses the flags into a :class:`hdp.launch.config.RunConfig`
(:func:`parse_config`), joins torchrun's process group and runs :func:`hdp.launch.train.train`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from hdp import GPUProfile
from hdp.planner import STRATEGIES, get_strategy
from hdp.profile import ProfileError

from .config import RunConfig, checked
from .config_file import ConfigFileError, config_argv
from .flags import build_parser, from_namespace
from .launcher import (
    die_with_launcher,
    launch,
    reports_errors,
    role,
    slurm_rank_environment,
    thread_count,
)
from .loggers import missing_package
from .model_source import model_source
from .resume import check_metrics_file
from .runtime import exit_without_teardown
from .stopping import kill_point
from .train import train


def refuse(prog: str, message: str) -> NoReturn:
    """Exit 2 with one line, ``prog: error: message``, printed once per screen
    (:func:`hdp.launch.launcher.reports_errors`): for what every rank meets alike."""
    if reports_errors():
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_config(argv: list[str] | None = None, *, prog: str = "pretrain.py") -> RunConfig:
    """The run's config from its flags (``sys.argv[1:]`` by default): a ``--config`` file's flags
    first, those given replacing them, then every rule between flags (:func:`checked`) and
    against the planner and this machine (:func:`check_environment`). A malformed command line
    exits with a short usage and argparse's error; a bad value, combination or file with one
    line (:func:`refuse`); both with status 2."""
    p = build_parser(prog)
    argv = sys.argv[1:] if argv is None else list(argv)
    given, _ = p.parse_known_args(argv)  # --config first: its flags go before the others
    if given.config is not None:
        try:
            argv = config_argv(given.config, p, argv) + argv
        except ConfigFileError as e:
            refuse(prog, str(e))
    try:
        config = checked(from_namespace(p.parse_args(argv), p))
        check_environment(config)
    except ValueError as e:
        refuse(prog, str(e))
    return config


def check_environment(config: RunConfig) -> None:
    """The rules a config must meet beyond its own flags: the planner's strategy takes its
    ``--kv-exchange``, the loggers' packages are installed, ``--metrics`` is a metrics log or
    new, the model and the GPU profile can be read, ``HDP_KILL_AT`` parses. Raises ValueError
    naming the flag otherwise."""
    planning = config.planning
    for flag in ("plan_budget", "max_ranks_per_seq"):
        if getattr(planning, flag) is not None and planning.strategy != "hdp":
            raise ValueError(
                f"--{flag.replace('_', '-')} applies to --strategy hdp: the baselines plan by "
                "their own rules"
            )
    if planning.kv_exchange != "auto" and not get_strategy(planning.strategy).takes_kv_exchange:
        takers = [name for name in STRATEGIES if get_strategy(name).takes_kv_exchange]
        raise ValueError(
            f"--kv-exchange {planning.kv_exchange} applies to --strategy {' or '.join(takers)}: "
            "the baselines exchange K/V as their own systems do"
        )
    for flag in ("tensorboard", "wandb"):
        if getattr(config.output, flag) and (why := missing_package(flag)):
            raise ValueError(why)
    check_metrics_file(config.output.metrics)
    if config.training.fused_loss and importlib.util.find_spec("liger_kernel") is None:
        raise ValueError("--fused-loss needs liger-kernel: pip install 'hdp-llm[liger]'")
    kill_point()
    model_source(config.model, config.data.tokenizer)
    if planning.gpu_profile:
        try:
            GPUProfile.load(planning.gpu_profile)
        except ProfileError as e:
            raise ValueError(str(e)) from None


def init_distributed(
    device_kind: str = "auto", prog: str = "pretrain.py"
) -> tuple[int, int, int, torch.device]:
    """(rank, world, ranks per node, device) from torchrun's environment (NCCL on CUDA, gloo on
    CPU); a plain ``python pretrain.py`` runs one rank without a process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_kind == "cuda" and local_world > gpus:
        refuse(
            prog,
            f"--device cuda with {local_world} ranks per node, but this node has {gpus} CUDA "
            f"GPUs: use --nproc-per-node {gpus} or --device cpu",
        )
    if device_kind == "cuda" or (device_kind == "auto" and 0 < local_world <= gpus):
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:  # torchrun: a process group, one rank included
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, local_world, device


def main(argv: list[str] | None = None, *, prog: str = "pretrain.py") -> int:
    """Parse the flags; start the ranks (``--nproc-per-node``), or be one and train; returns the
    exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    config = parse_config(argv, prog=prog)
    try:
        this = role(config.launcher, os.environ)
        if this == "launcher":
            return launch(config, argv, prog)
    except ValueError as e:
        refuse(prog, str(e))
    if this == "srun":
        os.environ.update(slurm_rank_environment(os.environ) or {})
    die_with_launcher()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(thread_count(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    # Whole-step peaks are planned close to the GPU's memory; the caching allocator's default
    # fixed-size segments can leave gigabytes reserved but unusable for the next large tensor.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    rank, world, per_node, device = init_distributed(config.training.device, prog)
    try:
        code = train(config, rank=rank, world=world, per_node=per_node, device=device, prog=prog)
        if dist.is_initialized():
            dist.barrier()  # leave together: no rank closes its sockets while a peer still reads
        return code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run() -> NoReturn:
    """``hdp-train``: :func:`main` under the name it was called by (the launcher's, for the
    ranks it starts), then exit without the interpreter's teardown
    (:func:`hdp.launch.runtime.exit_without_teardown`)."""
    prog = os.environ.get("HDP_PROG") or Path(sys.argv[0]).name or "hdp-train"
    exit_without_teardown(main(prog=prog))


if __name__ == "__main__":
    run()


__all__ = ["check_environment", "init_distributed", "main", "parse_config", "refuse", "run"]
