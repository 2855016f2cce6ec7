"""Offline simulation: sample global batches, plan each with every strategy, evaluate with the one
cost model, and summarise (means over steps). Used by ``hdp-sim`` and the benchmark scripts."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hdp import Plan, StepReport
from hdp.workloads import Workload

from . import PlanningError, StepPricing, get_strategy
from .breakdown import SlowestRank, slowest_rank
from .hybridcp import scheduler_name
from .tuning import Tuned, tune

RESULT_KEYS = (
    "step_time_s",
    "lower_bound_s",
    "imbalance",
    "exposed_comm_s",
    "comm_bytes",
    "nic_bytes",
    "nvlink_bytes",
    "peak_mem_bytes",
    "plan_time_s",
    "mfu",
)


@dataclass
class StrategyResult:
    """One strategy over all simulated steps."""

    name: str
    per_step: list[dict[str, float]] = field(default_factory=list)
    first_report: StepReport | None = None
    first_plan: Plan | None = None
    error: str | None = None
    slowest: list[SlowestRank] = field(default_factory=list)
    tuned: Tuned | None = None  # its plans of every step, with the search of its knobs
    limit: str = ""  # what its design stops it spreading a sequence past (Strategy.scaling_limit)

    def mean(self) -> dict[str, float]:
        if not self.per_step:
            return {}
        keys = self.per_step[0].keys()
        return {k: float(np.mean([s[k] for s in self.per_step])) for k in keys}

    def slowest_mean(self) -> SlowestRank | None:
        """Each step's slowest rank, broken down, and the parts' mean over the steps, as the
        table's columns are means (``None`` before any step)."""
        return SlowestRank.mean(self.slowest) if self.slowest else None


@dataclass
class SimResult:
    config: dict
    results: dict[str, StrategyResult]

    def to_json(self) -> dict:
        out: dict = {"config": self.config, "results": {}, "per_step": {}, "slowest_rank": {}}
        for name, r in self.results.items():
            if r.error is not None:
                out["results"][name] = {"error": r.error}
                continue
            out["results"][name] = r.mean()
            out["per_step"][name] = r.per_step
            # (a mean over the steps, rank null, and each step's own beside it)
            slowest = r.slowest_mean()
            if slowest is not None:
                out["slowest_rank"][name] = {
                    **slowest.to_json(),
                    "per_step": [b.to_json() for b in r.slowest],
                }
        return out


def simulate(
    workload: Workload,
    pricing: StepPricing,
    strategies: list[str],
    steps: int = 3,
    seed: int = 0,
    max_seq: int | None = None,
    tokens_per_step: int | None = None,
    options: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    batches: list[np.ndarray] | None = None,
    tune_knobs: bool = True,
) -> SimResult:
    """Plan ``steps`` seeded global batches with each strategy and evaluate them, all priced by
    ``pricing`` (``options``: a strategy's ``Options`` by its name, else its defaults; the K/V
    exchange of ``pricing`` is hdp's, the baselines keep their own). ``batches``: the global
    batches to plan instead (lengths, none above ``max_seq``); ``steps``, ``seed`` and
    ``tokens_per_step`` then do not apply. ``tune_knobs``: search each strategy's unset knobs
    over the batches and keep the value of the least mean step (Note [Tuning the baselines] in
    :mod:`hdp.planner.tuning`); else they take their systems' rules."""
    max_seq = int(max_seq or workload.max_seq)
    tokens_per_step = int(tokens_per_step or workload.tokens_per_step)
    if batches is not None:
        steps, tokens_per_step = _batch_sizes(batches)
    options = dict(options or {})
    # An unknown name fails before any planning.
    priced = {n: pricing.for_strategy(get_strategy(n)) for n in strategies}
    rng = np.random.default_rng(seed)
    results = {s: StrategyResult(s) for s in strategies}
    t_start = time.perf_counter()
    source = list(_global_batches(workload, rng, steps, tokens_per_step, max_seq, batches))
    for name in strategies:
        try:
            results[name].tuned = tune(
                get_strategy(name),
                priced[name],
                source,
                options.get(name),
                max_seq,
                progress,
                search=tune_knobs,
            )
        except PlanningError as e:
            results[name].error = str(e)
    for k, (lens, _) in enumerate(source):
        for name in strategies:
            r = results[name]
            if r.tuned is None:
                continue
            plan, report = r.tuned.planned[k]
            summary = {key: float(plan.predicted[key]) for key in RESULT_KEYS}
            summary["step_over_bound"] = summary["step_time_s"] / summary["lower_bound_s"]
            summary["num_waves"] = float(plan.num_waves)
            summary["sequences"] = float(lens.size)
            r.per_step.append(summary)
            r.slowest.append(slowest_rank(plan, report, priced[name].cost))
            if r.first_report is None:
                r.first_report, r.first_plan = report, plan
                r.limit = get_strategy(name).scaling_limit(plan, priced[name].cost)
            if progress and time.perf_counter() - t_start > 2.0:
                progress(
                    f"step {k + 1}/{steps}: {name:<9} planned in {summary['plan_time_s']:.2f} s, "
                    f"predicted {summary['step_time_s']:.2f} s"
                )
    config = _config(workload, pricing, max_seq, tokens_per_step, steps, seed, batches)
    config["strategies"] = strategies
    config["tuned"] = {
        n: r.tuned.summary(get_strategy(n))
        for n, r in results.items()
        if r.tuned is not None and r.tuned.searched
    }
    return SimResult(config, results)


def _config(
    workload: Workload,
    pricing: StepPricing,
    max_seq: int,
    tokens_per_step: int,
    steps: int,
    seed: int,
    batches: list[np.ndarray] | None,
) -> dict:
    """The setting of a simulation, as ``hdp-sim --json`` writes it."""
    cost = pricing.cost
    tp = cost.tensor_parallel
    return {
        "workload": workload.name,
        "gpus": pricing.cluster.num_ranks * tp,
        "gpus_per_node": pricing.cluster.ranks_per_node * tp,
        "tensor_parallel": tp,
        "gpu": pricing.cluster.gpu.name,
        "attention_backend": cost.attention_backend or pricing.cluster.gpu.attention_backend,
        "compiled": cost.compiled,
        "model": pricing.model.name,
        "max_seq": max_seq,
        "tokens_per_step": tokens_per_step,
        "capacity_peer": cost.capacity("peer"),
        "capacity_wave": cost.capacity("wave"),
        "steps": steps,
        "seed": seed if batches is None else None,
        "sync": pricing.sync or "native",
        "kv_exchange": pricing.kv_exchange,
    }


def _batch_sizes(batches: list[np.ndarray]) -> tuple[int, int]:
    """(steps, mean tokens) of given global batches; ValueError where there are none or one is
    empty."""
    if not batches or not all(np.size(b) for b in batches):
        raise ValueError("batches: give at least one global batch, each of one sequence or more")
    return len(batches), int(np.mean([np.sum(b) for b in batches]))


def _global_batches(
    workload: Workload,
    rng: np.random.Generator,
    steps: int,
    tokens_per_step: int,
    max_seq: int,
    batches: list[np.ndarray] | None,
) -> Iterator[tuple[np.ndarray, int | None]]:
    """(lengths, token budget) of each step: ``batches`` as given (each its own budget), else
    ``steps`` batches sampled from ``workload``."""
    if batches is None:
        for _ in range(steps):
            yield workload.sample_batch(rng, tokens_per_step, max_seq), tokens_per_step
        return
    for lens in batches:
        lens = np.asarray(lens, dtype=np.int64)
        if int(lens.max()) > max_seq:
            raise ValueError(
                f"a batch has a sequence of {int(lens.max())} tokens, over max_seq {max_seq}"
            )
        yield lens, None


def format_table(sim: SimResult) -> str:
    """The comparison table printed by ``hdp-sim``."""
    head = (
        "strategy",
        "sync",
        "step s",
        "vs static",
        "step/LB",
        "imbalance",
        "exposed comm s",
        "kv",
        "NIC GB/rank",
        "NVLink GB/rank",
        "peak mem GB",
        "plan s",
        "MFU",
        "waves",
    )
    rows = [head]
    # Per GPU: with tensor parallelism a plan's rank is a group, and the bytes counted are one
    # GPU's share of each group's.
    ranks = sim.config["gpus"] // sim.config.get("tensor_parallel", 1)
    static = sim.results.get("static")
    static_t = static.mean().get("step_time_s") if static and static.error is None else None
    for name, r in sim.results.items():
        if r.error is not None:
            rows.append((name, "-", "failed: " + r.error) + ("",) * (len(head) - 3))
            continue
        m = r.mean()
        rows.append(
            (
                name,
                r.first_plan.sync if r.first_plan else "-",
                f"{m['step_time_s']:.3f}",
                f"{static_t / m['step_time_s']:.2f}x" if static_t else "-",
                f"{m['step_over_bound']:.2f}",
                f"{m['imbalance']:.2f}",
                f"{m['exposed_comm_s']:.3f}",
                r.first_plan.kv_exchange if r.first_plan else "-",
                f"{m['nic_bytes'] / 1e9 / ranks:.1f}",
                f"{m['nvlink_bytes'] / 1e9 / ranks:.1f}",
                f"{m['peak_mem_bytes'] / 1e9:.1f}",
                f"{m['plan_time_s']:.3f}",
                f"{100 * m['mfu']:.1f}%",
                f"{m['num_waves']:.1f}",
            )
        )
    failed = [r for r in rows[1:] if len(r) > 2 and str(r[2]).startswith("failed")]
    ok = [r for r in rows if r not in failed]
    widths = [max(len(str(r[i])) for r in ok) for i in range(len(head))]
    lines = [
        "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
        for r in ok
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{r[0]}: {r[2]}" for r in failed]
    return "\n".join(lines + slowest_lines(sim) + planned_by(sim) + tuned_lines(sim))


def slowest_lines(sim: SimResult) -> list[str]:
    """A line per strategy under the table: what its slowest rank's step (a mean over the
    steps) is made of, so a reader can see why one strategy is slower than another."""
    out = []
    width = max((len(name) for name in sim.results), default=0) + 1
    for name, r in sim.results.items():
        slowest = r.slowest_mean() if r.error is None else None
        if slowest is not None:
            out.append(f"{name + ':':<{width}} {slowest.describe()}")
    return out


def planned_by(sim: SimResult) -> list[str]:
    """Lines under the table naming what planned each baseline: hdp's models of their systems,
    and for ``hybridcp`` the scheduler that formed its groups (megatron-core's own takes about
    ten times the CPU of ours for the same groups, which the plan s column would show)."""
    models = [n for n in sim.results if n not in ("hdp", "hybridcp")]
    systems = "hdp's model of its system" if len(models) == 1 else "hdp's models of their systems"
    lines = [f"{', '.join(models)}: planned by {systems}"] if models else []
    hybridcp = sim.results.get("hybridcp")
    if hybridcp is not None and hybridcp.first_plan is not None:
        plan = hybridcp.first_plan
        hint = (
            "--hybridcp-impl ours makes the same groups in a tenth of the time or less"
            if plan.predicted.get("megatron_scheduler")
            else "--hybridcp-impl megatron runs megatron-core's own"
        )
        lines.append(f"hybridcp: planned by {scheduler_name(plan)} ({hint})")
    return lines


def tuned_lines(sim: SimResult) -> list[str]:
    """Lines naming the knobs each baseline ran with, what was searched, and the limit a
    baseline's design sets on the ranks a sequence may span, where the cluster is past it."""
    lines = []
    for name, r in sim.results.items():
        if r.tuned is not None and r.tuned.searched:
            lines.append(f"{name}: tuned to {r.tuned.summary(get_strategy(name))}")
        if r.limit:
            lines.append(f"{name}: {r.limit}")
    return lines


def stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
