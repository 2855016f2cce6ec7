"""Starting a run where it should: the checkpoint to resume from, whether it may continue this
run's setup, the tokens it already counted, and a metrics file without the rows it redoes.

A checkpoint records a fingerprint of the run's setup (:func:`fingerprint`): the model (with its
RoPE), the data
(each source's file name, size and document lengths, the tokenizer, the weights, the vocabulary,
the batch shape and seed), the planning flags and the optimizer's (learning rate, its schedule,
weight decay, gradient clipping). Resuming with a different one is refused with one line naming
what changed, unless ``--allow-changed-setup``: then changed data restarts the data position (the
old position indexes documents of other sources), changed planning flags just plan the next steps
differently, and changed optimizer flags take effect from the resumed step. The model can never
change: its shards would not load. ``--steps`` is not part of it: a run may be extended, and its
learning-rate schedule is saved beside the fingerprint (Note [Warm-up, decay and extended runs]
in launch/schedule.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import checkpoint
from .checkpoint import CheckpointError

if TYPE_CHECKING:
    from .config import CheckpointingConfig, RunConfig


@dataclass
class Resume:
    """Where a resumed run starts: the checkpoint, its step, its data position (``None``: start
    the data afresh, as ``--allow-changed-setup`` does for changed data) and its accounting."""

    path: Path
    step: int
    data_state: dict | None
    trained_tokens: int
    truncated_tokens: int
    skipped_updates: int = 0
    schedule: dict | None = None  # the learning-rate schedule saved (hdp.launch.schedule.Schedule)


def fingerprint(config: RunConfig, sources: list, *, vocab: int, model: dict) -> dict:
    """The setup a checkpoint continues: ``model`` (:meth:`ModelSource.fingerprint
    <hdp.launch.model_source.ModelSource.fingerprint>`), then the config's fields that define the
    run (:meth:`RunConfig.fingerprint <hdp.launch.config.RunConfig.fingerprint>`: ``data``,
    ``planning``, ``optimizer``), the data section with the sources read and the vocabulary."""
    flags = config.fingerprint()
    data = {
        "sources": [s.fingerprint() for s in sources],
        "tokenizers": sorted({s.tokenizer.id for s in sources if hasattr(s, "tokenizer")}),
        "vocab": vocab,
        **flags.pop("data"),
    }
    return {"model": model, "data": data, **flags}


def _flatten(obj, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        return {
            k: v for key, val in obj.items() for k, v in _flatten(val, f"{prefix}{key}.").items()
        }
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        return {
            k: v for i, val in enumerate(obj) for k, v in _flatten(val, f"{prefix}{i + 1}.").items()
        }
    return {prefix.rstrip("."): obj}


def differences(saved: dict, now: dict) -> list[str]:
    """``key: saved -> now`` for each field of the fingerprints that differs."""
    a, b = _flatten(saved), _flatten(now)
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def check_setup(saved: dict, now: dict, *, allow: bool, where: Path) -> bool:
    """Whether the data position may be kept. Raises CheckpointError when the setup changed and
    ``allow`` is not given, or when the model changed."""
    changed = differences(saved.get("model", {}), now["model"])
    if changed:
        raise CheckpointError(
            f"cannot resume from {where}: it holds another model ({'; '.join(changed)})"
        )
    data = differences(saved.get("data", {}), now["data"])
    items = [f"data.{d}" for d in data]
    for section in [s for s in now if s not in ("model", "data")]:
        if section in saved:  # a checkpoint from before a section was added holds none
            # The decay horizon left the fingerprint: it is saved as the schedule instead.
            kept = {k: v for k, v in saved[section].items() if k != "lr_decay_steps"}
            items += [f"{section}.{d}" for d in differences(kept, now[section])]
    if items and not allow:
        more = f"; and {len(items) - 4} more" if len(items) > 4 else ""
        raise CheckpointError(
            f"cannot resume from {where}: the setup changed since it was saved "
            f"({'; '.join(items[:4])}{more}): restore it, or pass --allow-changed-setup to "
            "resume anyway (changed data restarts the data position)"
        )
    return not data


def find_resume(
    ck: CheckpointingConfig, steps: int, setup: dict, log: Callable[[str], None]
) -> Resume | None:
    """The checkpoint a run of ``steps`` steps continues, checked against its checkpointing flags
    (a collective); ``None`` starts from step 0. Raises CheckpointError with the line to print
    otherwise."""
    folder = ck.dir
    if folder is None:
        return None
    if not ck.resume:
        existing = checkpoint.existing(folder)
        if existing:
            raise CheckpointError(
                f"--checkpoint-dir {folder} already holds checkpoints ({existing[0]} and "
                f"{len(existing) - 1} more): pass --resume to continue them, or choose another "
                "directory"
            )
        return None
    found = checkpoint.select(folder, step=ck.resume_step)
    for line in found.warnings:
        log(line)
    if found.path is None:
        log(f"no valid checkpoint in {folder}: starting from step 0")
        return None
    meta = checkpoint.read_state(found.path)
    if not isinstance(meta.get("data"), dict):
        raise CheckpointError(
            f"{found.path / checkpoint.STATE}: 'data' (the data position) is missing or not an "
            "object: restore the file or resume another step"
        )
    step = meta["step"]
    if steps <= step:
        raise CheckpointError(
            f"--steps {steps} is not above step {step}, where {found.path} resumes: "
            "pass a larger --steps to train on"
        )
    keep_data = check_setup(
        meta.get("fingerprint", {}), setup, allow=ck.allow_changed_setup, where=found.path
    )
    if not keep_data:
        log(f"warning: the data changed since {found.path}: the data position starts afresh")
    acc = meta.get("accounting", {})
    return Resume(
        found.path,
        step,
        meta["data"] if keep_data else None,
        int(acc.get("trained_tokens", 0)),
        int(acc.get("truncated_tokens", 0)),
        int(acc.get("skipped_updates", 0)),
        meta.get("schedule") or _older_schedule(meta.get("fingerprint", {})),
    )


def _older_schedule(saved: dict) -> dict | None:
    """The schedule of a checkpoint saved before schedules were: its fingerprint's flags."""
    optimizer = saved.get("optimizer", {})
    if "lr_decay_steps" not in optimizer:
        return None
    return {"warmup": optimizer["warmup"], "decay_steps": optimizer["lr_decay_steps"]}


def check_metrics_file(path: Path | None) -> None:
    """ValueError naming the line unless ``path`` is absent, empty or hdp's own metrics log:
    each line a JSON object with an integer ``step`` and a ``loss``, the last one perhaps cut
    short by a kill. A run appends to that file and drops its rows of steps it trains again,
    so a file of anything else (a corpus, notes) would lose its lines."""
    if path is None or not path.exists():
        return
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--metrics {path}: cannot read it as text ({e})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines) and line.startswith('{"step": '):
                continue  # a row cut short by a kill
            row = None
        if _is_row(row):
            continue
        raise ValueError(
            f"--metrics {path}: line {number} is not an hdp metrics row, and a run rewrites the "
            "file: give a new path, or an earlier run's metrics file to continue it"
        )


def _is_row(row) -> bool:
    """Whether a parsed line is one of hdp's metrics rows: an integer ``step`` and a ``loss``."""
    return (
        isinstance(row, dict)
        and isinstance(row.get("step"), int)
        and not isinstance(row["step"], bool)
        and "loss" in row
    )


def open_metrics(path: Path | None, start: int, log: Callable[[str], None]):
    """The metrics file, open for appending, without the rows of steps after ``start`` (this run
    trains them again; a row cut short by a kill goes too). ``None`` when there is no file."""
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        kept, dropped = [], 0
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
                redone = int(row["step"]) > start
            except (ValueError, KeyError, TypeError):
                redone = True
            if redone:
                dropped += 1
            else:
                kept.append(line + "\n")
        if dropped:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
            log(
                f"{path}: replaced {dropped} rows of steps after {start} "
                "(this run trains those steps)"
            )
    return open(path, "a")


__all__ = [
    "Resume",
    "check_metrics_file",
    "check_setup",
    "find_resume",
    "fingerprint",
    "open_metrics",
]
