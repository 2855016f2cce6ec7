"""What a training step reports: the ranks' measurements gathered, the cost model's prediction
beside them, one ``--metrics`` row and one log line per step."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from hdp import CostModel, plural
from hdp.attention import COMM
from hdp.dataloader.loader import StepData

from .memory import PeakMemory
from .runtime import StepResult


@dataclass
class RankStats:
    """What the ranks measured in one step, gathered on every rank (lists: one entry a rank)."""

    busy_s: list[float]
    peak_mem_bytes: list[float]  # :class:`PeakMemory`
    comm_bytes: float  # what all ranks sent
    weights_finite: bool = True  # every rank's weights after the update (Note [Non-finite updates])


@dataclass
class Predicted:
    """What the cost model priced for the step's plan, per rank (rank 0 only; else empty)."""

    rank_s: list[float]  # busy time: compute, exposed communication and offload
    mem_bytes: list[float]  # peak over the waves
    activation_bytes: list[float]  # the activation part of ``mem_bytes``


def gather_stats(
    res: StepResult,
    *,
    world: int,
    device: torch.device,
    memory: PeakMemory,
    weights_finite: torch.Tensor | None = None,
) -> RankStats:
    """Every rank's busy time, peak memory and sent bytes, and whether its weights are finite
    after the update (a 0-dim flag on the device), gathered on every rank in one collective."""
    # On the training device: NCCL has no CPU tensors.
    mine = torch.tensor(
        [res.busy_s, memory.step_peak(), COMM.fwd_bytes_sent + COMM.bwd_bytes_sent, 1.0],
        dtype=torch.float64,
        device=device,
    )
    if weights_finite is not None:
        mine[3] = weights_finite
    ranks = [mine]
    if dist.is_initialized():
        ranks = [torch.zeros(4, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(ranks, mine)
    rows = [r.tolist() for r in ranks]
    return RankStats(
        busy_s=[r[0] for r in rows],
        peak_mem_bytes=[r[1] for r in rows],
        comm_bytes=sum(r[2] for r in rows),
        weights_finite=all(r[3] == 1.0 for r in rows),
    )


def metrics_record(
    data: StepData,
    res: StepResult,
    *,
    step: int,
    step_time: float,
    stats: RankStats,
    lr: float,
    grad_norm: float,
    mfu: float,
    trained: int,
    predicted: Predicted,
    vocab: int,
    update_skipped: bool = False,
    skipped_updates: int = 0,
) -> dict:
    """The step's line of the ``--metrics`` file: measured figures and, beside them, what the
    cost model predicted (``predicted_step_s``; per rank ``predicted_rank_s`` beside ``busy_s``
    and ``predicted_mem_bytes`` beside ``peak_mem_bytes``). ``update_skipped``: the loss or the
    gradient norm was not finite and the optimizer did not step (``skipped_updates``: how many
    steps so far). ``vocab``: the model's, whose log is the loss of a model that learnt nothing."""
    busy_s = stats.busy_s
    return {
        "step": step,
        "loss": res.loss,
        "vocab": vocab,
        "tokens": data.tokens,
        "loss_tokens": data.loss_tokens,
        "step_time_s": step_time,
        "tokens_per_s": data.tokens / step_time,
        "imbalance": max(busy_s) / (sum(busy_s) / len(busy_s)) if sum(busy_s) > 0 else 1.0,
        "plan_time_s": data.plan_time_s,
        "data_wait_s": data.wait_s,
        "comm_bytes": stats.comm_bytes,
        "kv_exchange": data.plan.kv_exchange,
        "predicted_nic_bytes": data.plan.predicted.get("nic_bytes", float("nan")),
        "waves": data.plan.num_waves,
        "lr": lr,
        "grad_norm": grad_norm,
        "mfu": mfu,
        "predicted_step_s": data.plan.predicted.get("step_time_s", float("nan")),
        "busy_s": busy_s,
        "predicted_rank_s": predicted.rank_s,
        "peak_mem_bytes": stats.peak_mem_bytes,
        "predicted_mem_bytes": predicted.mem_bytes,
        "predicted_activation_bytes": predicted.activation_bytes,
        "trained_tokens": trained,
        "truncated_tokens": data.truncated_tokens,
        "update_skipped": update_skipped,
        "skipped_updates": skipped_updates,
    }


def predict(cost: CostModel, data: StepData) -> Predicted:
    """Each rank's busy time and peak memory as the cost model prices the step's plan."""
    report = cost.evaluate(data.plan)
    activations = cost.activation_bytes(report.tokens, data.plan.offload)
    fullest = report.mem_bytes.argmax(axis=0)  # each rank's peak wave
    ranks = np.arange(report.mem_bytes.shape[1])
    return Predicted(
        rank_s=report.busy_s.sum(axis=0).tolist(),
        mem_bytes=report.mem_bytes[fullest, ranks].tolist(),
        activation_bytes=activations[fullest, ranks].tolist(),
    )


def clock(seconds: float) -> str:
    """``seconds`` as h:mm:ss."""
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def step_line(record: dict, data: StepData, *, elapsed: float, left: int, done: int) -> str:
    """The step's log line; ``elapsed`` seconds of this run so far, ``done`` of its steps
    trained and ``left`` to go (the ETA extrapolates the mean step)."""
    eta = elapsed / max(done, 1) * left
    return (
        f"step {record['step']:>5}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
        f"grad norm {record['grad_norm']:.3g}  tokens/s {record['tokens_per_s']:,.0f}  "
        f"MFU {100 * record['mfu']:.2f}%  mem {max(record['peak_mem_bytes']) / 1e9:.2f} GB  "
        f"imbalance {record['imbalance']:.2f}  plan {data.plan_time_s:.3f}s  "
        f"comm {record['comm_bytes'] / 1e6:.1f} MB  waves {data.plan.num_waves}  "
        f"[{clock(elapsed)}, ETA {clock(eta)}]"
        + ("  not finite: no update" if record.get("update_skipped") else "")
    )


def first_step_line(cost: CostModel, data: StepData, step: int) -> str:
    """What the run's first step holds and what the cost model expects of it (time as h:mm:ss,
    each rank's peak memory against what a rank has), so a step of minutes (a 2M-token step on
    CPU) is not mistaken for a hang; a warning where it is predicted to take over an hour."""
    lens = data.plan.seq_lens
    predicted = cost.evaluate(data.plan).step_time_s
    peak = max(predict(cost, data).mem_bytes, default=0.0)
    line = (
        f"step {step}: {plural(len(lens), 'sequence')}, longest {int(lens.max(initial=0)):,} "
        f"tokens; predicted {clock(predicted)} and {peak / 1e9:.1f} GB per rank (of "
        f"{cost.cluster.gpu.memory_bytes / 1e9:.0f} GB) by the cost model "
        f"({cost.cluster.gpu.name} profile)"
    )
    if predicted > 3600:
        line += "\nwarning: this step is predicted to take over an hour; a progress line follows "
        line += "every 30 s"
    return line


def data_line(sources: list, max_seq: int) -> str:
    """The run's data: each source with its documents and tokens, and the tokenizer; a note when
    no document comes near ``--max-seq``."""
    parts, longest = [], 0
    for src in sources:
        lens = np.asarray(src.lengths)
        longest = max(longest, int(lens.max(initial=0)))
        tokenizer = getattr(getattr(src, "tokenizer", None), "id", None)
        parts.append(
            f"{src.name} ({plural(int(np.count_nonzero(lens)), 'document')}, "
            f"{int(lens.sum()):,} tokens" + (f", tokenizer {tokenizer}" if tokenizer else "") + ")"
        )
    line = f"data: {'; '.join(parts)}; longest document {longest:,} tokens"
    if longest * 2 <= max_seq:
        line += (
            f"\nnote: no document is longer than {longest:,} tokens, so no step holds a sequence "
            f"near --max-seq {max_seq:,}; for longer ones pass --data with long documents or "
            "--workload byted-2m"
        )
    return line


class Heartbeat:
    """While a step runs longer than ``every`` seconds, rank 0 prints its progress against the
    cost model's prediction every ``every`` seconds (a background thread; ``with`` per step)."""

    def __init__(self, log, step: int, predicted_s: float, every: float = 30.0):
        self.log, self.step, self.predicted_s, self.every = log, step, predicted_s, every
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hdp-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._done.wait(self.every):
            elapsed = time.perf_counter() - self._t0
            share = elapsed / self.predicted_s if self.predicted_s > 0 else float("nan")
            eta = max(self.predicted_s - elapsed, 0.0)
            self.log(
                f"step {self.step}: {clock(elapsed)} elapsed, {share:.0%} of the predicted "
                f"{clock(self.predicted_s)}, ETA {clock(eta)}"
                + (" (past the prediction)" if elapsed > self.predicted_s else "")
            )
