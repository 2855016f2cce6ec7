"""What a plan's exchange of keys and values costs, per cell: the P2P exchanges (``rank``,
``node``) from their traffic counts (:mod:`hdp.traffic`), ``ulysses`` from its all-to-alls
(:mod:`hdp.ulysses`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import ulysses

if TYPE_CHECKING:
    from .cost import CostModel
    from .plan import Plan


@dataclass
class ExchangeCost:
    """Per cell ``[num_waves, num_ranks]``: the exchange's time not hidden behind attention over
    all layers; per step: bytes sent over NICs and over NVLink; the blocks a rank buffers."""

    exposed_s: np.ndarray
    nic_bytes: float
    nvlink_bytes: float
    max_in_block: np.ndarray | float = 0.0
    relay_block: np.ndarray | float = 0.0


def price_exchange(
    cost: CostModel, plan: Plan, attn_layer: np.ndarray, labels: np.ndarray
) -> ExchangeCost:
    """The exchange cost of ``plan`` given each cell's attention time per layer."""
    if plan.kv_exchange == "ulysses":
        return _ulysses(cost, plan)
    m = cost.model
    traffic = cost.kv_traffic(plan, labels)
    t_fwd, t_bwd = cost.comm_time_per_layer(traffic)
    fs = cost.attn_fwd_share
    exposed = m.layers * (
        np.maximum(0.0, t_fwd - fs * attn_layer) + np.maximum(0.0, t_bwd - (1.0 - fs) * attn_layer)
    )
    # K/V forward, K/V again and dK/dV (as many bytes) backward.
    per_token = m.kv_bytes_per_token * m.layers * 3.0
    return ExchangeCost(
        exposed,
        float(traffic.out_inter.sum() * per_token),
        float(traffic.out_intra.sum() * per_token),
        traffic.max_in_block,
        traffic.relay_block,
    )


def _ulysses(cost: CostModel, plan: Plan) -> ExchangeCost:
    m, c = cost.model, cost.cluster
    groups = ulysses.Groups.of(plan)
    split = groups.degree > 1
    lens, g = plan.seq_lens[groups.seq[split]], groups.degree[split]
    ckpt = cost.compute.attention_recomputed
    per_layer = ulysses.comm_time(m, c, lens, g, ckpt)
    cell = groups.wave[split] * plan.num_ranks + groups.rank[split]
    size = plan.num_waves * plan.num_ranks
    exposed = m.layers * np.bincount(cell, weights=per_layer, minlength=size)
    links = ulysses.links(m, c, lens, g, ckpt)
    return ExchangeCost(
        exposed.reshape(plan.num_waves, plan.num_ranks),
        float(m.layers * links.nic_bytes.sum()),
        float(m.layers * links.nvlink_bytes.sum()),
    )
