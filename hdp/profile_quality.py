"""How far a measured profile can be trusted: the repeat rule of ``hdp-calibrate measure``, the
noise it records in the profile, and the self-consistency check a profile file passes before it
prices a plan (:func:`hdp.profile.read_profile_json`: ``GPUProfile.load``, so every
``--gpu-profile``).

Note [Repeating a row until its spread is small]
------------------------------------------------
Each row (one kernel call at one size) is timed after warm-up, one repeat at a time. Its *spread*
is the relative gap between the fastest and the k-th fastest repeat, ``t_(k) / t_(1) - 1`` with
``k = SPREAD_K = 3``. Repeating stops once at least ``min_repeats`` (>= k) are timed and the spread
is at most the target (``SPREAD_TARGET``, 5%); else once the repeats add up to the row's time
limit and number at least ``min_repeats + 2`` (so that a slow row, whose time limit comes after
three repeats, can still drop two disturbed ones); else at ``max_repeats``. The row's time is the
median of its k fastest repeats.

Why the fastest: another process on the host only ever adds time to a repeat, so the fastest
repeats are those the device ran undisturbed; the more repeats a disturbed row gets, the likelier
k of them ran undisturbed, and the spread falls. A row that still has a large spread at its time
limit was disturbed throughout (or the kernel itself varies): its time is uncertain by about its
spread, and the profile records it.

Worked example (milliseconds, target 5%): repeats 10.0, 15.0, 12.0: the fastest three span
12 / 10 - 1 = 50%, repeat; 10.1: fastest three 10.0, 10.1, 12.0, spread 20%, repeat; 10.2:
fastest three 10.0, 10.1, 10.2, spread 2%: stop. The row's time is 10.1 ms, its spread 0.02.

Note [Rows that disagree]
-------------------------
Rows of one kernel that differ in one size only (a GEMM shape over tokens; a causal attention
shape over document length, per document; a full block over its queries, and over its keys; a
memory-bound op over tokens; the optimizer over parameters; a collective over bytes) are compared
with their neighbour of the next smaller size. The larger call does more work, so it may neither
take less than ``1 / DISAGREEMENT_FACTOR`` of its neighbour's time nor run at less than
``1 / DISAGREEMENT_FACTOR`` of its neighbour's rate (work per second). Besides, the fastest GEMM
row must reach at least ``1 / PEAK_FACTOR`` of ``peak_flops`` and at most ``PEAK_OVERSHOOT``
times it, and no row may have a recorded spread above ``SPREAD_LIMIT``. Every shipped profile
passes; a profile measured while other processes took the host's CPUs for some rows and not
others fails, and a planner would otherwise price its kernels several times apart.

Worked example (factor 3): GEMM rows of shape 64 x 512 at 1,024 tokens in 2.9 ms (68.7
GFLOP/s) and at 2,048 tokens in 19.8 ms (20.3 GFLOP/s): the larger runs at 0.30x its
neighbour's rate, below 1/3: the two rows disagree. At 2,048 tokens in 7.9 ms (50.8 GFLOP/s,
0.74x) they agree: a larger GEMM may leave a CPU's caches and run somewhat slower.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

SPREAD_K = 3
SPREAD_TARGET = 0.05  # what measuring aims for; rows above it are named at the end of measure
SPREAD_LIMIT = 0.25  # a row above it is refused by the check
DISAGREEMENT_FACTOR = 3.0
PEAK_FACTOR = 10.0  # the fastest GEMM row may run this far below peak_flops (small shapes)
PEAK_OVERSHOOT = 1.1  # ... and this far above it (the peak rounded, or a row timed short)
FORCE_ENV = "HDP_FORCE_PROFILE"


def spread(times: Sequence[float], k: int = SPREAD_K) -> float:
    """``t_(k) / t_(1) - 1`` of the fastest ``k`` of ``times`` (all of them where fewer); 0 for
    one time (Note [Repeating a row until its spread is small])."""
    fastest = sorted(times)[:k]
    return fastest[-1] / fastest[0] - 1.0 if fastest and fastest[0] > 0 else 0.0


def typical(times: Sequence[float], k: int = SPREAD_K) -> float:
    """The median of the fastest ``k`` of ``times``: a row's time."""
    return float(np.median(sorted(times)[:k]))


@dataclass(frozen=True)
class RepeatRule:
    """When to stop repeating one row (Note [Repeating a row until its spread is small])."""

    limit_s: float  # a noisy row stops once its repeats add up to this (and min_repeats + 2)
    min_repeats: int = SPREAD_K
    max_repeats: int = 100
    target: float = SPREAD_TARGET
    k: int = SPREAD_K

    def __post_init__(self) -> None:
        if not self.k <= self.min_repeats <= self.max_repeats:
            raise ValueError(f"a repeat rule needs k <= min_repeats <= max_repeats, got {self}")

    def finished(self, times: Sequence[float]) -> bool:
        """Whether ``times`` (the repeats so far) are enough."""
        if len(times) < self.min_repeats:
            return False
        if spread(times, self.k) <= self.target or len(times) >= self.max_repeats:
            return True
        return sum(times) >= self.limit_s and len(times) >= self.min_repeats + 2

    def to_json(self) -> dict[str, float]:
        """The rule as a profile's ``measurement`` object records it."""
        return {
            "spread_k": self.k,
            "spread_target": self.target,
            "row_limit_s": self.limit_s,
            "min_repeats": self.min_repeats,
            "max_repeats": self.max_repeats,
        }


def load_average() -> tuple[float, float, float]:
    """The host's 1, 5 and 15-minute load averages (zeros where the system has none)."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)
    return (round(one, 2), round(five, 2), round(fifteen, 2))


@dataclass(frozen=True)
class Measurement:
    """How a profile was measured (its ``measurement`` object): the host's CPUs and load averages
    before and after, the repeat rule and every table row's spread, in row order."""

    cpus: int
    load_before: tuple[float, ...]
    load_after: tuple[float, ...]
    rule: dict[str, float] = field(default_factory=dict)
    spread: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def target(self) -> float:
        return float(self.rule.get("spread_target", SPREAD_TARGET))

    @property
    def peak_load(self) -> float:
        """The higher 1-minute load average, before or after."""
        return max(self.load_before[:1] + self.load_after[:1], default=0.0)

    @property
    def busy(self) -> bool:
        """Whether more processes wanted a CPU than the host has (the load average counts the
        ones running and the ones waiting for a CPU, the measuring process included)."""
        return self.peak_load > self.cpus

    def rows_above(self, bound: float) -> dict[str, list[int]]:
        """Per table, the indices of the rows whose spread is above ``bound``."""
        out = {t: [i for i, s in enumerate(v) if s > bound] for t, v in self.spread.items()}
        return {t: rows for t, rows in out.items() if rows}

    def to_json(self) -> dict:
        return {
            "cpus": self.cpus,
            "load_before": list(self.load_before),
            "load_after": list(self.load_after),
            **self.rule,
            "spread": {t: list(v) for t, v in self.spread.items()},
        }

    @classmethod
    def from_json(cls, data: object, rows: Mapping[str, int]) -> Measurement:
        """The ``measurement`` object of a profile whose tables have ``rows[table]`` rows;
        ``ValueError`` saying what is wrong otherwise."""
        if not isinstance(data, dict):
            raise ValueError("measurement must be a JSON object")
        loads = [data.get("load_before", []), data.get("load_after", [])]
        if not all(isinstance(v, list) and all(_number(x) for x in v) for v in loads):
            raise ValueError("measurement.load_before and load_after must be lists of numbers")
        cpus = data.get("cpus", 0)
        if not (isinstance(cpus, int) and cpus >= 0):
            raise ValueError(f"measurement.cpus must be a whole number >= 0, got {cpus!r}")
        spreads = data.get("spread", {})
        if not isinstance(spreads, dict):
            raise ValueError("measurement.spread must be an object of lists, one per table")
        for table, values in spreads.items():
            if table not in rows:
                raise ValueError(f"measurement.spread names no table of the profile: {table!r}")
            if not (isinstance(values, list) and all(_number(x) for x in values)):
                raise ValueError(f"measurement.spread.{table} must be a list of numbers >= 0")
            if len(values) != rows[table]:
                raise ValueError(
                    f"measurement.spread.{table} has {len(values)} values for {rows[table]} rows "
                    "(one per row, in order): remeasure, or delete the measurement object"
                )
        rule = {k: v for k, v in data.items() if k not in _NOT_RULE and _number(v)}
        return cls(
            cpus,
            tuple(float(x) for x in loads[0]),
            tuple(float(x) for x in loads[1]),
            rule,
            {t: tuple(float(x) for x in v) for t, v in spreads.items()},
        )


_NOT_RULE = ("cpus", "load_before", "load_after", "spread")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


# ----------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class Disagreement:
    """Rows of a profile that disagree (Note [Rows that disagree]): which, and how."""

    rows: str
    why: str

    def __str__(self) -> str:
        return f"{self.rows}: {self.why}"


@dataclass(frozen=True)
class _Point:
    size: float
    seconds: float  # of one call, or per document
    work: float
    label: str


def _g(x: float) -> str:
    """A size as a row holds it: whole numbers in full."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _series(tables: Mapping[str, Sequence[Sequence]]) -> list[list[_Point]]:
    """The rows grouped into kernels that differ in one size only, each sorted by it (then time)."""
    groups: dict[tuple, list[_Point]] = {}

    def add(key: tuple, size: float, seconds: float, work: float, label: str) -> None:
        groups.setdefault(key, []).append(_Point(float(size), float(seconds), float(work), label))

    for backend, kind, h, kv, d, a, b, s in tables.get("attention", ()):
        label = f"attention {backend} {kind} {h}/{kv}x{d} a={_g(a)} b={_g(b)}"
        shape = ("attention", backend, kind, h, kv, d)
        if kind == "causal":  # per document: b documents of a tokens
            add(shape, a, s / b, a * (a + 1) / 2 * h * d, label)
        else:
            add((*shape, "queries", a), b, s, a * b * h * d, label)
            add((*shape, "keys", b), a, s, a * b * h * d, label)
    for t, n_in, n_out, s in tables.get("gemm", ()):
        add(
            ("gemm", n_in, n_out),
            t,
            s,
            6 * t * n_in * n_out,
            f"gemm {_g(t)}x{_g(n_in)}x{_g(n_out)}",
        )
    for op, width, t, s in tables.get("memory_bound", ()):
        add(("memory_bound", op, width), t, s, width * t, f"{op} {_g(t)}x{_g(width)}")
    for params, s in tables.get("optimizer", ()):
        add(("optimizer",), params, s, params, f"optimizer {_g(params)} params")
    for op, ranks, nbytes, s in tables.get("collective", ()):
        add(("collective", op, ranks), nbytes, s, nbytes, f"{op} {_g(ranks)} ranks {_g(nbytes)} B")
    return [sorted(g, key=lambda p: (p.size, p.seconds)) for g in groups.values()]


def _neighbours(tables: Mapping[str, Sequence[Sequence]], factor: float) -> list[Disagreement]:
    found = []
    for series in _series(tables):
        for small, large in zip(series, series[1:]):
            time_ratio = large.seconds / small.seconds
            rate_ratio = (large.work / large.seconds) / (small.work / small.seconds)
            rows = f"{large.label} against {small.label}"
            if time_ratio < 1 / factor:
                why = f"more work in {time_ratio:.2g}x the time (bound 1/{factor:g})"
                found.append(Disagreement(rows, why))
            elif rate_ratio < 1 / factor:
                why = f"{rate_ratio:.2g}x the rate (bound 1/{factor:g})"
                found.append(Disagreement(rows, why))
    return found


def _peak(gemm: Sequence[Sequence], peak_flops: float | None) -> list[Disagreement]:
    if not gemm or not peak_flops:
        return []
    rate, t, n_in, n_out = max((6 * t * i * o / s, t, i, o) for t, i, o, s in gemm)
    share = rate / peak_flops
    if 1 / PEAK_FACTOR <= share <= PEAK_OVERSHOOT:
        return []
    bound = f"1/{PEAK_FACTOR:g}" if share < 1 else f"{PEAK_OVERSHOOT:g}"
    rows = f"gemm {_g(t)}x{_g(n_in)}x{_g(n_out)} (the fastest) against peak_flops {peak_flops:.3g}"
    return [Disagreement(rows, f"{share:.2g}x the peak (bound {bound})")]


def _spread(tables: Mapping[str, Sequence[Sequence]], m: Measurement | None) -> list[Disagreement]:
    if m is None:
        return []
    found = []
    for table, indices in m.rows_above(SPREAD_LIMIT).items():
        for i in indices:
            why = f"spread {m.spread[table][i]:.0%} (bound {SPREAD_LIMIT:.0%})"
            found.append(Disagreement(_row_label(table, tables[table][i]), why))
    return found


def _row_label(table: str, row: Sequence) -> str:
    """The label :func:`_series` gives ``row`` of ``table``."""
    series = _series({table: [row]})
    return series[0][0].label


def disagreements(
    tables: Mapping[str, Sequence[Sequence]],
    peak_flops: float | None = None,
    measurement: Measurement | None = None,
    factor: float = DISAGREEMENT_FACTOR,
) -> list[Disagreement]:
    """The rows of a profile that disagree with each other, with its peak, or with their own
    repeats (Note [Rows that disagree]); empty where none do. ``tables``: rows by table name, as
    ``hdp.profile.TABLE_COLUMNS`` orders them."""
    return (
        _neighbours(tables, factor)
        + _peak(tables.get("gemm", ()), peak_flops)
        + _spread(tables, measurement)
    )


def forced(force: bool = False) -> bool:
    """``force``, or ``HDP_FORCE_PROFILE`` set to something other than empty or 0."""
    return force or os.environ.get(FORCE_ENV, "").strip() not in ("", "0")


def refusal(where: str, found: Sequence[Disagreement], shown: int = 1) -> str:
    """One line refusing the profile at ``where`` for ``found``, and what to do."""
    listed = "; ".join(str(d) for d in found[:shown])
    more = f" (and {len(found) - shown} more)" if len(found) > shown else ""
    return (
        f"{where}: rows of this profile disagree ({listed}{more}), so it would misprice plans; "
        f"measure it again on an idle machine (hdp-calibrate measure), list them all with "
        f"hdp-calibrate check {where}, or set {FORCE_ENV}=1 to plan with it anyway"
    )


def measurement_warnings(
    m: Measurement | None, found: Sequence[Disagreement], where: str
) -> list[str]:
    """Lines warning of a busy host, of rows whose spread stayed above the target and of rows
    that disagree (``found``), then what to do; none where all is well. ``where``: the
    profile's path."""
    lines = []
    if m is not None and m.busy:
        lines.append(
            f"the host was busy: load average {m.peak_load:.1f} on {m.cpus} CPUs (more "
            "processes wanted a CPU than there are), so rows ran slower than on an idle host, "
            "some more than others"
        )
    noisy = m.rows_above(m.target) if m is not None else {}
    if m is not None and noisy:
        count, total = sum(map(len, noisy.values())), sum(map(len, m.spread.values()))
        worst = max(s for v in m.spread.values() for s in v)
        by_table = ", ".join(f"{t} {len(v)}" for t, v in noisy.items())
        lines.append(
            f"{count} of {total} rows ({by_table}) kept a spread above {m.target:.0%} within "
            f"their time limit (worst {worst:.0%}): their times are uncertain by about as much"
        )
    if found:
        lines.append(
            f"{_count(len(found), 'consistency check')} failed (first: {found[0]}): "
            f"hdp-sim, hdp-plan and hdp-train will refuse this profile unless {FORCE_ENV}=1"
        )
    if lines:
        lines.append(
            "measure again on an idle machine (uptime shows the load); hdp-calibrate check "
            f"{where} lists what disagrees; to plan with this profile anyway set {FORCE_ENV}=1"
        )
    return lines


__all__ = [
    "DISAGREEMENT_FACTOR",
    "FORCE_ENV",
    "SPREAD_LIMIT",
    "SPREAD_TARGET",
    "Disagreement",
    "Measurement",
    "RepeatRule",
    "disagreements",
    "forced",
    "load_average",
    "measurement_warnings",
    "refusal",
    "spread",
    "typical",
]
