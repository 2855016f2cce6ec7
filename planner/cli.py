"""Command-line tools: ``hdp-sim`` (compare strategies on sampled batches) and ``hdp-plan``
(plan one global batch and write PLAN.json)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hdp import (
    BACKEND_NAMES,
    GPU_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    GPUProfile,
    format_size,
    gpu_preset,
    model_spec,
    plural,
)
from hdp.argtypes import MAX_RANKS, command, integer, model, output_file, size
from hdp.workloads import file_workload, get_workload, read_lengths, split_long, workload_names

from . import STRATEGIES, PlanningError, StepPricing, get_strategy, plan_and_evaluate
from .hybridcp import scheduler_name
from .strategies import add_option_flags, options_from_flags

# Sizes and counts of 0 are refused, not read as "the default": every flag is checked as given.
_size = size(1)
_positive = integer(1)
_ranks = integer(1, MAX_RANKS)


def _add_cluster_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster and model")
    g.add_argument("--gpus", type=_ranks, required=True, help="number of GPUs (ranks)")
    g.add_argument(
        "--gpus-per-node",
        type=_ranks,
        default=8,
        help="GPUs per node sharing NVLink (default 8)",
    )
    gpu = g.add_mutually_exclusive_group()
    gpu.add_argument(
        "--gpu", default="h100", help=f"GPU preset: {', '.join(GPU_PRESETS)} (default h100)"
    )
    gpu.add_argument(
        "--gpu-profile",
        metavar="PROFILE.json",
        default=None,
        help="GPU profile file (from hdp-calibrate measure) instead of a preset",
    )
    g.add_argument(
        "--model",
        type=model,
        default="llama-7b",
        metavar="NAME|CONFIG",
        help=f"model preset ({', '.join(MODEL_PRESETS)}; default llama-7b) or a transformers "
        "config.json (or its directory)",
    )
    g.add_argument(
        "--attention-backend",
        choices=("auto", *BACKEND_NAMES),
        default="auto",
        help="the attention kernels priced, from the GPU profile's rows measured with them "
        "(flash_attn: torch_flash's where it has none); auto (default): the profile's own, "
        "what training runs by default (FlashAttention on GPUs, the reference on a CPU profile)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="price the decoder layers and the loss as torch.compile runs them, as hdp-train "
        "does by default on CUDA (default: eager, as the baselines' own systems run)",
    )
    g.add_argument(
        "--capacity",
        type=_size,
        default=None,
        help="most tokens one rank holds in one wave (default: derived from GPU memory and the "
        "model)",
    )
    g.add_argument(
        "--sync",
        choices=("wave", "peer"),
        default=None,
        help="synchronisation mode for every strategy (default: each strategy's own where memory "
        "allows)",
    )
    add_option_flags(g)
    g.add_argument(
        "--kv-exchange",
        choices=("auto", "rank", "node", "ulysses"),
        default="auto",
        help="how hdp plans move K/V between the ranks of a split sequence: rank (each rank "
        "fetches what it lacks), node (once per node, forwarded over NVLink), ulysses "
        "(all-to-alls over heads, at most one rank a head) or auto (default: the fastest the "
        "cost model predicts); the baselines exchange K/V as their own systems do",
    )


# Beyond this many ranks a CPU profile is more likely a mistake than a CPU cluster.
CPU_RANKS_EXPECTED = 8


def _pricing(args: argparse.Namespace, strategy: str | None = None) -> StepPricing:
    """The one pricing of the flags (``strategy``: the one strategy planned, if one)."""
    cluster, model = _specs(args)
    asked = args.attention_backend
    backend = None if asked == "auto" else cluster.gpu.tables.rows_for(asked)
    if asked != "auto" and backend is None:
        raise ValueError(
            f"--attention-backend {asked}: the {cluster.gpu.name} profile has no attention rows "
            f"for it (it has {', '.join(cluster.gpu.tables.attention_backends)}); measure them "
            "with hdp-calibrate measure, or choose another"
        )
    pricing = StepPricing.build(
        model,
        cluster,
        attention_backend=backend,
        compiled=args.compile,
        capacity=args.capacity,
        sync=args.sync,
        kv_exchange=args.kv_exchange,
        tensor_parallel=getattr(args, "tp", 1),
    )
    return pricing if strategy is None else pricing.for_strategy(get_strategy(strategy))


def _specs(args: argparse.Namespace) -> tuple[ClusterSpec, object]:
    gpu = GPUProfile.load(args.gpu_profile) if args.gpu_profile else gpu_preset(args.gpu)
    if gpu.attention_backend == "reference" and args.gpus > CPU_RANKS_EXPECTED:
        print(
            f"warning: the {gpu.name} profile prices CPU ranks (reference attention, host "
            f"memory), so {args.gpus} ranks on it are a CPU cluster; for GPUs pass --gpu h100 "
            "or a GPU's profile",
            file=sys.stderr,
        )
    return ClusterSpec(args.gpus, args.gpus_per_node, gpu), model_spec(args.model)


def _strategies(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {', '.join(unknown) or '(none)'}: choose from "
            f"{', '.join(STRATEGIES)}"
        )
    return names


def sim_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hdp-sim",
        description="Predict step time, balance, memory and communication of every planning "
        "strategy on sampled "
        "global batches of a workload, with one cost model.",
        epilog="example: hdp-sim --workload byted-2m --gpus 1024 --max-seq 2M --model llama-7b "
        "--plot out.png",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", help=f"standard workload: {', '.join(workload_names())}")
    src.add_argument(
        "--lengths",
        type=Path,
        help="file of sequence lengths to sample from, one integer per line (.gz ok)",
    )
    _add_cluster_model_args(p)
    p.add_argument(
        "--tp",
        type=integer(1, 64),
        default=1,
        metavar="N",
        help="tensor parallelism folded into a rank: every rank of the plans is a group of N GPUs "
        "of one node (Megatron's TP with sequence parallelism: 1/N of the heads, MLP and "
        "vocabulary per GPU, its all-gathers and reduce-scatters priced on NVLink); --gpus "
        "counts GPUs and --capacity a group's tokens (default 1)",
    )
    p.add_argument(
        "--max-seq",
        type=_size,
        default=None,
        help="longest sequence; longer documents are split (default: the workload's)",
    )
    p.add_argument(
        "--tokens-per-step",
        type=_size,
        default=None,
        help="global batch in tokens (default: the workload's; 32M for --lengths)",
    )
    p.add_argument(
        "--strategies",
        type=_strategies,
        default=list(STRATEGIES),
        help=f"comma-separated (default: {','.join(STRATEGIES)})",
    )
    p.add_argument(
        "--untuned",
        action="store_true",
        help="run each baseline's knobs not set by a flag at its system's rule, instead of "
        "searching them for the least mean step (what each baseline was searched over is "
        "printed under the table)",
    )
    p.add_argument(
        "--steps", type=integer(1, 100_000), default=3, help="global batches to sample (default 3)"
    )
    p.add_argument(
        "--seed", type=integer(0, 2**32 - 1), default=0, help="sampling seed (default 0)"
    )
    p.add_argument("--json", type=output_file, default=None, help="write results as JSON")
    p.add_argument(
        "--plot",
        type=output_file,
        default=None,
        help="write a PNG: strategies compared, per-rank timelines",
    )
    return p


# The most sequences hdp-sim plans in one step: sampling and planning grow with them, and this
# many take tens of seconds a step; the workloads' own steps hold a few thousand.
MAX_SIM_SEQUENCES = 1 << 22


def _check_step_size(workload, max_seq: int | None, tokens_per_step: int | None) -> None:
    """ValueError where a step would hold more than ``MAX_SIM_SEQUENCES`` sequences: at least
    the step's tokens over the shorter of the mean length and ``--max-seq``."""
    cap = max_seq or workload.max_seq
    tokens = tokens_per_step or workload.tokens_per_step
    expected = tokens / min(workload.mean_length, cap)
    if expected > MAX_SIM_SEQUENCES:
        raise ValueError(
            f"a step of {format_size(tokens)} tokens in sequences of at most {format_size(cap)} "
            f"holds about {expected:,.0f} sequences, past the {MAX_SIM_SEQUENCES:,} hdp-sim "
            "plans: lower --tokens-per-step or raise --max-seq"
        )


@command
def sim_main(argv: list[str] | None = None) -> int:
    from .plot import plot_simulation
    from .sim import format_table, simulate, stderr_progress

    parser = sim_parser()
    args = parser.parse_args(argv)
    if args.plot and not _has_matplotlib():
        parser.error("--plot needs matplotlib: pip install matplotlib, or leave out --plot")
    try:
        pricing = _pricing(args)
        cluster, model = pricing.cluster, pricing.model
        workload = (
            get_workload(args.workload)
            if args.workload
            else file_workload(args.lengths, args.max_seq, args.tokens_per_step)
        )
        _check_step_size(workload, args.max_seq, args.tokens_per_step)
        t0 = time.perf_counter()
        sim = simulate(
            workload,
            pricing,
            args.strategies,
            steps=args.steps,
            seed=args.seed,
            max_seq=args.max_seq,
            tokens_per_step=args.tokens_per_step,
            options={s: options_from_flags(STRATEGIES[s], args) for s in args.strategies},
            progress=stderr_progress,
            tune_knobs=not args.untuned,
        )
        errors = {r.error for r in sim.results.values()}
        if len(errors) == 1 and None not in errors:  # the setup fails every strategy alike
            raise ValueError(errors.pop())
        c = sim.config
        ranks = f"{cluster.num_ranks} x {cluster.gpu.name} ({cluster.ranks_per_node} per node"
        if args.tp > 1:
            ranks = (
                f"{args.gpus} x {cluster.gpu.name} as {cluster.num_ranks} tensor-parallel "
                f"groups of {args.tp} ({cluster.ranks_per_node} groups per node"
            )
        peer = f"{c['capacity_peer']} (peer)"
        if not c["capacity_peer"]:  # a reader takes "0" for a bug, not for a full GPU
            peer = "0 (peer: the unsharded weights leave no room)"
        print(
            f"{c['workload']}: {model.name} on {ranks}, {c['attention_backend']} attention), "
            f"max_seq {c['max_seq']}, {c['tokens_per_step']} tokens/step, capacity "
            f"{peer} / {c['capacity_wave']} (wave) tokens per rank, "
            f"{plural(c['steps'], 'step')}, seed {c['seed']}"
        )
        print(format_table(sim))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)  # as --metrics of training
            args.json.write_text(json.dumps(sim.to_json(), indent=1) + "\n")
            print(f"wrote {args.json}")
        if args.plot:
            args.plot.parent.mkdir(parents=True, exist_ok=True)
            plot_simulation(sim, args.plot)
            print(f"wrote {args.plot}")
        print(f"simulated in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    except (ValueError, OSError) as e:
        print(f"hdp-sim: error: {e}", file=sys.stderr)
        return 2
    return 0 if all(r.error is None for r in sim.results.values()) else 1


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hdp-plan",
        description="Plan one global batch (the lengths in a file) and write PLAN.json: for every "
        "wave and rank, "
        "the [sequence, start, end] shards it holds, plus the cost model's predictions.",
    )
    p.add_argument(
        "--lengths",
        type=Path,
        required=True,
        help="sequence lengths of the batch, one integer per line (.gz ok)",
    )
    _add_cluster_model_args(p)
    p.add_argument(
        "--strategy",
        choices=list(STRATEGIES),
        default="hdp",
        help="planning strategy (default hdp)",
    )
    p.add_argument(
        "--max-seq",
        type=_size,
        default=None,
        help="split sequences longer than this first (default: no split)",
    )
    p.add_argument("--out", type=output_file, required=True, help="where to write PLAN.json")
    return p


@command
def plan_main(argv: list[str] | None = None) -> int:
    args = plan_parser().parse_args(argv)
    try:
        pricing = _pricing(args, args.strategy)
        cluster = pricing.cluster
        lens = read_lengths(args.lengths)
        if args.max_seq:
            lens = split_long(lens, args.max_seq)
        plan, report = plan_and_evaluate(
            lens,
            pricing,
            args.strategy,
            max_seq=args.max_seq,
            options=options_from_flags(STRATEGIES[args.strategy], args),
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plan.save(args.out)
    except PlanningError as e:
        print(f"hdp-plan: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"hdp-plan: error: {e}", file=sys.stderr)
        return 2
    p = plan.predicted
    by = f"; planned by {scheduler_name(plan)}" if args.strategy == "hybridcp" else ""
    print(
        f"{args.strategy}: {plural(lens.size, 'sequence')}, {int(lens.sum())} tokens on "
        f"{plural(cluster.num_ranks, 'rank')} in {plural(plan.num_waves, 'wave')} ({plan.sync} "
        f"sync), {plural(plan.num_shards, 'shard')}{by}"
    )
    print(
        f"predicted step {p['step_time_s']:.3f} s, lower bound {p['lower_bound_s']:.3f} s "
        f"({p['step_time_s'] / p['lower_bound_s']:.2f}x), imbalance {p['imbalance']:.2f}, exposed "
        "comm "
        f"{p['exposed_comm_s']:.3f} s, peak memory {p['peak_mem_bytes'] / 1e9:.1f} GB, planned in "
        f"{p['plan_time_s']:.3f} s"
    )
    n = cluster.num_ranks
    print(
        f"K/V exchange {plan.kv_exchange}: {p['nic_bytes'] / 1e9 / n:.2f} GB per rank over NICs, "
        f"{p['nvlink_bytes'] / 1e9 / n:.2f} GB per rank over NVLink per step (as hdp-sim's "
        "columns)"
    )
    print(f"wrote {args.out}")
    return 0
