#!/usr/bin/env python3
"""Training measurements for docs/benchmarks.md (CPU, gloo).

Trains the same global batches of a wlb-128k-shaped corpus (scaled to fit a CPU) with several
strategies on N gloo ranks, one run each, and prints per strategy the measured step time, the
measured busy-time imbalance (slowest rank / mean), and the cost model's predicted step time.

    python scripts/bench_train.py --ranks 4 --steps 6 --tokens-per-step 16K --max-seq 8K \
        --capacity 4K
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def _rank(rank: int, world: int, argv: list[str]) -> None:
    import torch

    from hdp.launch.cli import parse_config
    from hdp.launch.train import train

    torch.set_num_threads(1)
    train(parse_config(argv), rank=rank, world=world, per_node=world, device=torch.device("cpu"))


def main() -> int:
    from hdp.testing.ranks import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tokens-per-step", default="16K")
    p.add_argument("--max-seq", default="8K")
    p.add_argument("--capacity", default="4K")
    p.add_argument("--strategies", default="hdp,static,bytescale")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in args.strategies.split(","):
            out = Path(tmp) / f"{s}.jsonl"
            argv = [
                "--model",
                "tiny",
                "--workload",
                "wlb-128k",
                "--synthetic-docs",
                "2000",
                "--tokens-per-step",
                args.tokens_per_step,
                "--max-seq",
                args.max_seq,
                "--capacity",
                args.capacity,
                "--steps",
                str(args.steps),
                "--strategy",
                s,
                "--metrics",
                str(out),
                "--log-every",
                str(10**6),
            ]
            run_ranks(_rank, args.ranks, argv, timeout=3600)
            recs = [json.loads(x) for x in out.read_text().splitlines()][1:]  # first step: warm-up
            keys = ("step_time_s", "imbalance", "predicted_step_s", "waves")
            rows.append((s, *(sum(r[k] for r in recs) / len(recs) for k in keys)))
    print(
        f"{args.ranks} gloo ranks (1 thread each) on {os.cpu_count()} cores, tiny model, "
        f"wlb-128k lengths, {args.tokens_per_step} tokens/step, max_seq {args.max_seq}, "
        f"capacity {args.capacity}, mean of steps 2-{args.steps}:"
    )
    print(
        f"  {'strategy':<10} {'step s':>8} {'vs hdp':>7} {'imbalance':>10} {'predicted s':>12} "
        f"{'measured/pred':>14} {'waves':>6}"
    )
    base = next((r[1] for r in rows if r[0] == "hdp"), rows[0][1])
    for s, t, imb, pred, waves in rows:
        print(
            f"  {s:<10} {t:>8.3f} {t / base:>6.2f}x {imb:>10.2f} {pred:>12.3f} "
            f"{t / pred:>14.2f} {waves:>6.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
