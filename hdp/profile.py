"""Measured kernel tables of one device, and the times they imply for calls never measured.

A profile (``hdp.profile/1`` JSON, see docs/cost_model.md) holds, besides peak figures and
links, tables of measured forward + backward times: attention calls, GEMMs, memory-bound ops,
the optimizer step and collectives. :class:`KernelTables` turns them into times for any call.
A measured profile also holds an optional ``measurement`` object (how noisy each row was, how
busy the host: :mod:`hdp.profile_quality`); :func:`read_profile_json` refuses a profile whose rows
disagree with each other.

Note [Interpolating measured kernels]
-------------------------------------
Times are interpolated as *rates* (work per second) in log space, and clamped flat outside the
measured range, so a call between two measured sizes runs at a rate between theirs.

- Attention work is ``pairs x heads x head_dim``: a causal document of ``L`` tokens has
  ``L (L + 1) / 2`` query-key pairs, a full block ``q x k``. A causal call is priced by its
  documents' length; a full block by ``(q, k)``, bilinearly over the measured grid. More heads
  than the table's give the kernel more parallel tiles, as more query tokens would, so a full
  block of ``q`` queries and ``H`` heads is looked up at ``q H / H_table`` queries. Other head
  dimensions interpolate between the measured ones. Documents shorter than the shortest
  measured take as long as it (one tile). Below the smallest measured block the rate falls
  along the slope of the two smallest (in log space, between flat and proportional to the
  size), and a block of fewer queries than one tile takes as long as a tile: a small block
  leaves the kernel's tiles idle, it does not run at a long block's rate.
- A GEMM's work is ``6 tokens x in x out`` (forward and both backward products). A measured
  shape's rate is interpolated over tokens; fewer tokens than measured take as long as the
  fewest. Other shapes average the measured shapes' rates, weighted by inverse squared distance
  in ``(log in, log out)``.
- Memory-bound ops, the optimizer step and collectives are linear in their size: a fixed cost
  plus a per-element (per-parameter, per-byte) cost, fitted by least squares to the rows.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .profile_quality import Disagreement, Measurement, disagreements, forced, refusal

# The attention kernels, in the order training's ``auto`` prefers them (``hdp.attention.kernels``);
# a profile's attention rows are named by the backend that was measured.
BACKEND_NAMES = ("flash_attn", "torch_flash", "flash_attn_4", "cudnn", "reference")
# Names profiles written by an older hdp-calibrate gave their kernels.
LEGACY_BACKEND_NAMES = {"flash": "torch_flash"}


def backend_name(name: str) -> str:
    """``name``, or the backend name an older hdp-calibrate's ``name`` stands for."""
    return LEGACY_BACKEND_NAMES.get(name, name)


FORMAT = "hdp.profile/1"
TILE_TOKENS = 128  # query rows of one attention kernel tile: fewer run as long as a tile
TABLE_COLUMNS = {
    "attention": ("backend", "kind", "heads", "kv_heads", "head_dim", "a", "b", "seconds"),
    "gemm": ("tokens", "in", "out", "seconds"),
    "memory_bound": ("op", "width", "tokens", "seconds"),
    "optimizer": ("params", "seconds"),
    "collective": ("op", "ranks", "bytes", "seconds"),
}


class ProfileError(ValueError):
    """A profile that cannot be read: names the file and what is wrong."""


def causal_pairs(length):
    """Query-key pairs of a causal document of ``length`` tokens."""
    L = np.asarray(length, dtype=np.float64)
    return L * (L + 1.0) / 2.0


@dataclass(frozen=True)
class Linear:
    """A fit ``seconds = fixed + per_unit x size``."""

    fixed: float
    per_unit: float

    def __call__(self, size):
        return self.fixed + self.per_unit * np.asarray(size, dtype=np.float64)

    @classmethod
    def fit(cls, size: np.ndarray, seconds: np.ndarray) -> Linear:
        """Least squares on relative error (each row weighted by its inverse time), both >= 0."""
        size, seconds = np.asarray(size, np.float64), np.asarray(seconds, np.float64)
        if size.size == 1 or np.ptp(size) == 0:
            return cls(0.0, float(np.mean(seconds / size)))
        w = 1.0 / seconds
        A = np.stack([w, size * w], axis=1)
        fixed, per = np.linalg.lstsq(A, np.ones_like(seconds), rcond=None)[0]
        if fixed < 0:
            return cls(0.0, float(np.sum(size * seconds * w * w) / np.sum((size * w) ** 2)))
        if per < 0:
            return cls(float(np.mean(seconds)), 0.0)
        return cls(float(fixed), float(per))


_MESH_PER_OCTAVE = 8
_MESH_AXIS = np.arange(0, 26 * _MESH_PER_OCTAVE + 1) / _MESH_PER_OCTAVE  # log2 sizes, 1 to 2^26


def _mesh_interp(mesh: np.ndarray, x, y) -> np.ndarray:
    """Bilinear interpolation of ``mesh`` (both axes :data:`_MESH_AXIS`) at log2 sizes ``x``,
    ``y``, flat beyond the mesh."""
    # The planner interpolates millions of shards: every step works in place on one pass's
    # arrays, and the corners come by one flat index into shifted views of the mesh.
    last = _MESH_AXIS.size - 1
    fx = np.multiply(x, _MESH_PER_OCTAVE, dtype=np.float64)
    fy = np.multiply(y, _MESH_PER_OCTAVE, dtype=np.float64)
    if fx.ndim == 0 or fx.shape != fy.shape:  # (a scalar, or shapes to broadcast)
        fx, fy = (np.array(f) for f in np.broadcast_arrays(fx, fy))
    for f in (fx, fy):
        np.clip(f, 0, last, out=f)
    i, j = fx.astype(np.int64), fy.astype(np.int64)
    for f in (i, j):
        np.minimum(f, last - 1, out=f)
    tx, ty = np.subtract(fx, i, out=fx), np.subtract(fy, j, out=fy)
    sx, sy = 1 - tx, 1 - ty
    flat, row = mesh.ravel(), mesh.shape[1]
    k = np.multiply(i, row, out=i)
    k += j
    out = flat[k]
    out *= sx
    out *= sy
    for shift, a, b in ((row, tx, sy), (1, sx, ty), (row + 1, tx, ty)):
        part = flat[shift:][k]
        part *= a
        part *= b
        out += part
    return out


def _low_slope(at: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The slope of ``values`` (along axis 0) over their two lowest points, within [0, 1]."""
    if at.size < 2:
        return np.zeros(values.shape[1:])
    return np.clip((values[1] - values[0]) / (at[1] - at[0]), 0.0, 1.0)


def _grid_interp(xs: np.ndarray, ys: np.ndarray, grid: np.ndarray, x, y) -> np.ndarray:
    """Bilinear interpolation of ``grid[len(xs), len(ys)]`` at ``(x, y)``; flat above the grid,
    and below it along the slope of its two lowest rows or columns (Note [Interpolating
    measured kernels])."""
    x0, y0 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    below_x, below_y = np.minimum(x0 - xs[0], 0.0), np.minimum(y0 - ys[0], 0.0)
    x = np.clip(x0, xs[0], xs[-1])
    y = np.clip(y0, ys[0], ys[-1])
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, max(xs.size - 2, 0))
    j = np.clip(np.searchsorted(ys, y, side="right") - 1, 0, max(ys.size - 2, 0))
    i1, j1 = np.minimum(i + 1, xs.size - 1), np.minimum(j + 1, ys.size - 1)
    tx = np.where(xs[i1] > xs[i], (x - xs[i]) / np.where(xs[i1] > xs[i], xs[i1] - xs[i], 1), 0.0)
    ty = np.where(ys[j1] > ys[j], (y - ys[j]) / np.where(ys[j1] > ys[j], ys[j1] - ys[j], 1), 0.0)
    inside = (
        grid[i, j] * (1 - tx) * (1 - ty)
        + grid[i1, j] * tx * (1 - ty)
        + grid[i, j1] * (1 - tx) * ty
        + grid[i1, j1] * tx * ty
    )
    slope_x = np.interp(y, ys, _low_slope(xs, grid))  # along x, at this y
    slope_y = np.interp(x, xs, _low_slope(ys, grid.T))
    return inside + slope_x * below_x + slope_y * below_y


def _filled_grid(q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """(log q values, log k values, log-rate grid) from scattered rows; a missing cell is
    interpolated along log k within its row (else along log q within its column)."""
    xs, ys = np.unique(np.log(q)), np.unique(np.log(k))
    i, j = np.searchsorted(xs, np.log(q)), np.searchsorted(ys, np.log(k))
    total, count = np.zeros((xs.size, ys.size)), np.zeros((xs.size, ys.size))
    np.add.at(total, (i, j), v)  # rows measured twice (two models' shapes) average
    np.add.at(count, (i, j), 1)
    grid = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    for axis in (1, 0):
        for idx in range(grid.shape[1 - axis]):
            line = grid[idx] if axis == 1 else grid[:, idx]
            known = ~np.isnan(line)
            if known.any() and not known.all():
                at = ys if axis == 1 else xs
                line[~known] = np.interp(at[~known], at[known], line[known])
    return xs, ys, np.where(np.isnan(grid), np.nanmean(grid), grid)


@dataclass(frozen=True)
class _AttentionFit:
    """One backend at one head dimension: causal documents by length, full blocks by (q, k).
    Rates are log(pairs x heads x head_dim per second)."""

    heads: int
    causal_len: np.ndarray  # log lengths
    causal_rate: np.ndarray
    full_q: np.ndarray  # log query tokens
    full_k: np.ndarray  # log key tokens
    full_rate: np.ndarray  # [q, k]

    @classmethod
    def build(cls, rows: list[tuple]) -> _AttentionFit:
        causal = sorted((a, b, s, h, d) for _, kind, h, _, d, a, b, s in rows if kind == "causal")
        full = [(a, b, s, h, d) for _, kind, h, _, d, a, b, s in rows if kind == "full"]
        heads = int((causal or full)[0][3])
        c_len = np.log([r[0] for r in causal]) if causal else np.zeros(0)
        c_rate = np.log([causal_pairs(a) * h * d * b / s for a, b, s, h, d in causal])
        if full:
            # Rows of other head counts sit at the queries that give as many parallel tiles.
            q = np.array([a * h / heads for a, _, _, h, _ in full], dtype=np.float64)
            k = np.array([r[1] for r in full], dtype=np.float64)
            rate = np.log([a * b * h * d / s for a, b, s, h, d in full])
            fq, fk, fr = _filled_grid(q, k, rate)
        else:  # no full blocks measured: a block runs as fast as a causal document of its size
            fq, fk, fr = c_len, c_len[:1], c_rate[:, None]
        if not causal:
            c_len, c_rate = fq, fr.max(axis=1)
        return cls(heads, c_len, np.asarray(c_rate), fq, fk, fr)

    def causal_log_rate(self, length) -> np.ndarray:
        return np.interp(np.log(np.maximum(length, 1.0)), self.causal_len, self.causal_rate)

    def full_log_rate(self, q, k, heads: int) -> np.ndarray:
        q_eff = np.maximum(np.asarray(q, np.float64), 1.0) * heads / self.heads
        return _grid_interp(self.full_q, self.full_k, self.full_rate, np.log(q_eff), np.log(k))


@dataclass(frozen=True, eq=False)
class KernelTables:
    """The measured tables of a profile (rows as in ``TABLE_COLUMNS``) and the times they imply
    (Note [Interpolating measured kernels]). Compared and hashed by identity: cost models key
    caches on their profile, and hashing every row each time would cost more than the lookup."""

    attention: tuple[tuple, ...] = ()
    gemm: tuple[tuple, ...] = ()
    memory_bound: tuple[tuple, ...] = ()
    optimizer: tuple[tuple, ...] = ()
    collective: tuple[tuple, ...] = ()

    # ------------------------------------------------------------------ attention
    @cached_property
    def _attention(self) -> dict[str, dict[int, _AttentionFit]]:
        by: dict[str, dict[int, list[tuple]]] = {}
        for row in self.attention:
            by.setdefault(row[0], {}).setdefault(int(row[4]), []).append(row)
        return {
            b: {d: _AttentionFit.build(r) for d, r in sorted(dims.items())}
            for b, dims in by.items()
        }

    @property
    def attention_backends(self) -> tuple[str, ...]:
        return tuple(self._attention)

    def rows_for(self, backend: str) -> str | None:
        """The attention rows that price ``backend``: its own, else for the ``flash_attn``
        package (FlashAttention-2, as torch's own) the ``torch_flash`` rows; ``None`` where the
        tables have neither."""
        backend = backend_name(backend)
        for rows in (backend, "torch_flash") if backend == "flash_attn" else (backend,):
            if rows in self._attention:
                return rows
        return None

    def _log_rate(self, backend: str, head_dim: int, rate_at) -> np.ndarray:
        fits = self._attention.get(backend)
        if fits is None:
            raise ProfileError(
                f"the profile has no attention rows for backend {backend!r} "
                f"(it has {', '.join(self._attention) or 'none'})"
            )
        dims = np.array(sorted(fits), dtype=np.float64)
        if dims.size == 1 or head_dim <= dims[0] or head_dim >= dims[-1]:
            near = dims[np.argmin(abs(np.log2(dims) - np.log2(head_dim)))]
            return rate_at(fits[int(near)])
        hi = int(np.searchsorted(dims, head_dim))
        lo_d, hi_d = dims[hi - 1], dims[hi]
        t = (np.log2(head_dim) - np.log2(lo_d)) / (np.log2(hi_d) - np.log2(lo_d))
        return (1 - t) * rate_at(fits[int(lo_d)]) + t * rate_at(fits[int(hi_d)])

    def causal_time(self, length, heads: int, head_dim: int, backend: str) -> np.ndarray:
        """Forward + backward of causal documents of ``length`` tokens (each), seconds."""
        L = np.maximum(np.asarray(length, np.float64), 1.0)
        shortest, mesh = self._causal_mesh(backend, head_dim)
        L = np.maximum(L, shortest)
        rate = np.interp(np.log2(L), _MESH_AXIS, mesh)
        return causal_pairs(L) * heads * head_dim / np.exp(rate)

    def causal_rate(self, length, heads: int, head_dim: int, backend: str) -> np.ndarray:
        """Query-key pairs per second of causal documents of ``length`` tokens: the rate
        :meth:`causal_time` prices them at (below the shortest measured, the shortest's)."""
        L = np.maximum(np.asarray(length, np.float64), 1.0)
        shortest, mesh = self._causal_mesh(backend, head_dim)
        rate = np.interp(np.log2(np.maximum(L, shortest)), _MESH_AXIS, mesh)
        return np.exp(rate) / (heads * head_dim)

    def full_time(self, q, k, heads: int, head_dim: int, backend: str) -> np.ndarray:
        """Forward + backward of ``q`` queries against ``k`` earlier keys (no mask), seconds.
        Fewer queries than one tile take as long as a tile."""
        q = np.maximum(np.asarray(q, np.float64), TILE_TOKENS)
        k = np.maximum(np.asarray(k, np.float64), 1.0)
        mesh = self._full_mesh(backend, head_dim, heads)
        rate = _mesh_interp(mesh, np.log2(q), np.log2(k))
        return q * k * heads * head_dim / np.exp(rate)

    def full_rate(self, q, k, heads: int, head_dim: int, backend: str) -> np.ndarray:
        """Query-key pairs per second of a block of ``q`` queries (at least a tile) against
        ``k`` keys: the rate :meth:`full_time` prices it at."""
        q = np.maximum(np.asarray(q, np.float64), TILE_TOKENS)
        k = np.maximum(np.asarray(k, np.float64), 1.0)
        mesh = self._full_mesh(backend, head_dim, heads)
        return np.exp(_mesh_interp(mesh, np.log2(q), np.log2(k))) / (heads * head_dim)

    # The planner prices millions of shards: rates are tabulated once per (backend, head_dim,
    # heads) on a mesh of 1/8 octaves, where the measured sizes (powers of two) are mesh points.
    @cached_property
    def _meshes(self) -> dict[tuple, Any]:
        return {}

    def _causal_mesh(self, backend: str, head_dim: int) -> tuple[float, np.ndarray]:
        key = ("causal", backend, head_dim)
        if key not in self._meshes:
            fits = self._attention.get(backend, {})
            shortest = min((np.exp(f.causal_len[0]) for f in fits.values()), default=1.0)
            L = np.maximum(2.0**_MESH_AXIS, shortest)
            self._meshes[key] = (
                shortest,
                self._log_rate(backend, head_dim, lambda f: f.causal_log_rate(L)),
            )
        return self._meshes[key]

    def _full_mesh(self, backend: str, head_dim: int, heads: int) -> np.ndarray:
        key = ("full", backend, head_dim, heads)
        if key not in self._meshes:
            q, k = np.meshgrid(2.0**_MESH_AXIS, 2.0**_MESH_AXIS, indexing="ij")
            self._meshes[key] = self._log_rate(
                backend, head_dim, lambda f: f.full_log_rate(q, k, heads)
            )
        return self._meshes[key]

    # ------------------------------------------------------------------ GEMMs
    @cached_property
    def _gemm(self) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        """(in, out) -> (log tokens, log rate) with rate = 6 tokens in out / seconds."""
        by: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for tokens, n_in, n_out, s in self.gemm:
            by.setdefault((int(n_in), int(n_out)), []).append(
                (tokens, 6.0 * tokens * n_in * n_out / s)
            )
        out = {}
        for shape, pts in by.items():
            pts.sort()
            out[shape] = (np.log([p[0] for p in pts]), np.log([p[1] for p in pts]))
        return out

    def gemm_time(self, tokens, n_in: int, n_out: int) -> np.ndarray:
        """Forward and both backward products of ``[tokens x n_in] @ [n_in x n_out]``, seconds."""
        if not self._gemm:
            raise ProfileError("the profile has no gemm rows")
        t = np.maximum(np.asarray(tokens, np.float64), 1.0)
        fewest = min(np.exp(x[0]) for x, _ in self._gemm.values())
        t_eff = np.maximum(t, fewest)
        log_rate = self._gemm_log_rate(t_eff, n_in, n_out)
        return 6.0 * t_eff * n_in * n_out / np.exp(log_rate)

    def _gemm_log_rate(self, tokens: np.ndarray, n_in: int, n_out: int) -> np.ndarray:
        exact = self._gemm.get((int(n_in), int(n_out)))
        if exact is not None:
            return np.interp(np.log(tokens), *exact)
        shapes = list(self._gemm)
        d2 = np.array([(np.log2(i / n_in)) ** 2 + (np.log2(o / n_out)) ** 2 for i, o in shapes])
        w = 1.0 / d2
        rates = np.stack([np.interp(np.log(tokens), *self._gemm[s]) for s in shapes])
        return np.tensordot(w / w.sum(), rates, axes=1)

    # ------------------------------------------------------------------ linear fits
    @cached_property
    def _memory_bound(self) -> dict[str, Linear]:
        by: dict[str, list[tuple[float, float]]] = {}
        for op, width, tokens, s in self.memory_bound:
            by.setdefault(op, []).append((width * tokens, s))
        return {op: Linear.fit(*np.array(v).T) for op, v in by.items()}

    def memory_bound_time(self, op: str, width: int, tokens) -> np.ndarray:
        """Forward + backward of a memory-bound op on ``[tokens x width]``, seconds (an op that
        was not measured is priced per element as ``rmsnorm``, an fp32 elementwise op)."""
        fit = self._memory_bound.get(op) or self._memory_bound.get("rmsnorm")
        if fit is None:
            raise ProfileError(f"the profile has no memory_bound rows for {op!r} or 'rmsnorm'")
        return fit(width * np.asarray(tokens, np.float64))

    @cached_property
    def _optimizer(self) -> Linear | None:
        if not self.optimizer:
            return None
        return Linear.fit(*np.array(self.optimizer, dtype=np.float64).T)

    def optimizer_time(self, params: float) -> float:
        """One AdamW step over ``params`` parameters, seconds (0 where not measured)."""
        return float(self._optimizer(params)) if self._optimizer is not None else 0.0

    @cached_property
    def _collective(self) -> dict[str, tuple[Linear, int]]:
        by: dict[str, list[tuple[float, float]]] = {}
        ranks: dict[str, int] = {}
        for op, n, size, s in self.collective:
            by.setdefault(op, []).append((size, s))
            ranks.setdefault(op, int(n))
        return {op: (Linear.fit(*np.array(v).T), ranks[op]) for op, v in by.items()}

    def collective_fit(self, op: str) -> tuple[Linear, int] | None:
        """``seconds = latency + per_byte x bytes`` of a measured collective and the ranks it was
        measured on; ``None`` where not measured. ``bytes``: the whole tensor (gathered, or
        reduced before scattering)."""
        return self._collective.get(op)

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_json(cls, tables: dict[str, Any], where: str = "profile") -> KernelTables:
        parts = {}
        for name, columns in TABLE_COLUMNS.items():
            table = tables.get(name, {"columns": list(columns), "rows": []})
            if tuple(table.get("columns", ())) != columns:
                raise ProfileError(
                    f"{where}: table {name!r} must have the columns {', '.join(columns)}"
                )
            rows = table.get("rows", [])
            for i, row in enumerate(rows):
                if len(row) != len(columns) or not float(row[-1]) > 0:
                    raise ProfileError(
                        f"{where}: table {name!r}, row {i}: expected {len(columns)} values with "
                        f"positive seconds, got {row!r}"
                    )
            if name == "attention":  # rows named by an older hdp-calibrate
                rows = [[backend_name(r[0]), *r[1:]] for r in rows]
            parts[name] = tuple(tuple(r) for r in rows)
        return cls(**parts)

    def to_json(self) -> dict[str, Any]:
        return {
            name: {"columns": list(columns), "rows": [list(r) for r in getattr(self, name)]}
            for name, columns in TABLE_COLUMNS.items()
        }

    def without(self, table: str, index: int) -> KernelTables:
        """These tables less one row (for leave-one-out checks)."""
        rows = getattr(self, table)
        return KernelTables(**{**self._parts(), table: rows[:index] + rows[index + 1 :]})

    def _parts(self) -> dict[str, tuple]:
        return {name: getattr(self, name) for name in TABLE_COLUMNS}


def read_profile_json(path: str | Path, force: bool = False) -> dict[str, Any]:
    """The JSON object of a profile file, with a clear error naming the file. A profile whose rows
    disagree (:func:`check_profile`) is refused with one line naming them, unless ``force`` or
    ``HDP_FORCE_PROFILE=1``: every ``--gpu-profile`` is read here, before it prices a plan."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the profile: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f'{path}: not a GPU profile (expected "format": "{FORMAT}")')
    if not forced(force):
        found = check_profile(data, str(path))
        if found:
            raise ProfileError(refusal(str(path), found))
    return data


def measurement_of(data: dict[str, Any], tables: KernelTables, where: str) -> Measurement | None:
    """The profile's record of how it was measured; ``None`` where it has none (older profiles,
    the shipped GPU ones)."""
    if "measurement" not in data:
        return None
    rows = {name: len(getattr(tables, name)) for name in TABLE_COLUMNS}
    try:
        return Measurement.from_json(data["measurement"], rows)
    except ValueError as e:
        raise ProfileError(f"{where}: {e}") from None


def check_profile(data: dict[str, Any], where: str = "profile") -> list[Disagreement]:
    """The rows of the profile ``data`` that disagree with each other, with its peak or with
    their own repeats (Note [Rows that disagree] in :mod:`hdp.profile_quality`); ProfileError
    where its tables cannot be read."""
    tables = KernelTables.from_json(data.get("tables", {}), where)
    peak = data.get("peak_flops")
    peak = float(peak) if isinstance(peak, (int, float)) and np.isfinite(peak) else None
    return disagreements(tables._parts(), peak, measurement_of(data, tables, where))


def _format_object(value: dict[str, Any], indent: str) -> str:
    """``value`` as JSON text, one key per line, nested objects likewise."""
    lines = []
    for key, v in value.items():
        text = _format_object(v, indent + "  ") if isinstance(v, dict) else json.dumps(v)
        lines.append(f"{indent}  {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(lines) + f"\n{indent}}}" if lines else "{}"


def format_profile(profile: dict[str, Any]) -> str:
    """The profile as JSON text: one key per line (the ``measurement`` object's too), one table
    row per line."""
    lines = []
    for key, value in profile.items():
        if key != "tables":
            text = _format_object(value, "  ") if isinstance(value, dict) else json.dumps(value)
            lines.append(f"  {json.dumps(key)}: {text}")
    parts = []
    for name, table in profile["tables"].items():
        rows = ",\n".join(f"        {json.dumps(r)}" for r in table["rows"])
        body = f"[\n{rows}\n      ]" if rows else "[]"
        parts.append(
            f'    {json.dumps(name)}: {{\n      "columns": {json.dumps(table["columns"])},\n'
            f'      "rows": {body}\n    }}'
        )
    lines.append('  "tables": {\n' + ",\n".join(parts) + "\n  }")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_profile(profile: dict[str, Any], path: Path) -> None:
    """Write ``profile`` to ``path`` atomically (a temporary file, then a rename)."""
    text = format_profile(profile)
    json.loads(text)  # the hand-laid-out text must stay valid JSON
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


__all__ = [
    "FORMAT",
    "KernelTables",
    "Linear",
    "ProfileError",
    "causal_pairs",
    "check_profile",
    "format_profile",
    "measurement_of",
    "read_profile_json",
    "write_profile",
]
