"""The fields of a PLAN.json object, each checked for its type before a :class:`hdp.Plan` is
built from them (``Plan.from_json``, which then validates the plan)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .plan import DEFAULT_KV_BLOCK_TOKENS, PlanError


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
    num_ranks = _whole(d["num_ranks"], "num_ranks", minimum=1)
    lens = d["seq_lens"]
    if not isinstance(lens, list):
        raise PlanError("PLAN.json 'seq_lens' must be a list of integers")
    for i, x in enumerate(lens):
        _whole(x, f"seq_lens[{i}]", minimum=0)
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
    if kw["predicted"] is not None and not isinstance(kw["predicted"], dict):
        raise PlanError("PLAN.json 'predicted' must be an object of numbers")
    if offload is not None:
        try:
            off = np.asarray(offload, dtype=np.float64)
        except (TypeError, ValueError):
            raise PlanError("PLAN.json 'offload' must be [num_waves][num_ranks] numbers") from None
        if off.shape != (num_waves, num_ranks):
            raise PlanError(
                f"PLAN.json 'offload' must be [num_waves][num_ranks], got shape {off.shape}"
            )
        kw["offload"] = off
    return lens, num_ranks, waves, kw


def _whole(value: Any, field: str, minimum: int | None) -> int:
    """A PLAN.json integer, as JSON wrote it (``500.7`` and ``"two"`` are not ``500``, ``2``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"PLAN.json '{field}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise PlanError(f"PLAN.json '{field}' must be >= {minimum}, got {value}")
    return value


def _list(d: dict[str, Any], key: str) -> list:
    value = d.get(key, [])
    if not isinstance(value, list):
        raise PlanError(f"PLAN.json '{key}' must be a list, got {value!r}")
    return value
