r"""Predicted against measured: training steps, and one rank's attention in real plans.

``metrics``: a ``launch/pretrain.py --metrics`` file; per step the measured step time over the
cost model's ``predicted_step_s``, each rank's measured busy time over ``predicted_rank_s`` and
its peak memory over ``predicted_mem_bytes``, then one JSON line summarising the steps after
``--skip`` (``activation_ratio``: measured activations over the model's, the factor that sets a
profile's ``activation_memory_scale``).

``attention``: plans real batches with hdp (``--gpus`` ranks), takes ranks with long shards,
short shards and whole documents, runs each rank's attention calls with the project's kernels
(``hdp.attention.kernels``: one causal varlen call over the rank's shards, one full call per shard
against the keys before it, forward + backward) on every backend asked for, and prints measured
over what the cost model prices for those calls.

``cpu-train``: measures a profile of this machine (``hdp-calibrate measure --device cpu --quick``,
one thread, as torchrun gives each of several ranks on a node), trains ``tiny`` for 8 steps on
2 gloo ranks with and without activation checkpointing, and prints ``metrics`` for each run.
Its median |measured / predicted - 1| over steps 3-8 is the CPU fidelity figure of
docs/benchmarks.md; it is a benchmark, not a test, because a busy host moves it.

    python scripts/bench_fidelity.py cpu-train
    python scripts/bench_fidelity.py metrics /tmp/hdp-gpu-check/train_metrics.jsonl
    python scripts/bench_fidelity.py attention --gpus 1024 --workloads byted-2m,wlb-128k \
        --backends torch_flash,cudnn --device cuda
    python scripts/bench_fidelity.py attention --gpus 16 --tokens 64K --model tiny \
        --profile cpu --backends reference --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hdp import ClusterSpec, Plan, gpu_profile, model_preset, parse_size
from hdp.planner import StepPricing, plan_step
from hdp.workloads import get_workload


def metrics_report(path: Path, skip: int) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        ranks = " ".join(
            f"{m / p:.2f}" for m, p in zip(r.get("busy_s", []), r.get("predicted_rank_s", []))
        )
        ratio = r["step_time_s"] / r["predicted_step_s"]
        print(
            f"step {r['step']:3d}  measured {r['step_time_s']:8.3f} s  predicted "
            f"{r['predicted_step_s']:8.3f} s  ratio {ratio:5.2f}  per rank busy ratio {ranks}"
            f"  memory ratio {' '.join(f'{x:.2f}' for x in memory_ratios(r))}"
        )
    kept = [r["step_time_s"] / r["predicted_step_s"] for r in rows[skip:]]
    activations = [x for r in rows[skip:] for x in activation_ratios(r)]
    return {
        "steps": len(kept),
        "median_ratio": statistics.median(kept) if kept else float("nan"),
        "min_ratio": min(kept, default=float("nan")),
        "max_ratio": max(kept, default=float("nan")),
        "max_memory_ratio": max(
            (x for r in rows[skip:] for x in memory_ratios(r)), default=float("nan")
        ),
        # The factor to multiply the profile's activation_memory_scale by for its activations
        # to match the largest measured.
        "activation_ratio": max(activations, default=float("nan")),
    }


def memory_ratios(row: dict) -> list[float]:
    """Each rank's measured peak memory over the cost model's (rows without them: none)."""
    pairs = zip(row.get("peak_mem_bytes", []), row.get("predicted_mem_bytes", []))
    return [m / p for m, p in pairs if p > 0]


def activation_ratios(row: dict) -> list[float]:
    """Each rank's measured activations over the cost model's: the measured peak less what the
    model counts besides activations (states, loss buffer, K/V in flight), over its activations."""
    triples = zip(
        row.get("peak_mem_bytes", []),
        row.get("predicted_mem_bytes", []),
        row.get("predicted_activation_bytes", []),
    )
    return [(m - (p - a)) / a for m, p, a in triples if a > 0]


def pick_ranks(plan: Plan) -> dict[str, tuple[int, int]]:
    """(rank, wave) of three kinds of work: the longest multi-rank shards, the shortest ones,
    and the most tokens of whole documents."""
    split = np.bincount(plan.seq, minlength=plan.seq_lens.size)[plan.seq] > 1
    whole = ~split & (plan.start == 0) & (plan.end == plan.seq_lens[plan.seq])
    sizes = plan.end - plan.start
    out = {}
    if split.any():
        k = np.flatnonzero(split)
        longest, shortest = k[np.argmax(sizes[k])], k[np.argmin(sizes[k])]
        out["long shards"] = (int(plan.rank[longest]), int(plan.wave[longest]))
        out["short shards"] = (int(plan.rank[shortest]), int(plan.wave[shortest]))
    if whole.any():
        cell = plan.wave * plan.num_ranks + plan.rank
        tokens = np.bincount(cell[whole], weights=sizes[whole])
        c = int(np.argmax(tokens))
        out["whole documents"] = (c % plan.num_ranks, c // plan.num_ranks)
    return out


def time_rank(plan: Plan, rank: int, wave: int, model, backend, device, dtype) -> float:
    """Forward + backward of the rank's attention calls in ``wave``, seconds (median of 3)."""
    import torch

    shards = plan.shards(rank, wave)
    q_lens = [b - a for _, a, b in shards]
    H, Hk, d = model.heads, model.kv_heads, model.head_dim
    scale = d**-0.5

    def call(nq, nk, causal, cu_q, cu_k):
        q = torch.randn(nq, H, d, device=device, dtype=dtype)
        k = torch.randn(nk, Hk, d, device=device, dtype=dtype)
        v = torch.randn_like(k)
        out, lse = backend.forward(q, k, v, cu_q, cu_k, max(q_lens), nk, causal, scale)
        backend.backward(torch.ones_like(out), q, k, v, out, lse, cu_q, cu_k,
                         max(q_lens), nk, causal, scale)  # fmt: skip

    def once() -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32,
                          device=device)  # fmt: skip
        call(int(sum(q_lens)), int(sum(q_lens)), True, cu, cu)
        for _, a, b in shards:
            if a > 0:
                cu_q = torch.tensor([0, b - a], dtype=torch.int32, device=device)
                cu_k = torch.tensor([0, a], dtype=torch.int32, device=device)
                call(b - a, a, False, cu_q, cu_k)
        sync()
        return time.perf_counter() - t0

    once()  # warm-up
    return statistics.median(once() for _ in range(3))


def attention_report(args) -> None:
    import torch

    from hdp.attention.kernels import get_backend

    model = model_preset(args.model)
    gpu = gpu_profile(args.profile)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the cpu profile was measured: one thread per rank
    for wl in args.workloads.split(","):
        w = get_workload(wl)
        lens = w.sample_batch(np.random.default_rng(args.seed), tokens_per_step=args.tokens)
        cluster = ClusterSpec(args.gpus, 8, gpu)
        plan = plan_step(lens, cluster, model, "hdp", max_seq=w.max_seq)
        for kind, (rank, wave) in pick_ranks(plan).items():
            for name in args.backends.split(","):
                cost = StepPricing.build(model, cluster, activation_checkpointing=False,
                                         attention_backend=name).cost  # fmt: skip
                sl = plan.shard_slice(rank, wave)
                predicted = float(cost.attn_time(plan.start[sl], plan.end[sl]).sum())
                measured = time_rank(plan, rank, wave, model, get_backend(name),
                                     device, dtype)  # fmt: skip
                print(
                    f"{wl:15s} {kind:16s} rank {rank:5d} wave {wave:2d} "
                    f"{sl.stop - sl.start:4d} shards  {name:9s} measured {measured * 1e3:9.2f} ms"
                    f"  predicted {predicted * 1e3:9.2f} ms  ratio {measured / predicted:5.2f}",
                    flush=True,
                )


def cpu_train_report(skip: int) -> None:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    with tempfile.TemporaryDirectory(prefix="hdp-fidelity-") as tmp:
        profile = Path(tmp) / "cpu.json"
        measure = [sys.executable, "-m", "hdp.launch.calibrate", "measure", "--device", "cpu"]
        subprocess.run([*measure, "--quick", "--out", str(profile)], cwd=root, env=env, check=True)
        for checkpointing in ("--no-activation-checkpointing", "--activation-checkpointing"):
            metrics = Path(tmp) / f"metrics{checkpointing}.jsonl"
            train = [
                *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
                *("--nproc-per-node", "2", str(root / "launch" / "pretrain.py")),
                *("--model", "tiny", "--tokens-per-step", "16K", "--max-seq", "4K"),
                *("--steps", "8", "--gpu-profile", str(profile), "--metrics", str(metrics)),
                checkpointing,
            ]
            subprocess.run(train, cwd=root, env=env, check=True, capture_output=True)
            print(f"-- tiny, 2 ranks, {checkpointing}")
            summary = metrics_report(metrics, skip)
            rows = [json.loads(line) for line in metrics.read_text().splitlines()][skip:]
            summary["median_abs_error"] = statistics.median(
                abs(r["step_time_s"] / r["predicted_step_s"] - 1) for r in rows
            )
            print(json.dumps(summary), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("metrics", help="measured / predicted of a training run's steps")
    m.add_argument("path", type=Path)
    m.add_argument("--skip", type=int, default=2, help="first steps left out of the summary")
    a = sub.add_parser("attention", help="one rank's attention in real plans, run and priced")
    a.add_argument("--gpus", type=int, default=1024)
    a.add_argument("--tokens", type=parse_size, default=None, help="tokens per step")
    a.add_argument("--workloads", default="byted-2m,github-2m,wlb-128k")
    a.add_argument("--model", default="llama-7b")
    a.add_argument("--profile", default="h100", help="GPU preset or profile JSON")
    a.add_argument("--backends", default="torch_flash", help="attention backends, comma-separated")
    a.add_argument("--device", default="cuda")
    a.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("cpu-train", help="a CPU profile of this machine against tiny's steps")
    c.add_argument("--skip", type=int, default=2, help="first steps left out of the summary")
    args = ap.parse_args()
    if args.command == "metrics":
        print(json.dumps(metrics_report(args.path, args.skip)))
    elif args.command == "cpu-train":
        cpu_train_report(args.skip)
    else:
        attention_report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
