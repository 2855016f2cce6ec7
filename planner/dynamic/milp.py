"""The malleable-job MILP of DESIGN.md, with pulp: one degree per long sequence.

Sequences of equal length form a bucket ``b`` (``c_b`` sequences) with the priced menu of
:func:`hdp.planner.menus.length_menus` (degree ``k``: height ``h_bk`` s, area ``a_bk`` rank-s)::

    minimise    M + eps * (sum_bk a_bk n_bk) / slots
    subject to  sum_k n_bk = c_b                     every sequence gets one degree
                n_bk <= c_b * y_bk                   y_bk = 1 where degree k is used
                h_bk * y_bk <= M                     every used degree within the height
                A_short + sum_bk a_bk n_bk <= slots * M
                M >= h_short                          the tallest unsplit sequence
                n_bk integer >= 0, y_bk binary

``slots`` is the ranks (``peer``) or ranks x waves (``wave``). The sweep of
:func:`hdp.planner.degrees.relaxation_bound` solves this exactly when every bucket holds one
sequence; the MILP also handles buckets of many equal lengths (synthetic and bucketed corpora)
and verifies the sweep. Its LP relaxation (``lp_bound_s``) is weaker than the sweep's bound, which
stays the reported one.

Solver: HiGHS (``highspy``) where installed, else the CBC that pulp bundles; one thread, a node
limit (deterministic: a time limit alone would let two runs disagree) and a time limit as a
safety net. The warm start (the sweep's degrees) bounds the objective (HiGHS) or is the initial
solution (CBC). On failure or timeout: a warning, and the caller keeps the heuristic.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hdp import CostModel

from ..degrees import Jobs, Relaxation, packed_time
from ..solver import NODE_LIMIT, make_solver, solver_name


@dataclass
class IlpChoice:
    """The MILP's degrees (``None`` where it failed) and what to report."""

    degrees: np.ndarray | None
    job_time: np.ndarray | None
    info: dict[str, float] = field(default_factory=dict)


def repeats(rel: Relaxation) -> bool:
    """Whether two sequences that may split share a length: only then can the MILP choose
    better than the sweep, which is exact for distinct lengths."""
    lens = rel.seq_lens[rel.long_ids]
    return np.unique(lens).size < lens.size


def count_variables(rel: Relaxation) -> int:
    """How many count variables the MILP of ``rel`` has: a menu entry of each bucket."""
    lens = rel.seq_lens[rel.long_ids].tolist()
    first = {L: mu for L, mu in zip(lens, rel.menus)}
    return sum(mu.degrees.size for mu in first.values())


@dataclass
class _Milp:
    """The MILP of one batch: the problem, its height ``M``, the count variable of each (bucket,
    menu entry), and each bucket's members (indices into ``rel.long_ids``) by length."""

    prob: Any
    height: Any
    counts: dict[tuple[int, int], Any]
    buckets: list[list[int]]


def solve_degrees(
    rel: Relaxation,
    cost: CostModel,
    sync: str,
    slots: int,
    warm: Jobs,
    time_limit_s: float = 2.0,
    solver: str | None = None,
    eps: float = 1e-4,
) -> IlpChoice:
    """Solve the MILP (module docstring) for the long sequences of ``rel``, starting from the
    degrees ``warm`` (whose busy times also price the sequences that stay whole)."""
    import pulp

    name = solver or solver_name()
    milp = _build(rel, cost, sync, slots, warm.degree, eps)
    info: dict[str, float] = {
        "ilp_variables": float(2 * len(milp.counts)),
        "ilp_solver_highs": float(name == "highs"),
    }
    try:
        if pulp.LpStatus[milp.prob.solve(make_solver(name, time_limit_s, mip=False))] == "Optimal":
            info["lp_bound_s"] = float(milp.height.value())
        status = milp.prob.solve(make_solver(name, time_limit_s))
    except Exception as e:  # solver missing, crashed, or refused the model
        return _failed(info, f"the MILP solver ({name}) failed ({e})")
    if pulp.LpStatus[status] != "Optimal" or milp.height.value() is None:
        return _failed(
            info,
            f"the MILP ({name}) ended '{pulp.LpStatus[status]}' within {time_limit_s:.1f} s / "
            f"{NODE_LIMIT} nodes",
        )
    info["ilp_objective_s"] = float(milp.height.value())
    return IlpChoice(*_solution(rel, milp, warm), info)


def _failed(info: dict[str, float], why: str) -> IlpChoice:
    warnings.warn(f"hdp: {why}; keeping the heuristic's degrees", RuntimeWarning, stacklevel=3)
    info["ilp_failed"] = 1.0
    return IlpChoice(None, None, info)


def _build(
    rel: Relaxation, cost: CostModel, sync: str, slots: int, warm: np.ndarray, eps: float
) -> _Milp:
    """The MILP over length buckets, each count variable warm-started from ``warm``."""
    import pulp

    lens = rel.seq_lens
    by_length: dict[int, list[int]] = {}
    for j, L in enumerate(lens[rel.long_ids].tolist()):
        by_length.setdefault(int(L), []).append(j)  # j indexes rel.long_ids / rel.menus
    buckets = [by_length[L] for L in sorted(by_length)]
    short = np.ones(lens.size, dtype=bool)
    short[rel.long_ids] = False
    packed = packed_time(cost, lens, cost.offload_capacity(sync))
    prob = pulp.LpProblem("hdp_degrees", pulp.LpMinimize)
    M = prob.add_variable("M", lowBound=float(packed[short].max(initial=0.0)))
    counts: dict[tuple[int, int], Any] = {}
    area_terms = []
    for b, members in enumerate(buckets):
        mu = rel.menus[members[0]]
        c = len(members)
        warm_counts: dict[int, int] = {}
        for j in members:
            d = int(warm[rel.long_ids[j]])
            warm_counts[d] = warm_counts.get(d, 0) + 1
        row = []
        for k, (d, h, a) in enumerate(
            zip(mu.degrees.tolist(), mu.height.tolist(), mu.area.tolist())
        ):
            n = prob.add_variable(f"n_{b}_{k}", lowBound=0, upBound=c, cat="Integer")
            y = prob.add_variable(f"y_{b}_{k}", cat="Binary")
            n.setInitialValue(warm_counts.get(d, 0))
            y.setInitialValue(1 if warm_counts.get(d, 0) else 0)
            prob += n <= c * y
            prob += h * y <= M
            counts[(b, k)] = n
            row.append(n)
            area_terms.append(a * n)
        prob += pulp.lpSum(row) == c
    prob += float(packed[short].sum()) + pulp.lpSum(area_terms) <= slots * M
    prob += M + eps * (pulp.lpSum(area_terms) / slots)
    return _Milp(prob, M, counts, buckets)


def _solution(rel: Relaxation, milp: _Milp, warm: Jobs) -> Jobs:
    """Every sequence's degree and busy time from the solved counts (``warm`` for the rest)."""
    degrees = np.asarray(warm.degree, dtype=np.int64).copy()
    job_time = np.array(warm.job_time, dtype=np.float64)
    for b, members in enumerate(milp.buckets):
        mu = rel.menus[members[0]]
        assigned: list[int] = []
        for k in range(mu.degrees.size):
            assigned += [k] * int(round(milp.counts[(b, k)].value() or 0))
        # Larger degrees to the first members (equal lengths: any order is the same job).
        for j, k in zip(members, sorted(assigned, reverse=True)):
            degrees[rel.long_ids[j]] = mu.degrees[k]
            job_time[rel.long_ids[j]] = mu.height[k]
    return Jobs(degrees, job_time)
