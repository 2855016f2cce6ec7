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

from hdp import Plan

from . import bytescale, flexsp, hybridcp, static
from .common import Context, option_flag
from .dynamic import NATIVE_SYNC, DynamicOptions, plan_dynamic


@dataclass(frozen=True)
class NoOptions:
    """The options of a strategy without knobs."""


@dataclass(frozen=True)
class HybridCPOptions:
    implementation: str = option_flag(
        "auto",
        flag="--hybridcp-impl",
        choices=("auto", "megatron", "ours"),
        help="hybridcp scheduler: ours (auto), which makes megatron-core's decisions in a tenth of "
        "its time or less, or megatron-core's own BalancedCPScheduler (megatron), to check",
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

    def plan(self, ctx: Context, options: NoOptions) -> Plan:
        return static.plan_static(ctx)


class Ulysses(Strategy):
    name = "ulysses"
    native_sync = static.NATIVE_SYNC
    summary = "DP x SP mesh, one power-of-two SP size, all-to-all over heads (DeepSpeed-Ulysses)"

    def exchanges(self, options: NoOptions) -> tuple[str, ...]:
        return ("ulysses", "rank")  # its all-to-all, or its placement in zigzag P2P

    def plan(self, ctx: Context, options: NoOptions) -> Plan:
        return static.plan_static(ctx, "ulysses")


class HybridCP(Strategy):
    name = "hybridcp"
    native_sync = hybridcp.NATIVE_SYNC
    summary = "Megatron-LM hybrid_context_parallel with its BalancedCPScheduler"
    Options = HybridCPOptions

    def plan(self, ctx: Context, options: HybridCPOptions) -> Plan:
        return hybridcp.plan_hybridcp(ctx, implementation=options.implementation)


class ByteScale(Strategy):
    name = "bytescale"
    native_sync = bytescale.NATIVE_SYNC
    summary = "ByteScale: whole short sequences, ceil(L / C) ranks for long ones, offload"

    def offloads(self, options: NoOptions) -> bool:
        return True

    def plan(self, ctx: Context, options: NoOptions) -> Plan:
        return bytescale.plan_bytescale(ctx)


class FlexSP(Strategy):
    name = "flexsp"
    native_sync = flexsp.NATIVE_SYNC
    summary = "FlexSP: MILP over power-of-two groups, DP length buckets, time limit"

    def exchanges(self, options: NoOptions) -> tuple[str, ...]:
        return ("ulysses", "rank")  # its Ulysses all-to-all, or its placement in zigzag P2P

    def plan(self, ctx: Context, options: NoOptions) -> Plan:
        return flexsp.plan_flexsp(ctx)


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


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ValueError naming the choices otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}"
        ) from None


def add_option_flags(p: argparse.ArgumentParser | Any) -> None:
    """Add each strategy's flagged knobs to ``p`` (``--hybridcp-impl``, ``--hdp-form``)."""
    for strategy in STRATEGIES.values():
        for f in fields(strategy.Options):
            if "flag" in f.metadata:
                p.add_argument(
                    f.metadata["flag"],
                    dest=_dest(strategy, f.name),
                    choices=f.metadata.get("choices"),
                    default=f.default,
                    help=f"{f.metadata['help']} (default {f.default})",
                )


def options_from_flags(strategy: Strategy, args: argparse.Namespace) -> Any:
    """``strategy``'s options with the values of its flags in ``args``."""
    flagged = {
        f.name: getattr(args, _dest(strategy, f.name))
        for f in fields(strategy.Options)
        if "flag" in f.metadata
    }
    return strategy.options(**flagged)


def _dest(strategy: Strategy, knob: str) -> str:
    return f"{strategy.name}_{knob}"
