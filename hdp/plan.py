"""The plan of one training step: which tokens each rank holds in each wave, and the KV traffic.

A *global batch* is a list of sequence lengths ``seq_lens``. A :class:`Shard` ``(seq, start, end)``
is the tokens ``[start, end)`` of sequence ``seq``. A plan gives, for every wave (micro-batch) and
every rank, an ordered list of shards; the rank's local tokens in that wave are the concatenation
of its shards in that order. Every token of every sequence is in exactly one shard, and all shards
of a sequence are in the same wave.

Attention is causal inside each sequence, so the rank holding queries of sequence ``s`` up to
position ``E`` needs the keys/values of every token of ``s`` before ``E``. The parts it does not
hold are *pieces* it receives from their owners. Everything one rank sends another in a wave
travels together, cut into messages of at most ``kv_block_tokens`` tokens. :meth:`Plan.comm_rounds`
orders the messages in congestion-free rounds: each rank sends at most one message and receives at
most one per round. The rounds are a proper edge colouring of the bipartite sender/receiver
multigraph with the minimum number of colours (König, :mod:`hdp.rounds`). Backward sends dK/dV of
the same pieces back along the reversed edges in the same rounds. A plan's ``kv_exchange`` says
whether each rank fetches what it lacks (``rank``) or each node does once (``node``,
:mod:`hdp.exchange`).

Shards are stored as parallel int64 numpy arrays (one entry per shard) so that plans with millions
of shards (a static mesh at 2M context) validate and evaluate quickly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from . import exchange, wire
from .exchange import KV_EXCHANGES, KVTransfer, WaveExchange
from .shard import Shard

SYNC_MODES = ("wave", "peer")


class PlanError(ValueError):
    """A plan that breaks an invariant (coverage, ranges, waves, capacity, JSON form)."""


# The per-shard arrays of a plan, in the order the constructor takes them.
SHARD_COLUMNS = ("rank", "wave", "seq", "start", "end")
# Names (and versions) the layout of Plan.to_wire; from_wire refuses any other.
WIRE_FORMAT = "hdp.plan/1"
# Largest K/V message between two ranks (tokens); PLAN.json's ``kv_block_tokens`` defaults to it.
DEFAULT_KV_BLOCK_TOKENS = 8192
# Granularity of multi-rank shards and of per-rank capacities (tokens): the attention kernels'
# tile, so shares of a split sequence and a rank's token budget fill whole tiles.
BLOCK_TOKENS = 128


class Plan:
    """Placement of one global batch on ``num_ranks`` ranks in ``num_waves`` waves.

    Build one with :meth:`from_shards` (nested lists), :meth:`from_arrays` (numpy, one entry per
    shard, in each cell's local order) or :meth:`from_json` (the PLAN.json form).

    Attributes:
        seq_lens: int64 array, tokens of each sequence of the global batch.
        num_ranks: ranks taking part.
        sync: ``"wave"`` (all ranks run every wave in lockstep) or ``"peer"`` (each rank runs its
            own waves; only ranks sharing a sequence wait for each other).
        offload: ``[num_waves, num_ranks]``: the fraction of checkpointed activations offloaded
            to host memory in each cell (zeros when the plan offloads nothing).
        barriers: wave indices before which every rank synchronises (Megatron hybrid CP).
        kv_block_tokens: largest KV block moved in one P2P message.
        predicted: the planner's predictions (step time, bound, ...), free-form floats.
        strategy: name of the strategy that produced the plan, if any.
        capacity: tokens per rank per wave the planner was given, if any.
        kv_exchange: ``"rank"`` (each rank fetches the K/V it lacks), ``"node"`` (once per
            node, forwarded over NVLink; :mod:`hdp.exchange`) or ``"ulysses"`` (the ranks of a
            split sequence split its heads and exchange by all-to-all: at most one a head).
        ranks_per_node: ranks per node, ``[k * n, (k + 1) * n)`` forming node ``k``; required
            by ``node`` exchange.
    """

    def __init__(
        self,
        seq_lens: Sequence[int] | np.ndarray,
        num_ranks: int,
        rank: np.ndarray,
        wave: np.ndarray,
        seq: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        *,
        sync: str = "wave",
        num_waves: int | None = None,
        offload: np.ndarray | None = None,
        barriers: Iterable[int] = (),
        kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS,
        predicted: dict[str, float] | None = None,
        strategy: str | None = None,
        capacity: int | None = None,
        kv_exchange: str = "rank",
        ranks_per_node: int | None = None,
    ) -> None:
        if sync not in SYNC_MODES:
            raise PlanError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        if int(num_ranks) < 1:
            raise PlanError(f"num_ranks must be >= 1, got {num_ranks}")
        if int(kv_block_tokens) < 1:
            raise PlanError(f"kv_block_tokens must be >= 1, got {kv_block_tokens}")
        if kv_exchange not in KV_EXCHANGES:
            raise PlanError(f"kv_exchange must be one of {KV_EXCHANGES}, got {kv_exchange!r}")
        if ranks_per_node is not None and int(ranks_per_node) < 1:
            raise PlanError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        if kv_exchange == "node" and ranks_per_node is None:
            raise PlanError("kv_exchange 'node' needs ranks_per_node (the GPUs of one node)")
        self.seq_lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        self.num_ranks = int(num_ranks)
        arrays = [np.asarray(a, dtype=np.int64).reshape(-1) for a in (rank, wave, seq, start, end)]
        if len({a.shape for a in arrays}) != 1:
            raise PlanError("rank, wave, seq, start and end must have one entry per shard each")
        if _in_cell_order(arrays[1], arrays[0]):  # e.g. from_wire: sorting would change nothing
            arrays = [a.copy() for a in arrays]
        else:  # a stable sort by cell keeps each cell's local order as given
            order = np.lexsort((arrays[0], arrays[1]))
            arrays = [a[order] for a in arrays]
        self.rank, self.wave, self.seq, self.start, self.end = arrays
        inferred = int(self.wave.max()) + 1 if self.wave.size else 1
        self.num_waves = max(int(num_waves) if num_waves is not None else 1, inferred)
        self.sync = sync
        if offload is None:
            self.offload = np.zeros((self.num_waves, self.num_ranks))
        else:
            self.offload = np.asarray(offload, dtype=np.float64).reshape(
                self.num_waves, self.num_ranks
            )
        self.barriers = tuple(sorted(int(b) for b in barriers))
        self.kv_block_tokens = int(kv_block_tokens)
        self.predicted: dict[str, float] = dict(predicted or {})
        self.strategy = strategy
        self.capacity = capacity
        self.kv_exchange = kv_exchange
        self.ranks_per_node = None if ranks_per_node is None else int(ranks_per_node)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(cls, seq_lens, num_ranks, rank, wave, seq, start, end, **kw) -> Plan:
        return cls(seq_lens, num_ranks, rank, wave, seq, start, end, **kw)

    @classmethod
    def from_shards(
        cls,
        seq_lens: Sequence[int],
        num_ranks: int,
        waves: Sequence[Sequence[Sequence[Shard | Sequence[int]]]],
        **kw: Any,
    ) -> Plan:
        """``waves[w][r]`` is rank ``r``'s ordered list of shards in wave ``w``."""
        cols: list[list[int]] = [[], [], [], [], []]
        for w, per_rank in enumerate(waves):
            if len(per_rank) != num_ranks:
                raise PlanError(
                    f"wave {w} lists {len(per_rank)} ranks, expected num_ranks = {num_ranks}"
                )
            for r, shards in enumerate(per_rank):
                for sh in shards:
                    if len(sh) != 3:
                        raise PlanError(
                            f"wave {w}, rank {r}: shard {sh!r} is not [seq, start, end]"
                        )
                    s, a, b = sh
                    for c, v in zip(cols, (r, w, s, a, b)):
                        c.append(int(v))
        kw.setdefault("num_waves", max(len(waves), 1))
        return cls(seq_lens, num_ranks, *(np.asarray(c, dtype=np.int64) for c in cols), **kw)

    @classmethod
    def from_json(cls, d: dict[str, Any] | str) -> Plan:
        """Read the PLAN.json form (a dict, or its text), every field's type checked and the plan
        validated (:meth:`validate`); ``predicted`` is optional. Raises :class:`PlanError` naming
        the field."""
        from . import plan_json  # it reads this module's names

        lens, num_ranks, waves, kw = plan_json.read(d)
        plan = cls.from_shards(lens, num_ranks, waves, **kw)
        plan.validate()
        return plan

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise PlanError(f"{path}: cannot read plan: {e.strerror}") from None
        try:
            return cls.from_json(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanError(
                f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}"
            ) from None
        except RecursionError:
            raise PlanError(f"{path}: JSON nested too deeply to read") from None
        except ValueError as e:  # an integer past Python's digit limit
            if isinstance(e, PlanError):
                raise PlanError(f"{path}: {e}") from None
            raise PlanError(f"{path}: not valid JSON: {e}") from None

    # ------------------------------------------------------------------ export
    def to_json(self) -> dict[str, Any]:
        """The PLAN.json form: ``waves[w][r]`` = list of ``[seq, start, end]``."""
        waves: list[list[list[list[int]]]] = [
            [[] for _ in range(self.num_ranks)] for _ in range(self.num_waves)
        ]
        for r, w, s, a, b in zip(
            *(x.tolist() for x in (self.rank, self.wave, self.seq, self.start, self.end))
        ):
            waves[w][r].append([s, a, b])
        out: dict[str, Any] = {
            "num_ranks": self.num_ranks,
            "seq_lens": self.seq_lens.tolist(),
            "sync": self.sync,
            "waves": waves,
        }
        if self.offload.any():
            out["offload"] = self.offload.tolist()
        if self.barriers:
            out["barriers"] = list(self.barriers)
        if self.kv_block_tokens != DEFAULT_KV_BLOCK_TOKENS:
            out["kv_block_tokens"] = self.kv_block_tokens
        if self.strategy is not None:
            out["strategy"] = self.strategy
        if self.capacity is not None:
            out["capacity"] = int(self.capacity)
        out["kv_exchange"] = self.kv_exchange
        if self.ranks_per_node is not None:
            out["ranks_per_node"] = self.ranks_per_node
        if self.predicted:
            out["predicted"] = {k: float(v) for k, v in self.predicted.items()}
        return out

    def with_exchange(self, kv_exchange: str) -> Plan:
        """The same placement run with another K/V exchange."""
        return Plan(
            self.seq_lens,
            self.num_ranks,
            *(getattr(self, c) for c in SHARD_COLUMNS),
            sync=self.sync,
            num_waves=self.num_waves,
            offload=self.offload,
            barriers=self.barriers,
            kv_block_tokens=self.kv_block_tokens,
            predicted=self.predicted,
            strategy=self.strategy,
            capacity=self.capacity,
            kv_exchange=kv_exchange,
            ranks_per_node=self.ranks_per_node,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")

    def to_wire(self) -> np.ndarray:
        """The form that crosses ranks: one ``uint8`` array (see :mod:`hdp.wire`) with every field.

        The header names the scalar fields (``num_ranks``, ``num_waves``, ``sync``, ``barriers``,
        ``kv_block_tokens``, ``strategy``, ``capacity``, ``kv_exchange``, ``ranks_per_node``,
        ``predicted``). The arrays travel as raw
        bytes: ``seq_lens``, the shard columns ``rank``, ``wave``, ``seq``, ``start``, ``end``, and
        ``offload`` when the plan offloads anything. :meth:`from_wire` rebuilds an equal plan.
        """
        fields = {
            "format": WIRE_FORMAT,
            "num_ranks": self.num_ranks,
            "num_waves": self.num_waves,
            "sync": self.sync,
            "barriers": list(self.barriers),
            "kv_block_tokens": self.kv_block_tokens,
            "strategy": self.strategy,
            "capacity": None if self.capacity is None else int(self.capacity),
            "kv_exchange": self.kv_exchange,
            "ranks_per_node": self.ranks_per_node,
            "predicted": {str(k): float(v) for k, v in self.predicted.items()},
        }
        arrays = {"seq_lens": self.seq_lens}
        arrays.update((c, getattr(self, c)) for c in SHARD_COLUMNS)
        if self.offload.any():
            arrays["offload"] = self.offload
        return wire.pack(fields, arrays)

    @classmethod
    def from_wire(cls, buf: np.ndarray | bytes) -> Plan:
        """The plan of :meth:`to_wire`'s ``buf``."""
        try:
            f, arrays = wire.unpack(buf)
        except wire.WireError as e:
            raise PlanError(f"not a plan in wire form: {e}") from None
        if f.get("format") != WIRE_FORMAT:
            raise PlanError(f"not a plan in wire form {WIRE_FORMAT!r}: format {f.get('format')!r}")
        missing = [k for k in ("seq_lens", *SHARD_COLUMNS) if k not in arrays]
        if missing:
            raise PlanError(f"the plan's wire form lacks the arrays {', '.join(missing)}")
        return cls(
            arrays["seq_lens"],
            f["num_ranks"],
            *(arrays[c] for c in SHARD_COLUMNS),
            sync=f["sync"],
            num_waves=f["num_waves"],
            offload=arrays.get("offload"),
            barriers=f["barriers"],
            kv_block_tokens=f["kv_block_tokens"],
            predicted=f["predicted"],
            strategy=f["strategy"],
            capacity=f["capacity"],
            kv_exchange=f.get("kv_exchange", "rank"),
            ranks_per_node=f.get("ranks_per_node"),
        )

    # ------------------------------------------------------------------ queries
    @property
    def num_shards(self) -> int:
        return int(self.seq.size)

    @cached_property
    def _cell_bounds(self) -> np.ndarray:
        """Offsets into the shard arrays: cell ``w * num_ranks + r`` is ``[b[c], b[c+1])``."""
        cell = self.wave * self.num_ranks + self.rank
        return np.searchsorted(cell, np.arange(self.num_waves * self.num_ranks + 1), side="left")

    def shard_slice(self, rank: int, wave: int) -> slice:
        c = wave * self.num_ranks + rank
        return slice(int(self._cell_bounds[c]), int(self._cell_bounds[c + 1]))

    def shards(self, rank: int, wave: int) -> list[Shard]:
        """Rank ``rank``'s shards in wave ``wave``, in local order."""
        if not (0 <= rank < self.num_ranks and 0 <= wave < self.num_waves):
            raise IndexError(
                f"no cell (rank {rank}, wave {wave}) in a plan of {self.num_ranks} ranks x "
                f"{self.num_waves} waves"
            )
        sl = self.shard_slice(rank, wave)
        return [
            Shard(int(s), int(a), int(b))
            for s, a, b in zip(self.seq[sl], self.start[sl], self.end[sl])
        ]

    def tokens_per_cell(self) -> np.ndarray:
        """``[num_waves, num_ranks]`` tokens each rank holds in each wave."""
        cell = self.wave * self.num_ranks + self.rank
        counts = np.bincount(
            cell, weights=self.end - self.start, minlength=self.num_waves * self.num_ranks
        )
        return counts.reshape(self.num_waves, self.num_ranks).astype(np.int64)

    def waves_of_rank(self) -> np.ndarray:
        """Number of waves each rank has work in (the last non-empty wave + 1)."""
        tok = self.tokens_per_cell()
        nz = tok > 0
        last = np.where(nz.any(axis=0), self.num_waves - np.argmax(nz[::-1], axis=0), 0)
        return last.astype(np.int64)

    def seq_wave(self) -> np.ndarray:
        """Wave of each sequence (-1 for empty sequences). Assumes a valid plan."""
        out = np.full(self.seq_lens.size, -1, dtype=np.int64)
        out[self.seq] = self.wave
        return out

    # ------------------------------------------------------------------ validation
    def validate(self, capacity: int | None = None, offload_capacity: int | None = None) -> None:
        """Raise :class:`PlanError` unless every invariant holds.

        Checked: ranges (ranks, waves, sequences, ``0 <= start < end <= len``); every token of
        every sequence in exactly one shard; all shards of a sequence in one wave; offload
        fractions in [0, 1]. When ``capacity`` is given, also at most ``capacity`` tokens per rank
        per wave (``offload_capacity`` for cells that offload activations).
        """
        problems = self._index_problems()
        if problems:  # the checks below index arrays by these values
            raise PlanError("invalid plan: " + "; ".join(problems))
        lens = self.seq_lens[self.seq]
        bad = (self.start < 0) | (self.end <= self.start) | (self.end > lens)
        if bad.any():
            i = int(np.argmax(bad))
            problems.append(
                f"shard {self._describe(i)} is not a non-empty range inside [0, {int(lens[i])})"
            )
        problems += self._coverage_problems()
        if ((self.offload < 0) | (self.offload > 1)).any():
            problems.append("offload fractions must lie in [0, 1]")
        if any(not 0 <= b_ < self.num_waves for b_ in self.barriers):
            problems.append(f"barriers must name waves in [0, {self.num_waves})")
        if capacity is not None:
            problems += self._capacity_problems(capacity, offload_capacity)
        if problems:
            raise PlanError(
                "invalid plan: "
                + "; ".join(problems[:5])
                + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
            )

    def _index_problems(self) -> list[str]:
        """Negative lengths, and ranks, waves or sequences outside their ranges."""
        problems: list[str] = []
        n = self.seq_lens.size
        if (self.seq_lens < 0).any():
            i = int(np.argmax(self.seq_lens < 0))
            problems.append(f"seq_lens[{i}] = {int(self.seq_lens[i])} is negative")
        bad = (self.rank < 0) | (self.rank >= self.num_ranks)
        if bad.any():
            problems.append(
                f"shard {self._describe(int(np.argmax(bad)))} names rank outside "
                f"[0, {self.num_ranks})"
            )
        bad = self.wave < 0
        if bad.any():
            problems.append(f"shard {self._describe(int(np.argmax(bad)))} has a negative wave")
        bad = (self.seq < 0) | (self.seq >= n)
        if bad.any():
            problems.append(
                f"shard {self._describe(int(np.argmax(bad)))} names a sequence outside [0, {n})"
            )
        return problems

    def _coverage_problems(self) -> list[str]:
        """Sorted by (seq, start), the shards of a sequence must tile [0, len) in one wave."""
        problems: list[str] = []
        order = np.lexsort((self.start, self.seq))
        s, a, b, w = self.seq[order], self.start[order], self.end[order], self.wave[order]
        first = np.ones(s.size, dtype=bool)
        first[1:] = s[1:] != s[:-1]
        last = np.ones(s.size, dtype=bool)
        last[:-1] = s[1:] != s[:-1]
        bad = first & (a != 0)
        if bad.any():
            i = int(np.argmax(bad))
            problems.append(f"sequence {int(s[i])}: tokens [0, {int(a[i])}) are in no shard")
        cont = ~first
        gap = np.zeros(s.size, dtype=bool)
        gap[1:] = cont[1:] & (a[1:] != b[:-1])
        if gap.any():
            i = int(np.argmax(gap))
            kind = "overlap" if a[i] < b[i - 1] else "leave a gap"
            problems.append(
                f"sequence {int(s[i])}: shards ending at {int(b[i - 1])} and starting at "
                f"{int(a[i])} {kind}"
            )
        bad = last & (b != self.seq_lens[s])
        if bad.any():
            i = int(np.argmax(bad))
            problems.append(
                f"sequence {int(s[i])}: tokens [{int(b[i])}, {int(self.seq_lens[s[i]])}) are in "
                "no shard"
            )
        covered = np.zeros(self.seq_lens.size, dtype=bool)
        covered[s] = True
        missing = (~covered) & (self.seq_lens > 0)
        if missing.any():
            i = int(np.argmax(missing))
            problems.append(f"sequence {i} (length {int(self.seq_lens[i])}) is in no shard")
        split = np.zeros(s.size, dtype=bool)
        split[1:] = cont[1:] & (w[1:] != w[:-1])
        if split.any():
            i = int(np.argmax(split))
            problems.append(
                f"sequence {int(s[i])} has shards in waves {int(w[i - 1])} and {int(w[i])}: "
                "all must share one wave"
            )
        return problems

    def _capacity_problems(self, capacity: int, offload_capacity: int | None) -> list[str]:
        """The first cell holding more tokens than its capacity, if any."""
        tok = self.tokens_per_cell()
        cap = np.full(tok.shape, float(capacity))
        if offload_capacity is not None:
            cap = np.where(self.offload > 0, float(max(offload_capacity, capacity)), cap)
        over = tok > cap
        if not over.any():
            return []
        wv, rk = (int(x[0]) for x in np.nonzero(over))
        return [
            f"rank {rk} holds {int(tok[wv, rk])} tokens in wave {wv}, above its capacity "
            f"{int(cap[wv, rk])}"
        ]

    def _describe(self, i: int) -> str:
        return (
            f"[{int(self.seq[i])}, {int(self.start[i])}, {int(self.end[i])}] "
            f"(rank {int(self.rank[i])}, wave {int(self.wave[i])})"
        )

    # ------------------------------------------------------------------ communication
    def cell_columns(self, wave: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """(rank, seq, start, end) of the shards of ``wave`` as lists, in cell order."""
        sl = slice(
            int(self._cell_bounds[wave * self.num_ranks]),
            int(self._cell_bounds[(wave + 1) * self.num_ranks]),
        )
        cols = (self.rank[sl], self.seq[sl], self.start[sl], self.end[sl])
        rank, seq, start, end = (x.tolist() for x in cols)
        return rank, seq, start, end

    def kv_needs(self, wave: int) -> dict[tuple[int, int], list[Shard]]:
        """What each rank receives from each other rank in ``wave``: ``(src, dst) -> pieces``
        (:func:`hdp.exchange.kv_needs`)."""
        return exchange.kv_needs(self, wave)

    def kv_transfers(self, wave: int) -> list[KVTransfer]:
        """The P2P messages of ``wave`` in the plan's K/V exchange."""
        return self.exchange(wave).transfers

    def exchange(self, wave: int) -> WaveExchange:
        """The messages of ``wave`` in rounds, with the relays' return phases
        (:func:`hdp.exchange.wave_exchange`)."""
        return exchange.wave_exchange(self, wave)

    def comm_rounds(self, wave: int) -> list[list[KVTransfer]]:
        """The KV messages of ``wave`` in congestion-free rounds.

        Each rank sends at most one message and receives at most one per round. In ``rank``
        exchange the number of rounds equals the largest number of messages any rank sends or
        receives (optimal).
        """
        return self.exchange(wave).rounds

    def kv_tokens_sent(self, wave: int) -> np.ndarray:
        """``[num_ranks]`` K/V tokens each rank sends in ``wave`` (forward pass of one layer)."""
        sent = np.zeros(self.num_ranks, dtype=np.int64)
        for m in self.kv_transfers(wave):
            sent[m.src] += m.tokens
        return sent

    def __repr__(self) -> str:
        return (
            f"Plan(strategy={self.strategy!r}, sequences={self.seq_lens.size}, "
            f"tokens={int(self.seq_lens.sum())}, ranks={self.num_ranks}, waves={self.num_waves}, "
            f"shards={self.num_shards}, sync={self.sync!r})"
        )


def _in_cell_order(wave: np.ndarray, rank: np.ndarray) -> bool:
    """Whether shards are already sorted by (wave, rank)."""
    if wave.size < 2:
        return True
    dw = wave[1:] - wave[:-1]
    return bool(((dw > 0) | ((dw == 0) & (rank[1:] >= rank[:-1]))).all())
