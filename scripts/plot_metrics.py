#!/usr/bin/env python3
"""Plot loss and throughput from one or more ``--metrics`` JSONL files of launch/pretrain.py.

The loss panel marks ln(vocab), the loss of a model that has learnt nothing.

python scripts/plot_metrics.py out/metrics.jsonl [more.jsonl ...] --out metrics.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("metrics.png"))
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps, ax_imb) = plt.subplots(1, 3, figsize=(14, 3.8))
    vocabs: set[int] = set()
    for f in args.files:
        try:
            recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            print(f"plot_metrics.py: error: {f}: {e}", file=sys.stderr)
            return 2
        steps = [r["step"] for r in recs]
        ax_loss.plot(steps, [r["loss"] for r in recs], label=f.name)
        ax_tps.plot(steps, [r["tokens"] / r["step_time_s"] for r in recs], label=f.name)
        ax_imb.plot(steps, [r["imbalance"] for r in recs], label=f.name)
        vocabs.update(r["vocab"] for r in recs if "vocab" in r)
    for vocab in sorted(vocabs):
        ax_loss.axhline(math.log(vocab), color="grey", linestyle=":", linewidth=1)
        ax_loss.annotate(
            f"ln({vocab})",
            (0.02, math.log(vocab)),
            xycoords=("axes fraction", "data"),
            fontsize=7,
            color="grey",
            va="bottom",
        )
    for ax, title in (
        (ax_loss, "loss"),
        (ax_tps, "tokens / s"),
        (ax_imb, "imbalance (slowest / mean busy)"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
    ax_loss.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
