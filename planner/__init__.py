"""Planning one training step: which ranks hold which tokens of which sequence, in which wave.

``plan_step(seq_lens, cluster, model, strategy="hdp", **opts) -> hdp.Plan`` runs one strategy and
fills ``plan.predicted`` from the one :class:`hdp.CostModel`:

=============  ===========================================================================
``static``     DP x CP mesh, one power-of-two CP size, zigzag (Megatron / TransformerEngine)
``hybridcp``   Megatron-LM ``hybrid_context_parallel`` with its ``BalancedCPScheduler``
``bytescale``  ByteScale: whole short sequences, ``ceil(L / C)`` ranks for long ones, offload
``flexsp``     FlexSP: MILP over power-of-two groups, DP length buckets, time limit
``hdp``        ours: degrees from the malleable-job relaxation / MILP, 128-token zigzag blocks,
               node-aware placement, gap filling, offload; ``form="megatron"``: Megatron's groups
=============  ===========================================================================

Options (all keyword): ``sync`` (``"wave"`` / ``"peer"``; default: the strategy's own mode where
parameters fit, else ``wave``), ``capacity`` (tokens per rank per wave; default from memory),
``max_seq`` (default: the longest sequence), ``tokens_per_step`` (default: the batch's tokens),
``activation_checkpointing`` (default True), ``hybridcp_impl`` (``auto``/``megatron``/``ours``),
``form`` (``hdp`` only: ``free``, or ``megatron`` for aligned power-of-two CP groups and barriers),
``hdp_options`` (``hdp`` only: a :class:`planner.hdp.HdpOptions`),
``kv_exchange`` (:func:`exchanges`: ``hdp``: ``auto``, ``rank`` or ``node``; ``flexsp``:
``ulysses`` or ``rank``), ``validate`` (default True). The baselines exchange K/V as their own
systems do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hdp import ClusterSpec, CostModel, ModelSpec, Plan, StepReport

from . import bytescale, flexsp, hdp, hybridcp, static
from .common import Context, PlanningError
from .degrees import length_menu, menu_floor, packed_time

STRATEGIES: dict[str, tuple[Callable[..., Plan], str]] = {
    "static": (static.plan_static, static.NATIVE_SYNC),
    "hybridcp": (hybridcp.plan_hybridcp, hybridcp.NATIVE_SYNC),
    "bytescale": (bytescale.plan_bytescale, bytescale.NATIVE_SYNC),
    "flexsp": (flexsp.plan_flexsp, flexsp.NATIVE_SYNC),
    "hdp": (hdp.plan_hdp, hdp.NATIVE_SYNC),
}


# Strategies that let a rank hold more than the capacity by offloading activations to host memory.
OFFLOADING = frozenset({"bytescale", "hdp"})


def choose_sync(
    cost: CostModel, native: str, longest: int, requested: str | None = None, offload: bool = False
) -> tuple[str, int]:
    """(sync mode, capacity): ``requested`` if given, else ``native`` where its memory holds the
    longest sequence on the cluster (with activation offload where ``offload``), else ``wave``
    (parameters sharded). Raises PlanningError with what to change when neither holds it."""
    n = cost.cluster.num_ranks
    modes = [requested] if requested else ([native, "wave"] if native != "wave" else ["wave"])
    best = None
    for mode in modes:
        cap = cost.capacity(mode)
        room = max(cost.offload_capacity(mode), cap) if offload else cap
        if cap > 0 and longest <= room * n:
            return mode, cap
        best = (mode, room)
    mode, room = best
    if room <= 0:
        fixes = "more GPUs, --sync wave," if mode != "wave" else "more GPUs"
        raise PlanningError(
            f"{cost.model.name} does not fit on {cost.cluster.gpu.name} in '{mode}' sync: "
            "parameters, gradients and optimizer states leave no room for activations; use "
            f"{fixes} or a smaller model"
        )
    held = (
        "tokens per rank per wave with activation offload"
        if offload
        else "tokens per rank per wave"
    )
    raise PlanningError(
        f"the cluster cannot hold a {longest}-token sequence: {n} ranks x {room} {held} "
        f"= {n * room} tokens; use at least {-(-longest // room)} GPUs or a smaller --max-seq"
    )


def plan_step(
    seq_lens: Sequence[int] | np.ndarray,
    cluster: ClusterSpec,
    model: ModelSpec,
    strategy: str = "hdp",
    **opts: Any,
) -> Plan:
    """Plan one global batch with ``strategy``; ``predicted`` holds the cost model's view."""
    return plan_and_evaluate(seq_lens, cluster, model, strategy, **opts)[0]


def plan_and_evaluate(
    seq_lens: Sequence[int] | np.ndarray,
    cluster: ClusterSpec,
    model: ModelSpec,
    strategy: str = "hdp",
    **opts: Any,
) -> tuple[Plan, StepReport]:
    """:func:`plan_step`, also returning the cost model's full report (per-rank timelines).

    ``cost`` (a :class:`hdp.CostModel`) may be passed to reuse one across calls."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if lens.size == 0:
        raise PlanningError(
            "the batch is empty: there are no sequences to plan (check the dataloader's token "
            "budget)"
        )
    if (lens < 0).any():
        raise ValueError(f"sequence {int(np.argmax(lens < 0))} has a negative length")
    cost = opts.pop("cost", None) or CostModel(
        model,
        cluster,
        activation_checkpointing=opts.pop("activation_checkpointing", True),
        capacity_override=opts.pop("capacity", None),
    )
    form = opts.pop("form", "free")
    allowed = exchanges(strategy, form)
    exchange = opts.pop("kv_exchange", None) or "auto"
    if exchange == "auto" and "auto" not in allowed:
        exchange = allowed[0]  # the strategy's own
    if exchange not in allowed:
        raise TypeError(
            f"kv_exchange={exchange!r} does not apply to {strategy} (form {form!r}): the "
            f"baselines exchange K/V as their own systems do; choose {', '.join(allowed)}"
        )
    fn, native = STRATEGIES[strategy]
    longest = int(lens.max(initial=0))
    # Megatron's runtime (hdp's megatron form) keeps every activation on the GPU.
    offload = strategy in OFFLOADING and form != "megatron"
    requested_sync = opts.pop("sync", None)
    cost = cost.with_exchange("rank" if exchange == "auto" else exchange)
    sync, cap = choose_sync(cost, native, longest, requested_sync, offload=offload)
    if exchange == "auto" and nic_may_bind(cost, lens, sync, cap):
        cost = cost.with_exchange("node")
        sync, cap = choose_sync(cost, native, longest, requested_sync, offload=offload)
    ctx = Context(
        seq_lens=lens,
        cost=cost,
        sync=sync,
        capacity=cap,
        max_seq=int(opts.pop("max_seq", None) or max(longest, 1)),
        tokens_per_step=int(opts.pop("tokens_per_step", None) or lens.sum()),
        seed=int(opts.pop("seed", 0)),
    )
    validate = opts.pop("validate", True)
    impl = opts.pop("hybridcp_impl", "auto")
    hdp_options = opts.pop("hdp_options", None)
    if (form != "free" or hdp_options is not None) and strategy != "hdp":
        raise TypeError("form= and hdp_options= apply to the hdp strategy only")
    if opts:
        raise TypeError(f"plan_step got unknown options: {', '.join(sorted(opts))}")
    t0 = time.perf_counter()
    if strategy == "hybridcp":
        plan = fn(ctx, implementation=impl)
    elif strategy == "hdp":
        plan = fn(ctx, form=form, options=hdp_options)
    else:
        plan = fn(ctx)
    plan_time = time.perf_counter() - t0
    if validate:
        plan.validate(capacity=cap, offload_capacity=cost.offload_capacity(sync))
    report = cost.evaluate(plan, plan_time_s=plan_time)
    if exchange == "auto" and plan.kv_exchange == "node":
        plan, report = _faster_exchange(cost, plan, report)
    plan.predicted.update(report.summary())
    plan.predicted["capacity"] = float(cap)
    return plan, report


def exchanges(strategy: str, form: str = "free") -> tuple[str, ...]:
    """The K/V exchanges a strategy's plans may be priced in, its own first (what ``auto`` picks):
    hdp's P2P ones (``auto``: Note [Node exchange] in :mod:`hdp.exchange`); FlexSP's Ulysses
    all-to-all, or ``rank`` to run its placement with dist_attn; every other baseline and hdp's
    Megatron form, ring/P2P from each rank (``rank``)."""
    if strategy == "hdp" and form != "megatron":
        return ("auto", "rank", "node")
    if strategy == "flexsp":
        return ("ulysses", "rank")
    return ("rank",)


def nic_may_bind(cost: CostModel, seq_lens: np.ndarray, sync: str, capacity: int) -> bool:
    """``auto`` exchange: whether to plan for ``node``. Where the cluster has one node the two
    are the same messages; elsewhere ``node`` pays off where the longest sequence, at its fastest
    in ``rank`` exchange, takes over half the step's work floor, so that its NIC traffic may bind
    the step. Otherwise ``rank`` keeps the relay buffers' memory for tokens."""
    if cost.cluster.num_nodes == 1 or seq_lens.size == 0:
        return False
    n = cost.cluster.num_ranks
    packed = packed_time(cost, seq_lens, cost.offload_capacity(sync))
    menu = length_menu(cost, int(seq_lens.max()), sync, capacity)
    fastest = float(menu.height.min()) if menu.degrees.size else float("inf")
    return fastest > 0.5 * menu_floor(packed, n)


def _faster_exchange(cost: CostModel, plan: Plan, report: StepReport) -> tuple[Plan, StepReport]:
    """``auto``: the plan made for ``node`` exchange, run in whichever exchange the cost model
    predicts faster for it."""
    other = plan.with_exchange("rank")
    other_report = cost.evaluate(other, plan_time_s=report.plan_time_s)
    if other_report.step_time_s < report.step_time_s:
        return other, other_report
    return plan, report


__all__ = [
    "OFFLOADING",
    "STRATEGIES",
    "PlanningError",
    "choose_sync",
    "plan_and_evaluate",
    "exchanges",
    "nic_may_bind",
    "plan_step",
]
