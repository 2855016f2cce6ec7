"""Per-cell K/V traffic of a plan, vectorised: the tokens of :mod:`hdp.exchange`'s messages.

A rank holding part of a sequence that other ranks also hold (a *holder*) needs the keys/values
of every token of it before the end ``E`` of its last shard there; what it does not hold itself it
receives from the other holders, and each shard goes to every other holder, truncated at that
holder's ``E``. Traffic between ranks of one node (``ranks_per_node``) uses NVLink, the rest the
NIC, so both directions are split into intra- and inter-node tokens. The cost model
(:mod:`hdp.cost`) turns these counts into time and memory.

In ``node`` exchange a node receives each remote token it needs once: the node's holders of a
sequence ``s`` fetch the tokens before ``E_max`` (their largest ``E``) that the node does not
hold, each an equal share, and forward over NVLink what the others need; an owner sends each shard
once to every other node holding ``s``, truncated at that node's ``E_max``. The NIC tokens are
exact per node and per sequence; the split between one node's relays, and so the NVLink
forwarding, is the even share the exchange's balancing aims at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .plan import Plan

_POS_BITS = 36  # positions < 2**36 tokens; group ids < 2**27: packed keys stay below 2**63


@dataclass
class KVTraffic:
    """Per-cell KV traffic of one plan, forward pass of one layer.

    Arrays are ``[num_waves, num_ranks]``. ``*_tokens`` count K/V tokens; multiply by
    ``ModelSpec.kv_bytes_per_token`` for bytes.
    """

    in_intra: np.ndarray
    in_inter: np.ndarray
    out_intra: np.ndarray
    out_inter: np.ndarray
    in_msgs: np.ndarray
    out_msgs: np.ndarray
    max_in_block: np.ndarray
    relay_block: np.ndarray | float = 0.0  # node exchange: the largest block a rank relays

    @classmethod
    def zeros(cls, num_waves: int, num_ranks: int) -> KVTraffic:
        return cls(*(np.zeros((num_waves, num_ranks)) for _ in range(8)))

    @property
    def received(self) -> np.ndarray:
        return self.in_intra + self.in_inter

    @property
    def sent(self) -> np.ndarray:
        return self.out_intra + self.out_inter


class _Holders(NamedTuple):
    """The (sequence, rank) pairs of sequences held by more than one rank, one entry each."""

    seq: np.ndarray
    rank: np.ndarray
    need_end: np.ndarray  # E: the end of the rank's last shard of the sequence
    held: np.ndarray  # tokens of the sequence the rank holds itself (float64)
    own_shards: np.ndarray  # shards of the sequence the rank holds itself
    wave: np.ndarray


class _SharedShards(NamedTuple):
    """Shards of sequences held by more than one rank, sorted by (sequence, start)."""

    seq: np.ndarray
    start: np.ndarray
    end: np.ndarray
    rank: np.ndarray
    gid: np.ndarray  # dense id of the shard's (sequence, node) group
    group_keys: np.ndarray  # sorted packed (sequence, node) keys, indexed by gid


def kv_traffic(
    plan: Plan, ranks_per_node: int, labels: np.ndarray | None = None, exchange: str | None = None
) -> KVTraffic:
    """Per-cell KV traffic of ``plan`` in ``exchange`` (default: the plan's ``kv_exchange``).

    Message counts are bounded by the distinct peers (``labels``: :func:`wave_components`) plus
    one per ``kv_block_tokens``.
    """
    exchange = exchange or plan.kv_exchange
    W, N = plan.num_waves, plan.num_ranks
    out = KVTraffic.zeros(W, N)
    if plan.num_shards == 0:
        return out
    seq_wave = plan.seq_wave()
    found = _holders(plan, seq_wave)
    if found is None:
        return out
    pairs, holders = found
    shards = _shared_shards(plan, holders, ranks_per_node)
    in_intra, in_inter, in_pieces, max_in = _received(
        pairs, shards, ranks_per_node, plan.kv_block_tokens
    )
    out_node, out_all, out_pieces = _sent(pairs, shards, ranks_per_node)
    blk = plan.kv_block_tokens
    relay = np.zeros(pairs.seq.size)
    if exchange == "node":
        node = _node_counts(pairs, shards, ranks_per_node, in_inter)
        in_intra = in_intra + node.forwarded_in
        in_inter = node.fetched
        out_all = out_node + node.out_inter
        relay = np.minimum(node.fetched, blk)
    s_cell = seq_wave[shards.seq] * N + shards.rank
    p_cell = pairs.wave * N + pairs.rank
    size = W * N

    def agg(cell: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.bincount(cell, weights=v, minlength=size).reshape(W, N)

    out.in_intra = agg(p_cell, in_intra)
    out.in_inter = agg(p_cell, in_inter)
    out.out_intra = agg(s_cell, out_node)
    out.out_inter = agg(s_cell, out_all - out_node)
    if exchange == "node":
        out.out_intra += agg(p_cell, node.forwarded_out)
    # Messages: one per peer (pieces from one peer travel together), one more per full block.
    if labels is None:
        labels = wave_components(plan)
    flat = (labels + (np.arange(W) * N)[:, None]).reshape(-1)
    peers = (np.bincount(flat, minlength=size)[flat] - 1).reshape(W, N)
    out.in_msgs = np.minimum(agg(p_cell, in_pieces), peers) + (out.received // blk)
    out.out_msgs = np.minimum(agg(s_cell, out_pieces), peers) + (out.sent // blk)
    mx = np.zeros(size)
    np.maximum.at(mx, p_cell, max_in)
    out.max_in_block = mx.reshape(W, N)
    if exchange == "node":
        rb = np.zeros(size)
        np.maximum.at(rb, p_cell, relay)
        out.relay_block = rb.reshape(W, N)
    return out


class _NodeCounts(NamedTuple):
    """Per holder pair in ``node`` exchange: NIC tokens it fetches, NVLink tokens forwarded to it
    and by it; per shard: NIC tokens its owner sends."""

    fetched: np.ndarray
    forwarded_in: np.ndarray
    forwarded_out: np.ndarray
    out_inter: np.ndarray


def _node_counts(
    pairs: _Holders, shards: _SharedShards, ranks_per_node: int, remote_need: np.ndarray
) -> _NodeCounts:
    """``node`` exchange counts from the holder pairs (``remote_need``: what each pair needs from
    other nodes, its ``rank``-exchange NIC tokens)."""
    gid = _lookup_group(shards.group_keys, pairs.seq, pairs.rank // ranks_per_node)
    groups = shards.group_keys.size
    e_max = np.zeros(groups, dtype=np.int64)
    np.maximum.at(e_max, gid, pairs.need_end)
    holders = np.bincount(gid, minlength=groups).astype(np.float64)
    o2 = np.lexsort((shards.start, shards.gid))
    g_gid, g_start, g_end = shards.gid[o2], shards.start[o2], shards.end[o2]
    cum = np.concatenate([[0.0], np.cumsum((g_end - g_start).astype(np.float64))])
    gkey = (g_gid << _POS_BITS) + g_start
    ids = np.arange(groups)
    held_before = _tokens_before(gkey, g_gid, g_start, g_end, cum, ids, e_max)
    node_fetch = e_max - held_before  # remote tokens the node needs, fetched once
    fetched = (node_fetch / np.maximum(holders, 1))[gid]
    forwarded_in = np.maximum(remote_need - fetched, 0.0)
    fwd_total = np.bincount(gid, weights=forwarded_in, minlength=groups)
    forwarded_out = (fwd_total / np.maximum(holders, 1))[gid]
    # An owner sends each shard once to every node holding its sequence, cut at that node's
    # E_max; its own node (whose E_max is at least the shard's end) is counted and taken off.
    g_seq = shards.group_keys >> 20
    o = np.lexsort((e_max, g_seq))
    sent, _ = _truncated_sum(g_seq[o], e_max[o], shards.seq, shards.start, shards.end)
    out_inter = sent - (shards.end - shards.start)
    return _NodeCounts(fetched, forwarded_in, forwarded_out, out_inter)


def _holders(plan: Plan, seq_wave: np.ndarray) -> tuple[_Holders, np.ndarray] | None:
    """The holder pairs of shared sequences and each sequence's number of holders (None: none)."""
    N = plan.num_ranks
    seq, rank, start, end = plan.seq, plan.rank, plan.start, plan.end
    # (sequence, rank) pairs: how far each holder needs keys (E) and what it holds (n).
    pair_key = seq * N + rank
    pk, pair_idx = np.unique(pair_key, return_inverse=True)
    E = np.zeros(pk.size, dtype=np.int64)
    np.maximum.at(E, pair_idx, end)
    held = np.bincount(pair_idx, weights=end - start, minlength=pk.size)
    own_shards = np.bincount(pair_idx, minlength=pk.size)
    p_seq, p_rank = pk // N, pk % N
    holders = np.bincount(p_seq, minlength=plan.seq_lens.size)
    multi = holders[p_seq] > 1
    if not multi.any():
        return None
    p_wave = seq_wave[p_seq]
    pairs = _Holders(
        p_seq[multi], p_rank[multi], E[multi], held[multi], own_shards[multi], p_wave[multi]
    )
    return pairs, holders


def _shared_shards(plan: Plan, holders: np.ndarray, ranks_per_node: int) -> _SharedShards:
    """Shards of multi-holder sequences, sorted by (seq, start), for "how much lies before E"."""
    keep = holders[plan.seq] > 1
    s_seq, s_start = plan.seq[keep], plan.start[keep]
    s_end, s_rank = plan.end[keep], plan.rank[keep]
    o = np.lexsort((s_start, s_seq))
    s_seq, s_start, s_end, s_rank = s_seq[o], s_start[o], s_end[o], s_rank[o]
    s_gid, group_keys = _group_ids(s_seq, s_rank // ranks_per_node)
    return _SharedShards(s_seq, s_start, s_end, s_rank, s_gid, group_keys)


def _received(
    pairs: _Holders, shards: _SharedShards, ranks_per_node: int, kv_block_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per holder pair: tokens received from its own node and from others, pieces received, and
    the largest block received."""
    ps, pE, pn = pairs.seq, pairs.need_end, pairs.held
    recv = pE - pn
    # Tokens of the pair's own node (all holders there, itself included) before E.
    lens = (shards.end - shards.start).astype(np.float64)
    o2 = np.lexsort((shards.start, shards.gid))
    g_gid, g_start, g_end, g_len = shards.gid[o2], shards.start[o2], shards.end[o2], lens[o2]
    cum = np.concatenate([[0.0], np.cumsum(g_len)])
    gkey = (g_gid << _POS_BITS) + g_start
    pair_gid = _lookup_group(shards.group_keys, ps, pairs.rank // ranks_per_node)
    node_before = _tokens_before(gkey, g_gid, g_start, g_end, cum, pair_gid, pE)
    in_intra = node_before - pn
    in_inter = recv - in_intra
    # Pieces received: other holders' shards starting before E.
    akey = (shards.seq << _POS_BITS) + shards.start
    n_before = np.searchsorted(akey, (ps << _POS_BITS) + pE, side="left") - np.searchsorted(
        akey, ps << _POS_BITS, side="left"
    )
    in_pieces = n_before - pairs.own_shards
    max_in = np.minimum(recv, kv_block_tokens)
    return in_intra, in_inter, in_pieces, max_in


def _sent(
    pairs: _Holders, shards: _SharedShards, ranks_per_node: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per shard: tokens sent to its own node and to all ranks, and pieces sent.

    Each shard ``[a, b)`` goes to every other holder ``c`` of its sequence, truncated at ``E_c``.
    """
    s_seq, s_start, s_end = shards.seq, shards.start, shards.end
    consumers_seq, consumers_E = pairs.seq, pairs.need_end
    consumers_node = pairs.rank // ranks_per_node
    o3 = np.lexsort((consumers_E, consumers_seq))
    c_seq, c_E = consumers_seq[o3], consumers_E[o3]
    sent_all, cnt_all = _truncated_sum(c_seq, c_E, s_seq, s_start, s_end)
    c_gid = _lookup_group(shards.group_keys, consumers_seq, consumers_node)
    o4 = np.lexsort((consumers_E, c_gid))
    sent_node, _ = _truncated_sum(c_gid[o4], consumers_E[o4], shards.gid, s_start, s_end)
    own = (s_end - s_start).astype(np.float64)
    out_all = sent_all - own  # the owner itself counted as a consumer needing all of it
    out_node = sent_node - own
    out_pieces = cnt_all - 1
    return out_node, out_all, out_pieces


def wave_components(plan: Plan) -> np.ndarray:
    """``[W, N]`` label of each rank's group in each wave: ranks sharing a sequence are joined
    (the label is the group's smallest rank)."""
    W, N = plan.num_waves, plan.num_ranks
    labels = np.tile(np.arange(N), (W, 1))
    if plan.num_shards == 0:
        return labels
    key = plan.seq * N + plan.rank
    pk = np.unique(key)
    p_seq, p_rank = pk // N, pk % N
    holders = np.bincount(p_seq, minlength=plan.seq_lens.size)
    multi = holders[p_seq] > 1
    if not multi.any():
        return labels
    p_seq, p_rank = p_seq[multi], p_rank[multi]
    seq_wave = plan.seq_wave()
    first = np.full(plan.seq_lens.size, -1, dtype=np.int64)
    # first holder of each sequence (p_seq is sorted, so the first occurrence)
    idx = np.flatnonzero(np.r_[True, p_seq[1:] != p_seq[:-1]])
    first[p_seq[idx]] = p_rank[idx]
    u = seq_wave[p_seq] * N + first[p_seq]
    v = seq_wave[p_seq] * N + p_rank
    flat = labels.reshape(-1).copy() + (np.arange(W) * N).repeat(N)
    while True:
        m = np.minimum(flat[u], flat[v])
        before = flat.copy()
        np.minimum.at(flat, u, m)
        np.minimum.at(flat, v, m)
        flat = flat[flat]  # pointer jumping
        if np.array_equal(before, flat):
            break
    return (flat - (np.arange(W) * N).repeat(N)).reshape(W, N)


def _group_ids(seq: np.ndarray, sub: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids of (seq, sub) pairs; returns (id of each element, sorted unique packed keys)."""
    key = (seq << 20) + sub
    uniq, inv = np.unique(key, return_inverse=True)
    return inv.astype(np.int64), uniq


def _lookup_group(sorted_keys: np.ndarray, seq: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Dense id of (seq, sub) in ``sorted_keys`` (-1 where absent)."""
    key = (seq << 20) + sub
    i = np.searchsorted(sorted_keys, key)
    i = np.minimum(i, max(sorted_keys.size - 1, 0))
    return np.where(sorted_keys[i] == key, i, -1)


def _tokens_before(gkey, g_gid, g_start, g_end, cum, query_gid, query_pos) -> np.ndarray:
    """Tokens held by group ``query_gid`` before position ``query_pos`` (groups of disjoint
    shards)."""
    first = np.searchsorted(gkey, query_gid << _POS_BITS, side="left")
    # shards starting before pos
    k = np.searchsorted(gkey, (query_gid << _POS_BITS) + query_pos, side="left")
    full = cum[np.maximum(k - 1, first)] - cum[first]  # shards first .. k-2 entirely before
    last = np.maximum(k - 1, 0)
    part = np.where(k > first, np.minimum(g_end[last], query_pos) - g_start[last], 0)
    return np.where(query_gid >= 0, full + part, 0.0)


def _truncated_sum(c_group, c_E, s_group, s_start, s_end) -> tuple[np.ndarray, np.ndarray]:
    """For each shard ``[a, b)`` of group ``g``: sum over consumers of g of
    ``clip(min(b, E) - a, 0)``, and the number of consumers with ``E > a``.

    Consumers must be sorted by (group, E).
    """
    key = (c_group << _POS_BITS) + c_E
    cumE = np.concatenate([[0.0], np.cumsum(c_E.astype(np.float64))])
    lo = np.searchsorted(key, (s_group << _POS_BITS) + s_start, side="right")  # first E > a
    mid = np.searchsorted(key, (s_group << _POS_BITS) + s_end, side="left")  # first E >= b
    hi = np.searchsorted(key, (s_group + 1) << _POS_BITS, side="left")  # end of group
    a = s_start.astype(np.float64)
    b = s_end.astype(np.float64)
    partial = (cumE[mid] - cumE[lo]) - (mid - lo) * a
    full = (hi - mid) * (b - a)
    return partial + full, (hi - lo).astype(np.float64)
