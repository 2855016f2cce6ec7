"""Placing one candidate: every sequence's degree is fixed, ranks and waves are chosen here.

In ``peer`` sync (:mod:`.peer`) multi-rank jobs go first, tallest first, then the sequences
that stay whole, slowest first; in ``wave`` sync (:mod:`.wave`) both kinds share one list,
tallest first. Both placers return a :class:`~.candidates.Assignment` of sparse, ordered keys,
which :func:`place` turns into waves and shards.
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
    if multi.size:
        aligns = ctx.splits(lens[multi], cand.degree[multi])[0]
        builder.add_zigzag(multi, job_wave, assignment.job_members, align=aligns)
    if single.size:
        builder.add(single_wave, assignment.single_rank[single], single, 0, lens[single])
    builder.offload_where_needed()
    builder.info = {
        "multi_rank_sequences": float(multi.size),
        "max_degree": float(cand.degree.max(initial=1)),
        "offloading_cells": float(len(builder.offload)),
        "offload_searches": float(searches),
    }
    return builder.build()
