"""Sequence-length workloads: the standard ones by name, or any lengths file; global-batch sampling.

The standard workloads (``byted-2m``, ``github-2m``, ``wikipedia-384k``, ``wlb-128k``) ship inside
the package (``hdp/data``). A workload is either *buckets* ``[low, high, token_share]`` (length
log-uniform inside a bucket; a bucket is drawn with probability proportional to
``token_share / mean_length_of_bucket``) or a *file* of real lengths drawn uniformly.

A global batch is drawn until it holds ``tokens_per_step`` tokens (the last sequence is cut to
fit, so every batch has exactly that many tokens); a sequence longer than ``max_seq`` is split into
``max_seq`` chunks, as the dataloader does by default.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np

from .argtypes import MAX_TOKENS


@dataclass(frozen=True)
class Workload:
    """A named length distribution with its standard context and global batch size (tokens)."""

    name: str
    max_seq: int
    tokens_per_step: int
    buckets: tuple[tuple[int, int, float], ...] | None = None
    lengths: np.ndarray | None = None
    source: str = ""

    def _buckets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(low, high, mean length, sample probability) of each bucket (log-uniform inside)."""
        lo = np.array([b[0] for b in self.buckets], dtype=np.float64)
        hi = np.array([b[1] for b in self.buckets], dtype=np.float64)
        share = np.array([b[2] for b in self.buckets], dtype=np.float64)
        mean = (hi - lo) / np.log(hi / lo)
        prob = share / mean
        return lo, hi, mean, prob / prob.sum()

    def sample_lengths(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths drawn from the distribution (int64, >= 1)."""
        if self.lengths is not None:
            return self.lengths[rng.integers(0, self.lengths.size, size=n)]
        lo, hi, _, prob = self._buckets()
        which = rng.choice(len(self.buckets), size=n, p=prob)
        u = rng.random(n)
        return np.maximum(1, (lo[which] * (hi[which] / lo[which]) ** u).astype(np.int64))

    @property
    def mean_length(self) -> float:
        if self.lengths is not None:
            return float(self.lengths.mean())
        _, _, mean, prob = self._buckets()
        return float((prob * mean).sum())

    def sample_batch(
        self,
        rng: np.random.Generator,
        tokens_per_step: int | None = None,
        max_seq: int | None = None,
    ) -> np.ndarray:
        """One global batch: lengths summing to ``tokens_per_step``, none above ``max_seq``."""
        budget = int(tokens_per_step or self.tokens_per_step)
        cap = int(max_seq or self.max_seq)
        if budget < 1 or cap < 1:
            raise ValueError("tokens_per_step and max_seq must be >= 1")
        parts: list[np.ndarray] = []
        total = 0
        draw = max(64, int(1.3 * budget / self.mean_length) + 16)
        while total < budget:
            raw = self.sample_lengths(draw, rng)
            chunks = split_long(raw, cap)
            csum = np.cumsum(chunks)
            k = int(np.searchsorted(csum, budget - total, side="left"))
            if k < chunks.size:
                take = chunks[: k + 1].copy()
                take[-1] -= int(csum[k]) - (budget - total)
                parts.append(take[take > 0])
                total = budget
            else:
                parts.append(chunks)
                total += int(csum[-1])
        return np.concatenate(parts).astype(np.int64)


def split_long(lengths: np.ndarray, max_seq: int) -> np.ndarray:
    """Split every length above ``max_seq`` into ``max_seq`` chunks plus a remainder, in order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not (lengths > max_seq).any():
        return lengths
    counts = -(-lengths // max_seq)
    out = np.full(int(counts.sum()), max_seq, dtype=np.int64)
    last = np.cumsum(counts) - 1
    out[last] = lengths - (counts - 1) * max_seq
    return out


@cache
def _workload_table() -> dict:
    with resources.files("hdp").joinpath("data/workloads.json").open() as f:
        return json.load(f)


def workload_names() -> list[str]:
    return sorted(k for k in _workload_table() if not k.startswith("_"))


@cache
def get_workload(name: str) -> Workload:
    """A standard workload by name; ``ValueError`` listing the names otherwise."""
    table = _workload_table()
    if name.startswith("_") or name not in table:
        raise ValueError(
            f"unknown workload {name!r}: choose one of {', '.join(workload_names())}, "
            "or pass --lengths FILE"
        )
    entry = table[name]
    lengths = None
    if "file" in entry:
        with resources.as_file(resources.files("hdp").joinpath("data", entry["file"])) as path:
            lengths = read_lengths(path)
    buckets = tuple(tuple(b) for b in entry["buckets"]) if "buckets" in entry else None
    return Workload(
        name,
        int(entry["max_seq"]),
        int(entry["tokens_per_step"]),
        buckets,
        lengths,
        entry.get("source", ""),
    )


def read_lengths(path: str | Path) -> np.ndarray:
    """Read one non-negative integer per line (``.gz`` accepted); skip blanks and ``#`` comments.

    Raises ``ValueError`` naming the file and line of the first bad entry.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such lengths file") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read lengths ({e})") from None
    lines = text.splitlines()
    try:
        values = np.array([int(x) for x in lines], dtype=np.int64)
        if values.size and values.max() > MAX_TOKENS:
            values = None  # the line-by-line reading below names the line
    except (ValueError, OverflowError):
        values = None
    if values is None:
        out = []
        for i, line in enumerate(lines, start=1):
            s = line.split("#", 1)[0].strip()
            if not s:
                continue
            try:
                v = int(s)
            except ValueError:
                raise ValueError(
                    f"{path}, line {i}: {line.strip()!r} is not an integer sequence length"
                ) from None
            if v > MAX_TOKENS:
                raise ValueError(
                    f"{path}, line {i}: sequence length {v} is above {MAX_TOKENS:,} tokens"
                )
            out.append(v)
        values = np.array(out, dtype=np.int64)
    if (values < 0).any():
        first = int(np.argmax(values < 0))
        line_no = _line_of_value_index(lines, first)
        raise ValueError(
            f"{path}, line {line_no}: sequence length {int(values[first])} is negative"
        )

    if values.size == 0 or values.sum() == 0:
        raise ValueError(f"{path}: holds no sequence of positive length")
    return values


def _line_of_value_index(lines: list[str], index: int) -> int:
    seen = -1
    for i, line in enumerate(lines, start=1):
        if line.split("#", 1)[0].strip():
            seen += 1
            if seen == index:
                return i
    return len(lines)


def file_workload(
    path: str | Path, max_seq: int | None = None, tokens_per_step: int | None = None
) -> Workload:
    """A workload drawing from the lengths in ``path`` (zeros dropped)."""
    lengths = read_lengths(path)
    lengths = lengths[lengths > 0]
    cap = int(max_seq) if max_seq else int(2 ** math.ceil(math.log2(max(int(lengths.max()), 2))))
    return Workload(
        Path(path).name, cap, int(tokens_per_step or 32 << 20), None, lengths, str(path)
    )
