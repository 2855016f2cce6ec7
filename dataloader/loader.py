"""The per-rank dataloader: plans ahead on rank 0, broadcasts compactly, reads only local shards.

Rank 0 runs a background thread that forms global batches (:class:`BatchStream`, lengths only) and
plans each with :func:`hdp.planner.plan_step`, keeping up to ``plan_ahead`` planned steps ready.
Each step rank 0 broadcasts one message (:func:`encode_step`: the batch's sequence descriptors and
the plan's wire form), and every rank, rank 0 included, runs the plan decoded from it, so all ranks
derive the same communication rounds. Every rank then reads only the tokens of its own shards (plus
one token past a shard's end, for the label). A run of one rank has no one to tell: its planning
thread reads the tokens too, so the training thread only takes the step. It yields a
:class:`StepData`: for each wave,
``input_ids``, ``labels`` (the next token of the same sequence; ``IGNORE_INDEX`` after a
sequence's last token), ``position_ids`` (position inside the sequence) and ``cu_seqlens`` of its
shards, and the step's global ``loss_tokens``.

``state_dict()`` is the stream state after the last step handed out (prefetched plans are formed
again on resume), so a resumed run sees exactly the same global batches, on any number of ranks.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from hdp import ClusterSpec, ModelSpec, Plan, Shard, wire

from .batching import BatchStream, GlobalBatch, SeqRef
from .sources import Source

if TYPE_CHECKING:  # for annotations only: the planner (plan_step) is imported where it plans
    from hdp.planner import StepPricing

IGNORE_INDEX = -100


@dataclass
class WaveData:
    """One rank's tokens of one wave, packed in ``shards`` order. Tensors are int64 ``[T]`` except
    ``cu_seqlens`` (int32 ``[len(shards) + 1]``)."""

    shards: list[Shard]
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor


@dataclass
class StepData:
    step: int
    plan: Plan
    waves: list[WaveData]
    loss_tokens: int  # global: label-bearing tokens of the whole step on all ranks
    tokens: int  # global tokens of the step
    truncated_tokens: int
    plan_time_s: float
    wait_s: float  # how long this rank waited for the step's data (planning not ready, reading)
    seqs: list[SeqRef] = field(default_factory=list)


# Names (and versions) the layout of a step message; decode_step refuses any other.
STEP_FORMAT = "hdp.step/1"


@dataclass(frozen=True)
class StepHeader:
    """The scalar fields of a step message; the sequences and the plan travel as arrays."""

    step: int
    truncated_tokens: int
    plan_time_s: float


def encode_step(batch: GlobalBatch, plan: Plan, plan_time_s: float) -> np.ndarray:
    """One ``uint8`` message (:mod:`hdp.wire`) with all a rank needs of a step.

    Its fields are :class:`StepHeader`'s and the names of the ``seqs`` columns; its arrays are
    ``seqs`` (one int64 row per :class:`SeqRef`) and ``plan`` (:meth:`Plan.to_wire`).
    """
    header = StepHeader(int(batch.step), int(batch.truncated_tokens), float(plan_time_s))
    fields = {"format": STEP_FORMAT, "seq_fields": list(SeqRef._fields), **asdict(header)}
    seqs = np.asarray(batch.seqs, dtype=np.int64).reshape(-1, len(SeqRef._fields))
    return wire.pack(fields, {"seqs": seqs, "plan": plan.to_wire()})


def decode_step(message: np.ndarray) -> tuple[GlobalBatch, Plan, float]:
    """The batch, plan and planning time of :func:`encode_step`'s ``message``."""
    fields, arrays = wire.unpack(message)
    if fields.get("format") != STEP_FORMAT or fields.get("seq_fields") != list(SeqRef._fields):
        raise ValueError(
            f"not a step message of format {STEP_FORMAT!r} with sequence columns "
            f"{SeqRef._fields}: {fields.get('format')!r}, {fields.get('seq_fields')}"
        )
    header = StepHeader(**{f.name: fields[f.name] for f in dataclass_fields(StepHeader)})
    refs = [SeqRef(*row) for row in arrays["seqs"].tolist()]
    batch = GlobalBatch(header.step, refs, header.truncated_tokens)
    return batch, Plan.from_wire(arrays["plan"]), header.plan_time_s


class HDPDataLoader:
    """Iterate :class:`StepData` for this rank; see the module docstring."""

    def __init__(
        self,
        sources: Sequence[Source],
        stream: BatchStream,
        cluster: ClusterSpec,
        model: ModelSpec,
        strategy: str = "hdp",
        plan_ahead: int = 2,
        group=None,
        plan_options: dict | None = None,
        pricing: StepPricing | None = None,
    ) -> None:
        self.sources = list(sources)
        if pricing is not None and (pricing.cluster, pricing.model) != (cluster, model):
            raise ValueError("the pricing is of another cluster or model than the loader's")
        self.pricing = pricing
        self.stream = stream
        self.cluster = cluster
        self.model = model
        self.strategy = strategy
        self.plan_options = dict(plan_options or {})
        self.group = group
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        if self.world != cluster.num_ranks:
            raise ValueError(
                f"the cluster spec has {cluster.num_ranks} ranks but the process group has "
                f"{self.world}"
            )
        self.plan_ahead = max(1, int(plan_ahead))
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if (self.distributed and dist.get_backend(group) == "nccl")
            else torch.device("cpu")
        )
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._delivered_state = stream.state_dict()

    # ------------------------------------------------------------------ planning (rank 0)
    def _plan(self, batch: GlobalBatch) -> tuple[Plan, float]:
        from hdp.planner import plan_step

        t0 = time.perf_counter()
        opts = dict(self.plan_options)
        opts.setdefault("max_seq", self.stream.max_seq)
        opts.setdefault("tokens_per_step", self.stream.tokens_per_step)
        if self.pricing is not None:
            plan = plan_step(batch.lengths, self.pricing, self.strategy, **opts)
        else:
            plan = plan_step(batch.lengths, self.cluster, self.model, self.strategy, **opts)
        return plan, time.perf_counter() - t0

    def _producer(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.stream.next_batch()
                state = self.stream.state_dict()
                plan, dt = self._plan(batch)
                if self.world == 1:  # no other rank to tell: read the tokens here, off the step
                    waves = [self._wave(batch, plan, w) for w in range(plan.num_waves)]
                    self._hand_over(((batch, plan, dt, waves), state))
                else:
                    self._hand_over((encode_step(batch, plan, dt), state))
        except BaseException as e:  # surface planning errors in the training thread
            self._hand_over(e)

    def _hand_over(self, item) -> None:
        """Queue ``item`` for the training thread unless the loader is closed meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _start(self) -> None:
        if self.rank == 0 and self._thread is None:
            self._queue = queue.Queue(maxsize=self.plan_ahead)
            self._thread = threading.Thread(target=self._producer, name="hdp-planner", daemon=True)
            self._thread.start()
            # A process that exits while this thread is inside the MILP solver aborts ("terminate
            # called without an active exception": HiGHS's C++ threads outlive the interpreter), so
            # a loader left open (an exception in the train loop) is closed at exit too.
            atexit.register(self.close)

    def ready_plans(self) -> int:
        """Planned steps waiting on rank 0 (how far planning is ahead of training)."""
        return self._queue.qsize() if self._queue is not None else 0

    # ------------------------------------------------------------------ broadcast
    def _broadcast(self, message: np.ndarray | None) -> np.ndarray:
        """Rank 0's step message on every rank: its length, then its bytes (two broadcasts)."""
        if not self.distributed:
            return message
        n = torch.tensor(
            [message.size if self.rank == 0 else 0], dtype=torch.int64, device=self._device
        )
        dist.broadcast(n, src=self._src(), group=self.group)
        buf = (
            torch.from_numpy(message).to(self._device)
            if self.rank == 0
            else torch.empty(int(n.item()), dtype=torch.uint8, device=self._device)
        )
        dist.broadcast(buf, src=self._src(), group=self.group)
        return message if self.rank == 0 else buf.cpu().numpy()

    def _src(self) -> int:
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    # ------------------------------------------------------------------ reading
    def _read(self, ref: SeqRef, start: int, stop: int) -> np.ndarray:
        return self.sources[ref.source].read(ref.doc, ref.offset + start, ref.offset + stop)

    def _wave(self, batch: GlobalBatch, plan: Plan, wave: int) -> WaveData:
        shards = plan.shards(self.rank, wave)
        ids, labels, pos, cu = [], [], [], [0]
        for s, a, b in shards:
            ref = batch.seqs[s]
            toks = self._read(ref, a, min(b + 1, ref.length))
            ids.append(toks[: b - a])
            lab = toks[1 : b - a + 1]
            if b == ref.length:  # the sequence's last token has no next token
                lab = np.concatenate([lab, [IGNORE_INDEX]])
            labels.append(lab)
            pos.append(np.arange(a, b, dtype=np.int64))
            cu.append(cu[-1] + b - a)
        cat = (
            (lambda xs: torch.from_numpy(np.concatenate(xs).astype(np.int64)))
            if shards
            else (lambda xs: torch.zeros(0, dtype=torch.int64))
        )
        return WaveData(
            list(shards), cat(ids), cat(labels), cat(pos), torch.tensor(cu, dtype=torch.int32)
        )

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> HDPDataLoader:
        self._start()
        return self

    def __next__(self) -> StepData:
        self._start()
        t0 = time.perf_counter()
        message = None
        if self.rank == 0:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            message, self._delivered_state = item
        if self.world == 1:
            batch, plan, plan_time, waves = message
        else:
            # Every rank, rank 0 included, runs the plan decoded from the same bytes.
            batch, plan, plan_time = decode_step(self._broadcast(message))
            if self.rank != 0:
                self._delivered_state = None  # rank 0 holds the state; see state_dict()
            waves = [self._wave(batch, plan, w) for w in range(plan.num_waves)]
        return StepData(
            batch.step,
            plan,
            waves,
            batch.loss_tokens,
            batch.tokens,
            batch.truncated_tokens,
            plan_time,
            time.perf_counter() - t0,
            batch.seqs,
        )

    def state_dict(self) -> dict:
        """The data position after the last step handed out (rank 0's view; identical everywhere
        once broadcast with :meth:`sync_state`)."""
        return dict(self._delivered_state) if self._delivered_state is not None else {}

    def sync_state(self) -> dict:
        """Broadcast rank 0's state to every rank and return it (for checkpoints all ranks save)."""
        if not self.distributed:
            return self.state_dict()
        obj = [self.state_dict() if self.rank == 0 else None]
        dist.broadcast_object_list(obj, src=self._src(), group=self.group)
        self._delivered_state = obj[0]
        return dict(obj[0])

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("load_state_dict must be called before iterating")
        self.stream.load_state_dict(state)
        self._delivered_state = self.stream.state_dict()

    def close(self, timeout_s: float = 300.0) -> None:
        """Stop planning ahead; wait for the plan in progress (bounded by the MILP's time limit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                warnings.warn(
                    f"hdp-planner thread still planning {timeout_s:.0f} s after close()",
                    RuntimeWarning,
                    stacklevel=2,
                )
            atexit.unregister(self.close)
