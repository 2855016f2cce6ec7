"""Planning one training step: which ranks hold which tokens of which sequence, in which wave.

``plan_step(seq_lens, pricing, strategy="hdp", **opts) -> hdp.Plan`` runs one strategy
(:data:`STRATEGIES`, :mod:`hdp.planner.strategies`) and fills ``plan.predicted`` from the
:class:`StepPricing`'s one cost model (:mod:`hdp.planner.pricing`):

=============  ===========================================================================
``static``     DP x CP mesh, one power-of-two CP size, zigzag (Megatron / TransformerEngine)
``hybridcp``   Megatron-LM ``hybrid_context_parallel`` with its ``BalancedCPScheduler``
``bytescale``  ByteScale: whole short sequences, ``ceil(L / C)`` ranks for long ones, offload
``flexsp``     FlexSP: MILP over power-of-two groups, DP length buckets, time limit
``hdp``        ours: degrees from the malleable-job relaxation / MILP, 128-token zigzag blocks,
               node-aware placement, gap filling, offload; ``form="megatron"``: Megatron's groups
=============  ===========================================================================

The first form, ``plan_step(seq_lens, cluster, model, strategy="hdp", **opts)``, still works: it
builds the pricing from the options ``sync`` (``"wave"`` / ``"peer"``; default: the strategy's
own mode where parameters fit, else ``wave``), ``capacity`` (tokens per rank per wave; default
from memory), ``activation_checkpointing`` (default True) or ``cost`` (a :class:`hdp.CostModel`
built once for many calls, instead of those two), and ``kv_exchange`` (``hdp``: ``auto``,
``rank``, ``node`` or ``ulysses``; ``flexsp``: ``ulysses`` or ``rank``; the baselines exchange
K/V as their own systems do). With a :class:`StepPricing` those belong to it.

Options of both forms (all keyword): ``max_seq`` (default: the longest sequence),
``tokens_per_step`` (default: the batch's tokens), ``seed``, ``validate`` (default True),
``options`` (the strategy's ``Options``: :class:`hdp.planner.dynamic.DynamicOptions` for ``hdp``,
:class:`hdp.planner.strategies.HybridCPOptions` for ``hybridcp``), and as shorthands for its knobs
``form`` (``hdp``: ``free``, ``whole`` or ``megatron``), ``hdp_options`` (``hdp``: a
``DynamicOptions``) and ``hybridcp_impl`` (``hybridcp``: ``auto``/``megatron``/``ours``; ignored by
the others).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from hdp import ClusterSpec, CostModel, ModelSpec, Plan, StepReport, ulysses

from .common import Context, PlanningError
from .degrees import heads_bound, packed_time, step_bound
from .dynamic.budget import Budget
from .dynamic.options import DynamicOptions
from .menus import fastest_height, menu_floor
from .pricing import Settled, StepPricing
from .strategies import STRATEGIES, Strategy, get_strategy

_PRICING_OPTIONS = ("sync", "capacity", "activation_checkpointing", "kv_exchange", "cost")


def plan_step(
    seq_lens: Sequence[int] | np.ndarray,
    pricing: StepPricing | ClusterSpec,
    *args: Any,
    **opts: Any,
) -> Plan:
    """Plan one global batch with a strategy; ``predicted`` holds the cost model's view.
    ``plan_step(seq_lens, pricing, strategy="hdp", **opts)``, or the first contract's
    ``plan_step(seq_lens, cluster, model, strategy="hdp", **opts)``."""
    return plan_and_evaluate(seq_lens, pricing, *args, **opts)[0]


def plan_and_evaluate(
    seq_lens: Sequence[int] | np.ndarray,
    pricing: StepPricing | ClusterSpec,
    *args: Any,
    **opts: Any,
) -> tuple[Plan, StepReport]:
    """:func:`plan_step`, also returning the cost model's full report (per-rank timelines)."""
    pricing, strategy, opts = _arguments(pricing, args, opts)
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if lens.size == 0:
        raise PlanningError(
            "the batch is empty: there are no sequences to plan (check the dataloader's token "
            "budget)"
        )
    if (lens < 0).any():
        raise ValueError(f"sequence {int(np.argmax(lens < 0))} has a negative length")
    options = _strategy_options(strategy, opts)
    exchange = pricing.exchange(strategy, options)
    longest = int(lens.max(initial=0))
    settled = pricing.settle(strategy, longest, options, exchange)
    if exchange == "auto" and nic_may_bind(settled.cost, lens, settled.sync, settled.capacity):
        settled = pricing.settle(strategy, longest, options, "node")
    cost, sync, cap = settled
    ctx = Context(
        seq_lens=lens,
        cost=cost,
        sync=sync,
        capacity=cap,
        max_seq=int(opts.pop("max_seq", None) or max(longest, 1)),
        tokens_per_step=int(opts.pop("tokens_per_step", None) or lens.sum()),
        seed=int(opts.pop("seed", 0)),
        any_exchange=exchange == "auto",
    )
    validate = opts.pop("validate", True)
    if opts:
        raise TypeError(f"plan_step got unknown options: {', '.join(sorted(opts))}")
    plan, report = _plan_once(strategy, ctx, options, validate)
    if exchange == "auto":  # (plan may be a head-parallel rival's: ``cost`` is P2P here)
        plan, report, cap = _or_head_parallel(strategy, ctx, options, validate, plan, report)
    plan.predicted.update(report.summary())
    plan.predicted["capacity"] = float(cap)
    return plan, report


def _or_head_parallel(
    strategy: Strategy, ctx: Context, options: Any, validate: bool, plan: Plan, report: StepReport
) -> tuple[Plan, StepReport, int]:
    """``auto``: the P2P ``plan`` (its report, its capacity), or a head-parallel plan of the
    same step where :func:`heads_may_win` and the budget let one be made and it is faster; the
    plan says the lesser bound, and what both searches had and charged."""
    t0 = time.perf_counter()
    cap = ctx.capacity
    by_heads = ctx.cost.with_exchange("ulysses")  # (no K/V buffers: its own capacity)
    bound = plan.predicted.get("bound_s")
    limit = getattr(options, "max_ranks_per_seq", None)
    heads = replace(
        ctx,
        cost=by_heads,
        capacity=by_heads.capacity(ctx.sync),
        bound_s=bound,
        max_ranks_per_seq=limit,
    )
    rest = _rest_of_budget(options, plan, heads)
    if rest is None or not heads_may_win(heads, report.step_time_s):
        return plan, report, cap
    rest_options, first_s = rest
    other, other_report = _plan_once(strategy, heads, rest_options, validate)
    spent = report.plan_time_s + time.perf_counter() - t0
    searched = plan.predicted.get("search_s", 0.0) + first_s
    searched += other.predicted.get("search_s", 0.0)
    budget = plan.predicted.get("budget_s")
    if other_report.step_time_s < report.step_time_s:
        plan, report, cap = other, other_report, heads.capacity
        # Bounds price P2P bytes in their exchange at its capacity: where the head-parallel
        # plan, with its own capacity, wins, the lesser bound holds for both.
        bound = min(bound, float(step_bound(by_heads, ctx.seq_lens, ctx.sync, heads.capacity)))
    plan.predicted["bound_s"] = bound
    if budget is not None:  # one step's budget, shared by both searches
        plan.predicted.update(budget_s=budget, search_s=searched)
    return plan, replace(report, plan_time_s=spent), cap


def _arguments(
    pricing: StepPricing | ClusterSpec, args: tuple, opts: dict[str, Any]
) -> tuple[StepPricing, Strategy, dict[str, Any]]:
    """(pricing, strategy, the remaining options) of either form of :func:`plan_step`."""
    opts = dict(opts)
    if isinstance(pricing, StepPricing):
        if len(args) > 1:
            raise TypeError("plan_step(seq_lens, pricing, strategy, **opts) takes one strategy")
        name = args[0] if args else opts.pop("strategy", "hdp")
        given = [k for k in _PRICING_OPTIONS if k in opts]
        if given:
            raise TypeError(
                f"{', '.join(given)} belong to the StepPricing: pass them to StepPricing.build"
            )
        return pricing, get_strategy(name), opts
    if not isinstance(pricing, ClusterSpec) or not args or not isinstance(args[0], ModelSpec):
        raise TypeError(
            "plan_step takes (seq_lens, pricing, strategy) or (seq_lens, cluster, model, strategy)"
        )
    if len(args) > 2:
        raise TypeError("plan_step(seq_lens, cluster, model, strategy, **opts) takes one strategy")
    name = args[1] if len(args) > 1 else opts.pop("strategy", "hdp")
    strategy = get_strategy(name)
    sync, exchange = opts.pop("sync", None), opts.pop("kv_exchange", None) or "auto"
    cost = opts.pop("cost", None)
    if cost is not None:  # a cost model built by the caller, shared across calls
        return StepPricing(cost, sync, exchange), strategy, opts
    built = StepPricing.build(
        args[0],
        pricing,
        activation_checkpointing=opts.pop("activation_checkpointing", True),
        capacity=opts.pop("capacity", None),
        sync=sync,
        kv_exchange=exchange,
    )
    return built, strategy, opts


def _strategy_options(strategy: Strategy, opts: dict[str, Any]) -> Any:
    """The strategy's options from ``options=`` and the shorthands, popped from ``opts``."""
    given = opts.pop("options", None)
    hdp_options = opts.pop("hdp_options", None)
    form = opts.pop("form", None)
    impl = opts.pop("hybridcp_impl", None)
    if (form not in (None, "free") or hdp_options is not None) and strategy.name != "hdp":
        raise TypeError("form= and hdp_options= apply to the hdp strategy only")
    if strategy.name != "hdp":
        form = None
    if hdp_options is not None:
        if given is not None:
            raise TypeError("pass the hdp strategy's options as options= or hdp_options=, not both")
        given = hdp_options
    changes = {}
    if form is not None:
        changes["form"] = form
    if impl is not None and strategy.name == "hybridcp":
        changes["implementation"] = impl
    return strategy.options(given, **changes)


def nic_may_bind(cost: CostModel, seq_lens: np.ndarray, sync: str, capacity: int) -> bool:
    """``auto`` exchange: whether to plan for ``node``. Where the cluster has one node the two
    are the same messages; elsewhere ``node`` pays off where the longest sequence, at its fastest
    in ``rank`` exchange, takes over half the step's work floor, so that its NIC traffic may bind
    the step. Otherwise ``rank`` keeps the relay buffers' memory for tokens."""
    if cost.cluster.num_nodes == 1 or seq_lens.size == 0:
        return False
    n = cost.cluster.num_ranks
    packed = packed_time(cost, seq_lens, cost.offload_capacity(sync))
    fastest = fastest_height(cost, int(seq_lens.max()), sync, capacity)
    return fastest > 0.5 * menu_floor(packed, n)


def heads_may_win(heads: Context, step_s: float) -> bool:
    """``auto`` exchange: whether to plan head-parallel (``ulysses``) groups too, beside a P2P
    plan of ``step_s``: where groups of at most one rank a head hold the longest sequence and
    a lower bound of head-parallel plans (:func:`hdp.planner.degrees.heads_bound`) is below
    ``step_s``; groups of at most ``heads.max_ranks_per_seq``."""
    cost, lens, sync = heads.cost, heads.seq_lens, heads.sync
    top = ulysses.most_members(cost.model, heads.num_ranks)
    top = min(top, heads.max_ranks_per_seq or top)
    room = max(cost.offload_capacity(sync), heads.capacity)
    if top < 2 or lens.size == 0 or int(lens.max()) > room * top:
        return False
    return heads_bound(cost, lens, sync, heads.num_ranks) < step_s


def _rest_of_budget(options: Any, plan: Plan, heads: Context) -> tuple[Any, float] | None:
    """``options`` for ``auto``'s head-parallel search of the step, and what its first plan is
    charged: with what the P2P search's budget left less the estimate of a first plan like the
    P2P plan (:meth:`~hdp.planner.dynamic.budget.Budget.first_plan_s`), where the budget affords
    that (``None`` where it does not); the options as they are, charged nothing, where the
    strategy has no budget."""
    if not isinstance(options, DynamicOptions) or "budget_s" not in plan.predicted:
        return options, 0.0
    left = plan.predicted["budget_s"] - plan.predicted.get("search_s", 0.0)
    first_s = Budget.first_plan_s(heads, *Budget.first_plan_work(heads, plan))
    if first_s > left:
        return None
    return replace(options, plan_budget_s=left - first_s), first_s


def _plan_once(
    strategy: Strategy, ctx: Context, options: Any, validate: bool
) -> tuple[Plan, StepReport]:
    """``strategy``'s plan of ``ctx`` and its report; under ``auto`` a plan made for ``node``
    runs in whichever P2P exchange is faster for it."""
    t0 = time.perf_counter()
    plan = strategy.plan(ctx, options)
    plan_time = time.perf_counter() - t0
    cost, sync = ctx.cost, ctx.sync
    if validate:  # (hdp may return a baseline's plan made for another exchange: its memory)
        own = cost.with_exchange(plan.kv_exchange)
        plan.validate(capacity=ctx.capacity, offload_capacity=own.offload_capacity(sync))
    report = cost.evaluate(plan, plan_time_s=plan_time)
    if ctx.any_exchange and plan.kv_exchange == "node":
        plan, report = _faster_exchange(cost, plan, report)
    return plan, report


def _faster_exchange(cost: CostModel, plan: Plan, report: StepReport) -> tuple[Plan, StepReport]:
    """``auto``: the plan made for ``node`` exchange, run in whichever exchange the cost model
    predicts faster for it."""
    other = plan.with_exchange("rank")
    other_report = cost.evaluate(other, plan_time_s=report.plan_time_s)
    if other_report.step_time_s < report.step_time_s:
        return other, other_report
    return plan, report


__all__ = [
    "STRATEGIES",
    "PlanningError",
    "Settled",
    "StepPricing",
    "Strategy",
    "get_strategy",
    "nic_may_bind",
    "plan_and_evaluate",
    "plan_step",
]
