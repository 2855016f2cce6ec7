"""The planning strategies, as objects in one registry (:data:`STRATEGIES`).

A strategy tells :func:`hdp.planner.plan_step` everything it needs besides the plan itself: the sync
mode its system runs in, whether its ranks may offload activations to host memory, which K/V
exchanges its plans may be priced in, and its knobs (a frozen ``Options`` dataclass whose
defaults are what ``plan_step`` plans with). A knob with ``flag`` metadata is also a flag of
``hdp-sim`` and ``hdp-plan`` (:func:`add_option_flags`).
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from hdp import CostModel, Plan, argtypes, ulysses

from . import bytescale, flexsp, hybridcp, static
from .common import Context, PlanningError, knob_flag, next_pow2, option_flag
from .dynamic import NATIVE_SYNC, DynamicOptions, plan_dynamic


@dataclass(frozen=True)
class NoOptions:
    """The options of a strategy without knobs."""


@dataclass(frozen=True)
class MeshOptions:
    size: int | None = knob_flag(
        flag="--mesh-size",
        metavar="RANKS",
        help="static and ulysses: the CP (SP) size of the mesh, a power of two; not set: the "
        "smallest at which every replica gets a micro-batch (hdp-sim searches it)",
    )


@dataclass(frozen=True)
class HybridCPOptions:
    implementation: str = option_flag(
        "auto",
        flag="--hybridcp-impl",
        choices=("auto", "megatron", "ours"),
        help="hybridcp scheduler: ours (auto), which makes megatron-core's decisions in a tenth of "
        "its time or less, or megatron-core's own BalancedCPScheduler (megatron), to check",
    )
    max_tokens_per_rank: int | None = knob_flag(
        flag="--hybridcp-max-tokens",
        metavar="TOKENS",
        help="hybridcp: Megatron's max_seqlen_per_dp_cp_rank; not set: the capacity (hdp-sim "
        "searches it)",
    )


@dataclass(frozen=True)
class ByteScaleOptions:
    capacity: int | None = knob_flag(
        flag="--bytescale-capacity",
        metavar="TOKENS",
        help="bytescale: tokens per rank per micro-batch, below what memory holds (then nothing is "
        "offloaded); not set: what memory holds (hdp-sim searches it)",
    )


class Strategy(ABC):
    """One way to plan a step; the subclasses below are the whole registry."""

    name: ClassVar[str]
    summary: ClassVar[str]
    native_sync: ClassVar[str]  # the sync mode its system runs in, where memory allows
    Options: ClassVar[type] = NoOptions
    # Whether a K/V exchange asked for (--kv-exchange) applies to its plans; a baseline
    # exchanges K/V as its own system does.
    takes_kv_exchange: ClassVar[bool] = False

    def offloads(self, options: Any) -> bool:
        """Whether a rank may hold more than the capacity by offloading activations."""
        return False

    def exchanges(self, options: Any) -> tuple[str, ...]:
        """The K/V exchanges its plans may be priced in, its own first (what ``auto`` picks)."""
        return ("rank",)

    def exchange_reason(self, options: Any) -> str:
        """Why :meth:`exchanges` is all it supports, for error messages."""
        return "a baseline exchanges K/V as its own system does"

    @abstractmethod
    def plan(self, ctx: Context, options: Any) -> Plan:
        """Plan the batch of ``ctx`` (``options``: an instance of :attr:`Options`)."""

    def search_space(self, ctx: Context, options: Any) -> list[Any]:
        """The options worth trying at the setting of ``ctx`` (Note [Tuning the baselines] in
        :mod:`hdp.planner.tuning`): ``options`` with each unset knob given each value its
        authors might choose; ``[options]`` where nothing is left to search."""
        return [options]

    def knob(self, options: Any) -> tuple[str, str] | None:
        """(name, value) of the knob set in ``options`` that :meth:`search_space` searches;
        ``None`` where it is not set."""
        return None

    def scaling_limit(self, plan: Plan, cost: CostModel) -> str:
        """Why, by its design, ``plan`` (priced by ``cost``) cannot spread a sequence over more
        of the cluster's ranks, in one line; empty where nothing in the design stops it."""
        return ""

    def options(self, given: Any = None, **changes: Any) -> Any:
        """``given`` (or the defaults) with ``changes``; TypeError for another strategy's options
        or a knob this strategy lacks."""
        base = self.Options() if given is None else given
        if not isinstance(base, self.Options):
            raise TypeError(
                f"the {self.name} strategy takes {self.Options.__name__}, not {type(base).__name__}"
            )
        unknown = set(changes) - {f.name for f in fields(self.Options)}
        if unknown:
            knobs = ", ".join(sorted(unknown))
            raise TypeError(f"{knobs} do not apply to the {self.name} strategy")
        return replace(base, **changes) if changes else base


class Static(Strategy):
    name = "static"
    native_sync = static.NATIVE_SYNC
    summary = "DP x CP mesh, one power-of-two CP size, zigzag (Megatron / TransformerEngine)"
    Options = MeshOptions
    mesh: ClassVar[str] = "CP"  # what its size is called

    def plan(self, ctx: Context, options: MeshOptions) -> Plan:
        return static.plan_static(ctx, self.name, options.size)

    def search_space(self, ctx: Context, options: MeshOptions) -> list[MeshOptions]:
        if options.size is not None:
            return [options]
        try:
            least = static.memory_size(ctx, self.name)
        except PlanningError:
            return [options]  # planning says why
        # Below the size at which the replicas are as many as the micro-batches some replicas
        # idle. Above it a rank's K/V traffic grows with the ring while its compute does not:
        # one doubling may still balance uneven micro-batches better, more only moves bytes.
        micro_batches = -(-ctx.tokens_per_step // max(ctx.max_seq, 1))
        first = max(least, next_pow2(ctx.num_ranks / max(micro_batches, 1)))
        most = static.largest_size(ctx, self.name)
        sizes = [first << k for k in range(2) if first << k <= most]
        return [replace(options, size=s) for s in sizes] or [options]

    def knob(self, options: MeshOptions) -> tuple[str, str] | None:
        return None if options.size is None else (f"{self.mesh} size", str(options.size))


class Ulysses(Static):
    name = "ulysses"
    summary = "DP x SP mesh, one power-of-two SP size, all-to-all over heads (DeepSpeed-Ulysses)"
    mesh = "SP"

    def exchanges(self, options: MeshOptions) -> tuple[str, ...]:
        return ("ulysses", "rank")  # its all-to-all, or its placement in zigzag P2P

    def scaling_limit(self, plan: Plan, cost: CostModel) -> str:
        return head_limit(plan, cost)


class HybridCP(Strategy):
    name = "hybridcp"
    native_sync = hybridcp.NATIVE_SYNC
    summary = "Megatron-LM hybrid_context_parallel with its BalancedCPScheduler"
    Options = HybridCPOptions

    def plan(self, ctx: Context, options: HybridCPOptions) -> Plan:
        return hybridcp.plan_hybridcp(ctx, options.implementation, options.max_tokens_per_rank)

    def search_space(self, ctx: Context, options: HybridCPOptions) -> list[HybridCPOptions]:
        if options.max_tokens_per_rank is not None:
            return [options]
        return [replace(options, max_tokens_per_rank=c) for c in smaller_capacities(ctx)]

    def knob(self, options: HybridCPOptions) -> tuple[str, str] | None:
        t = options.max_tokens_per_rank
        return None if t is None else ("max_seqlen_per_dp_cp_rank", str(t))


class ByteScale(Strategy):
    name = "bytescale"
    native_sync = bytescale.NATIVE_SYNC
    summary = "ByteScale: whole short sequences, ceil(L / C) ranks for long ones, offload"
    Options = ByteScaleOptions

    def offloads(self, options: ByteScaleOptions) -> bool:
        return True

    def plan(self, ctx: Context, options: ByteScaleOptions) -> Plan:
        return bytescale.plan_bytescale(ctx, options.capacity)

    def search_space(self, ctx: Context, options: ByteScaleOptions) -> list[ByteScaleOptions]:
        if options.capacity is not None:
            return [options]
        return [replace(options, capacity=c) for c in smaller_capacities(ctx)]

    def knob(self, options: ByteScaleOptions) -> tuple[str, str] | None:
        c = options.capacity
        return None if c is None else ("tokens per rank", str(c))


class FlexSP(Strategy):
    name = "flexsp"
    native_sync = flexsp.NATIVE_SYNC
    summary = "FlexSP: MILP over power-of-two groups, DP length buckets, time limit"

    def exchanges(self, options: NoOptions) -> tuple[str, ...]:
        return ("ulysses", "rank")  # its Ulysses all-to-all, or its placement in zigzag P2P

    def plan(self, ctx: Context, options: NoOptions) -> Plan:
        return flexsp.plan_flexsp(ctx)

    def scaling_limit(self, plan: Plan, cost: CostModel) -> str:
        return head_limit(plan, cost)


class Dynamic(Strategy):
    """The project's own strategy (named ``hdp`` on every command line)."""

    name = "hdp"
    native_sync = NATIVE_SYNC
    takes_kv_exchange = True
    summary = (
        "ours: degrees from the malleable-job relaxation / MILP, 128-token zigzag blocks, "
        "node-aware placement, gap filling, offload"
    )
    Options = DynamicOptions

    def offloads(self, options: DynamicOptions) -> bool:
        return options.form != "megatron"  # Megatron's runtime keeps activations on the GPU

    def exchanges(self, options: DynamicOptions) -> tuple[str, ...]:
        # auto: the faster of a P2P plan (Note [Node exchange] in hdp.exchange) and, where it
        # may win, a head-parallel one; Megatron's runtime exchanges per rank.
        if options.form == "megatron":
            return ("rank",)
        return ("auto", "rank", "node", "ulysses")

    def exchange_reason(self, options: DynamicOptions) -> str:
        return "in the megatron form, Megatron's runtime fetches K/V per rank"

    def plan(self, ctx: Context, options: DynamicOptions) -> Plan:
        return plan_dynamic(ctx, options)


STRATEGIES: dict[str, Strategy] = {
    s.name: s for s in (Static(), Ulysses(), HybridCP(), ByteScale(), FlexSP(), Dynamic())
}


def head_limit(plan: Plan, cost: CostModel) -> str:
    """A head-parallel plan's limit: its all-to-alls split the heads evenly over a group."""
    most = ulysses.max_degree(cost.model)
    if plan.kv_exchange != "ulysses" or most >= plan.num_ranks:
        return ""
    m = cost.model
    return (
        f"cannot use more than {most} of the {plan.num_ranks} ranks for one sequence: its "
        f"all-to-alls split {m.name}'s {m.heads} heads evenly over a group"
    )


SMALLEST_CAPACITY = 1024  # tokens per rank: below, the kernels' fixed costs dominate


def smaller_capacities(ctx: Context) -> list[int]:
    """The capacity of ``ctx`` and its halvings while the cluster still holds the longest
    sequence (``max_seq``) and a rank at least :data:`SMALLEST_CAPACITY` tokens: how a system
    that sizes its groups by tokens per rank is told to spread long sequences wider."""
    out = [ctx.capacity]
    while out[-1] // 2 >= SMALLEST_CAPACITY and out[-1] // 2 * ctx.num_ranks >= ctx.max_seq:
        out.append(out[-1] // 2)
    return out


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ValueError naming the choices otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}"
        ) from None


def add_option_flags(p: argparse.ArgumentParser | Any) -> None:
    """Add each strategy's flagged knobs to ``p`` (``--hybridcp-impl``, ``--mesh-size``, ...);
    a knob shared by several strategies (``static`` and ``ulysses``'s size) is one flag."""
    added: set[str] = set()
    for strategy in STRATEGIES.values():
        for f in fields(strategy.Options):
            flag = f.metadata.get("flag")
            if flag is None or flag in added:
                continue
            added.add(flag)
            if f.metadata.get("seconds"):
                p.add_argument(
                    flag,
                    dest=_dest(flag),
                    metavar="SECONDS",
                    type=argtypes.number(),
                    default=f.default,
                    help=f.metadata["help"],
                )
                continue
            if "metavar" in f.metadata:
                p.add_argument(
                    flag,
                    dest=_dest(f.metadata["flag"]),
                    metavar=f.metadata["metavar"],
                    type=argtypes.size(),
                    default=None,
                    help=f.metadata["help"],
                )
                continue
            p.add_argument(
                flag,
                dest=_dest(flag),
                choices=f.metadata.get("choices"),
                default=f.default,
                help=f"{f.metadata['help']} (default {f.default})",
            )


def options_from_flags(strategy: Strategy, args: argparse.Namespace) -> Any:
    """``strategy``'s options with the values of its flags in ``args``."""
    flagged = {
        f.name: getattr(args, _dest(f.metadata["flag"]))
        for f in fields(strategy.Options)
        if "flag" in f.metadata
    }
    return strategy.options(**flagged)


def _dest(flag: str) -> str:
    return "knob_" + flag.lstrip("-").replace("-", "_")
