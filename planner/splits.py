"""The closed form of one sequence split over ``d`` ranks in zigzag shares: each member's busy
time, the job's area and the most tokens a member holds, for many (length, degree) pairs at once,
by the cost model's own arithmetic (``tests/test_planner_hdp.py`` checks the two agree). The degree
menus of :mod:`hdp.planner.menus`, the bounds of :mod:`hdp.planner.degrees` and the FlexSP baseline
price splits with it.
:func:`head_split_times` is the same for head-parallel (Ulysses) groups, as hdp's ``ulysses``
menus price them, and :func:`ulysses_options` as bounds price them.

Note [A member's cell in a bound]: a bound's entry (``split_times`` with ``latency`` False) must
hold for every strategy's plan as its own runtime prices it, and a member's share may sit in a
cell with other work. The member is then busy at least for its own attention, the traffic that
attention does not hide, and the dense layers of the cell's tokens, which are at least its share
(:meth:`hdp.compute.ComputeModel.least_dense_time_from`, fixed costs included). hdp's runtime
runs its attention as the closed form prices it. A ring (Note [One kernel call per ring step]
in :mod:`hdp.ring`) runs it in one call a step whose rate grows with the cell's split tokens
``T``: a larger cell runs the share's attention faster and its dense layers slower. So the entry
takes the least busy time over cells of ``T`` from the share up, a quarter octave at a time
(each at the fastest call of its range and the dense time of its least ``T``), the last for
every ``T`` past four times the share. Its traffic is priced by its bytes, with a message from
each partner (Note [Bounds price bytes and partners] in :mod:`hdp.planner.menus`). Its area
keeps the closed form's attention and dense work at the best speed a token. Example: 6,138
tokens of llama-7b on two A100s of one node, 2,048 tokens a rank. ByteScale's ring plan steps
1.3677 s and hdp's split 1.3729 s; priced alone in its cell at hdp's attention the entry bounds
at 1.3729 s, over ByteScale's plan, and with the ring's cells at 1.3452 s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from hdp import CostModel, ulysses
from hdp.compute import ComputeModel
from hdp.cost import KVTraffic
from hdp.plan import DEFAULT_KV_BLOCK_TOKENS
from hdp.profile import TILE_TOKENS

from .common import zigzag_positions, zigzag_shares

_POS_BITS = 36  # token positions < 2**36: (job, position) keys stay below 2**63
_CELL_STEPS = 8  # a bound's cells of a member's share up to 4x it, in quarter octaves


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
    ``latency`` False prices K/V traffic as bounds do: its bytes, and a message from each
    partner whatever the plan (Note [Bounds price bytes and partners] in
    :mod:`hdp.planner.menus`)."""
    return ZigzagJobs.of(cost, lengths, parts, align).times(sync, latency)


class ZigzagJobs(NamedTuple):
    """What both of :func:`split_times`' pricings share, one row per member of every job
    (:meth:`of`); :meth:`times` prices them, :meth:`only` keeps some of the jobs."""

    cost: CostModel  # its exchange shaped the traffic
    parts: np.ndarray  # per job
    rep: np.ndarray  # the job of each member
    d: np.ndarray  # its job's members
    held: np.ndarray  # tokens it holds
    attn_layer: np.ndarray  # its attention, one layer
    ring: _RingShare  # its attention where a ring runs it (one call per ring step)
    traffic: KVTraffic
    partners: np.ndarray  # the other members it receives from in any plan of its split

    @classmethod
    def of(
        cls, cost: CostModel, lengths: np.ndarray, parts: np.ndarray, align: int | np.ndarray
    ) -> ZigzagJobs:
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
        # (The rings of other strategies split exactly: only those shares may run in one.)
        exact = np.flatnonzero((np.broadcast_to(align, parts.shape) == 1)[rep])
        ring = _RingShare.of(cost, lengths, rep, exact, head, tail, head_start, tail_end)
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
        partners = _partners(rep, head, tail, head_start, tail_end)
        return cls(cost, parts, rep, d, held, attn_layer, ring, traffic, partners)

    @property
    def most_tokens(self) -> np.ndarray:
        """Per job, the most tokens one member holds."""
        return _job_max(self.parts.size, self.rep, self.held, 0)

    def only(self, jobs: np.ndarray) -> ZigzagJobs:
        """These jobs where ``jobs`` (a mask over them) is set, in order."""
        keep = jobs[self.rep]
        member = np.cumsum(keep) - 1  # each kept member's row among the kept
        ring = self.ring
        in_ring = keep[ring.rows]
        ring = _RingShare(member[ring.rows[in_ring]], ring.pairs[in_ring], ring.whole_rate[in_ring])
        t = self.traffic
        traffic = replace(t, **{f: getattr(t, f)[keep] for f in _MEMBER_TRAFFIC})
        rep = (np.cumsum(jobs) - 1)[self.rep[keep]]
        d, held, attn, partners = (
            x[keep] for x in (self.d, self.held, self.attn_layer, self.partners)
        )
        return ZigzagJobs(self.cost, self.parts[jobs], rep, d, held, attn, ring, traffic, partners)

    def times(
        self, sync: str, latency: bool, own_cells: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`split_times` of these jobs. ``own_cells`` (with ``latency`` False): for plans
        that run every member's share in a micro-batch of its own (Megatron's), so its dense
        work is the share's own, fixed costs and all, its traffic as those plans are priced,
        and its area the members' busy times."""
        cost = self.cost
        m, held = cost.model, self.held
        per_token = cost.compute.least_dense_s_per_token(cost.offload_capacity(sync))
        traffic = self.traffic
        if not latency:
            traffic = replace(traffic, in_msgs=self.partners, out_msgs=self.partners)
        t_fwd, t_bwd = cost.comm_time_per_layer(traffic)
        fs = cost.attn_fwd_share
        offload_s, multi = _offload_s(cost, sync, held), self.d > 1

        def busy(attn, dense, tf=t_fwd, tb=t_bwd, off=offload_s, split=multi) -> np.ndarray:
            exposed = m.layers * (
                np.maximum(0.0, tf - fs * attn) + np.maximum(0.0, tb - (1 - fs) * attn)
            )
            return np.maximum(m.layers * attn + dense, off) + np.where(split, exposed, 0.0)

        if latency or own_cells:
            busy_s = busy(self.attn_layer, cost.dense_time(held))
        else:  # Note [A member's cell in a bound]
            dense = cost.compute.least_dense_time_from(held)
            busy_s = busy(self.attn_layer, dense)
            rows, least = self.ring.rows, self.ring.least_attention(cost.compute)
            on = [x[rows] for x in (t_fwd, t_bwd, offload_s, multi)]
            faster = busy(least, dense[rows], *on) < busy_s[rows]  # where a ring may be faster
            rows, on = rows[faster], [x[faster] for x in on]
            if rows.size:
                # (A cell size at a time, so that one row of each array stays in the cache.)
                attn, dense = self.ring.cells(cost.compute, held[rows], rows)
                in_ring = busy(attn[0], dense[0], *on)
                for attn_k, dense_k in zip(attn[1:], dense[1:]):
                    np.minimum(in_ring, busy(attn_k, dense_k, *on), out=in_ring)
                busy_s[rows] = np.minimum(busy_s[rows], in_ring)
        n = self.parts.size
        height, most = _job_max(n, self.rep, busy_s, -np.inf), self.most_tokens
        if sync == "peer" and latency:
            area = self.parts * height  # the members start together and wait for the slowest
        elif own_cells:  # (a member's wait may run other micro-batches: its busy time only)
            area = np.bincount(self.rep, weights=busy_s, minlength=n)
        else:
            # A wave lasts as long as its slowest rank anyway, and whole sequences may share a
            # member's cell (their dense layers then run at the packed speed, and their
            # attention may hide under its K/V traffic): count only compute, dense at the best
            # speed. Bounds count so in peer sync too, where other sequences may fill a
            # member's wait.
            packed = m.layers * self.attn_layer + held * per_token
            area = np.bincount(
                self.rep, weights=np.where(np.isfinite(busy_s), packed, np.inf), minlength=n
            )
        return height, area, most


_MEMBER_TRAFFIC = ("in_intra", "in_inter", "out_intra", "out_inter", "in_msgs", "out_msgs")


class _RingShare(NamedTuple):
    """What a ring's attention of a member costs (Note [One kernel call per ring step] in
    :mod:`hdp.ring`): its chunks' query-key pairs, queries padded to a tile, at no more than
    its document's rate whole or a call over the cell's split tokens."""

    rows: np.ndarray  # the members it covers
    pairs: np.ndarray
    whole_rate: np.ndarray  # pairs a second of its document whole

    @classmethod
    def of(
        cls,
        cost: CostModel,
        lengths: np.ndarray,
        rep: np.ndarray,
        rows: np.ndarray,
        head: np.ndarray,
        tail: np.ndarray,
        head_start: np.ndarray,
        tail_end: np.ndarray,
    ) -> _RingShare:
        c, m = cost.compute, cost.model

        def pairs(q: np.ndarray, start: np.ndarray) -> np.ndarray:
            return np.where(q > 0, np.maximum(q, TILE_TOKENS) * ((q + 1.0) / 2.0 + start), 0.0)

        h, t, first, last = head[rows], tail[rows], head_start[rows], tail_end[rows]
        apart = pairs(h, first) + pairs(t, last - t)
        # (A plan may hold a member's adjacent chunks as one shard: fewer padded pairs.)
        together = np.where(first + h == last - t, pairs(h + t, first), apart)
        whole = c.gpu.tables.causal_rate(lengths, m.heads, m.head_dim, c.backend)[rep[rows]]
        return cls(rows, np.minimum(apart, together), whole)

    def least_attention(self, compute: ComputeModel) -> np.ndarray:
        """Each member's attention, one layer, at its document's rate whole: the least in any
        cell."""
        return self.pairs / self.whole_rate * compute.attn_recompute

    def cells(
        self, compute: ComputeModel, held: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per member of ``rows`` (columns; ``held`` tokens each), its least attention and
        dense time in a cell of ``T`` split tokens or more, ``T`` from its share up a quarter
        octave a row to four times it and then any more (Note [A member's cell in a bound])."""
        at = np.searchsorted(self.rows, rows)
        rates = np.minimum(self.whole_rate[at], compute.fastest_ring_rates(held, _CELL_STEPS))
        attn = self.pairs[at] / rates * compute.attn_recompute
        return attn, compute.least_dense_time_ladder(held, _CELL_STEPS)


def _partners(
    rep: np.ndarray,
    head: np.ndarray,
    tail: np.ndarray,
    head_start: np.ndarray,
    tail_end: np.ndarray,
) -> np.ndarray:
    """Per member: how many other members of its job hold a token before the end of its own
    last one. A plan of the split receives a piece from each (:func:`hdp.traffic.kv_traffic`
    counts a message per peer), and in zigzag shares that is every other member."""
    d = np.bincount(rep)[rep]
    gaps = np.bincount(rep, weights=head == 0, minlength=int(rep.max(initial=-1)) + 1)[rep] > 0
    if not gaps.any():  # (every member's head lies before every other member's tail)
        return d - 1
    rep, head, tail, head_start, tail_end = (
        x[gaps] for x in (rep, head, tail, head_start, tail_end)
    )
    first = np.where(head > 0, head_start, tail_end - tail)
    last = np.where(tail > 0, tail_end, head_start + head)
    job = rep.astype(np.int64) << _POS_BITS
    starts = np.sort(np.where(head + tail > 0, job + first, job + (1 << _POS_BITS) - 1))
    before = np.searchsorted(starts, job + last) - np.searchsorted(starts, job)
    out = d - 1
    out[gaps] = np.where(head + tail > 0, before - 1, 0)
    return out


def _offload_s(cost: CostModel, sync: str, held: np.ndarray) -> np.ndarray:
    """Each member's offload copy (0 where it holds its share in memory; inf where it cannot
    even with offload): a member is busy the longer of it and its compute, plus its exposed
    traffic."""
    fraction = np.where(
        held <= cost.offload_capacity(sync), cost.offload_needed(held, sync), np.inf
    )
    return np.where(fraction <= 1.0, cost.offload_time(held, np.minimum(fraction, 1.0)), np.inf)


def _job_max(n: int, rep: np.ndarray, values: np.ndarray, empty: float) -> np.ndarray:
    """Per job of ``n`` (``rep``: each member's), the most of its members' ``values``
    (``empty`` where it has none)."""
    out = np.full(n, empty, dtype=values.dtype)
    np.maximum.at(out, rep, values)
    return out


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
        jobs = int(rep.max(initial=-1)) + 1
        first_node = node[np.searchsorted(rep, np.arange(jobs))][rep]
        nodes = np.zeros(jobs, dtype=np.int64)
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
    busy = np.maximum(compute, _offload_s(cost, sync, held)) + comm
    height, most = _job_max(n, rep, busy, -np.inf), _job_max(n, rep, held, 0)
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
    # A member holds at least L / g tokens and may share its cell: its height is at least its
    # attention, its all-to-alls and a micro-batch of that many tokens; its area counts dense
    # work at the best speed (a shared cell's fixed costs are paid once).
    own = m.layers * (attn / g + comm)
    height = own + cost.compute.least_dense_time_from(L / g)
    area = (
        g * own + L * per_token if sync == "peer" else m.layers * (attn + g * comm) + L * per_token
    )
    cuts = np.cumsum(sizes)[:-1]
    return list(zip(np.split(height, cuts), np.split(area, cuts)))


__all__ = [
    "ZigzagJobs",
    "head_split_times",
    "menu_pricing",
    "split_times",
    "ulysses_options",
]
