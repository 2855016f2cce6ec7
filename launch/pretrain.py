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
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # run from a checkout without installing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hdp import (
    GPU_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    CostModel,
    gpu_preset,
    model_preset,
    parse_size,
)  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pretrain.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model", default="tiny", choices=list(MODEL_PRESETS), help="model preset (default tiny)"
    )
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
        default=None,
        help="synthetic data with lengths of a standard workload "
        "(default when no --data: wlb-128k)",
    )
    g.add_argument(
        "--data-weights", default=None, help="comma-separated token weights of the --data sources"
    )
    g.add_argument(
        "--tokenizer", default=None, help="tokenizer.json for 'text' records (default: UTF-8 bytes)"
    )
    g.add_argument(
        "--synthetic-docs", type=int, default=20000, help="documents of the synthetic corpus"
    )
    g.add_argument(
        "--max-seq",
        type=parse_size,
        default=parse_size("16K"),
        help="longest sequence (default 16K)",
    )
    g.add_argument(
        "--tokens-per-step",
        type=parse_size,
        default=parse_size("64K"),
        help="global batch in tokens",
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
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument(
        "--warmup", type=int, default=10, help="linear warm-up steps, then cosine decay to 10%%"
    )
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    t.add_argument("--activation-checkpointing", action="store_true")
    t.add_argument("--compile", action="store_true", help="torch.compile the decoder layers (GPU)")
    pl = p.add_argument_group("planning")
    pl.add_argument("--strategy", default="hdp", help="hdp, static, hybridcp or bytescale")
    pl.add_argument(
        "--sync", choices=("wave", "peer"), default=None, help="default: peer where memory allows"
    )
    pl.add_argument(
        "--capacity",
        type=parse_size,
        default=None,
        help="tokens per rank per wave (default: from memory)",
    )
    pl.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: one CUDA GPU per local rank where there are enough, else CPU (gloo)",
    )
    pl.add_argument(
        "--gpu",
        default=None,
        help=f"GPU profile for planning: {', '.join(GPU_PRESETS)} (default: detected)",
    )
    pl.add_argument("--plan-ahead", type=int, default=2)
    o = p.add_argument_group("output")
    o.add_argument(
        "--metrics", type=Path, default=None, help="append one JSON object per step to this file"
    )
    o.add_argument("--log-every", type=int, default=1)
    o.add_argument("--checkpoint-dir", type=Path, default=None)
    o.add_argument(
        "--save-every", type=int, default=0, help="checkpoint every N steps (and at the end)"
    )
    o.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir",
    )
    args = p.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        p.error("--resume needs --checkpoint-dir")
    if args.max_seq > args.tokens_per_step:
        p.error(
            f"--max-seq ({args.max_seq}) exceeds --tokens-per-step ({args.tokens_per_step}): "
            "a sequence must fit in one global batch"
        )
    if args.steps < 1 or args.plan_ahead < 1 or args.log_every < 1:
        p.error("--steps, --plan-ahead and --log-every must be >= 1")
    return args


def init_distributed(device_kind: str = "auto") -> tuple[int, int, int, torch.device]:
    """(rank, world, ranks per node, device) from torchrun's environment (NCCL on CUDA, gloo on
    CPU); a plain ``python pretrain.py`` runs one rank without a process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_kind == "cuda" and local_world > gpus:
        raise SystemExit(
            f"pretrain.py: error: --device cuda with {local_world} ranks per node, but this node has "
            f"{gpus} CUDA GPUs: use --nproc-per-node {gpus} or --device cpu"
        )
    if device_kind == "cuda" or (device_kind == "auto" and 0 < local_world <= gpus):
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:  # torchrun: FSDP2 over all ranks, one rank included
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))), device


def detect_gpu(device: torch.device) -> str:
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


def build_sources(args, vocab: int):
    from dataloader import SyntheticSource, load_tokenizer, open_source

    if args.data:
        tok = load_tokenizer(args.tokenizer)
        return [open_source(p, tok, vocab, args.skip_bad_records) for p in args.data]
    return [SyntheticSource(args.workload or "wlb-128k", args.synthetic_docs, vocab, args.seed)]


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, per_node, device = init_distributed(args.device)
    try:
        code = train(args, rank, world, per_node, device)
        if dist.is_initialized():
            dist.barrier()  # leave together: no rank closes its sockets while a peer still reads
        return code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args, rank: int, world: int, per_node: int, device: torch.device) -> int:
    from attention import COMM
    from dataloader import BatchStream, DataError, HDPDataLoader
    from hdp import checkpoint
    from hdp.model import Llama
    from hdp.runtime import run_waves, shard_model
    from planner import OFFLOADING, PlanningError, choose_sync

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    spec = model_preset(args.model)
    if device.type == "cpu" and spec.dtype_bytes != 4:
        from dataclasses import replace

        spec = replace(spec, dtype_bytes=4)  # fp32 on CPU
    cluster = ClusterSpec(world, min(per_node, world), gpu_preset(args.gpu or detect_gpu(device)))
    cost = CostModel(
        spec,
        cluster,
        activation_checkpointing=args.activation_checkpointing,
        capacity_override=args.capacity,
    )
    try:
        sync, cap = choose_sync(
            cost, "peer", args.max_seq, args.sync, offload=args.strategy in OFFLOADING
        )
        sources = build_sources(args, spec.vocab)
        weights = [float(x) for x in args.data_weights.split(",")] if args.data_weights else None
        stream = BatchStream(
            [s.lengths for s in sources],
            args.tokens_per_step,
            args.max_seq,
            seed=args.seed,
            weights=weights,
            truncate=args.truncate,
        )
    except (PlanningError, DataError, ValueError) as e:
        log(f"pretrain.py: error: {e}")
        return 2
    loader = HDPDataLoader(
        sources,
        stream,
        cluster,
        spec,
        args.strategy,
        plan_ahead=args.plan_ahead,
        plan_options={
            "sync": sync,
            "capacity": args.capacity,
            "activation_checkpointing": args.activation_checkpointing,
        },
    )
    torch.manual_seed(args.seed)  # identical initial weights on every rank, sharded below
    model = Llama(
        spec,
        activation_checkpointing=args.activation_checkpointing,
        loss_chunk_tokens=cost.loss_chunk_tokens,
    ).to(device)
    if args.compile:
        for layer in model.layers:
            layer.mlp.compile()
    if dist.is_initialized():
        shard_model(model, sync, mixed_precision=device.type == "cuda")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup, args.steps))
    start = 0
    if args.resume:
        path = checkpoint.latest(args.checkpoint_dir)
        if path is None:
            log(f"no checkpoint in {args.checkpoint_dir}: starting from step 0")
        else:
            start, data_state = checkpoint.load(path, model, optimizer, scheduler)
            loader.load_state_dict(data_state)
            log(f"resumed from {path} at step {start}")
    params = sum(p.numel() for p in model.parameters())
    log(
        f"{spec.name}: {params / 1e6:.1f}M parameters on {world} x {device.type} ({cluster.gpu.name} profile), "
        f"{sync} sync, capacity {cap} tokens per rank per wave, strategy {args.strategy}, "
        f"{args.tokens_per_step} tokens/step, max_seq {args.max_seq}"
    )
    autocast = torch.bfloat16 if device.type == "cuda" else None
    # Fault injection for resilience tests: HDP_KILL_AT=RANK:STEP makes that rank SIGKILL itself in
    # the middle of that step (after its forward/backward, before the optimizer step).
    kill_rank, kill_step = (int(x) for x in os.environ.get("HDP_KILL_AT", "-1:-1").split(":"))
    metrics_file = open(args.metrics, "a") if (args.metrics and rank == 0) else None
    trained = 0
    t_run = time.perf_counter()
    for step_idx in range(start, args.steps):
        t0 = time.perf_counter()
        data = next(loader)
        COMM.reset()
        res = run_waves(model, data, autocast_dtype=autocast)
        if rank == kill_rank and step_idx + 1 == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), args.grad_clip if args.grad_clip > 0 else float("inf")
        )
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_time = time.perf_counter() - t0
        # On the training device: NCCL has no CPU tensors.
        stats = torch.tensor(
            [res.busy_s, COMM.fwd_bytes_sent + COMM.bwd_bytes_sent],
            dtype=torch.float64,
            device=device,
        )
        if dist.is_initialized():
            busy = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world)]
            dist.all_gather(busy, stats)
            busy_s = [float(b[0]) for b in busy]
            comm = sum(float(b[1]) for b in busy)
        else:
            busy_s, comm = [res.busy_s], float(stats[1])
        trained += data.tokens
        flops = cost.model_flops(data.plan.seq_lens)
        record = {
            "step": step_idx + 1,
            "loss": res.loss,
            "tokens": data.tokens,
            "loss_tokens": data.loss_tokens,
            "step_time_s": step_time,
            "tokens_per_s": data.tokens / step_time,
            "imbalance": max(busy_s) / (sum(busy_s) / len(busy_s)) if sum(busy_s) > 0 else 1.0,
            "plan_time_s": data.plan_time_s,
            "data_wait_s": data.wait_s,
            "comm_bytes": comm,
            "waves": data.plan.num_waves,
            "lr": scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "mfu": flops / (step_time * world * cluster.gpu.peak_flops),
            "predicted_step_s": data.plan.predicted.get("step_time_s", float("nan")),
            "trained_tokens": trained,
            "truncated_tokens": data.truncated_tokens,
        }
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if (step_idx + 1) % args.log_every == 0:
            log(
                f"step {step_idx + 1:>5}  loss {res.loss:.4f}  tokens/s {record['tokens_per_s']:,.0f}  "
                f"MFU {100 * record['mfu']:.2f}%  imbalance {record['imbalance']:.2f}  plan {data.plan_time_s:.3f}s  "
                f"comm {comm / 1e6:.1f} MB  waves {data.plan.num_waves}"
            )
        if args.checkpoint_dir and (
            (args.save_every and (step_idx + 1) % args.save_every == 0)
            or step_idx + 1 == args.steps
        ):
            checkpoint.save(
                args.checkpoint_dir, step_idx + 1, model, optimizer, scheduler, loader.sync_state()
            )
    loader.close()
    skipped = sum(s.skipped_tokens for s in sources)
    truncated = stream.state_dict()["truncated_tokens"] if rank == 0 else 0
    log(
        f"done: {args.steps - start} steps in {time.perf_counter() - t_run:.1f} s; tokens trained {trained:,}, "
        f"skipped in sources {skipped:,} ({sum(s.skipped_documents for s in sources):,} documents), truncated {truncated:,}"
    )
    if metrics_file:
        metrics_file.close()
    return 0


if __name__ == "__main__":
    from hdp.runtime import exit_without_teardown

    exit_without_teardown(main())
