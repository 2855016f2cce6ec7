"""The ``hdp`` search: candidate families in order, each placed once, the fastest kept.

Note [The candidate families]
-----------------------------
A candidate is one degree per sequence (:class:`~.assignment.Candidate`). The search places, in
this order:

1. *Heights*: the relaxation's degrees at a few heights (:func:`candidate_heights`). ``peer``
   sync: around the relaxation's ``M``. ``wave`` sync: a step is the sum of its waves' heights,
   so tall jobs must share waves side by side; heights run from a quarter of the shortest the
   tallest job can be up to ``M``.
2. *Per wave* (``wave`` sync, several waves): the relaxation over ranks x waves, as if the area
   spread evenly over the waves.
3. *The MILP* (:mod:`hdp.planner.dynamic.milp`) where it fits the time budget, warm-started from 1.
4. At the best height (``wave`` sync): *token-capped* degrees, so more sequences split and every
   cell gets a mix; and *two tiers*, in which the cheapest whole sequences per token get waves
   of their own, so the dense waves keep token room (a wave costs only its collectives' tail
   where its compute hides them).
5. *Shelves* (``wave`` sync, :mod:`.shelves`), unless the best plan is within 0.1% of the bound.
6. *Groups* (:mod:`.groups`, :mod:`.mixed`): the ranks cut into groups, each sequence split over
   one group or whole on one of its ranks, each group's sequences stacked into shared waves.
   *Equal groups*: groups of one size (a few sizes), the sequences a variant splits each over
   one group (:func:`.groups.group_splits`: every sequence long enough, or in a P2P exchange
   also only those over a rank's capacity); in ``ulysses`` exchange always (head-parallel
   groups of at most one rank a head), in a P2P exchange where :func:`few_sequences` holds.
   *Mixed sizes* (Note [Mixed group sizes]): power-of-two groups as FlexSP lays them out,
   chosen without its MILP, up to ``RIVAL_RANKS`` ranks and ``RIVAL_SEQUENCES`` sequences,
   unless the best plan so far meets the bound. Both catch what the relaxation's
   degrees miss where they do not fit side by side: a profile where splitting every sequence
   saves work (the CPU's reference attention), or short sequences that share a group's
   micro-batches and so its fixed costs.
7. *The baselines' plans* (:func:`rival_plans`), each made in this step's sync mode and capacity for
   the ``rank`` exchange the baselines run (unless the step asks for ``node``), where it is cheap to
   make and price (unless ``DynamicOptions.rivals`` is off, to see what hdp's own search finds):
   the static mesh's where it has at most ``STATIC_RIVAL_SHARDS`` shards (the
   DeepSpeed-Ulysses mesh's there too, and wherever FlexSP's is priced),
   ByteScale's and Megatron's hybrid CP (our re-implementation) up to ``RIVAL_RANKS`` ranks
   (up to ``SMALL_BATCH_RIVAL_RANKS`` for at most ``RIVAL_SEQUENCES`` sequences),
   FlexSP's where :func:`cheap_flexsp` holds (past it, its MILP solved once per micro-batch
   alone takes up to 6 times hdp's whole search); none where hdp's plan already meets its
   bound. hdp must never plan slower than a system it replaces, and the relaxation misses what
   such plans exploit: mixed group sizes, or a micro-batch's fixed cost on few ranks (a
   one-token sequence that opens a wave of its own costs the dense layers' whole weight
   traffic). Past those sizes a baseline's plan costs more to price than the search and is far
   from the best plan. In ``ulysses`` exchange the rivals are those whose groups split heads:
   FlexSP's and the DeepSpeed-Ulysses mesh. Under ``auto`` a P2P search prices those two too,
   as their systems run them: FlexSP's wherever it prices its P2P placement, the mesh wherever
   it prices the static one or FlexSP's. (The head-parallel planning beside it runs only where
   its plan could gain over 2%.)

Every placed candidate where a multi-rank job raised a wave that already held work by more
than ``stack_share`` of its time is also placed with *no stacking* (such jobs open waves of
their own), and the faster of the two counts.

Note [Skipping by work]
-----------------------
In ``wave`` sync the candidates of 1-3 go least work first. A candidate's work
(:func:`hdp.planner.degrees.work_area`) spread over the ranks is a lower bound of its step, so one
whose work is not below the best step so far cannot win and is not placed. A height candidate
is compared only with the best height candidate, so the best height, where 4 starts, is the one
all heights placed would give.

In ``peer`` sync a rank's work runs back to back, so the step is at least the busy time of every
multi-rank job's slowest member. The bound's entries of the job's menu (Note [Bounds price bytes,
not messages] in :mod:`hdp.planner.menus`) bound that from below, so a candidate whose tallest job's
entry is not below the best step so far is not placed either. At 1024 ranks the tallest height
candidate is often such a one: its jobs alone take longer than the best plan. Not in ``ulysses``
exchange: there the entries are the P2P splits', and a head-parallel job may run 3x faster.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np

from hdp import Plan, ulysses

from ..bytescale import plan_bytescale
from ..common import Context, PlanningError, fewest_micro_batches, next_pow2
from ..degrees import Jobs, Relaxation, relaxation_bound, step_bound, work_area
from ..flexsp import plan_flexsp
from ..hybridcp import plan_hybridcp
from ..static import plan_static
from . import milp
from .candidates import Candidate, num_waves_for
from .groups import group_counts, group_plan, group_splits
from .megatron import plan_megatron_form
from .mixed import mixed_group_plans
from .options import DynamicOptions
from .place import place
from .shelves import shelf_candidates
from .wave import rebalance_wave

# The baselines' plans priced beside hdp's candidates (family 7), where they are this small.
STATIC_RIVAL_SHARDS = 4096
RIVAL_RANKS = 256
# Up to this many ranks ByteScale's and hybrid CP's plans are rivals for batches of at most
# ``RIVAL_SEQUENCES`` sequences too: hybrid CP's plan then costs at most about 0.1 s.
SMALL_BATCH_RIVAL_RANKS = 1024
FLEXSP_RIVAL_RANKS = 8
FLEXSP_RIVAL_SOLVES = 4
# Past this many sequences neither FlexSP's plan (its length buckets' dynamic programming grows
# with their square) nor mixed-size groups are cheap, and whole sequences fill the gaps anyway.
RIVAL_SEQUENCES = 1024
# Batches of at most this many sequences (on at most ``RIVAL_RANKS`` ranks) get FlexSP's plan
# however many times it solves its MILP, and in a P2P exchange equal-group plans: with few
# sequences a batch's degrees may leave gaps the placer cannot fill.
FEW_SEQUENCES = 64

NATIVE_SYNC = "peer"


class CandidateSearch:
    """Places candidates, each once, skips those that cannot win (Note [Skipping by work]) and
    keeps the fastest plan by the cost model."""

    def __init__(self, ctx: Context, options: DynamicOptions, rel: Relaxation) -> None:
        self.ctx, self.options, self.rel = ctx, options, rel
        self.num_waves = num_waves_for(ctx)
        self.skips = ctx.sync == "wave" and options.skip_by_work
        # (Head-parallel jobs run faster than the P2P splits the menus' bound entries price.)
        self.skips_tall = (
            ctx.sync == "peer" and options.skip_by_work and ctx.cost.kv_exchange != "ulysses"
        )
        self.best_s = math.inf
        self.best_plan: Plan | None = None
        self._placed: dict[tuple, tuple[float, bool]] = {}  # -> (step s, whether a job stacked)
        self._work: dict[bytes, float] = {}

    def work_s(self, degree: np.ndarray) -> float:
        """The candidate's work spread over the ranks (s): a lower bound of its step."""
        key = degree.tobytes()
        if key not in self._work:
            ctx = self.ctx
            area = work_area(ctx.cost, self.rel, degree, ctx.sync)
            self._work[key] = area / ctx.num_ranks
        return self._work[key]

    def tallest_job_s(self, degree: np.ndarray) -> float:
        """The least busy time the slowest member of the candidate's tallest multi-rank job may
        have: the bound's entry of its menu at its degree (between two entries, the lower)."""
        tallest = 0.0
        for i, mu in zip(self.rel.long_ids.tolist(), self.rel.menus):
            d, at = int(degree[i]), mu.bound_degrees
            k = int(np.searchsorted(at, d))
            if d <= 1 or k == at.size or (k == 0 and at[0] != d):
                continue  # whole, or past the menu's ends: no entry bounds it
            h = mu.bound_height[k] if at[k] == d else min(mu.bound_height[k - 1 : k + 1])
            tallest = max(tallest, float(h))
        return tallest

    def cannot_win(self, degree: np.ndarray) -> bool:
        return self.skips and self.work_s(degree) >= self.best_s

    def place_once(self, cand: Candidate, prune_at: float = math.inf) -> tuple[float, bool]:
        """Step time of ``cand`` and whether a multi-rank job stacked; a repeat returns what the
        first placement got. Not placed (``inf``) where its work, or in ``peer`` sync its tallest
        job, is ``prune_at`` or more (Note [Skipping by work])."""
        key = (cand.degree.tobytes(), cand.cheap_share, cand.stack_share)
        if key in self._placed:
            return self._placed[key]
        if (self.skips and self.work_s(cand.degree) >= prune_at) or (
            self.skips_tall and self.tallest_job_s(cand.degree) >= prune_at
        ):
            self._placed[key] = (math.inf, False)
            return self._placed[key]
        placement = place(self.ctx, self.num_waves, cand, self.options)
        t = self.ctx.cost.evaluate(placement.plan).step_time_s
        self._placed[key] = (t, placement.stacked_jobs > 0)
        if self.options.on_place is not None:
            self.options.on_place(cand, placement)
        if t < self.best_s:
            self.best_s, self.best_plan = t, placement.plan
        return self._placed[key]

    def place(self, cand: Candidate, prune_at: float = math.inf) -> float:
        """Step time of ``cand``, or of its no-stacking variant where that is faster (Note [The
        candidate families]); without a stacked job the variant is the same plan, not placed."""
        t, stacked = self.place_once(cand, prune_at)
        if stacked:
            no_stacking = replace(cand, stack_share=self.options.stack_share)
            t = min(t, self.place_once(no_stacking, self.best_s)[0])
        return t

    def place_in_work_order(self, cands: list[Candidate]) -> list[float]:
        """Step time of each of ``cands`` (``inf`` where skipped), least work first where the
        search skips (Note [Skipping by work])."""
        times = [math.inf] * len(cands)
        order = list(range(len(cands)))
        if self.skips:
            order.sort(key=lambda k: self.work_s(cands[k].degree))
        for k in order:
            heights = [t for t, c in zip(times, cands) if c.height_s is not None]
            best_height_s = min(heights, default=math.inf)
            prune_at = best_height_s if cands[k].height_s is not None else self.best_s
            times[k] = self.place(cands[k], prune_at)
        return times

    def consider(self, name: str, plan: Plan) -> None:
        """Keep ``plan``, baseline ``name``'s, where it is faster than the best so far; it is
        then hdp's plan, and ``predicted["from_<name>"]`` says where it came from. It is priced
        as hdp's runtime would run it, not as the baseline's system does."""
        plan.strategy = "hdp"
        t = self.ctx.cost.evaluate(plan).step_time_s
        if t < self.best_s:
            plan.predicted[f"from_{name}"] = 1.0
            self.best_s, self.best_plan = t, plan

    def polish_wave(self) -> None:
        """Move whole sequences out of the slowest cells of the best plan while that is faster."""
        for _ in range(3):
            moved = rebalance_wave(
                self.ctx, self.best_plan, self.ctx.cost.evaluate(self.best_plan).busy_s
            )
            if moved is None:
                return
            t = self.ctx.cost.evaluate(moved).step_time_s
            if t >= self.best_s:
                return
            self.best_s, self.best_plan = t, moved


def check_fits(ctx: Context) -> None:
    """Raise PlanningError when the longest sequence cannot be held by all ranks together (in
    ``ulysses`` exchange: by as many ranks as the model has heads)."""
    longest = int(ctx.seq_lens.max(initial=0))
    off_cap = ctx.offload_capacity
    if longest > off_cap * ctx.num_ranks:
        raise PlanningError(
            f"hdp: a sequence of {longest} tokens needs {-(-longest // off_cap)} ranks at "
            f"{off_cap} tokens each (with activation offload), but the cluster has "
            f"{ctx.num_ranks}; use more GPUs or a smaller --max-seq"
        )
    m = ctx.cost.model
    most = ulysses.most_members(m, ctx.num_ranks)
    if ctx.cost.kv_exchange == "ulysses" and longest > off_cap * most:
        raise PlanningError(
            f"hdp: a sequence of {longest} tokens needs {-(-longest // off_cap)} ranks at "
            f"{off_cap} tokens each, but a head-parallel group has at most {most} ({m.name} has "
            f"{m.heads} heads); use --kv-exchange rank or node, or a smaller --max-seq"
        )


def plan_dynamic(ctx: Context, options: DynamicOptions | None = None) -> Plan:
    """Plan with the candidate families of Note [The candidate families]; the fastest by the
    cost model reports its gap to the bound (:func:`hdp.planner.degrees.step_bound`) in
    ``predicted["bound_s"]``, in the form ``options.form`` asks."""
    options = options or DynamicOptions()
    form = options.form
    if form == "megatron":
        return plan_megatron_form(ctx, options)
    if form not in ("free", "whole"):
        raise ValueError(f"unknown hdp form {form!r}: choose 'free', 'whole' or 'megatron'")
    check_fits(ctx)
    bound_s = float(step_bound(ctx.cost, ctx.seq_lens, ctx.sync, ctx.capacity))
    if form == "whole":
        plan = _plan_whole(ctx, options)
        plan.predicted["bound_s"] = bound_s
        return plan
    rel = relaxation_bound(ctx.cost, ctx.seq_lens, ctx.sync, ctx.capacity, ctx.num_ranks)
    search = CandidateSearch(ctx, options, rel)
    heights = candidate_heights(rel, ctx.sync, options)
    cands, info = degree_candidates(ctx, rel, heights, options)
    times = search.place_in_work_order(cands)
    if ctx.sync == "wave":
        _, h = min((t, c.height_s) for t, c in zip(times, cands) if c.height_s is not None)
        for cand in best_height_variants(ctx, rel, h, options):
            search.place(cand, prune_at=search.best_s)
        if search.best_s > bound_s * (1 + 1e-3):
            shelves = shelf_candidates(
                ctx,
                rel,
                search.num_waves,
                heights,
                shelf_heights=options.shelf_heights,
                stack_share=options.stack_share,
                hopeless=search.cannot_win,
            )
            for cand in shelves[: options.shelf_placed]:
                search.place_once(cand, search.best_s)
        search.polish_wave()
    if ctx.cost.kv_exchange == "ulysses" or few_sequences(ctx):
        for groups in group_counts(ctx):
            for split, exact in group_splits(ctx, ctx.num_ranks // groups):
                plan = group_plan(ctx, groups, split, exact)
                if plan is not None:
                    search.consider("equal_groups", plan)
    within_caps = ctx.num_ranks <= RIVAL_RANKS and ctx.seq_lens.size <= RIVAL_SEQUENCES
    if within_caps and search.best_s > bound_s * (1 + 1e-9):
        for plan in mixed_group_plans(ctx):
            search.consider("mixed_groups", plan)
    if options.rivals and search.best_s > bound_s * (1 + 1e-9):  # none beats the bound
        for name, rival in rival_plans(ctx):
            search.consider(name, rival)
    plan = search.best_plan
    plan.predicted.update(info)
    plan.predicted["bound_s"] = bound_s
    plan.predicted["relaxation_height_s"] = rel.height_s
    return plan


def few_sequences(ctx: Context) -> bool:
    """Whether the batch has at most ``FEW_SEQUENCES`` sequences on at most ``RIVAL_RANKS``
    ranks: then equal-group plans (P2P) and FlexSP's plan are cheap beside hdp's search."""
    return ctx.seq_lens.size <= FEW_SEQUENCES and ctx.num_ranks <= RIVAL_RANKS


def cheap_flexsp(ctx: Context) -> bool:
    """Whether FlexSP's plan is cheap beside hdp's search: on at most ``FLEXSP_RIVAL_RANKS``
    ranks, where :func:`few_sequences` holds, or for at most ``RIVAL_SEQUENCES`` sequences
    where it solves its MILP at most ``FLEXSP_RIVAL_SOLVES`` times (once, and in ``wave`` sync
    where its plan has more waves than the fewest micro-batches once more for each of those:
    :mod:`hdp.planner.flexsp`, Note [FlexSP's micro-batches]). Its MILP grows with the sequences,
    not the ranks: its group sizes are the powers of two."""
    n = ctx.num_ranks
    if n <= FLEXSP_RIVAL_RANKS or few_sequences(ctx):
        return True
    solves = 1 if ctx.sync == "peer" else 1 + fewest_micro_batches(ctx)
    return ctx.seq_lens.size <= RIVAL_SEQUENCES and solves <= FLEXSP_RIVAL_SOLVES


def rival_plans(ctx: Context) -> Iterator[tuple[str, Plan]]:
    """(name, plan) of each baseline whose plan of this step is cheap to make and price
    (family 7); a baseline that cannot plan the step is left out."""
    n = ctx.num_ranks
    makers: list[tuple[str, Callable[[Context], Plan]]] = []
    cp_least = next_pow2(ctx.max_seq / max(ctx.capacity, 1))
    static_cheap = ctx.seq_lens.size * cp_least <= STATIC_RIVAL_SHARDS
    if static_cheap:
        makers.append(("static", plan_static))
    small_batch = ctx.seq_lens.size <= RIVAL_SEQUENCES and n <= SMALL_BATCH_RIVAL_RANKS
    if n <= RIVAL_RANKS or small_batch:
        makers.append(("bytescale", plan_bytescale))
        makers.append(("hybridcp", lambda c: plan_hybridcp(c, implementation="ours")))
    flexsp_cheap = cheap_flexsp(ctx)
    if flexsp_cheap:
        makers.append(("flexsp", plan_flexsp))
    mesh_cheap = flexsp_cheap or static_cheap  # (the mesh costs what the static one does)
    mesh = ("ulysses", lambda c: plan_static(c, "ulysses"))
    if ctx.cost.kv_exchange == "ulysses":  # head-parallel: the baselines whose groups split heads
        makers = ([mesh] if mesh_cheap else []) + [(k, f) for k, f in makers if k == "flexsp"]
    own = ctx  # the baselines' own plans: made for the ``rank`` exchange they run, where it may
    if ctx.any_exchange and ctx.cost.kv_exchange == "node":
        own = replace(ctx, cost=ctx.cost.with_exchange("rank"))
    runs = [(name, make, own) for name, make in makers]
    if ctx.any_exchange and ctx.cost.kv_exchange != "ulysses":
        heads = replace(ctx, cost=ctx.cost.with_exchange("ulysses"))  # as their systems run
        if flexsp_cheap:
            runs.append(("flexsp", plan_flexsp, heads))
        if mesh_cheap:
            runs.append((*mesh, heads))
    for name, make, where in runs:
        try:
            plan = make(where)
        except PlanningError:  # its layout does not fit this step: nothing to compare
            continue
        yield name, plan


def _plan_whole(ctx: Context, options: DynamicOptions) -> Plan:
    """Every sequence on one rank: only the placement balances."""
    longest = int(ctx.seq_lens.max(initial=0))
    if longest > ctx.capacity:
        raise PlanningError(
            f"hdp (whole form): a sequence of {longest} tokens does not fit one rank's "
            f"{ctx.capacity} tokens; raise the capacity or use a form that splits sequences"
        )
    degree = np.ones(ctx.seq_lens.size, dtype=np.int64)
    return place(ctx, num_waves_for(ctx), Candidate(degree, ctx.whole_s), options).plan


def candidate_heights(rel: Relaxation, sync: str, options: DynamicOptions) -> list[float]:
    """Job heights to place (family 1 of Note [The candidate families]). ``wave``: from the
    shortest the tallest job can be (every job on its fastest degree: narrow shelves, more area)
    up to ``M`` (every job on its smallest area: wide shelves), and below: there the tallest job
    stays at its fastest while the others get faster too, so they stack under it in fewer,
    fuller waves."""
    if sync == "peer" or not rel.menus:
        return [rel.height_s * f for f in options.height_factors]
    floor = max(float(mu.height.min()) for mu in rel.menus)
    top = max(floor, rel.height_s)
    shelves = [float(h) for h in np.geomspace(floor, top, 4)] if top > floor * 1.01 else [floor]
    return [floor * 0.25, floor * 0.5] + shelves


def degree_candidates(
    ctx: Context, rel: Relaxation, heights: list[float], options: DynamicOptions
) -> tuple[list[Candidate], dict[str, float]]:
    """Families 1-3 of Note [The candidate families], and what the MILP reports."""
    cands = [Candidate(*rel.degrees_at(h, ctx.whole_s), height_s=h) for h in heights]
    num_waves = num_waves_for(ctx)
    if ctx.sync == "wave" and num_waves > 1:
        slots = ctx.num_ranks * num_waves
        per_wave = relaxation_bound(ctx.cost, ctx.seq_lens, ctx.sync, ctx.capacity, slots)
        cands += [
            Candidate(*per_wave.degrees_at(per_wave.height_s * f, ctx.whole_s))
            for f in options.height_factors
        ]
    info: dict[str, float] = {}
    use_ilp = options.use_ilp
    if use_ilp or (use_ilp is None and milp.fits_budget(rel, ctx.num_ranks)):
        warm = Jobs(cands[0].degree, cands[0].job_time)
        choice = milp.solve_degrees(
            rel, ctx.cost, ctx.sync, ctx.num_ranks, warm, time_limit_s=options.ilp_time_limit_s
        )
        info.update(choice.info)
        if choice.degrees is not None:
            cands.insert(0, Candidate(choice.degrees, choice.job_time))
    return cands, info


def best_height_variants(
    ctx: Context, rel: Relaxation, height: float, options: DynamicOptions
) -> list[Candidate]:
    """Family 4 of Note [The candidate families]: token-capped degrees, then two tiers."""
    cands = [
        Candidate(*rel.degrees_at(height, ctx.whole_s, int(share * ctx.offload_capacity)))
        for share in options.token_shares
    ]
    cheap = options.cheap_wave_share
    return cands + [Candidate(*rel.degrees_at(height, ctx.whole_s), cheap_share=cheap)]
