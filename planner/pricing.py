"""How a run prices its steps: one :class:`StepPricing`, built once, handed to everything that
plans or predicts (``plan_step``, the dataloader, ``hdp-sim``, ``hdp-plan``, the Megatron
scheduler, training's metrics), so that a plan is optimised for the kernels that run and a
metrics row's predictions come from the model that made the plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, NamedTuple

from hdp import ClusterSpec, CostModel, ModelSpec

from .common import PlanningError
from .strategies import Strategy

SYNC_MODES = ("wave", "peer")
EXCHANGES = ("auto", "rank", "node", "ulysses")


class Settled(NamedTuple):
    """What a strategy plans one batch with: the cost model in its K/V exchange, the sync mode
    and the capacity (tokens per rank per wave)."""

    cost: CostModel
    sync: str
    capacity: int


@dataclass(frozen=True)
class StepPricing:
    """The one cost model of a run and the policies that settle a step's sync mode, capacity and
    K/V exchange.

    ``sync``: the mode asked for, or ``None`` for each strategy's own where memory allows (else
    ``wave``). ``kv_exchange``: ``auto`` (each strategy's own; for hdp, Note [Node exchange] in
    :mod:`hdp.exchange`), or one the strategy supports."""

    cost: CostModel
    sync: str | None = None
    kv_exchange: str = "auto"

    def __post_init__(self) -> None:
        if self.sync not in (None, *SYNC_MODES):
            raise ValueError(f"sync must be one of {', '.join(SYNC_MODES)}, got {self.sync!r}")
        if self.kv_exchange not in EXCHANGES:
            raise ValueError(
                f"kv_exchange must be one of {', '.join(EXCHANGES)}, got {self.kv_exchange!r}"
            )

    @classmethod
    def build(
        cls,
        model: ModelSpec,
        cluster: ClusterSpec,
        *,
        attention_backend: str | None = None,
        activation_checkpointing: bool = True,
        checkpointed_layers: int | None = None,
        kept_attention: bool = False,
        compiled: bool = False,
        capacity: int | None = None,
        sync: str | None = None,
        kv_exchange: str = "auto",
        tensor_parallel: int = 1,
        dkv_bytes: int = 4,
        own_runtimes: bool = True,
    ) -> StepPricing:
        """The pricing of ``model`` on ``cluster`` running ``attention_backend``'s kernels (the
        profile's measured rows of that backend; ``None``: the profile's own). With
        ``tensor_parallel`` > 1 a rank of the plans is a tensor-parallel group of that many GPUs
        of one node: the cost model prices one GPU's shard of the model, ``capacity`` counts
        the group's tokens, and ValueError says where the model or the nodes do not split.
        ``dkv_bytes``: :class:`~hdp.CostModel`'s, for hdp's plans; every baseline's are priced
        in the model's compute dtype (:meth:`cost_for`). ``checkpointed_layers``,
        ``kept_attention`` and ``compiled``: :class:`~hdp.CostModel`'s. ``own_runtimes``
        False: every plan runs on hdp's runtime, as training runs a baseline's plan, and is
        priced so (one rule for all: hdp's)."""
        cost = CostModel(
            model.tensor_shard(tensor_parallel),
            cluster.tensor_groups(tensor_parallel),
            attention_backend=attention_backend,
            activation_checkpointing=activation_checkpointing,
            checkpointed_layers=checkpointed_layers,
            kept_attention=kept_attention,
            compiled=compiled,
            capacity_override=capacity,
            tensor_parallel=tensor_parallel,
            dkv_bytes=dkv_bytes,
            own_runtimes=own_runtimes,
        )
        return cls(cost, sync, kv_exchange)

    @property
    def model(self) -> ModelSpec:
        return self.cost.model

    @property
    def cluster(self) -> ClusterSpec:
        return self.cost.cluster

    def for_strategy(self, strategy: Strategy) -> StepPricing:
        """The pricing ``strategy`` plans with: this one where the K/V exchange asked for applies
        to it (:attr:`Strategy.takes_kv_exchange`), else the baseline's own: its own exchange
        (``auto``) and its cost model (:meth:`cost_for`)."""
        if strategy.takes_kv_exchange:
            return self
        return replace(self, cost=self.cost_for(strategy), kv_exchange="auto")

    def cost_for(
        self, strategy: Strategy, exchange: str = "auto", options: Any = None
    ) -> CostModel:
        """The cost model of ``strategy``'s plans in ``exchange`` (``auto``: its own). hdp's is
        :attr:`cost`. A baseline in its own exchange runs as its system does, and every one of
        them (TransformerEngine's ring under the static mesh, hybridcp and ByteScale; the
        all-to-alls of Ulysses and FlexSP) returns gradients in the model's compute dtype: its
        dK/dV partials are priced at ``dtype_bytes`` per element, where hdp's ``dist_attn``
        sums them in fp32. A baseline's placement in another exchange (FlexSP's in ``rank``),
        or any plan where the cost model prices no runtime but hdp's (``own_runtimes`` False),
        runs on hdp's runtime and is priced as hdp's plans are."""
        dkv = self.model.dtype_bytes
        own = strategy.exchanges(strategy.options(options))[0]
        if (
            not self.cost.own_runtimes
            or strategy.takes_kv_exchange
            or exchange not in ("auto", own)
            or self.cost.dkv_bytes == dkv
        ):
            return self.cost
        if dkv not in self._baseline_costs:
            other = replace(self.cost, dkv_bytes=dkv)
            other.__dict__["compute"] = self.cost.compute  # the same kernels: share the tables
            self._baseline_costs[dkv] = other
        return self._baseline_costs[dkv]

    @cached_property
    def _baseline_costs(self) -> dict[int, CostModel]:
        return {}

    def exchange(self, strategy: Strategy, options: Any) -> str:
        """The K/V exchange ``strategy`` plans in: :attr:`kv_exchange`, where ``auto`` means
        the strategy's own. ValueError where the strategy cannot run the one asked for."""
        allowed = strategy.exchanges(options)
        exchange = self.kv_exchange
        if exchange == "auto" and "auto" not in allowed:
            return allowed[0]
        if exchange not in allowed:
            raise ValueError(
                f"K/V exchange {exchange!r} does not apply to {strategy.name} plans "
                f"({strategy.exchange_reason(options)}); choose {', '.join(allowed)}"
            )
        return exchange

    def settle(
        self, strategy: Strategy, longest: int, options: Any = None, exchange: str = "rank"
    ) -> Settled:
        """The cost model in ``exchange`` (``auto`` prices ``rank``), and the sync mode and
        capacity ``strategy`` plans sequences of up to ``longest`` tokens with. Raises
        PlanningError with what to change where no mode holds them."""
        own = self.cost_for(strategy, exchange, options)
        cost = own.with_exchange("rank" if exchange == "auto" else exchange)
        offload = strategy.offloads(strategy.options(options))
        sync, capacity = _choose_sync(cost, strategy.native_sync, longest, self.sync, offload)
        return Settled(cost, sync, capacity)


def _choose_sync(
    cost: CostModel, native: str, longest: int, requested: str | None, offload: bool
) -> tuple[str, int]:
    """(sync mode, capacity): ``requested`` if given, else ``native`` where its memory holds the
    longest sequence on the cluster (with activation offload where ``offload``), else ``wave``
    (parameters sharded)."""
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
