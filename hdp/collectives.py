"""Time of FSDP's parameter collectives over all ranks: the all-gathers and reduce-scatters
that :class:`~hdp.CostModel` prices per wave (``wave`` sync) or per step (``peer`` sync).

Note [Ring collectives across nodes]
------------------------------------
NCCL runs an all-gather or reduce-scatter over many nodes as several rings at once, one per NIC
of a node. Each ring enters a node once, through its own NIC, and goes on over NVLink inside it;
so all of a node's NICs share the inter-node bytes, and a GPU's NIC carries ``1 /
ranks_per_node`` of them. The bus bandwidth is then the node's NICs together, unless NVLink
(which carries the rest) is slower.

Example: 64 A100s, 8 to a node, one 200 Gb/s NIC each (22.5 GB/s in the preset). Gathering 14 GB
of bf16 parameters moves 14 x 63/64 GB per GPU at min(240, 8 x 22.5) = 180 GB/s: 0.077 s. Were
the bytes to cross one NIC at its own rate, it would take 0.61 s.

With tensor parallelism a rank is a group of GPUs holding a shard each, and each shard's
collective runs on rings of its own, so ``ranks_per_node`` counts ranks, not GPUs. A last node
that is not full has fewer NICs, and every ring crosses it.
"""

from __future__ import annotations

from .specs import ClusterSpec, ModelSpec


def bus_bandwidth(cluster: ClusterSpec) -> float:
    """Bytes per second an all-gather or reduce-scatter over all of ``cluster``'s ranks moves
    per rank (Note [Ring collectives across nodes])."""
    g, n, per_node = cluster.gpu, cluster.num_ranks, cluster.ranks_per_node
    if n <= per_node:
        return g.nvlink_bw
    last_node = n - (cluster.num_nodes - 1) * per_node
    return min(g.nvlink_bw, min(per_node, last_node) * g.nic_bw)


def fsdp_time(model: ModelSpec, cluster: ClusterSpec, op: str, nbytes: float) -> float:
    """One FSDP collective ``op`` over all ranks, moving ``(n - 1) / n`` of ``nbytes`` per rank,
    seconds.

    Where the profile measured it (``reduce_scatter`` may stand in as ``all_reduce``), each FSDP
    unit (a layer, and the root) pays the measured latency and the bytes the measured per-byte
    time, rescaled from the measured rank count; else the bytes move at :func:`bus_bandwidth`."""
    n = cluster.num_ranks
    if n == 1:
        return 0.0
    tables = cluster.gpu.tables
    measured = tables.collective_fit(op) or (
        tables.collective_fit("all_reduce") if op == "reduce_scatter" else None
    )
    if measured is None:
        return nbytes * (n - 1) / n / bus_bandwidth(cluster)
    fit, ranks = measured
    share = ((n - 1) / n) / ((ranks - 1) / ranks) if ranks > 1 else 1.0
    return (model.layers + 1) * fit.fixed + fit.per_unit * nbytes * share
