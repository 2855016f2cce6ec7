"""The relaxation's roundings: the degrees the search places first (Note [One search] in
:mod:`.search`, item 2)."""

from __future__ import annotations

import numpy as np

from ..common import Context
from ..degrees import Relaxation, relaxation_bound
from .candidates import Candidate, num_waves_for
from .groups import SplitPrices, most_members


def roundings(ctx: Context, rel: Relaxation) -> list[Candidate]:
    """The relaxation's degrees at each of :func:`rounding_heights`, and in ``wave`` sync with
    several waves also :func:`per_wave_roundings`; least work first (:func:`work_s`), the order
    in which a small budget places them."""
    out = [Candidate(*rel.degrees_at(h, ctx.whole_s)) for h in rounding_heights(rel, ctx.sync)]
    waves = num_waves_for(ctx)
    if ctx.sync == "wave" and waves > 1:
        out += per_wave_roundings(ctx, waves)
    out = sorted(out, key=lambda cand: work_s(ctx, rel, cand))
    packed = packed_rounding(ctx, rel) if ctx.sync == "wave" and waves == 1 else None
    return out if packed is None else [packed, *out]


def per_wave_roundings(ctx: Context, waves: int) -> list[Candidate]:
    """The degrees of the relaxation over ranks x ``waves`` (as if the work spread evenly over
    the waves) at its height and a little above."""
    per_wave = relaxation_bound(
        ctx.cost,
        ctx.seq_lens,
        ctx.sync,
        ctx.capacity,
        ctx.num_ranks * waves,
        most_ranks=ctx.max_ranks_per_seq,
    )
    heights = [per_wave.height_s * f for f in (1.0, 1.04, 1.12)]
    return [Candidate(*per_wave.degrees_at(h, ctx.whole_s)) for h in heights]


def packed_rounding(ctx: Context, rel: Relaxation) -> Candidate | None:
    """Where the relaxation's degrees at ``M`` leave more tall jobs than ranks (Note [One
    search], item 2), :func:`room_for_tall_jobs` at the height from ``M`` to ``1.2 M`` whose
    degrees promise the least step (the height or their area over the ranks, whichever is
    more; a height they do not fit promises nothing); ``None`` where they fit at ``M``."""
    best: tuple[float, Candidate] | None = None
    priced = SplitPrices(ctx)
    for f in (1.0, 1.04, 1.08, 1.12, 1.2):
        height = rel.height_s * f
        cand = room_for_tall_jobs(ctx, rel, height, priced)
        if cand is None:
            if f == 1.0:
                return None
            continue
        time, tall = _tall_members(ctx, cand, height)
        if tall > ctx.num_ranks:
            continue
        promise = max(height, float((cand.degree * time).sum()) / ctx.num_ranks)
        if best is None or promise < best[0]:
            best = (promise, cand)
    return None if best is None else best[1]


def room_for_tall_jobs(
    ctx: Context, rel: Relaxation, height: float, priced: SplitPrices | None = None
) -> Candidate | None:
    """The relaxation's degrees at ``height`` with room for its tall jobs: within ``height`` a
    rank holds at most one job (whole or a member's share) taller than half of it, so where
    such jobs outnumber the ranks, those that free a rank for the least extra area are split
    further, each to the least of a few degrees (up to three times its own) whose members are
    under half of ``height``, until they fit or none is left. ``None`` where they fit already
    or none can be split so. ``priced``: the prices of earlier heights, added to here."""
    lens, n, half = ctx.seq_lens, ctx.num_ranks, height / 2
    degree, job_time = rel.degrees_at(height, ctx.whole_s)
    time, tall = _tall_members(ctx, Candidate(degree, job_time), height)
    over = tall - n
    if over <= 0:
        return None
    # Three degrees a tall job, priced in one pass: where its time would fall under half
    # were it to shrink as 1 / degree, one more, and a quarter more.
    seqs = np.flatnonzero(time > half)
    top = np.minimum(np.minimum(3 * degree[seqs], lens[seqs] // 2), most_members(ctx))
    guess = np.ceil(degree[seqs] * time[seqs] / half).astype(np.int64)
    tries = np.stack([guess, guess + 1, np.ceil(1.25 * guess).astype(np.int64)], axis=1)
    tries = np.clip(tries, degree[seqs, None] + 1, None)
    ok = tries <= top[:, None]
    row_seq, row_deg = np.broadcast_to(seqs[:, None], tries.shape)[ok], tries[ok]
    row_time = (priced or SplitPrices(ctx)).of(lens[row_seq], row_deg)
    fits = np.flatnonzero(row_time <= half)
    seq, at = np.unique(row_seq[fits], return_index=True)  # each one's least such degree
    if seq.size == 0:
        return None
    new_deg, new_time = row_deg[fits][at], row_time[fits][at]
    freed = degree[seq]
    extra = (new_deg * new_time - freed * time[seq]) / freed
    order = np.argsort(extra, kind="stable")
    take = order[: int(np.searchsorted(np.cumsum(freed[order]), over)) + 1]
    degree, job_time = degree.copy(), job_time.copy()
    degree[seq[take]], job_time[seq[take]] = new_deg[take], new_time[take]
    return Candidate(degree, job_time)


def _tall_members(ctx: Context, cand: Candidate, height: float) -> tuple[np.ndarray, int]:
    """Each sequence's time in ``cand`` (a multi-rank job's, or whole at its packed time) and
    how many ranks the jobs taller than half of ``height`` take."""
    time = np.where(cand.degree > 1, cand.job_time, ctx.packed_s)
    return time, int(cand.degree[time > height / 2].sum())


def work_s(ctx: Context, rel: Relaxation, cand: Candidate) -> float:
    """The rank-seconds of compute ``cand``'s degrees cover at least (split sequences their
    menu area, whole ones their packed time), over the ranks."""
    area = ctx.packed_s.copy()
    if rel.menus:
        degrees, _, menu_area, seg = rel.entries
        ids = rel.long_ids[seg]
        chosen = (degrees == cand.degree[ids]) & (cand.degree[ids] > 1)
        area[ids[chosen]] = menu_area[chosen]
    return float(area.sum()) / ctx.num_ranks


def rounding_heights(rel: Relaxation, sync: str) -> list[float]:
    """Heights at which the relaxation's degrees are read (Note [One search], item 2): ``M``
    and a little above in ``peer`` sync; in ``wave`` sync a step is the sum of its waves'
    heights, so tall jobs must share waves side by side: from a quarter of the least height
    the tallest job can have up to ``M``."""
    if sync == "peer" or not rel.menus:
        return [rel.height_s * f for f in (1.0, 1.04, 1.12)]
    floor = max(float(mu.height.min()) for mu in rel.menus)
    top = max(floor, rel.height_s)
    ladder = [float(h) for h in np.geomspace(floor, top, 4)] if top > floor * 1.01 else [floor]
    return [floor * 0.5, floor * 0.25, *ladder]
