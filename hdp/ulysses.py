"""What head-parallel (Ulysses) sequence parallelism costs: how FlexSP runs a split sequence.

A sequence of ``L`` tokens on a group of ``g`` ranks, ``L / g`` tokens each: before attention an
all-to-all gives every member the whole sequence for ``H / g`` query heads (and the K/V heads
those need: ``kv_heads / g``, or one replicated head where ``g > kv_heads``); each member runs
causal attention over all ``L`` tokens for its heads; an all-to-all returns the output to the
token owners. Backward sends the output gradient the same way and Q, K, V gradients back (with
activation checkpointing the forward's all-to-alls run again). The all-to-alls sit between the
projections and attention, so they are not hidden behind compute. Degrees above the head count
have no heads to split (FlexSP's limit).

Peers of one node exchange over NVLink, the others through the NIC; a member's time is the
larger of the two byte counts over their bandwidths, at the share of each an all-to-all attains
where the profile has it measured (``GPUProfile.alltoall_nic_share``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .specs import ClusterSpec, GPUProfile, ModelSpec


def max_degree(model: ModelSpec) -> int:
    """The most ranks a power-of-two Ulysses group may have: each member takes an equal share of
    the query heads, so the largest power of two that divides them (32 heads: 32; 40: 8)."""
    return model.heads & -model.heads


def most_members(model: ModelSpec, num_ranks: int) -> int:
    """The most ranks of ``num_ranks`` one head-parallel group may have: one a query head, as
    ``dist_attn`` splits them (FlexSP's groups are powers of two too: :func:`max_degree`)."""
    return min(num_ranks, model.heads)


@dataclass(frozen=True)
class UlyssesLinks:
    """Per member of each group, bytes one layer's training moves, by link."""

    nic_bytes: np.ndarray
    nvlink_bytes: np.ndarray


def bytes_per_member(model: ModelSpec, length, degree, recomputed: float) -> np.ndarray:
    """Bytes one member sends (and receives) in one layer's training all-to-alls, the layer's
    forward run again in the share ``recomputed`` of the layers (activation checkpointing: 1 for
    every layer, 0 for none)."""
    L = np.asarray(length, dtype=np.float64)
    g = np.asarray(degree, dtype=np.float64)
    d, b = model.head_dim, model.dtype_bytes
    local = L / g
    share = (g - 1) / g
    q_o = 2 * local * share * model.heads * d * b  # Q out, O back
    kv = 2 * local * (g - 1) * np.maximum(model.kv_heads / g, 1.0) * d * b
    forward = q_o + kv
    passes = 2.0 + recomputed  # forward, [forward again], backward (dO, dQ/dK/dV)
    return np.where(g > 1, passes * forward, 0.0)


def links(model: ModelSpec, cluster: ClusterSpec, length, degree, recomputed) -> UlyssesLinks:
    """Per member: :func:`bytes_per_member` split by link for a group of ``degree`` consecutive
    ranks from a node boundary (peers on its own node over NVLink)."""
    g = np.asarray(degree, dtype=np.float64)
    total = bytes_per_member(model, length, degree, recomputed)
    local_peers = np.minimum(g, cluster.ranks_per_node) - 1
    nic_share = np.where(g > 1, (g - 1 - local_peers) / np.maximum(g - 1, 1), 0.0)
    return UlyssesLinks(total * nic_share, total * (1 - nic_share))


def link_seconds(gpu: GPUProfile, lk: UlyssesLinks) -> np.ndarray:
    """Seconds the all-to-all bytes ``lk`` take on ``gpu``'s links, both at once (no latency)."""
    nic = lk.nic_bytes / (gpu.nic_bw * gpu.alltoall_nic_share)
    return np.maximum(nic, lk.nvlink_bytes / (gpu.nvlink_bw * gpu.alltoall_nvlink_share))


def comm_time(model: ModelSpec, cluster: ClusterSpec, length, degree, recomputed) -> np.ndarray:
    """One layer's training all-to-all time of one member, seconds (not overlapped); ``recomputed``
    as for :func:`bytes_per_member`."""
    gpu = cluster.gpu
    lk = links(model, cluster, length, degree, recomputed)
    g = np.asarray(degree, dtype=np.float64)
    lat = np.where(lk.nic_bytes > 0, gpu.nic_latency, gpu.nvlink_latency)
    calls = 4.0 + 2.0 * recomputed  # QKV and O forward [and again], dO and dQKV backward
    t = link_seconds(gpu, lk) + calls * lat
    return np.where(g > 1, t, 0.0)


@dataclass(frozen=True)
class Groups:
    """The (sequence, rank) pairs of a plan's split sequences: each member of each group."""

    seq: np.ndarray
    rank: np.ndarray
    wave: np.ndarray
    degree: np.ndarray  # members of the pair's group
    held: np.ndarray  # tokens of the sequence the member holds

    @classmethod
    def of(cls, plan) -> Groups:
        N = plan.num_ranks
        key, idx = np.unique(plan.seq * N + plan.rank, return_inverse=True)
        seq, rank = key // N, key % N
        held = np.bincount(idx, weights=plan.end - plan.start, minlength=key.size)
        degree = np.bincount(seq, minlength=plan.seq_lens.size)[seq]
        return cls(seq, rank, plan.seq_wave()[seq], degree, held)


def shard_attention(plan, groups: Groups, whole_attention, per_shard: np.ndarray) -> np.ndarray:
    """``per_shard`` attention times with each split sequence's replaced: a member computes the
    whole sequence's causal attention for its share of the heads (``whole_attention(lengths)``:
    one layer of causal attention over whole sequences), spread over its shards by tokens."""
    split = groups.degree > 1
    if not split.any():
        return per_shard
    N = plan.num_ranks
    lens = plan.seq_lens[groups.seq[split]]
    member_s = whole_attention(lens) / groups.degree[split]
    keys = groups.seq[split] * N + groups.rank[split]
    shard_keys = plan.seq * N + plan.rank
    at = np.searchsorted(keys, shard_keys)
    at = np.minimum(at, keys.size - 1)
    in_split = keys[at] == shard_keys
    share = (plan.end - plan.start) / np.maximum(groups.held[split][at], 1)
    return np.where(in_split, member_s[at] * share, per_shard)
