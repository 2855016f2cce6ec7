"""Global batches by token budget, from lengths alone (no token is read here).

Documents of each source are visited in a seeded shuffled order, a new order every epoch; several
sources are mixed by token weights (the next document comes from the source furthest below its
share). A document longer than ``max_seq`` becomes ``max_seq`` chunks (or is truncated). Each chunk
is a training *sequence* (:class:`SeqRef`). A truncated document's lost tokens are counted in the
batch that trains it (``truncated_tokens``): one definition, what the trained documents lost.

Sequences wait in a lookahead window of about ``lookahead_steps`` global batches. A batch takes at
most ``tokens_per_step`` tokens: first from the *outlier queue* (sequences of at least
``outlier_tokens``; as WLB-LLM does, so that no step gets all the very long sequences of the
window: each step takes ``ceil(queued / lookahead_steps)`` of them, at least one), then the
other waiting sequences in arrival order, each that still fits. Nothing is dropped or repeated:
which tokens are trained over an epoch does not change, only when.

The whole state (cursors, window, queue, counters) is a plain dict, so a run resumed from
``state_dict()`` forms exactly the batches the uninterrupted run would have, on any number of
ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class SeqRef(NamedTuple):
    """One training sequence: tokens ``[offset, offset + length)`` of document ``doc`` of source
    ``source``, read in that source's epoch ``epoch``."""

    source: int
    epoch: int
    doc: int
    offset: int
    length: int


@dataclass
class GlobalBatch:
    step: int
    seqs: list[SeqRef]
    truncated_tokens: int  # tokens --truncate cut from the documents this batch trains

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((s.length for s in self.seqs), dtype=np.int64, count=len(self.seqs))

    @property
    def tokens(self) -> int:
        return int(sum(s.length for s in self.seqs))

    @property
    def loss_tokens(self) -> int:
        """Tokens with a next-token label (the last token of each sequence has none)."""
        return int(sum(s.length - 1 for s in self.seqs))


class BatchStream:
    """Endless global batches over ``lengths`` (one int64 array of document lengths per source)."""

    def __init__(
        self,
        lengths: Sequence[np.ndarray],
        tokens_per_step: int,
        max_seq: int,
        seed: int = 0,
        weights: Sequence[float] | None = None,
        truncate: bool = False,
        lookahead_steps: int = 4,
        outlier_tokens: int | None = None,
    ) -> None:
        if max_seq > tokens_per_step:
            raise ValueError(
                f"max_seq ({max_seq}) exceeds tokens_per_step ({tokens_per_step}): a sequence "
                "would not fit a global batch"
            )
        self.lengths = [np.asarray(x, dtype=np.int64) for x in lengths]
        if not any((x > 0).any() for x in self.lengths):
            raise ValueError("the data holds no document with tokens")
        self.usable = [np.flatnonzero(x > 0) for x in self.lengths]
        w = np.asarray(
            weights if weights is not None else [max(int(x.sum()), 1) for x in self.lengths],
            dtype=np.float64,
        )
        if (
            w.shape != (len(self.lengths),)
            or not np.isfinite(w).all()
            or (w < 0).any()
            or w.max() <= 0
        ):
            raise ValueError(
                f"weights must be one finite non-negative number per source, got {list(w)}"
            )
        w = w / w.max()  # the sum of 1e308 and 1e308 overflows; of their ratios, never
        self.weights = w / w.sum()
        self.tokens_per_step = int(tokens_per_step)
        self.max_seq = int(max_seq)
        self.seed = int(seed)
        self.truncate = truncate
        self.lookahead_steps = max(1, int(lookahead_steps))
        self.outlier_tokens = int(
            outlier_tokens if outlier_tokens is not None else max(1, max_seq // 4)
        )
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        self.state = {
            "step": 0,
            "cursors": [[0, 0] for _ in self.lengths],  # (epoch, position in that epoch's order)
            "taken": [0] * len(self.lengths),  # tokens drawn from each source
            "pending": [],  # SeqRef tuples waiting in the window
            "outliers": [],
            "trained_tokens": 0,
            "truncated_tokens": 0,
        }

    # ------------------------------------------------------------------ documents
    def _order(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 8:
                self._orders.clear()
            rng = np.random.default_rng([self.seed, source, epoch])
            self._orders[key] = self.usable[source][rng.permutation(self.usable[source].size)]
        return self._orders[key]

    def _next_document(self) -> tuple[int, int, int]:
        st = self.state
        live = [s for s in range(len(self.lengths)) if self.weights[s] > 0 and self.usable[s].size]
        s = min(live, key=lambda i: (st["taken"][i] / self.weights[i], i))
        epoch, pos = st["cursors"][s]
        order = self._order(s, epoch)
        doc = int(order[pos])
        pos += 1
        if pos == order.size:
            epoch, pos = epoch + 1, 0
        st["cursors"][s] = [epoch, pos]
        st["taken"][s] += int(self.lengths[s][doc])
        return s, epoch if pos else epoch - 1, doc

    def _fill(self) -> None:
        st = self.state
        want = self.lookahead_steps * self.tokens_per_step
        have = sum(x[4] for x in st["pending"]) + sum(x[4] for x in st["outliers"])
        while have < want:
            s, epoch, doc = self._next_document()
            L = int(self.lengths[s][doc])
            if self.truncate:
                L = min(L, self.max_seq)  # the cut is counted when the batch trains it
            for off in range(0, L, self.max_seq):
                ref = [s, epoch, doc, off, min(self.max_seq, L - off)]
                (st["outliers"] if ref[4] >= self.outlier_tokens else st["pending"]).append(ref)
                have += ref[4]

    # ------------------------------------------------------------------ batches
    def next_batch(self) -> GlobalBatch:
        st = self.state
        self._fill()
        budget = self.tokens_per_step
        take: list[list[int]] = []
        outliers = st["outliers"]
        k = max(1, math.ceil(len(outliers) / self.lookahead_steps)) if outliers else 0
        kept = []
        for ref in outliers:
            if k > 0 and ref[4] <= budget:
                take.append(ref)
                budget -= ref[4]
                k -= 1
            else:
                kept.append(ref)
        st["outliers"] = kept
        rest = []
        for ref in st["pending"]:
            if ref[4] <= budget:
                take.append(ref)
                budget -= ref[4]
            else:
                rest.append(ref)
        st["pending"] = rest
        # With --truncate a document is one sequence from its start: what it lost is the rest.
        lost = sum(int(self.lengths[r[0]][r[2]]) - r[4] for r in take) if self.truncate else 0
        batch = GlobalBatch(st["step"], [SeqRef(*r) for r in take], lost)
        st["step"] += 1
        st["trained_tokens"] += batch.tokens
        st["truncated_tokens"] += lost
        return batch

    def state_dict(self) -> dict:
        st = self.state
        return {
            "step": st["step"],
            "cursors": [list(c) for c in st["cursors"]],
            "taken": list(st["taken"]),
            "pending": [list(r) for r in st["pending"]],
            "outliers": [list(r) for r in st["outliers"]],
            "trained_tokens": st["trained_tokens"],
            "truncated_tokens": st["truncated_tokens"],
            "config": {
                "tokens_per_step": self.tokens_per_step,
                "max_seq": self.max_seq,
                "seed": self.seed,
                "sources": len(self.lengths),
                "truncate": self.truncate,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        cfg = state.get("config", {})
        mine = self.state_dict()["config"]
        diff = [k for k in mine if k in cfg and cfg[k] != mine[k]]
        if diff:
            raise ValueError(
                "cannot resume: the data configuration changed since the checkpoint ("
                + ", ".join(f"{k}: {cfg[k]} -> {mine[k]}" for k in diff)
                + ")"
            )
        self.state = {
            k: (
                v
                if not isinstance(v, list)
                else [list(x) if isinstance(x, (list, tuple)) else x for x in v]
            )
            for k, v in state.items()
            if k != "config"
        }
