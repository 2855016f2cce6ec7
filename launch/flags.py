"""The flags of ``pretrain.py`` / ``hdp-train``, one argument group per section of
:class:`hdp.launch.config.RunConfig` (a group's title is its section's name).

Each flag checks its own value here (:mod:`hdp.argtypes`); a flag of a ``Literal`` field takes
its choices from the config (:func:`hdp.launch.config.choices`); rules between flags live in
:func:`hdp.launch.config.checked`. :func:`from_namespace` turns parsed flags into the config.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any, NoReturn

from hdp import GPU_PRESETS, MODEL_PRESETS
from hdp.argtypes import (
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
from hdp.workloads import workload_names

from .config import SECTIONS, PlanningConfig, RunConfig, TrainingConfig, choices
from .launcher import reports_errors
from .model_source import DEFAULT_MODEL
from .stopping import parse_signals

USAGE = """Pretrain a Llama-style model with hybrid data parallelism.

    torchrun --nproc-per-node 4 launch/pretrain.py --model tiny --workload wlb-128k \\
        --tokens-per-step 64K --max-seq 16K --steps 20 --metrics out/metrics.jsonl

Every rank is a data-parallel replica (FSDP2 over all ranks; one rank is not sharded). Each
step, rank 0 plans the next global batch in the background (--strategy), each rank reads only
its shards' tokens, runs the plan's waves with block-level P2P attention, and the optimizer
steps once. CUDA + NCCL + bf16 autocast where a GPU is present, CPU + gloo + fp32 otherwise.
hdp-train is the same program, installed as a command. It starts its own ranks with
--nproc-per-node N (hdp-train --nproc-per-node 4 --model tiny ...), or runs as one rank under
torchrun (torchrun --no-python --nproc-per-node 4 hdp-train ...) or srun (srun --ntasks-per-node
8 hdp-train ...). Multi-node: the same command on every node with --nnodes N --node-rank K
--rdzv-endpoint HOST:PORT, which srun fills in (see launch/slurm.sbatch)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every flag's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """A malformed command line: a one-line usage and argparse's error, printed once per
    screen (:func:`hdp.launch.launcher.reports_errors`); ``--help`` lists the flags."""

    def error(self, message: str) -> NoReturn:
        if reports_errors():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser(prog: str = "pretrain.py") -> argparse.ArgumentParser:
    """The parser of every flag, grouped by the config section each one sets."""
    p = Parser(
        prog=prog,
        usage="%(prog)s [--config RUN.toml] [FLAG ...]  (--help lists every flag)",
        description=USAGE.split("\n\n")[0],
        allow_abbrev=False,  # a --config file's flags are replaced by those given in full
        formatter_class=HelpFormatter,
        epilog=USAGE.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--config",
        type=input_file,
        default=None,
        metavar="RUN.toml",
        help='flags from a TOML file (keys are flag names, e.g. max-seq = "4K"; see '
        "examples/run.toml); flags on the command line replace the file's",
    )
    for name, add in SECTION_FLAGS.items():
        add(p.add_argument_group(name))
    return p


def exit_signals(text: str):
    try:
        return parse_signals(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--exit-signal: ")) from None


def _model_flags(g) -> None:
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
        type=number(1.0, exclusive=True),  # at most 1: every pair turns a radian per position
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


def _data_flags(g) -> None:
    source = g.add_mutually_exclusive_group()
    source.add_argument(
        "--data",
        action="append",
        default=None,
        metavar="PATH",
        help="training data: .jsonl, .parquet, a Megatron .bin/.idx prefix (repeat to mix)",
    )
    source.add_argument(
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
        type=size(2),  # a sequence of one token has no next token to train on
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
    g.add_argument(
        "--seed",
        type=integer(0, 2**32 - 1),
        default=0,
        help="seed of the initial weights and the data order",
    )


def _training_flags(g) -> None:
    g.add_argument("--steps", type=integer(1), default=20, help="train until this step")
    g.add_argument(
        "--nan-policy",
        choices=choices(TrainingConfig, "nan_policy"),
        default="stop",
        help="a step whose loss or gradient norm is not finite never updates the weights: stop "
        "the run there (default; exit status 3) or skip its update and go on, counting it in "
        "the metrics",
    )
    g.add_argument(
        "--exit-signal",
        type=exit_signals,
        default=",".join(s.name for s in TrainingConfig.exit_signals),
        metavar="SIGNALS",
        help="on any of these signals (comma-separated, or none) every rank finishes the step in "
        "hand, saves a checkpoint and exits 0; a second signal stops at once (default: "
        "%(default)s; torchrun forwards SIGUSR1 only with --signals-to-handle)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each decoder layer around its attention, and the loss, for any wave "
        "length (the first step says how long compiling took; default: on CUDA, where it "
        "measures faster, and not on CPU); see Note [Compiled layers] in launch/model.py",
    )
    g.add_argument(
        "--fused-loss",
        action="store_true",
        help="the LM head and cross-entropy as Liger-Kernel's fused kernel (CUDA; pip install "
        "'hdp-llm[liger]'): no logits are written out, instead of 4K-token chunks",
    )
    g.add_argument(
        "--attention-backend",
        type=choice(choices(TrainingConfig, "attention_backend"), "attention backend"),
        default="auto",
        help="attention kernels of dist_attn: auto (default: flash_attn, else torch_flash, else "
        "cudnn on Hopper and later; reference on CPU), or force one of "
        f"{', '.join(choices(TrainingConfig, 'attention_backend')[1:])}",
    )
    g.add_argument(
        "--device",
        choices=choices(TrainingConfig, "device"),
        default="auto",
        help="auto: one CUDA GPU per local rank where there are enough, else CPU (gloo)",
    )


def _optimizer_flags(g) -> None:
    # Upper ends far past any run that trains: an AdamW step moves a weight by about --lr, and
    # its decay by --lr x --weight-decay of it; beyond these, fp32 weights overflow.
    g.add_argument(
        "--lr",
        type=number(0.0, exclusive=True, max_value=1e6),
        default=3e-4,
        help="peak learning rate",
    )
    g.add_argument(
        "--warmup",
        type=integer(0),
        default=10,
        help="linear warm-up steps, then cosine decay to 10%%",
    )
    g.add_argument(
        "--lr-decay-steps",
        type=integer(1),
        default=None,
        help="step where the cosine decay reaches 10%% of --lr (default: --steps, or the "
        "checkpoint's when resuming, so an extended run keeps its schedule); a longer --warmup "
        "ends there",
    )
    g.add_argument(
        "--weight-decay", type=number(0.0, max_value=10.0), default=0.1, help="AdamW weight decay"
    )
    g.add_argument(
        "--grad-clip",
        type=number(0.0, max_value=1e6),
        default=1.0,
        help="max gradient norm (0: off)",
    )


def _planning_flags(g) -> None:
    g.add_argument(
        "--strategy",
        type=choice(choices(PlanningConfig, "strategy"), "strategy"),
        default="hdp",
        help=f"planning strategy: {', '.join(choices(PlanningConfig, 'strategy'))} (default hdp)",
    )
    g.add_argument(
        "--sync",
        choices=choices(PlanningConfig, "sync"),
        default=None,
        help="default: peer where memory allows",
    )
    g.add_argument(
        "--kv-exchange",
        choices=choices(PlanningConfig, "kv_exchange"),
        default="auto",
        help="how hdp plans move K/V between the ranks of a split sequence: rank (each rank "
        "fetches what it lacks), node (once per node, forwarded inside it), ulysses (all-to-alls "
        "over heads, at most one rank a head) or auto (default: the fastest the cost model "
        "predicts)",
    )
    g.add_argument(
        "--gpus-per-node",
        type=integer(1, MAX_RANKS),
        default=None,
        help="ranks that form one node for planning (default: torchrun's ranks per node); "
        "fewer make virtual nodes on one machine",
    )
    g.add_argument(
        "--capacity",
        type=size(1),
        default=None,
        help="tokens per rank per wave (default: from memory)",
    )
    g.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute layers in backward (default: only where --max-seq does not fit the "
        "ranks without it, and then only the fewest layers that hold a step in as few waves as "
        "recomputing every layer would)",
    )
    g.add_argument(
        "--checkpointed-layers",
        type=integer(0, 1 << 16),
        default=None,
        metavar="N",
        help="recompute only the first N decoder layers (implies --activation-checkpointing; "
        "default: every layer with --activation-checkpointing, the cost model's choice without)",
    )
    g.add_argument(
        "--keep-attention",
        action="store_true",
        help="with --activation-checkpointing, keep attention's q, k, v, output and LSE instead "
        "of recomputing attention in backward (the cost model plans for their memory; by "
        "default a run keeps them where that is the cheaper way to fit)",
    )
    gpu = g.add_mutually_exclusive_group()
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
    g.add_argument("--plan-ahead", type=integer(1), default=2, help="steps planned ahead")
    _hdp_search_flags(g)


def _hdp_search_flags(g) -> None:
    """The hdp search's options (:class:`hdp.planner.dynamic.DynamicOptions`) a run may set."""
    g.add_argument(
        "--plan-budget",
        type=number(0.0, max_value=1e6),
        default=None,
        metavar="SECONDS",
        help="--strategy hdp: seconds of one core its search may spend on a step past its first "
        "plan, in the loader's background thread (default: a 100th of the step, at least 0.05)",
    )
    g.add_argument(
        "--max-ranks-per-seq",
        type=integer(1, MAX_RANKS),
        default=None,
        metavar="RANKS",
        help="--strategy hdp: the most ranks one sequence may span (default: as many as make it "
        "faster)",
    )


def _checkpointing_flags(g) -> None:
    g.add_argument(
        "--checkpoint-dir",
        type=output_dir,
        default=None,
        help="where checkpoints go (default: none are saved); see docs/reliability.md",
    )
    g.add_argument(
        "--save-every",
        type=integer(0),
        default=0,
        help="checkpoint every N steps (and at the end; 0: only at the end)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest valid checkpoint in --checkpoint-dir (none, or only "
        "unfinished saves: from step 0). Checkpoints are trusted input: their metadata is a "
        "pickle",
    )
    g.add_argument(
        "--resume-step",
        type=integer(1),
        default=None,
        metavar="STEP",
        help="resume from this step's checkpoint instead of the newest (implies --resume; newer "
        "checkpoints must be moved away first)",
    )
    g.add_argument(
        "--allow-changed-setup",
        action="store_true",
        help="resume although the data, planning or optimizer setup differs from the "
        "checkpoint's (changed data restarts the data position)",
    )


def _output_flags(g) -> None:
    g.add_argument(
        "--metrics",
        type=output_file,
        default=None,
        help="one JSON object per step, appended to this file; the rows of steps this run "
        "trains (again) are replaced",
    )
    g.add_argument(
        "--tensorboard",
        type=output_dir,
        default=None,
        metavar="DIR",
        help="also write every metrics field as a TensorBoard scalar here (needs the "
        "tensorboard package)",
    )
    g.add_argument(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="also log every metrics field to this Weights & Biases project (needs wandb)",
    )
    g.add_argument("--log-every", type=integer(1), default=1, help="log a line every N steps")


def _launcher_flags(g) -> None:
    g.add_argument(
        "--nproc-per-node",
        type=integer(1, MAX_RANKS),
        default=None,
        metavar="N",
        help="start N ranks on this node and watch them (instead of torchrun): signals are "
        "forwarded, a failed rank is reported in one line, each rank's output goes to "
        "--log-dir (rank 0's to the screen too)",
    )
    g.add_argument(
        "--nnodes",
        type=integer(1, MAX_RANKS),
        default=None,
        help="nodes in the job, each running this command (default: 1, or SLURM_NNODES under srun)",
    )
    g.add_argument(
        "--node-rank",
        type=integer(0, MAX_RANKS),
        default=None,
        metavar="K",
        help="this node's index (default: 0, or SLURM_NODEID under srun)",
    )
    g.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST[:PORT]",
        help="where node 0's rank 0 listens for the others (default: this host on a free port "
        "for one node; under srun the job's first node, port 20000 + job id mod 20000)",
    )
    g.add_argument(
        "--log-dir",
        type=output_dir,
        default=None,
        metavar="DIR",
        help="each rank's full output as rankR.log (default: CHECKPOINT_DIR/logs/TIME, or a "
        "new temporary directory; the launcher names it)",
    )


SECTION_FLAGS = {
    "model": _model_flags,
    "data": _data_flags,
    "training": _training_flags,
    "optimizer": _optimizer_flags,
    "planning": _planning_flags,
    "checkpointing": _checkpointing_flags,
    "output": _output_flags,
    "launcher": _launcher_flags,
}


def section_dests(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """{section: the ``dest`` of each flag in its group}."""
    return {
        group.title: [a.dest for a in group._group_actions]
        for group in parser._action_groups
        if group.title in SECTION_FLAGS
    }


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


__all__ = ["SECTION_FLAGS", "USAGE", "build_parser", "from_namespace", "section_dests"]
