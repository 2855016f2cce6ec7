"""Attention of the plans whose runtime is a ring of context parallelism run as
TransformerEngine runs it: one kernel call per ring step over all of a rank's chunks.

Note [One kernel call per ring step]
------------------------------------
hdp's runtime calls the attention kernel once per K/V block, and its plans are priced so
(:meth:`ComputeModel.attn_time <hdp.compute.ComputeModel.attn_time>`: a causal call for a shard's
diagonal, a full call against its earlier keys). TransformerEngine's ring attention, which the
``static`` mesh and ``hybridcp`` (Megatron's context parallelism) run and ByteScale's ring
runs the same way, holds a micro-batch in THD layout: each of the ``cp`` members of a CP group
holds two zigzag chunks of every document, and in each of the ``cp`` ring steps it makes ONE
variable-length kernel call over all its documents' chunk pairs of that step. A cell of such a
plan (:data:`RING_STRATEGIES`, except in the ``ulysses`` exchange) is priced:

- a document one rank holds whole (a CP group of one): one causal document, as the tables price
  it (their causal rows time calls over many documents of one length, so this is a document's
  share of a packed call);
- the chunks of documents split over several ranks: their query-key pairs (a chunk's causal
  pairs with itself and its queries against every earlier key of its document), each chunk's
  queries padded up to one query tile (:data:`~hdp.profile.TILE_TOKENS`): the kernel runs a
  whole tile for a segment however few of its rows are real. They run at the rate of one call
  over the cell's ``T`` split tokens: the least of the tables' rates for a causal document of
  ``T`` tokens (the first step's call is causal) and for blocks of ``T`` queries against
  ``T / 2`` keys and of ``T / 2`` against ``T`` (the later steps' calls: a rank's two chunks
  against a lower peer's first chunks, or its second chunks against a higher peer's two; these
  rows are timed one call at a time, so a small call leaves SMs idle as it does in the ring);
  and no faster than the chunk's document runs whole, so that a split never prices below the
  unsplit document;
- the per-call cost once per ring step, not per chunk: zigzag spreads a cell's work evenly over
  its ``cp`` steps and each step takes at least the shortest call the tables price, so the cell's
  split attention is the larger of its chunks' work and ``cp`` shortest calls.

Not charged: the key side of a small segment (a step whose segment has a few keys still runs a
whole key block). A rank's two chunks of a document share a segment in most steps but are
padded each; for chunks much shorter than a tile the price is still below the kernel's work,
erring on the baseline's side.

Worked example (llama-7b, h100, ``torch_flash``): a 2,048-token document packed into a
micro-batch for CP 256 becomes 512 chunks of 4 tokens; chunk ``j`` holds queries ``4j`` to
``4j + 3``. Priced as its own calls each chunk takes at least a tile's causal call and a tile of
queries against its earlier keys in a single call: 0.136 s a layer over the 256 ranks, 207x the
whole document's 0.656 ms. As the ring runs it, chunk ``j``'s 4 queries have ``4j + 2.5``
keys each on average; padded to 128 queries that is ``128 (4j + 2.5)`` pairs, and over the 512
chunks ``128 (4 x 512 x 511 / 2 + 2.5 x 512)`` = 67.1 M pairs, 32x the document's 2.10 M (the
padding: 128 rows for 4). In a cell of at least 4,096 tokens they run at the whole document's
rate, so the document costs 32x its unsplit attention over the ranks (21 ms a layer), 1/8 of it
on each rank; the ring's 256 steps of at least one shortest call (12 us each) are shared by
every document of the cell.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .profile import TILE_TOKENS

if TYPE_CHECKING:
    from .compute import ComputeModel
    from .plan import Plan

# The strategies whose plans run TransformerEngine's ring (or ByteScale's, the same way).
RING_STRATEGIES = ("static", "hybridcp", "bytescale")


def runs_ring(plan: Plan) -> bool:
    """Whether ``plan``'s attention runs as a ring of one call per step (Note [One kernel call
    per ring step]); the ``ulysses`` exchange splits heads, not a ring."""
    return plan.strategy in RING_STRATEGIES and plan.kv_exchange != "ulysses"


def cell_attention(compute: ComputeModel, plan: Plan) -> np.ndarray:
    """One layer's attention of every cell of ``plan`` run as a ring (Note [One kernel call per
    ring step]), ``[num_waves, num_ranks]`` seconds."""
    W, N = plan.num_waves, plan.num_ranks
    cell = plan.wave * N + plan.rank
    # Ranks holding each sequence: its CP group's size, the ring's steps.
    held = np.unique(plan.seq * N + plan.rank)
    degree = np.bincount(held // N, minlength=plan.seq_lens.size)[plan.seq]
    out = np.zeros(W * N)
    whole = degree <= 1
    if whole.any():  # one call over the document, however many shards it is held in
        seqs, first = np.unique(plan.seq[whole], return_index=True)
        lens = plan.seq_lens[seqs]
        times = compute.attn_time(np.zeros_like(lens), lens)
        out += np.bincount(cell[whole][first], weights=times, minlength=W * N)
    split = ~whole
    if split.any():
        out += _split_attention(compute, plan, cell[split], split, degree[split], W * N)
    return out.reshape(W, N)


def _split_attention(
    compute: ComputeModel,
    plan: Plan,
    cell: np.ndarray,
    split: np.ndarray,
    degree: np.ndarray,
    cells: int,
) -> np.ndarray:
    """Per cell (flat), the attention of the shards ``split`` of documents split over ranks."""
    tables, backend = compute.gpu.tables, compute.backend
    h, d = compute.model.heads, compute.model.head_dim
    start = plan.start[split].astype(np.float64)
    q = plan.end[split] - start
    pairs = np.maximum(q, TILE_TOKENS) * ((q + 1.0) / 2.0 + start)  # whole query tiles
    T = np.bincount(cell, weights=q, minlength=cells)
    busy = np.flatnonzero(T)  # most cells of a large peer plan are empty
    call = np.ones(cells)
    whole_call, half_call = T[busy], T[busy] / 2
    call[busy] = np.minimum.reduce(
        [
            tables.causal_rate(whole_call, h, d, backend),
            tables.full_rate(whole_call, half_call, h, d, backend),
            tables.full_rate(half_call, whole_call, h, d, backend),
        ]
    )
    whole = tables.causal_rate(plan.seq_lens[plan.seq[split]], h, d, backend)
    work = np.bincount(cell, weights=pairs / np.minimum(call[cell], whole), minlength=cells)
    steps = np.zeros(cells)
    np.maximum.at(steps, cell, degree)
    shortest_call = float(tables.causal_time(1.0, h, d, backend))
    return np.maximum(work, steps * shortest_call) * compute.attn_recompute
