"""The fields of a PLAN.json object, each checked for its type before a :class:`hdp.Plan` is
built from them (``Plan.from_json``, which then validates the plan)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from .plan import DEFAULT_KV_BLOCK_TOKENS, PlanError

# The largest integer a field may hold: past it, arrays of it overflow int64 or fill the memory.
_LARGEST = {"num_ranks": 1 << 20, "tokens": 1 << 36, "other": 1 << 40}


def read(d: dict[str, Any] | str) -> tuple[list[int], int, list, dict[str, Any]]:
    """(seq_lens, num_ranks, waves, keyword arguments of ``Plan``) of a PLAN.json object (or its
    text). Raises :class:`PlanError` naming the first field of the wrong type."""
    if isinstance(d, str):
        d = json.loads(d)
    if not isinstance(d, dict):
        raise PlanError("PLAN.json must hold a JSON object")
    for key in ("num_ranks", "seq_lens", "waves"):
        if key not in d:
            raise PlanError(f"PLAN.json lacks the required key {key!r}")
    num_ranks = _whole(d["num_ranks"], "num_ranks", minimum=1, maximum=_LARGEST["num_ranks"])
    lens = d["seq_lens"]
    if not isinstance(lens, list):
        raise PlanError("PLAN.json 'seq_lens' must be a list of integers")
    for i, x in enumerate(lens):
        _whole(x, f"seq_lens[{i}]", minimum=0, maximum=_LARGEST["tokens"])
    waves = d["waves"]
    if not isinstance(waves, list) or not all(isinstance(w, list) for w in waves):
        raise PlanError(
            "PLAN.json 'waves' must be a list (waves) of lists (ranks) of [seq, start, end] lists"
        )
    for w, per_rank in enumerate(waves):
        for r, shards in enumerate(per_rank):
            if not isinstance(shards, list):
                raise PlanError(f"PLAN.json 'waves[{w}][{r}]' must be a list of shards")
            for i, sh in enumerate(shards):
                if not (isinstance(sh, list) and len(sh) == 3):
                    raise PlanError(f"PLAN.json 'waves[{w}][{r}][{i}]' is not [seq, start, end]")
                for v in sh:
                    _whole(v, f"waves[{w}][{r}][{i}]", minimum=None)
    num_waves = len(waves)
    offload = d.get("offload")
    for key in ("sync", "strategy", "kv_exchange"):
        if d.get(key) is not None and not isinstance(d[key], str):
            raise PlanError(f"PLAN.json '{key}' must be a string, got {d[key]!r}")
    kw: dict[str, Any] = dict(
        sync=d.get("sync", "wave"),
        barriers=[_whole(b, "barriers", minimum=0) for b in _list(d, "barriers")],
        kv_block_tokens=_whole(
            d.get("kv_block_tokens", DEFAULT_KV_BLOCK_TOKENS), "kv_block_tokens", minimum=1
        ),
        predicted=d.get("predicted"),
        strategy=d.get("strategy"),
        capacity=None if d.get("capacity") is None else _whole(d["capacity"], "capacity", 1),
        kv_exchange=d.get("kv_exchange", "rank"),
        ranks_per_node=None
        if d.get("ranks_per_node") is None
        else _whole(d["ranks_per_node"], "ranks_per_node", minimum=1),
    )
    _check_predicted(kw["predicted"])
    if offload is not None:
        kw["offload"] = _offload(offload, num_waves, num_ranks)
    return lens, num_ranks, waves, kw


def _whole(value: Any, field: str, minimum: int | None, maximum: int = _LARGEST["other"]) -> int:
    """A PLAN.json integer, as JSON wrote it (``500.7`` and ``"two"`` are not ``500``, ``2``),
    in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"PLAN.json '{field}' must be an integer, got {_short(value)}")
    if minimum is not None and value < minimum:
        raise PlanError(f"PLAN.json '{field}' must be >= {minimum}, got {_short(value)}")
    if value > maximum:
        raise PlanError(f"PLAN.json '{field}' must be <= {maximum}, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """``value``'s repr, cut to a line (a huge integer has thousands of digits)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "an integer"
    return text if len(text) <= 60 else text[:57] + "..."


def _offload(value: Any, num_waves: int, num_ranks: int) -> np.ndarray:
    """The ``offload`` field: [num_waves][num_ranks] numbers in [0, 1]."""
    rows = value if isinstance(value, list) else None
    if rows is None or len(rows) != num_waves:
        raise PlanError(
            f"PLAN.json 'offload' must be [num_waves][num_ranks] numbers ({num_waves} waves)"
        )
    for w, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != num_ranks:
            raise PlanError(f"PLAN.json 'offload[{w}]' must be a list of {num_ranks} numbers")
        for r, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
                raise PlanError(
                    f"PLAN.json 'offload[{w}][{r}]' must be a number in [0, 1], got {_short(x)}"
                )
    return np.asarray(rows, dtype=np.float64).reshape(num_waves, num_ranks)


def _check_predicted(predicted: Any) -> None:
    """``predicted``: absent, or an object whose values are numbers (or lists of numbers)."""
    if predicted is None:
        return
    if not isinstance(predicted, dict):
        raise PlanError("PLAN.json 'predicted' must be an object of numbers")
    for key, value in predicted.items():
        items = value if isinstance(value, list) else [value]
        for x in items:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise PlanError(
                    f"PLAN.json 'predicted.{key}' must be a number or a list of numbers, "
                    f"got {_short(value)}"
                )
            if isinstance(x, int) and abs(x) > 1 << 62 or isinstance(x, float) and math.isinf(x):
                raise PlanError(f"PLAN.json 'predicted.{key}' is out of range: {_short(value)}")


def _list(d: dict[str, Any], key: str) -> list:
    value = d.get(key, [])
    if not isinstance(value, list):
        raise PlanError(f"PLAN.json '{key}' must be a list, got {value!r}")
    return value
