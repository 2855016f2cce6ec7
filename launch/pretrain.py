#!/usr/bin/env python3
"""Pretrain a Llama-style model with hybrid data parallelism.

    torchrun --nproc-per-node 4 launch/pretrain.py --model tiny --workload wlb-128k \\
        --tokens-per-step 64K --max-seq 16K --steps 20 --metrics out/metrics.jsonl

Every rank is a data-parallel replica (FSDP2 over all ranks). Each step, rank 0 plans the next
global batch in the background (``--strategy``), each rank reads only its shards' tokens, runs
the plan's waves with block-level P2P attention, and the optimizer steps once. CUDA + NCCL + bf16
autocast where a GPU is present, CPU + gloo + fp32 otherwise. Multi-node: run the same torchrun
command on every node with ``--nnodes N --node-rank K --rdzv-endpoint HOST:PORT`` (see
``launch/slurm.sbatch``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Run from a checkout without installing: the repository root goes first on sys.path. Python put
# this script's folder there, where model.py, train.py, ... would be top-level modules shadowing
# any others of those names; from the root they are launch.model, launch.train, ...
_HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or os.curdir).resolve() == _HERE:
    del sys.path[0]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from attention import BACKEND_NAMES  # noqa: E402
from hdp import GPU_PRESETS, MODEL_PRESETS, GPUProfile, format_size  # noqa: E402
from hdp.argtypes import (  # noqa: E402
    MAX_DOCUMENTS,
    MAX_RANKS,
    choice,
    input_dir,
    input_file,
    input_file_or_dir,
    integer,
    model,
    number,
    number_list,
    output_dir,
    output_file,
    rope_scaling,
    size,
)
from hdp.profile import ProfileError  # noqa: E402
from hdp.workloads import workload_names  # noqa: E402
from launch.config_file import ConfigFileError, config_argv  # noqa: E402
from launch.loggers import missing_package  # noqa: E402
from launch.model_source import DEFAULT_MODEL, model_source  # noqa: E402
from launch.runtime import exit_without_teardown  # noqa: E402
from launch.stopping import DEFAULT_SIGNALS, parse_signals  # noqa: E402
from launch.train import kill_point, train  # noqa: E402
from planner import STRATEGIES  # noqa: E402

# Without --tokens-per-step a step holds this many tokens, or one --max-seq sequence if longer.
DEFAULT_TOKENS_PER_STEP = 64 << 10


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every flag's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pretrain.py",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,  # a --config file's flags are replaced by those given in full
        formatter_class=HelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--config",
        type=input_file,
        default=None,
        metavar="RUN.toml",
        help='flags from a TOML file (keys are flag names, e.g. max-seq = "4K"; see '
        "examples/run.toml); flags on the command line replace the file's",
    )
    add_model_args(p.add_argument_group("model"))
    add_data_args(p.add_argument_group("data"))
    add_training_args(p.add_argument_group("training"))
    add_planning_args(p.add_argument_group("planning"))
    add_output_args(p.add_argument_group("output"))
    argv = sys.argv[1:] if argv is None else list(argv)
    config, _ = p.parse_known_args(argv)  # --config first: its flags go before the others
    if config.config is not None:
        try:
            argv = config_argv(config.config, p, argv) + argv
        except ConfigFileError as e:
            p.error(str(e))
    args = p.parse_args(argv)
    check_combinations(p, args)
    return args


def check_combinations(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What no single flag's type can check: flags against each other and the environment."""
    if args.resume_step is not None:
        args.resume = True
    if args.resume and args.checkpoint_dir is None:
        p.error(f"{'--resume-step' if args.resume_step else '--resume'} needs --checkpoint-dir")
    if args.keep_attention:
        if args.activation_checkpointing is False:
            p.error("--keep-attention applies with --activation-checkpointing")
        args.activation_checkpointing = True
    if args.allow_changed_setup and not args.resume:
        p.error("--allow-changed-setup only applies with --resume")
    if args.kv_exchange != "auto" and args.strategy != "hdp":
        p.error(
            f"--kv-exchange {args.kv_exchange} applies to --strategy hdp: the baselines exchange "
            "K/V as their own systems do"
        )
    if args.tokens_per_step is None:
        args.tokens_per_step = max(DEFAULT_TOKENS_PER_STEP, args.max_seq)
    elif args.max_seq > args.tokens_per_step:
        p.error(
            f"--max-seq ({format_size(args.max_seq)}) exceeds --tokens-per-step "
            f"({format_size(args.tokens_per_step)}): a sequence must fit in one global batch; "
            "raise --tokens-per-step or leave it out"
        )
    if args.data_weights is not None:
        n = len(args.data) if args.data else 0
        if n != len(args.data_weights):
            p.error(
                f"--data-weights has {len(args.data_weights)} weights for {n} --data sources: "
                "give one per --data"
            )
    for flag in ("tensorboard", "wandb"):
        if getattr(args, flag) and (why := missing_package(flag)):
            p.error(why)
    try:
        kill_point()
        model_source(args)
    except ValueError as e:
        p.error(str(e))
    if args.gpu_profile:
        try:
            GPUProfile.load(args.gpu_profile)
        except ProfileError as e:
            p.error(str(e))


def add_model_args(g) -> None:
    g.add_argument(
        "--model",
        type=model,
        default=None,
        metavar="NAME|CONFIG",
        help=f"model preset ({', '.join(MODEL_PRESETS)}; default {DEFAULT_MODEL}) or a "
        "transformers config.json (or its directory) to train from random weights",
    )
    g.add_argument(
        "--init-from",
        type=input_dir,
        default=None,
        metavar="DIR",
        help="start from a Hugging Face checkpoint: DIR holds config.json and model.safetensors "
        "(or shards with model.safetensors.index.json); llama, mistral, qwen2, qwen3",
    )
    g.add_argument(
        "--rope-theta",
        type=number(0.0, exclusive=True),
        default=None,
        help="RoPE base for context extension (default: the model's)",
    )
    g.add_argument(
        "--rope-scaling",
        type=rope_scaling,
        default=None,
        metavar="JSON",
        help="RoPE scaling in transformers' keys, replacing the model's, e.g. "
        '\'{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}\' '
        "(linear, llama3, yarn; null: none)",
    )


def add_data_args(g) -> None:
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--data",
        action="append",
        default=None,
        metavar="PATH",
        help="training data: .jsonl, .parquet, a Megatron .bin/.idx prefix (repeat to mix)",
    )
    src.add_argument(
        "--workload",
        type=choice(workload_names(), "workload"),
        default=None,
        help="synthetic data with lengths of a standard workload "
        "(default when no --data: wlb-128k)",
    )
    g.add_argument(
        "--data-weights",
        type=number_list,
        default=None,
        help="comma-separated token weights of the --data sources",
    )
    g.add_argument(
        "--tokenizer",
        type=input_file_or_dir,
        default=None,
        help="tokenizer.json, or a Hugging Face tokenizer directory, for 'text' records "
        "(default: the --init-from directory's, else UTF-8 bytes)",
    )
    g.add_argument(
        "--synthetic-docs",
        type=integer(1, MAX_DOCUMENTS),
        default=20000,
        help="documents of the synthetic corpus",
    )
    g.add_argument(
        "--max-seq",
        type=size(1),
        default=16 << 10,
        help="longest sequence (default 16K)",
    )
    g.add_argument(
        "--tokens-per-step",
        type=size(1),
        default=None,
        help="global batch in tokens (default: 64K, or --max-seq if larger)",
    )
    g.add_argument(
        "--truncate",
        action="store_true",
        help="truncate documents longer than --max-seq instead of splitting",
    )
    g.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="skip and count bad records instead of failing",
    )


def add_training_args(t) -> None:
    t.add_argument("--steps", type=integer(1), default=20, help="train until this step")
    t.add_argument(
        "--seed",
        type=integer(0, 2**32 - 1),
        default=0,
        help="seed of the initial weights and the data order",
    )
    t.add_argument(
        "--lr", type=number(0.0, exclusive=True), default=3e-4, help="peak learning rate"
    )
    t.add_argument(
        "--warmup",
        type=integer(0),
        default=10,
        help="linear warm-up steps, then cosine decay to 10%%",
    )
    t.add_argument(
        "--lr-decay-steps",
        type=integer(1),
        default=None,
        help="step where the cosine decay reaches 10%% of --lr (default: --steps, or the "
        "checkpoint's when resuming, so an extended run keeps its schedule); a longer --warmup "
        "ends there",
    )
    t.add_argument("--weight-decay", type=number(0.0), default=0.1, help="AdamW weight decay")
    t.add_argument("--grad-clip", type=number(0.0), default=1.0, help="max gradient norm (0: off)")
    t.add_argument(
        "--nan-policy",
        choices=("stop", "skip"),
        default="stop",
        help="a step whose loss or gradient norm is not finite never updates the weights: stop "
        "the run there (default; exit status 3) or skip its update and go on, counting it in "
        "the metrics",
    )
    t.add_argument(
        "--exit-signal",
        type=exit_signals,
        default=",".join(DEFAULT_SIGNALS),
        metavar="SIGNALS",
        help="on any of these signals (comma-separated, or none) every rank finishes the step in "
        "hand, saves a checkpoint and exits 0; a second signal stops at once (default: "
        "%(default)s; torchrun forwards SIGUSR1 only with --signals-to-handle)",
    )
    t.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute each layer in backward (default: only where --max-seq does not fit the "
        "ranks without it)",
    )
    t.add_argument(
        "--keep-attention",
        action="store_true",
        help="with --activation-checkpointing, keep attention's output and LSE instead of "
        "recomputing attention in backward (more memory than the cost model plans for: lower "
        "--capacity if memory runs out)",
    )
    t.add_argument("--compile", action="store_true", help="torch.compile the decoder layers (GPU)")
    t.add_argument(
        "--attention-backend",
        type=choice(["auto", *BACKEND_NAMES], "attention backend"),
        default="auto",
        help="attention kernels of dist_attn: auto (default: flash_attn, else torch_flash, else "
        "cudnn on Hopper and later; reference on CPU), or force one of "
        f"{', '.join(BACKEND_NAMES)}",
    )


def exit_signals(text: str):
    try:
        return parse_signals(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--exit-signal: ")) from None


def add_planning_args(pl) -> None:
    pl.add_argument(
        "--strategy",
        type=choice(list(STRATEGIES), "strategy"),
        default="hdp",
        help=f"planning strategy: {', '.join(STRATEGIES)} (default hdp)",
    )
    pl.add_argument(
        "--sync", choices=("wave", "peer"), default=None, help="default: peer where memory allows"
    )
    pl.add_argument(
        "--kv-exchange",
        choices=("auto", "rank", "node"),
        default="auto",
        help="how hdp plans move K/V between nodes: rank (each rank fetches what it lacks), "
        "node (once per node, forwarded inside it) or auto (default: node on more than one node "
        "where the cost model predicts it faster)",
    )
    pl.add_argument(
        "--gpus-per-node",
        type=integer(1, MAX_RANKS),
        default=None,
        help="ranks that form one node for planning (default: torchrun's ranks per node); "
        "fewer make virtual nodes on one machine",
    )
    pl.add_argument(
        "--capacity",
        type=size(1),
        default=None,
        help="tokens per rank per wave (default: from memory)",
    )
    pl.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: one CUDA GPU per local rank where there are enough, else CPU (gloo)",
    )
    gpu = pl.add_mutually_exclusive_group()
    gpu.add_argument(
        "--gpu",
        type=choice(list(GPU_PRESETS), "GPU preset"),
        default=None,
        help=f"GPU preset for planning: {', '.join(GPU_PRESETS)} (default: detected)",
    )
    gpu.add_argument(
        "--gpu-profile",
        metavar="PROFILE.json",
        default=None,
        help="GPU profile file for planning (from hdp-calibrate measure) instead of a preset",
    )
    pl.add_argument("--plan-ahead", type=integer(1), default=2, help="steps planned ahead")


def add_output_args(o) -> None:
    o.add_argument(
        "--metrics",
        type=output_file,
        default=None,
        help="one JSON object per step, appended to this file; the rows of steps this run "
        "trains (again) are replaced",
    )
    o.add_argument(
        "--tensorboard",
        type=output_dir,
        default=None,
        metavar="DIR",
        help="also write every metrics field as a TensorBoard scalar here (needs the "
        "tensorboard package)",
    )
    o.add_argument(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="also log every metrics field to this Weights & Biases project (needs wandb)",
    )
    o.add_argument("--log-every", type=integer(1), default=1, help="log a line every N steps")
    o.add_argument(
        "--checkpoint-dir",
        type=output_dir,
        default=None,
        help="where checkpoints go (default: none are saved); see docs/reliability.md",
    )
    o.add_argument(
        "--save-every",
        type=integer(0),
        default=0,
        help="checkpoint every N steps (and at the end; 0: only at the end)",
    )
    o.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest valid checkpoint in --checkpoint-dir (none, or only "
        "unfinished saves: from step 0). Checkpoints are trusted input: their metadata is a "
        "pickle",
    )
    o.add_argument(
        "--resume-step",
        type=integer(1),
        default=None,
        metavar="STEP",
        help="resume from this step's checkpoint instead of the newest (implies --resume; newer "
        "checkpoints must be moved away first)",
    )
    o.add_argument(
        "--allow-changed-setup",
        action="store_true",
        help="resume although the data, planning or optimizer setup differs from the "
        "checkpoint's (changed data restarts the data position)",
    )


def init_distributed(device_kind: str = "auto") -> tuple[int, int, int, torch.device]:
    """(rank, world, ranks per node, device) from torchrun's environment (NCCL on CUDA, gloo on
    CPU); a plain ``python pretrain.py`` runs one rank without a process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_kind == "cuda" and local_world > gpus:
        raise SystemExit(
            f"pretrain.py: error: --device cuda with {local_world} ranks per node, but this node "
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


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, per_node, device = init_distributed(args.device)
    try:
        code = train(args, rank=rank, world=world, per_node=per_node, device=device)
        if dist.is_initialized():
            dist.barrier()  # leave together: no rank closes its sockets while a peer still reads
        return code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    exit_without_teardown(main())
