"""``hdp-data``: inspect a corpus the way training reads it."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from hdp import model_spec
from hdp.argtypes import command, input_file, integer, model, size
from hdp.workloads import split_long

from .sources import DataError, open_source
from .tokenizer import load_tokenizer


def stats(
    paths: list[str],
    max_seq: int | None,
    skip_bad: bool,
    tokenizer: str | None,
    vocab_size: int | None,
) -> dict:
    """Documents, tokens, skips and sequence-length percentiles of the corpus at ``paths``."""
    tok = load_tokenizer(tokenizer)
    docs = tokens = skipped_docs = skipped_tokens = 0
    lengths = []
    per_source = []
    for path in paths:
        src = open_source(path, tok, vocab_size, skip_bad)
        lens = src.lengths[src.lengths > 0]
        docs += int(lens.size)
        tokens += int(lens.sum())
        skipped_docs += int(src.skipped_documents)
        skipped_tokens += int(src.skipped_tokens)
        per_source.append(
            {
                "path": path,
                "documents": int(lens.size),
                "tokens": int(lens.sum()),
                "skipped_documents": int(src.skipped_documents),
                "skipped_tokens": int(src.skipped_tokens),
            }
        )
        lengths.append(split_long(lens, max_seq) if max_seq else lens)
    seqs = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    pct = {}
    if seqs.size:
        for q in (1, 10, 50, 90, 99, 99.9):
            pct[f"p{q:g}"] = float(np.percentile(seqs, q))
        pct.update(min=int(seqs.min()), max=int(seqs.max()), mean=float(seqs.mean()))
    return {
        "documents": docs,
        "tokens": tokens,
        "skipped_documents": skipped_docs,
        "skipped_tokens": skipped_tokens,
        "read_tokens": tokens + skipped_tokens,
        "sequences": int(seqs.size),
        "max_seq": max_seq,
        "lengths": pct,
        "sources": per_source,
        "_lengths": seqs,
    }


def histogram(seqs: np.ndarray, width: int = 50) -> list[str]:
    """Sequences and tokens per power-of-two length bucket, as text bars (bars: share of tokens)."""
    if seqs.size == 0:
        return []
    b = np.floor(np.log2(np.maximum(seqs, 1))).astype(int)
    lines = []
    total = seqs.sum()
    for k in range(int(b.min()), int(b.max()) + 1):
        m = b == k
        share = seqs[m].sum() / total
        lines.append(
            f"  [{2**k:>9}, {2 ** (k + 1):>9})  {int(m.sum()):>9} seqs  "
            f"{100 * share:5.1f}% tokens  " + "#" * int(round(share * width))
        )
    return lines


@command
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hdp-data", description="Inspect a training corpus the way hdp reads it."
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stats", help="documents, tokens, skipped records and length percentiles")
    s.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a .jsonl or .parquet file, a Megatron .bin/.idx prefix, or synthetic:WORKLOAD[:DOCS]",
    )
    s.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the report"
    )
    s.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="skip and count bad records instead of failing",
    )
    s.add_argument(
        "--max-seq",
        type=size(1),
        default=None,
        help="split documents longer than this, as training does",
    )
    s.add_argument(
        "--tokenizer",
        type=input_file,
        default=None,
        help="tokenizer.json for 'text' records (default: UTF-8 bytes)",
    )
    vocab = s.add_mutually_exclusive_group()
    vocab.add_argument(
        "--vocab-size",
        type=integer(1, 1 << 31),
        default=None,
        help="reject token ids at or above this (default: any non-negative id)",
    )
    vocab.add_argument(
        "--model",
        type=model,
        default=None,
        metavar="NAME|CONFIG",
        help="check token ids against this model's vocabulary (a preset, or a transformers "
        "config.json), as pretrain.py --model does",
    )
    args = p.parse_args(argv)
    vocab_size = model_spec(args.model).vocab if args.model else args.vocab_size
    try:
        res = stats(args.paths, args.max_seq, args.skip_bad_records, args.tokenizer, vocab_size)
    except (DataError, ValueError) as e:
        print(f"hdp-data: error: {e}", file=sys.stderr)
        return 2
    seqs = res.pop("_lengths")
    if args.json:
        print(json.dumps(res))
        return 0
    print(
        f"documents {res['documents']:,}  tokens {res['tokens']:,}  "
        f"skipped {res['skipped_documents']:,} documents / {res['skipped_tokens']:,} tokens  "
        f"(read {res['read_tokens']:,} = trained {res['tokens']:,} + skipped "
        f"{res['skipped_tokens']:,})"
    )
    if res["lengths"]:
        L = res["lengths"]
        print(
            f"sequences {res['sequences']:,}"
            + (f" after splitting at {args.max_seq}" if args.max_seq else "")
            + f": min {L['min']}, p50 {L['p50']:.0f}, p90 {L['p90']:.0f}, p99 {L['p99']:.0f}, "
            f"max {L['max']}, mean {L['mean']:.1f}"
        )
        print("length histogram:")
        print("\n".join(histogram(seqs)))
    return 0
