"""Placing one candidate: every sequence's degree is fixed, ranks and waves are chosen here.

In ``peer`` sync (:mod:`.peer`) multi-rank jobs go first, tallest first, then the sequences
that stay whole, slowest first, and each rank's first cell of them after its last job joins
that job's cell where both fit (:func:`_joined_tails`); in ``wave`` sync (:mod:`.wave`) both
kinds share one list, tallest first. Both placers return a :class:`~.candidates.Assignment` of
sparse, ordered keys, which :func:`place` turns into waves and shards.
"""

from __future__ import annotations

import numpy as np

from hdp import Plan

from ..common import Context, PlanBuilder
from .candidates import Candidate, jobs_and_singles
from .peer import peer_levels, place_peer
from .wave import place_wave


def place(ctx: Context, num_waves: int, cand: Candidate) -> Plan:
    """Place ``cand`` on ranks and waves and build its plan."""
    lens = ctx.seq_lens
    multi, single = jobs_and_singles(ctx, cand.degree, cand.job_time)
    searches = 0
    if ctx.sync == "wave":
        assignment, searches = place_wave(ctx, num_waves, multi, single, cand)
    else:
        assignment = place_peer(ctx, multi, single, cand)
    job_key = np.asarray(assignment.job_key, dtype=np.int64)
    single_key = assignment.single_key[single]
    if ctx.sync == "wave":  # the distinct keys in order are the waves
        uniq = np.unique(np.concatenate([job_key, single_key]))
        job_wave, single_wave = np.searchsorted(uniq, job_key), np.searchsorted(uniq, single_key)
    else:
        job_wave, single_wave = peer_levels(
            ctx.num_ranks,
            assignment.job_members,
            job_key,
            assignment.single_rank[single],
            single_key,
        )
    builder = PlanBuilder(ctx, "hdp")
    single_rank = assignment.single_rank[single]
    if multi.size:
        aligns = ctx.splits(lens[multi], cand.degree[multi])[0]
        wave, rank, seq, start, end = builder.zigzag(
            multi, job_wave, assignment.job_members, align=aligns
        )
        if ctx.sync == "peer" and single.size:
            held = (wave, rank, end - start)
            single_wave = _joined_tails(ctx, held, single_wave, single_rank, lens[single])
            # (A level whose cells all joined their jobs' is dropped.)
            _, waves = np.unique(np.concatenate([wave, single_wave]), return_inverse=True)
            wave, single_wave = waves[: wave.size], waves[wave.size :]
        builder.add(wave, rank, seq, start, end)
    if single.size:
        builder.add(single_wave, single_rank, single, 0, lens[single])
    builder.offload_where_needed()
    builder.info = {
        "multi_rank_sequences": float(multi.size),
        "max_degree": float(cand.degree.max(initial=1)),
        "offloading_cells": float(len(builder.offload)),
        "offload_searches": float(searches),
    }
    return builder.build()


def _joined_tails(
    ctx: Context, jobs: tuple, wave: np.ndarray, rank: np.ndarray, tokens: np.ndarray
) -> np.ndarray:
    """``peer`` sync: the waves of whole sequences (``wave``, ``rank``, ``tokens``) with each
    rank's first cell of them after its last multi-rank job (``jobs``: its shards' waves, ranks
    and tokens) moved into that job's cell where the two fit the capacity. Levels would give
    them a cell of their own, which pays a micro-batch's fixed cost a second time."""
    n = ctx.num_ranks
    job_wave, job_rank, job_tokens = jobs
    last = np.full(n, -1, dtype=np.int64)
    np.maximum.at(last, job_rank, job_wave)
    at_last = job_wave == last[job_rank]
    held = np.bincount(job_rank[at_last], weights=job_tokens[at_last], minlength=n)
    after = (last[rank] >= 0) & (wave > last[rank])
    first = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(first, rank[after], wave[after])
    chosen = after & (wave == first[rank])
    cell = np.bincount(rank[chosen], weights=tokens[chosen], minlength=n)
    move = chosen & (held + cell <= ctx.capacity)[rank]
    out = wave.copy()
    out[move] = last[rank[move]]
    return out
