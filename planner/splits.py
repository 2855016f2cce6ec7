"""The closed form of one sequence split over ``d`` ranks in zigzag shares: each member's busy
time, the job's area and the most tokens a member holds, for many (length, degree) pairs at once,
by the cost model's own arithmetic (``tests/test_planner_hdp.py`` checks the two agree). The degree
menus of :mod:`hdp.planner.menus`, the bounds of :mod:`hdp.planner.degrees` and the FlexSP baseline
price splits with it.
:func:`head_split_times` is the same for head-parallel (Ulysses) groups, as hdp's ``ulysses``
menus price them, and :func:`ulysses_options` as bounds price them."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from hdp import CostModel, ulysses
from hdp.cost import KVTraffic
from hdp.plan import DEFAULT_KV_BLOCK_TOKENS

from .common import zigzag_positions, zigzag_shares


def split_times(
    cost: CostModel,
    lengths: np.ndarray,
    parts: np.ndarray,
    sync: str = "peer",
    align: int | np.ndarray = 1,
    latency: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (length, parts) pair: (height s: slowest member's busy time, area s: rank-seconds the
    job covers in ``sync`` mode, most tokens on one member). Members that must hold more than the
    capacity offload the needed share of their activations (priced by the cost model).
    ``latency`` False prices K/V traffic by its bytes alone, for bounds (Note [Bounds price
    bytes, not messages])."""
    return _ZigzagJobs.of(cost, lengths, parts, align).times(sync, latency)


def split_times_both(
    cost: CostModel,
    lengths: np.ndarray,
    parts: np.ndarray,
    sync: str = "peer",
    align: int | np.ndarray = 1,
    own_cells: bool = False,
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """:func:`split_times` with ``latency`` True and False, from one pass over the shares.
    ``own_cells``: the second for plans that run every member's share in a micro-batch of its
    own (Megatron's), so its dense work is the share's own, fixed costs and all, and its area
    the members' busy times."""
    jobs = _ZigzagJobs.of(cost, lengths, parts, align)
    return jobs.times(sync, True), jobs.times(sync, False, own_cells)


class _ZigzagJobs(NamedTuple):
    """What both of :func:`split_times`' pricings share, one row per member of every job."""

    cost: CostModel  # its exchange shaped the traffic
    parts: np.ndarray  # per job
    rep: np.ndarray  # the job of each member
    d: np.ndarray  # its job's members
    held: np.ndarray  # tokens it holds
    attn_layer: np.ndarray  # its attention, one layer
    traffic: KVTraffic

    @classmethod
    def of(
        cls, cost: CostModel, lengths: np.ndarray, parts: np.ndarray, align: int | np.ndarray
    ) -> _ZigzagJobs:
        lengths = np.asarray(lengths, dtype=np.int64)
        parts = np.asarray(parts, dtype=np.int64)
        rpn = cost.cluster.ranks_per_node
        rep, member, head, tail = zigzag_shares(lengths, parts, align)
        head_start, tail_end = zigzag_positions(rep, head, tail)
        held = head + tail
        # Heads and tails priced in one call (attn_time prices an empty chunk at 0).
        chunks = cost.attn_time(
            np.concatenate([head_start, tail_end - tail]),
            np.concatenate([head_start + head, tail_end]),
        )
        attn_layer = chunks[: head.size] + chunks[head.size :]
        d = parts[rep]
        # Node of each member (groups start at a node boundary) and per-node sums.
        node_idx = np.cumsum(member % rpn == 0) - 1  # rows are grouped by job, members ascending
        node_heads = np.bincount(node_idx, weights=head)
        node_size = np.bincount(node_idx)
        # Tails of members j > i on i's node: the node's tail total minus the inclusive prefix.
        tail_cum = np.cumsum(tail)
        node_first = np.searchsorted(node_idx, np.arange(node_heads.size))
        node_tail_incl = tail_cum - (tail_cum - tail)[node_first][node_idx]
        node_tails = np.bincount(node_idx, weights=tail)
        received = tail_end - held
        in_intra = node_heads[node_idx] - head + node_tails[node_idx] - node_tail_incl
        out_all = (d - 1) * head + member * tail
        out_intra = (node_size[node_idx] - 1) * head + (member % rpn) * tail
        if cost.kv_exchange == "node":
            links = _ZigzagLinks(rep, node_idx, head, tail, tail_end, received, in_intra)
            received, in_intra, out_intra, out_all = links.node_exchange(out_intra)
        msgs_in = (d - 1) + received // DEFAULT_KV_BLOCK_TOKENS
        msgs_out = (d - 1) + out_all // DEFAULT_KV_BLOCK_TOKENS
        traffic = KVTraffic(
            in_intra, received - in_intra, out_intra, out_all - out_intra, msgs_in, msgs_out, None
        )
        return cls(cost, parts, rep, d, held, attn_layer, traffic)

    def times(
        self, sync: str, latency: bool, own_cells: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`split_times` of these jobs (``own_cells``: :func:`split_times_both`'s)."""
        cost = self.cost
        m, held, attn_layer = cost.model, self.held, self.attn_layer
        # Whole sequences may share a member's cell (their dense layers then run at the packed
        # speed): bounds price dense work at the best speed per token.
        per_token = cost.compute.least_dense_s_per_token(cost.offload_capacity(sync))
        dense = cost.dense_time(held) if latency or own_cells else held * per_token
        compute = m.layers * attn_layer + dense
        t_fwd, t_bwd = cost.comm_time_per_layer(self.traffic, latency)
        fs = cost.attn_fwd_share
        exposed = m.layers * (
            np.maximum(0.0, t_fwd - fs * attn_layer)
            + np.maximum(0.0, t_bwd - (1 - fs) * attn_layer)
        )
        exposed = np.where(self.d > 1, exposed, 0.0)
        n = self.parts.size
        busy, height, most = _jobs(cost, sync, n, self.rep, held, compute, exposed)
        if sync == "peer" and latency:
            area = self.parts * height  # the members start together and wait for the slowest
        elif own_cells:  # (a member's wait may run other micro-batches: its busy time only)
            area = np.bincount(self.rep, weights=busy, minlength=n)
        else:
            # A wave lasts as long as its slowest rank anyway, and whole sequences may share a
            # member's cell (their dense layers then run at the packed speed, and their
            # attention may hide under its K/V traffic): count only compute, dense at the best
            # speed. Bounds count so in peer sync too, where other sequences may fill a
            # member's wait.
            packed = m.layers * attn_layer + held * per_token
            area = np.bincount(
                self.rep, weights=np.where(np.isfinite(busy), packed, np.inf), minlength=n
            )
        return height, area, most


def _jobs(
    cost: CostModel, sync: str, n: int, rep, held, compute, exposed
) -> tuple[np.ndarray, ...]:
    """Each member's busy time (its compute, exposed traffic and the part of its offload copy
    compute does not hide; inf where it cannot hold its share even with offload), and per job of
    ``n`` its slowest member's busy time and the most tokens a member holds."""
    fraction = np.where(
        held <= cost.offload_capacity(sync), cost.offload_needed(held, sync), np.inf
    )
    offload = np.maximum(0.0, cost.offload_time(held, np.minimum(fraction, 1.0)) - compute)
    busy = np.where(fraction <= 1.0, compute + exposed + offload, np.inf)
    height = np.full(n, -np.inf)
    np.maximum.at(height, rep, busy)
    most = np.zeros(n, dtype=np.int64)
    np.maximum.at(most, rep, held)
    return busy, height, most


class _ZigzagLinks(NamedTuple):
    """Per member of zigzag jobs: where it sits and what it receives in ``rank`` exchange."""

    rep: np.ndarray  # the job of each member
    node_idx: np.ndarray  # its node (jobs start at a node boundary)
    head: np.ndarray
    tail: np.ndarray
    tail_end: np.ndarray
    received: np.ndarray
    in_intra: np.ndarray

    def node_exchange(self, out_intra: np.ndarray) -> tuple[np.ndarray, ...]:
        """(received, received over NVLink, sent over NVLink, sent) in ``node`` exchange.

        Note [Node exchange] in :mod:`hdp.exchange`: a node fetches once, an equal share per
        member, what it lacks before its latest tail end. Heads go to every other node of the
        job; tails go to the nodes of members ``j < i``, the earlier nodes, whose tails come later.
        """
        node, rep = self.node_idx, self.rep
        size = np.bincount(node).astype(np.float64)
        node_end = np.zeros(size.size, dtype=np.int64)
        np.maximum.at(node_end, node, self.tail_end)
        node_held = np.bincount(node, weights=self.head + self.tail)
        fetched = ((node_end - node_held) / size)[node]
        forwarded = np.maximum(self.received - self.in_intra - fetched, 0.0)
        fwd_out = (np.bincount(node, weights=forwarded) / size)[node]
        first_node = node[np.searchsorted(rep, rep, side="left")]
        nodes = np.zeros(int(rep.max(initial=-1)) + 1, dtype=np.int64)
        np.maximum.at(nodes, rep, node - first_node + 1)
        out_inter = (nodes[rep] - 1) * self.head + (node - first_node) * self.tail
        in_intra = self.in_intra + forwarded
        out_intra = out_intra + fwd_out
        return in_intra + fetched, in_intra, out_intra, out_intra + out_inter


def head_split_times(
    cost: CostModel,
    lengths: np.ndarray,
    parts: np.ndarray,
    sync: str = "peer",
    align: int | np.ndarray = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`split_times` of head-parallel groups (``ulysses`` exchange, :mod:`hdp.ulysses`),
    as the cost model prices them: members hold zigzag shares of the tokens, each attends over
    the whole sequence for ``1 / parts`` of the heads, and the all-to-alls are not hidden."""
    lengths = np.asarray(lengths, dtype=np.int64)
    parts = np.asarray(parts, dtype=np.int64)
    m = cost.model
    rep, _, head, tail = zigzag_shares(lengths, parts, align)
    held = head + tail
    d = parts[rep]
    whole = cost.attn_time(np.zeros(lengths.size), lengths)[rep]
    compute = m.layers * whole / d + cost.dense_time(held)
    ckpt = cost.compute.attention_recomputed
    comm = m.layers * ulysses.comm_time(m, cost.cluster, lengths[rep], d, ckpt)
    n = lengths.size
    busy, height, most = _jobs(cost, sync, n, rep, held, compute, comm)
    if sync == "peer":
        area = parts * height
    else:  # (split_times' reasons) dense at the best speed; the all-to-alls hide nowhere
        per_token = cost.compute.least_dense_s_per_token(cost.offload_capacity(sync))
        packed = m.layers * whole / d + held * per_token + comm
        area = np.bincount(rep, weights=np.where(np.isfinite(busy), packed, np.inf), minlength=n)
    return height, area, most


def menu_pricing(cost: CostModel, pow2: bool) -> tuple[Callable, int, bool]:
    """How hdp's degree menus price a split, the most ranks it may take and whether its shares
    may be whole blocks: in ``ulysses`` exchange head-parallel groups of at most one rank a
    head in exact shares (:meth:`hdp.planner.common.Context.split`), else zigzag P2P (``pow2``, the
    Megatron form, always: exact shares)."""
    if cost.kv_exchange == "ulysses" and not pow2:
        return head_split_times, ulysses.most_members(cost.model, cost.cluster.num_ranks), False
    return split_times, cost.cluster.num_ranks, not pow2


def ulysses_options(
    cost: CostModel, lengths: list[int], sync: str
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per length, (height s, area s) of the sequence on every head-parallel (Ulysses) group a
    plan may give it, for bounds (Note [Bounds cover head-parallel plans] in
    :mod:`hdp.planner.degrees`); all lengths priced at once."""
    m, n = cost.model, cost.cluster.num_ranks
    off_cap = cost.offload_capacity(sync)
    most = ulysses.most_members(m, n)
    least = [max(2, -(-x // max(off_cap, 1))) for x in lengths]
    sizes = [max(0, most + 1 - lo) for lo in least]
    g = np.concatenate([np.arange(lo, most + 1) for lo in least] or [np.zeros(0)]).astype(float)
    lens = np.asarray(lengths, dtype=np.float64)
    L = np.repeat(lens, sizes)
    links = ulysses.links(m, cost.cluster, L, g, cost.compute.attention_recomputed)
    comm = ulysses.link_seconds(cost.cluster.gpu, links)
    attn = np.repeat(cost.attn_time(np.zeros(lens.size), lens), sizes)
    per_token = cost.compute.least_dense_s_per_token(off_cap)
    height = m.layers * (attn / g + comm) + L / g * per_token
    area = g * height if sync == "peer" else m.layers * (attn + g * comm) + L * per_token
    cuts = np.cumsum(sizes)[:-1]
    return list(zip(np.split(height, cuts), np.split(area, cuts)))


__all__ = [
    "head_split_times",
    "menu_pricing",
    "split_times",
    "split_times_both",
    "ulysses_options",
]
