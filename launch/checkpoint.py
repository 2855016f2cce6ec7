"""Checkpoints with ``torch.distributed.checkpoint``: sharded model and optimizer states, plus the
step, the LR schedule, the dataloader position, the run's token accounting, its setup fingerprint
and each rank's RNG state, so a resumed run trains on exactly the tokens the uninterrupted run
would have.

Layout: ``DIR/step_00000042/`` holds the DCP shards, ``train_state.json``, ``rng_rank*.pt``, the
caller's extra files (``hf/``: the config and tokenizer ``hdp-export`` writes out) and, written
last and atomically, ``manifest.json``: the size and SHA-256 of every other file. A
checkpoint is valid when its manifest is there and every file it lists has its size and checksum;
anything else (a save killed half-way, a missing or truncated shard, a flipped byte) is damaged.
``DIR/latest`` names the newest checkpoint for people and tools; resuming does not trust it: it
takes the newest valid ``step_*`` and warns about each damaged newer one and a stale ``latest``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

FORMAT = "hdp.checkpoint/1"
MANIFEST = "manifest.json"
HF_FOLDER = "hf"
STATE = "train_state.json"
_STEP_DIR = re.compile(r"step_(\d{8})")
UNFINISHED = f"no {MANIFEST}: its save did not finish"


class CheckpointError(Exception):
    """A checkpoint directory that cannot be used as asked: one line saying what to change."""


@dataclass
class Selection:
    """What :func:`select` found: the checkpoint to resume from (``None``: none in the folder)
    and one warning line per thing passed over."""

    path: Path | None
    warnings: list[str] = field(default_factory=list)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def agree(obj):
    """Rank 0's ``obj`` on every rank (decisions about files are taken once, on rank 0)."""
    if not dist.is_initialized():
        return obj
    box = [obj if _rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _one_process_quietly():
    """DCP in a run without a process group, without its warning that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def _write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` under a temporary name, synced, then renamed: readers see the old
    file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not leave a stray file behind
        raise


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _hash_shared(path: Path, names: list[str]) -> dict[str, str | None]:
    """SHA-256 of each of ``names`` in ``path`` (``None``: unreadable), each rank hashing every
    ``world``-th file so that a large checkpoint costs one rank's share of the reading."""
    mine = {}
    for name in names[_rank() :: _world()]:
        try:
            mine[name] = _sha256(path / name)
        except OSError:
            mine[name] = None
    if not dist.is_initialized():
        return mine
    parts = [None] * _world()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def step_dirs(folder: Path) -> list[Path]:
    """The ``step_*`` directories of ``folder``, newest first. Raises CheckpointError when the
    folder cannot be listed."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CheckpointError(f"cannot read --checkpoint-dir {folder}: {e.strerror}") from None
    steps = [n for n in names if _STEP_DIR.fullmatch(n) and (folder / n).is_dir()]
    return [folder / n for n in sorted(steps, reverse=True)]


def existing(folder: Path) -> list[str]:
    """The names of ``folder``'s ``step_*`` directories, newest first, as rank 0 sees them (a
    collective). Raises CheckpointError on every rank when the folder cannot be listed."""
    found = None
    if _rank() == 0:
        try:
            found = [d.name for d in step_dirs(folder)]
        except CheckpointError as e:
            found = str(e)
    found = agree(found)
    if isinstance(found, str):
        raise CheckpointError(found)
    return found


def _move_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``step_N.damaged`` (``.damaged2``, ...), keeping it."""
    k = 1
    while True:
        aside = path.with_name(path.name + (".damaged" if k == 1 else f".damaged{k}"))
        if not aside.exists():
            path.rename(aside)
            return aside
        k += 1


def _prepare_target(path: Path) -> str | None:
    """Make room for a new checkpoint at ``path`` (rank 0): an unfinished save there is removed,
    a damaged checkpoint moved aside; a valid one is never written over. Returns the refusal,
    or ``None``."""
    if not path.exists():
        return None
    manifest, problem = check_listing(path)
    if problem == UNFINISHED:
        try:
            shutil.rmtree(path)
            print(f"warning: removed the unfinished save {path} ({problem})", flush=True)
            return None
        except OSError:  # what could not be removed is kept aside, never saved over
            pass
    problem = problem or hash_problem(path, manifest, shared=False)
    if problem is None:
        return f"{path} is a valid checkpoint; hdp never writes over one"
    aside = _move_aside(path)
    print(f"warning: moved the damaged checkpoint {path} to {aside} ({problem})", flush=True)
    return None


def _space_warning(folder: Path) -> str | None:
    """A warning when ``folder``'s disk has less free space than its newest checkpoint took
    (``None`` too when the space cannot be read)."""
    try:
        return _space_shortfall(folder)
    except (OSError, CheckpointError):
        return None


def _space_shortfall(folder: Path) -> str | None:
    for path in step_dirs(folder):
        manifest, problem = check_listing(path)
        if problem is None:
            size = sum(entry["size"] for entry in manifest["files"].values())
            free = shutil.disk_usage(folder).free
            if free < size:
                return (
                    f"warning: {_mib(free)} free in {folder}, and {path.name} took "
                    f"{_mib(size)}: this save may fail; free space or move old checkpoints away"
                )
            return None
    return None


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# What torch.save's zip writer says where the file system took fewer bytes than it wrote.
_SHORT_WRITE = ("file write failed", "unexpected pos")


def _failure(e: BaseException) -> str:
    """What went wrong in a save, in a few words: the OS error's text where there is one (DCP
    wraps each rank's exception in a CheckpointException)."""
    found = [e]
    if isinstance(e, dcp.CheckpointException):
        found = [exc for exc, _ in e.failures.values()]
    for exc in found:
        if isinstance(exc, _NotFinite):
            return str(exc)
        if isinstance(exc, OSError) and exc.strerror:
            return exc.strerror[0].lower() + exc.strerror[1:]
    first = (str(found[0]).strip().splitlines() or [""])[0][:200]
    if isinstance(found[0], RuntimeError) and any(m in first for m in _SHORT_WRITE):
        # torch's zip writer turns a short write (ENOSPC, a quota) into a RuntimeError
        return f"a write was cut short, as on a full disk (torch's writer: {first})"
    return f"{type(found[0]).__name__}: {first}"


def save(
    folder: str | Path,
    step: int,
    model,
    optimizer,
    scheduler,
    state: dict,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Save everything needed to continue after ``step`` optimizer steps (a collective).
    ``state`` (JSON) holds the schedule-independent rest: data position, accounting,
    fingerprint. ``files`` ({name: contents}) go into ``hf/``. Raises CheckpointError, on every
    rank, when the target is a valid checkpoint or a write fails (disk full, ...): then the
    partial directory is removed and the newest checkpoint stays what it was."""
    folder = Path(folder)
    path = folder / f"step_{step:08d}"
    refusal = None
    if _rank() == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            refusal = _prepare_target(path)
            warning = _space_warning(folder)  # a warning only: it never stops a save
            if warning:
                print(warning, flush=True)
        except OSError as e:
            refusal = f"cannot save step {step} to {folder}: {_failure(e)}"
    refusal = agree(refusal)
    if refusal:
        raise CheckpointError(refusal)
    try:
        _write(path, step, model, optimizer, scheduler, state, files)
    except _WriteFailed as e:
        if _rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        on = f" (rank {e.rank})" if _world() > 1 else ""
        raise CheckpointError(f"cannot save step {step} to {folder}{on}: {e.reason}") from None
    if _rank() == 0:
        try:
            _write_atomic(folder / "latest", path.name + "\n")
        except OSError as e:  # the checkpoint is valid without it: resuming never reads it
            print(f"warning: cannot update {folder / 'latest'}: {_failure(e)}", flush=True)
    _barrier()
    return path


class _WriteFailed(Exception):
    """A write of a save failed on ``rank`` (raised on every rank alike)."""

    def __init__(self, rank: int, reason: str):
        super().__init__(reason)
        self.rank, self.reason = rank, reason


def _together(write) -> None:
    """Run ``write()`` on every rank, then raise _WriteFailed on all of them if it failed on
    any: a rank whose write failed must not leave its peers waiting in the next collective."""
    error = None
    try:
        write()
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - any failure, every rank
        error = _failure(e)
    errors = [error]
    if dist.is_initialized():
        errors = [None] * _world()
        dist.all_gather_object(errors, error)
    for rank, reason in enumerate(errors):
        if reason:
            raise _WriteFailed(rank, reason)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (a view: writing it writes ``t``)."""
    return t.to_local() if hasattr(t, "to_local") else t


def first_non_finite(tensors: dict) -> str | None:
    """The name of the first of ``tensors`` ({name: tensor}) holding a non-finite value, or
    ``None``; a DTensor by its local shard."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            local = local_part(t.detach())
            if local.numel() and not torch.isfinite(local).all():
                return name
    return None


class _NotFinite(Exception):
    """A tensor of the state to save holds a non-finite value: no valid checkpoint can hold it."""


def _write(path: Path, step: int, model, optimizer, scheduler, state: dict, files) -> None:
    """The files of a checkpoint, the manifest last (a collective)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)

    def shards() -> None:
        tensors = {f"model.{k}": v for k, v in model_sd.items()}
        for name, entries in optim_sd.get("state", {}).items():
            tensors.update({f"optimizer state {k} of {name}": v for k, v in entries.items()})
        bad = first_non_finite(tensors)
        if bad is not None:  # Note [Non-finite updates]: the update check makes this rare
            raise _NotFinite(f"{bad} holds a non-finite value, which no checkpoint may hold")
        with _one_process_quietly():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))

    def own_files() -> None:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, path / f"rng_rank{_rank()}.pt")
        if _rank() == 0:
            meta = {"step": step, "scheduler": scheduler.state_dict(), **state}
            _write_atomic(path / STATE, json.dumps(meta))
            _write_files(path / HF_FOLDER, files or {})

    _together(shards)
    _together(own_files)
    names = agree(_listing(path))
    sums = _hash_shared(path, names)

    def manifest() -> None:
        if _rank() == 0:
            listed = {n: {"size": (path / n).stat().st_size, "sha256": sums[n]} for n in names}
            text = json.dumps({"format": FORMAT, "step": step, "files": listed})
            _write_atomic(path / MANIFEST, text)

    _together(manifest)


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    if not files:
        return
    folder.mkdir(exist_ok=True)
    for name, contents in files.items():
        (folder / name).write_bytes(contents)


def _listing(path: Path) -> list[str]:
    """The files of a checkpoint the manifest covers, as paths relative to it."""
    names = []
    for root, _, files in os.walk(path):
        for n in files:
            rel = os.path.relpath(os.path.join(root, n), path)
            if rel != MANIFEST and not n.endswith(".tmp"):
                names.append(rel.replace(os.sep, "/"))
    return sorted(names)


def check_listing(path: Path) -> tuple[dict | None, str | None]:
    """(manifest, problem) from what can be checked without reading the shards: the manifest,
    and every file it lists being there with its size."""
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None, UNFINISHED
    except OSError as e:
        return None, f"cannot read {MANIFEST}: {e.strerror}"
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        step = int(manifest["step"])
    except (ValueError, KeyError, TypeError):
        return None, f"{MANIFEST} is not a manifest of format {FORMAT}"
    if manifest.get("format") != FORMAT or path.name != f"step_{step:08d}" or STATE not in files:
        return None, f"{MANIFEST} is not a manifest of format {FORMAT} for {path.name}"
    for name, entry in sorted(files.items()):
        if not isinstance(entry, dict):
            return None, f"{MANIFEST} is not a manifest of format {FORMAT} (entry {name})"
        try:
            size = (path / name).stat().st_size
        except OSError:
            return None, f"file {name} is missing"
        if size != entry.get("size"):
            return None, f"file {name} has {size} bytes, the manifest says {entry.get('size')}"
    return manifest, None


def hash_problem(path: Path, manifest: dict, *, shared: bool = True) -> str | None:
    """The first file of ``manifest`` whose checksum differs, as a problem, or ``None``.
    ``shared``: a collective, the ranks hashing a share each."""
    names = sorted(manifest["files"])
    sums = _hash_shared(path, names) if shared else {n: _sha256(path / n) for n in names}
    for name in names:
        if sums.get(name) != manifest["files"][name].get("sha256"):
            return f"file {name} does not match its checksum (corrupted)"
    return None


def _read_latest(folder: Path) -> tuple[str | None, str | None]:
    """(name in ``latest``, problem reading it); (None, None) when there is no ``latest``."""
    try:
        text = (folder / "latest").read_bytes().decode("utf-8").strip()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot read {folder / 'latest'}: {e.strerror}"
    except UnicodeDecodeError:
        return None, f"{folder / 'latest'} is not text"
    if not _STEP_DIR.fullmatch(text):
        return None, f"{folder / 'latest'} holds {text[:40]!r}, not a step_NNNNNNNN name"
    return text, None


def select(folder: str | Path, *, step: int | None = None) -> Selection:
    """The newest valid checkpoint in ``folder``, or the one of ``step`` (a collective; every rank
    gets rank 0's view of the folder and hashes a share). Only unfinished saves (a kill during
    the first save) select none, with a warning each: they hold nothing that was ever valid.
    Raises CheckpointError when the folder cannot be read, holds finished checkpoints of which
    none is valid, or when ``step``'s is missing, damaged or older than a valid one the run
    would write over."""
    folder = Path(folder)
    found = None
    if _rank() == 0:
        try:
            dirs = step_dirs(folder)
            found = ([(d, *check_listing(d)) for d in dirs], _read_latest(folder))
        except CheckpointError as e:
            found = str(e)
    found = agree(found)
    if isinstance(found, str):
        raise CheckpointError(found)
    candidates, (latest_name, latest_problem) = found
    if step is not None:
        return Selection(_chosen_step(folder, step, candidates), [])
    warnings, passed = [], []
    chosen = None
    for path, manifest, problem in candidates:
        problem = problem or hash_problem(path, manifest)
        if problem is None:
            chosen = path
            break
        passed.append(f"{path.name}: {problem}")
    unfinished = all(problem == UNFINISHED for _, _, problem in candidates)
    if candidates and chosen is None and not unfinished:
        raise CheckpointError(
            f"no valid checkpoint in {folder} ({'; '.join(passed)}): move the damaged "
            "step_* directories away to start from step 0"
        )
    for line in passed:
        kind = "unfinished" if line.endswith(UNFINISHED) else "damaged"
        warnings.append(f"warning: skipped the {kind} checkpoint {folder}/{line}")
    if latest_problem:
        warnings.append(f"warning: {latest_problem}; ignored")
    elif chosen is not None and latest_name not in (None, chosen.name):
        warnings.append(
            f"warning: {folder / 'latest'} names {latest_name}, but the newest valid checkpoint "
            f"is {chosen.name}; using {chosen.name}"
        )
    return Selection(chosen, warnings)


def _chosen_step(folder: Path, step: int, candidates: list) -> Path:
    """``step``'s checkpoint among ``candidates`` (path, manifest, problem), checked whole: a
    run from it would save the steps after it, so no valid newer one may exist."""
    name = f"step_{step:08d}"
    mine = [c for c in candidates if c[0].name == name]
    if not mine:
        held = ", ".join(path.name for path, _, _ in candidates) or "none"
        raise CheckpointError(f"--resume-step {step}: no {name} in {folder} (it holds: {held})")
    newer = [
        path.name
        for path, manifest, problem in candidates
        if path.name > name and not (problem or hash_problem(path, manifest))
    ]
    if newer:
        raise CheckpointError(
            f"--resume-step {step}: {folder} holds newer checkpoints ({', '.join(newer)}) that "
            f"this run would write over; move them to another directory to train on from {name}"
        )
    path, manifest, problem = mine[0]
    problem = problem or hash_problem(path, manifest)
    if problem:
        raise CheckpointError(f"--resume-step {step}: {path} is damaged ({problem})")
    return path


def read_state(path: str | Path) -> dict:
    """``train_state.json`` of a checkpoint :func:`select` found valid, its fields checked:
    checkpoints are trusted input, but one edited by hand must fail with a line naming the
    field, not a traceback or a silently wrong resume. Raises CheckpointError."""
    path = Path(path)
    where = path / STATE
    try:
        meta = json.loads(where.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: cannot read it ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    named = _STEP_DIR.fullmatch(path.name)
    problem = _state_problem(meta, int(named[1]) if named else None)
    if problem:
        raise CheckpointError(f"{where}: {problem}: restore the file or resume another step")
    return meta


def _state_problem(meta: dict, step: int | None) -> str | None:
    """What is wrong with a checkpoint's state (``step``: the one its directory names)."""

    def count(value, minimum: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= minimum

    if not count(meta.get("step"), 1):
        return f"'step' must be an integer >= 1, got {meta.get('step')!r}"
    if step is not None and meta["step"] != step:
        return f"'step' is {meta['step']} but the directory holds step {step}"
    for key, value in (meta.get("accounting") or {}).items():
        if not count(value, 0):
            return f"'accounting.{key}' must be an integer >= 0, got {value!r}"
    schedule = meta.get("schedule")
    if schedule is not None and not (
        isinstance(schedule, dict)
        and count(schedule.get("warmup"), 0)
        and count(schedule.get("decay_steps"), 1)
    ):
        return f"'schedule' must hold an integer warmup >= 0 and decay_steps >= 1, got {schedule!r}"
    return None


def load(path: str | Path, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, schedule and RNG from a checkpoint saved by :func:`save`;
    returns its ``train_state.json``."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _one_process_quietly():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    meta = read_state(path)
    scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / f"rng_rank{_rank()}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved
        rng = torch.load(rng_file, weights_only=True)  # tensors only: nothing else to unpickle
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


__all__ = [
    "CheckpointError",
    "Selection",
    "existing",
    "load",
    "read_state",
    "save",
    "select",
    "step_dirs",
]
