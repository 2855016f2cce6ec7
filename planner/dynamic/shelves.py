"""``wave`` sync shelf candidates: the longest sequences side by side in one tall first wave.

A single relaxation height cannot express this plan. At a height where the longest jobs are
area-efficient, the next ones are that tall too; they open tall waves that the whole sequences
cannot fill, because those run out of tokens before they run out of time. A shelf takes the
longest jobs at area-efficient degrees into one first wave and gives every other sequence a
fast, wide degree, so the waves after the shelf balance finely.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from ..common import Context
from ..degrees import Relaxation
from .candidates import Candidate, jobs_and_singles
from .wave import place_wave_jobs


def shelf_candidates(
    ctx: Context,
    rel: Relaxation,
    num_waves: int,
    heights: list[float],
    *,
    shelf_heights: int,
    stack_share: float,
    hopeless: Callable[[np.ndarray], bool] = lambda degree: False,
) -> list[Candidate]:
    """Shelf candidates, placed with no stacking (``stack_share``), best first by
    :func:`estimate_wave_step`.

    Up to ``shelf_heights`` shelf heights ``H1`` come from the longest sequence's menu, above
    its fastest time. The longest sequences, longest first, each on the fewest ranks that keep
    it under ``H1``, join the shelf while their ranks fit; then the shelf's tallest job widens
    to its next menu degree while the ranks left allow. Every other sequence takes the
    relaxation's degrees at the two lowest candidate ``heights``. Candidates for which
    ``hopeless(degree)`` holds are left out before they are estimated."""
    if not rel.menus:
        return []
    lens = ctx.seq_lens
    by_length = sorted(range(len(rel.menus)), key=lambda j: (-int(lens[rel.long_ids[j]]), j))
    first = rel.menus[by_length[0]]
    tall = first.height[np.isfinite(first.height) & (first.height >= 1.02 * first.height.min())]
    tall = np.sort(tall)[::-1]
    if tall.size == 0:
        return []
    scored = []
    for top in tall[:: max(1, tall.size // shelf_heights)].tolist():
        on_shelf = _shelf(rel, by_length, top, ctx.num_ranks)
        for rest in heights[:2]:
            degree, job_time = rel.degrees_at(rest, ctx.whole_s)
            for j, k in on_shelf.items():
                degree[rel.long_ids[j]] = rel.menus[j].degrees[k]
                job_time[rel.long_ids[j]] = rel.menus[j].height[k]
            if hopeless(degree):
                continue
            cand = Candidate(degree, job_time, stack_share=stack_share)
            scored.append(
                (estimate_wave_step(ctx, num_waves, cand, stack_share), len(scored), cand)
            )
    scored.sort(key=lambda c: c[:2])
    return [cand for _, _, cand in scored]


def _shelf(rel: Relaxation, by_length: list[int], top: float, n: int) -> dict[int, int]:
    """The long sequences on a shelf of height ``top`` over ``n`` ranks: menu index -> entry."""
    on_shelf: dict[int, int] = {}
    width = 0
    for j in by_length:
        fits = np.flatnonzero(rel.menus[j].height <= top)
        if fits.size and width + int(rel.menus[j].degrees[fits[0]]) <= n:
            on_shelf[j] = int(fits[0])
            width += int(rel.menus[j].degrees[fits[0]])
    tallest = [(-float(rel.menus[j].height[k]), j) for j, k in on_shelf.items()]
    heapq.heapify(tallest)
    while tallest:
        j = tallest[0][1]
        mu, k = rel.menus[j], on_shelf[j]
        if k + 1 >= mu.degrees.size or width + int(mu.degrees[k + 1] - mu.degrees[k]) > n:
            break
        width += int(mu.degrees[k + 1] - mu.degrees[k])
        on_shelf[j] = k + 1
        heapq.heapreplace(tallest, (-float(mu.height[k + 1]), j))
    return on_shelf


def estimate_wave_step(
    ctx: Context, num_waves: int, cand: Candidate, stacked_share: float
) -> float:
    """Step (s) a ``wave``-sync candidate would get, from its multi-rank jobs alone: the waves'
    heights, plus the time of the whole sequences that the cells' spare time and token room
    cannot take (a fluid at their mean time per token), spread over the ranks. It costs about a
    tenth of a placement (docs/benchmarks.md has how well it ranks)."""
    off_cap = ctx.offload_capacity
    multi, single = jobs_and_singles(ctx, cand.degree, cand.job_time)
    layer = place_wave_jobs(ctx, num_waves, multi, cand, stacked_share=stacked_share)
    height = layer.load.max(axis=1)
    fill_s = float(ctx.packed_s[single].sum())
    per_token = fill_s / max(int(ctx.seq_lens[single].sum()), 1)
    room = np.minimum(
        height[:, None] - layer.load, per_token * np.maximum(0, off_cap - layer.tokens)
    )
    return float(height.sum()) + max(0.0, fill_s - float(room.sum())) / ctx.num_ranks
