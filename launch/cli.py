"""The training command: ``launch/pretrain.py`` under torchrun, or ``hdp-train`` once installed.

:func:`main` parses the flags into a :class:`launch.config.RunConfig`, joins torchrun's process
group and runs :func:`launch.train.train`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from .config import parse_config
from .runtime import exit_without_teardown
from .train import train


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
        raise SystemExit(
            f"{prog}: error: --device cuda with {local_world} ranks per node, but this node "
            f"has {gpus} CUDA GPUs: use --nproc-per-node {gpus} or --device cpu"
        )
    if device_kind == "cuda" or (device_kind == "auto" and 0 < local_world <= gpus):
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:  # torchrun: FSDP2 over all ranks, one rank included
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, local_world, device


def main(argv: list[str] | None = None, *, prog: str = "pretrain.py") -> int:
    """Parse the flags, join torchrun's ranks, train; returns the exit code."""
    config = parse_config(argv, prog=prog)
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
    """``hdp-train``: :func:`main` under the name it was called by, then exit without the
    interpreter's teardown (:func:`launch.runtime.exit_without_teardown`)."""
    exit_without_teardown(main(prog=Path(sys.argv[0]).name or "hdp-train"))


__all__ = ["init_distributed", "main", "run"]
