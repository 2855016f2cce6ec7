"""``hdp-calibrate check``: whether a profile's rows agree with each other, and how well it prices a
table of measured kernel times.

First the profile's own rows are checked against each other, its peak and their recorded spread
(Note [Rows that disagree] in :mod:`hdp.profile_quality`), and how it was measured (host load,
spreads) is printed; a profile that fails is refused unless ``--force``, as planning refuses it.

Then, with ``--table``: the table has the columns of ``hdp/data/measured/h100_measured.csv``:
``kind`` (``attn_doc``: ``b`` causal documents of ``a`` tokens in one call; ``attn_shard``: ``a``
queries against ``b`` earlier keys; ``gemm``: ``[a x b] @ [b x c]``), ``heads``, ``kv_heads``,
``head_dim``, ``a``, ``b``, ``c``, ``ms`` (forward + backward) and optionally ``backend``
(``torch_flash`` where absent). Each row is priced by the profile; the errors are reported over
the step-relevant rows (attention calls of at least 512 query tokens, GEMMs of at least 1K
tokens). Where the profile holds the row itself, the row is also priced by the profile without it
(leave-one-out): how well the tables generalise to calls between their measurements.
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hdp.profile import (
    TABLE_COLUMNS,
    KernelTables,
    ProfileError,
    backend_name,
    check_profile,
    measurement_of,
    read_profile_json,
)
from hdp.profile_quality import (
    DISAGREEMENT_FACTOR,
    FORCE_ENV,
    SPREAD_LIMIT,
    Disagreement,
    Measurement,
    measurement_warnings,
)
from hdp.specs import GPU_PRESETS, GPUProfile, gpu_profile, plural

STEP_RELEVANT_QUERIES = 512
STEP_RELEVANT_TOKENS = 1024


@dataclass(frozen=True)
class Row:
    """One measured call: its kind, shape, backend and forward + backward seconds."""

    kind: str
    heads: int
    head_dim: int
    a: int
    b: int
    c: int
    backend: str
    seconds: float

    @property
    def step_relevant(self) -> bool:
        limit = STEP_RELEVANT_TOKENS if self.kind == "gemm" else STEP_RELEVANT_QUERIES
        return self.a >= limit

    def price(self, tables: KernelTables) -> float:
        if self.kind == "gemm":
            return float(tables.gemm_time(self.a, self.b, self.c))
        if self.kind == "attn_doc":
            per_doc = tables.causal_time(self.a, self.heads, self.head_dim, self.backend)
            return float(per_doc) * self.b
        return float(tables.full_time(self.a, self.b, self.heads, self.head_dim, self.backend))

    def profile_index(self, tables: KernelTables) -> tuple[str, int] | None:
        """(table, index) of this very measurement in ``tables``, if they hold it."""
        if self.kind == "gemm":
            rows, key = tables.gemm, (self.a, self.b, self.c)
            found = [i for i, r in enumerate(rows) if tuple(r[:3]) == key]
            return ("gemm", found[0]) if found else None
        kind = "causal" if self.kind == "attn_doc" else "full"
        key = (self.backend, kind, self.heads, self.head_dim, self.a, self.b)
        for i, r in enumerate(tables.attention):
            if (r[0], r[1], r[2], r[4], r[5], r[6]) == key:
                return ("attention", i)
        return None


COLUMNS = ("kind", "heads", "head_dim", "a", "b", "c", "ms")
KINDS = ("attn_doc", "attn_shard", "gemm")


# The largest dimension a row may hold: tokens of a step or a sequence (MAX_TOKENS), past any
# head count, head size or width of a model.
_LARGEST = 1 << 36


def _field(path: Path, line: int, record: dict, column: str, low: float) -> float:
    """``record[column]``: a time above 0 (``ms``) or a whole number in ``[low, 2^36]``; else
    one error naming the file, line and column."""
    text = record.get(column)
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    time = column == "ms"
    whole = low <= value <= _LARGEST and value == int(value) if np.isfinite(value) else False
    if not (np.isfinite(value) and (value > 0 if time else whole)):
        what = (
            "a finite time above 0 ms"
            if time
            else f"a whole number from {int(low)} to {_LARGEST:,}"
        )
        raise ProfileError(f"{path}, line {line}, column {column}: expected {what}, got {text!r}")
    return value


def read_table(path: str | Path) -> list[Row]:
    """The rows of a measured table; one clear error naming the file, line and column."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the table: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a text CSV file") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ProfileError(
            f"{path}, line 1: the header lacks column {', '.join(missing)} (expected "
            f"{','.join(COLUMNS)}[,backend])"
        )
    rows = []
    for line, r in enumerate(reader, start=2):
        if r["kind"] not in KINDS:
            raise ProfileError(
                f"{path}, line {line}, column kind: {r['kind']!r} is not one of {', '.join(KINDS)}"
            )
        # A GEMM has no heads (0 in the tables) and multiplies by c >= 1; an attention call has
        # heads, and b >= 1 documents (attn_doc) or keys before its queries (attn_shard).
        gemm = r["kind"] == "gemm"
        rows.append(
            Row(
                kind=r["kind"],
                heads=int(_field(path, line, r, "heads", 0 if gemm else 1)),
                head_dim=int(_field(path, line, r, "head_dim", 0 if gemm else 1)),
                a=int(_field(path, line, r, "a", 1)),
                b=int(_field(path, line, r, "b", 1)),
                c=int(_field(path, line, r, "c", 1 if gemm else 0)),
                backend=backend_name(r.get("backend") or "torch_flash"),
                seconds=_field(path, line, r, "ms", 0) / 1e3,
            )
        )
    if not rows:
        raise ProfileError(f"{path}: no rows below the header")
    return rows


def _summary(errors: list[float]) -> tuple[float, float]:
    e = np.abs(np.asarray(errors, dtype=np.float64))
    return (float(np.median(e)), float(e.max())) if e.size else (float("nan"), float("nan"))


def check(profile: GPUProfile, rows: list[Row], out=None) -> dict[str, float]:
    """Print every row's predicted / measured time (to ``out``, default stdout) and return the
    summary of the errors."""
    out = out or sys.stdout
    tables = profile.tables
    errors, loo = [], []
    for row in rows:
        try:
            predicted = row.price(tables)
        except ProfileError as e:
            print(f"{row.kind} {row.backend}: {e}", file=out)
            continue
        err = predicted / row.seconds - 1.0
        where = row.profile_index(tables)
        loo_err = row.price(tables.without(*where)) / row.seconds - 1.0 if where else None
        if row.step_relevant:
            errors.append(err)
            if loo_err is not None:
                loo.append(loo_err)
        print(
            f"{row.kind:10s} {row.backend:9s} heads {row.heads:3d} hd {row.head_dim:3d} "
            f"{row.a:7d} {row.b:7d} {row.c:6d}  measured {row.seconds * 1e3:9.3f} ms  "
            f"predicted {predicted * 1e3:9.3f} ms  err {err:+7.1%}"
            + (f"  leave-one-out {loo_err:+7.1%}" if loo_err is not None else ""),
            file=out,
        )
    median, worst = _summary(errors)
    summary = {"rows": len(errors), "median_rel_err": median, "max_rel_err": worst}
    if loo:
        summary["loo_median_rel_err"], summary["loo_max_rel_err"] = _summary(loo)
    return summary


def read_profile(name: str) -> tuple[GPUProfile, dict[str, Any]]:
    """The profile ``name`` (a preset, or a JSON file read even where its rows disagree: this is
    where they are reported) and its JSON object."""
    path = Path(name)
    if name in GPU_PRESETS or not (path.suffix == ".json" or path.exists()):
        profile = gpu_profile(name)  # a preset, or ValueError naming the presets
        return profile, profile.to_json()
    data = read_profile_json(path, force=True)
    return GPUProfile.from_json(data, str(path)), data


def report_consistency(
    name: str, found: list[Disagreement], m: Measurement | None, out=None
) -> None:
    """Print how the profile ``name`` was measured (``m``) and which of its rows disagree
    (``found``, from :func:`hdp.profile.check_profile`) to ``out`` (default stdout)."""
    out = out or sys.stdout
    if m is None:
        print(f"{name}: no measurement record (host load, spreads): rows checked alone", file=out)
    else:
        spreads = _spreads(m)
        print(
            f"{name}: measured with load average {_load(m.load_before)} before and "
            f"{_load(m.load_after)} after on {m.cpus} CPUs; spread of {len(spreads)} rows: "
            f"largest {max(spreads, default=0):.1%}, {sum(s > m.target for s in spreads)} above "
            f"the {m.target:.0%} target",
            file=out,
        )
        for line in measurement_warnings(m, [], name)[:-1]:  # the advice comes below
            print(f"warning: {line}", file=out)
    for d in found:
        print(f"disagree: {d}", file=out)
    print(
        f"{name}: {plural(len(found), 'disagreement')} (bounds: a factor of "
        f"{DISAGREEMENT_FACTOR:g} between neighbouring rows, spread {SPREAD_LIMIT:.0%})",
        file=out,
    )


def check_main(args) -> int:
    """``hdp-calibrate check PROFILE [--table CSV] [--backend NAME] [--force]``; the last line
    printed is the JSON summary. Bad input prints nothing on stdout."""
    try:
        profile, data = read_profile(args.profile)
        found = check_profile(data, args.profile)
        m = measurement_of(data, profile.tables, args.profile)
        rows = _table_rows(args) if args.table else None
    except (ProfileError, ValueError) as e:
        print(f"hdp-calibrate: error: {e}", file=sys.stderr)
        return 2
    report_consistency(args.profile, found, m)
    if found and not args.force:
        print(
            f"hdp-calibrate: error: {args.profile}: {plural(len(found), 'disagreement')} "
            "(listed above): measure it again on an idle machine, or pass --force to go on "
            f"(planning with it needs {FORCE_ENV}=1)",
            file=sys.stderr,
        )
        return 1
    if rows is None:
        spreads = _spreads(m) if m is not None else []
        table_rows = sum(len(getattr(profile.tables, t)) for t in TABLE_COLUMNS)
        summary = {"disagreements": len(found), "table_rows": table_rows}
        print(json.dumps({**summary, "max_spread": max(spreads, default=None)}))
        return 0
    summary = check(profile, rows)
    print(json.dumps({**summary, "disagreements": len(found)}))
    if not summary["rows"]:
        print(
            f"hdp-calibrate: error: {args.table} has no step-relevant rows (attention of at "
            f"least {STEP_RELEVANT_QUERIES} queries, GEMMs of at least {STEP_RELEVANT_TOKENS} "
            "tokens): nothing to summarise",
            file=sys.stderr,
        )
        return 1
    return 0


def _table_rows(args) -> list[Row]:
    """The rows of ``--table``, those of ``--backend`` alone where it is given; ValueError where
    the table has no attention rows of that backend."""
    rows = read_table(args.table)
    if not args.backend:
        return rows
    backend = backend_name(args.backend)
    backends = sorted({r.backend for r in rows if r.kind != "gemm"})
    if backend not in backends:
        raise ValueError(
            f"--backend {backend}: {args.table} has attention rows of "
            f"{', '.join(backends) or 'no backend'}"
        )
    return [r for r in rows if r.kind == "gemm" or r.backend == backend]


def _spreads(m: Measurement) -> list[float]:
    return [s for values in m.spread.values() for s in values]


def _load(load: tuple[float, ...]) -> str:
    """The 1-minute load average, or ``unknown``."""
    return f"{load[0]:.2f}" if load else "unknown"
