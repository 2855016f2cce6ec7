#!/usr/bin/env python3
"""Dataloader measurements for docs/benchmarks.md.

1. Tokens per second one rank receives (HDPDataLoader, planning in the background) from the same
   corpus stored as jsonl (``input_ids``) and as a Megatron ``.bin``/``.idx`` pair, and the jsonl
   index pass (first open) against opening with the cached index.
2. How far ahead rank 0's plans are ready for a simulated 1024-rank H100 cluster on byted-2m
   (llama-7b): batch forming + planning time per step against the step time the plan predicts.

    python scripts/bench_dataloader.py --tokens 8M --steps 8
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hdp import ClusterSpec, model_preset, parse_size
from hdp.dataloader import BatchStream, HDPDataLoader, JsonlSource, MegatronSource, SyntheticSource
from hdp.planner import plan_step


def write_corpus(folder: Path, tokens: int, seed: int = 0) -> tuple[Path, Path]:
    """The same documents (wlb-128k lengths, random ids < 32000) as jsonl and as .bin/.idx."""
    syn = SyntheticSource("wlb-128k", max(16, int(tokens / 4000)), 32000, seed)
    jsonl = folder / "corpus.jsonl"
    lens = []
    with open(jsonl, "w") as f, open(folder / "corpus.bin", "wb") as b:
        for d in range(syn.lengths.size):
            ids = syn.read(d)
            f.write(json.dumps({"input_ids": ids.tolist()}) + "\n")
            b.write(ids.astype(np.int32).tobytes())
            lens.append(ids.size)
    lens = np.asarray(lens, dtype=np.int32)
    ptr = (np.concatenate([[0], np.cumsum(lens)[:-1]]) * 4).astype(np.int64)
    with open(folder / "corpus.idx", "wb") as f:
        f.write(
            b"MMIDIDX\x00\x00"
            + struct.pack("<Q", 1)
            + struct.pack("<B", 4)
            + struct.pack("<QQ", lens.size, lens.size + 1)
        )
        f.write(lens.tobytes() + ptr.tobytes() + np.arange(lens.size + 1, dtype=np.int64).tobytes())
    return jsonl, folder / "corpus"


def throughput(src, steps: int, tokens_per_step: int) -> float:
    stream = BatchStream([src.lengths], tokens_per_step, 32768, seed=0)
    loader = HDPDataLoader(
        [src],
        stream,
        ClusterSpec.preset("cpu", 1),
        model_preset("tiny"),
        "hdp",
        plan_options={"capacity": tokens_per_step},
    )
    next(loader)  # warm-up: the first plan
    t0 = time.perf_counter()
    n = 0
    for _ in range(steps):
        step = next(loader)
        n += sum(w.input_ids.numel() for w in step.waves)
    loader.close()
    return n / (time.perf_counter() - t0)


def plan_ahead(gpus: int, steps: int) -> None:
    src = SyntheticSource("byted-2m", 60000, 32000, 0)
    stream = BatchStream([src.lengths], 32 << 20, 2 << 20, seed=0)
    cluster = ClusterSpec.preset("h100", gpus)
    model = model_preset("llama-7b")
    print(f"rank 0 planning for {gpus} x h100, byted-2m, llama-7b, 32M tokens/step (hdp strategy):")
    print(
        f"  {'step':>4} {'form batch s':>12} {'plan s':>8} {'predicted step s':>17} "
        f"{'step / planning':>17}"
    )
    for k in range(steps):
        t0 = time.perf_counter()
        batch = stream.next_batch()
        t1 = time.perf_counter()
        plan = plan_step(batch.lengths, cluster, model, "hdp", max_seq=2 << 20)
        t2 = time.perf_counter()
        step_s = plan.predicted["step_time_s"]
        print(
            f"  {k:>4} {t1 - t0:>12.3f} {t2 - t1:>8.3f} {step_s:>17.2f} "
            f"{step_s / (t2 - t0):>16.0f}x"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokens",
        type=parse_size,
        default=parse_size("8M"),
        help="corpus size for the throughput test",
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--gpus", type=int, default=1024)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jsonl, prefix = write_corpus(Path(tmp), args.tokens)
        t0 = time.perf_counter()
        src = JsonlSource(jsonl, vocab_size=32000)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        JsonlSource(jsonl, vocab_size=32000)
        cached = time.perf_counter() - t0
        tps = 1 << 20
        print(
            f"corpus: {int(src.lengths.sum()):,} tokens in {src.lengths.size:,} documents; "
            f"{tps:,} tokens per step; 1 rank"
        )
        print(
            f"  jsonl index pass (first open):  {first:7.2f} s "
            f"({src.lengths.sum() / first / 1e6:.1f} M tokens/s); cached index: {cached:.3f} s"
        )
        for name, s in (
            ("jsonl", src),
            ("megatron .bin/.idx", MegatronSource(prefix, vocab_size=32000)),
        ):
            print(
                f"  {name:<20} {throughput(s, args.steps, tps) / 1e6:8.2f} M tokens/s delivered "
                "per rank"
            )
    plan_ahead(args.gpus, max(3, args.steps // 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
