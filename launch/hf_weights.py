"""Hugging Face checkpoints into hdp's model: a directory's ``config.json`` and safetensors
weights, checked whole before anything is read, then loaded into each rank's FSDP2 shards.

Note [Loading a checkpoint into shards]
---------------------------------------
The model is built on the meta device and sharded first, so no rank ever holds a whole tensor.
FSDP2 splits each parameter along its first dimension as ``torch.chunk`` does: with ``W`` ranks a
tensor of ``n`` rows gives rank ``r`` rows ``[r * c, min(n, (r + 1) * c))``, ``c = ceil(n / W)``.
A safetensors file stores each tensor row-major at a byte range its header names, so those rows
are one contiguous range of the file: each rank reads exactly its rows, in pieces of at most
``_READ_BYTES``, straight into its shard (converting the dtype), one file after another. Example:
``model.embed_tokens.weight`` of 101 x 64 bf16 values on 4 ranks: rank 3 reads rows 78-100, the
23 * 64 * 2 bytes starting 78 * 128 bytes into the tensor's range.

Reading with ``readinto`` instead of a memory map keeps the file's pages out of the rank's
resident memory, so a rank's peak is its shards plus one piece.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from hdp import ModelSpec
from hdp.hf_config import ConfigError, read_config, spec_from_config

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Files beside the weights that a served or evaluated model needs: the tokenizer's and the
# generation defaults. They travel into hdp's checkpoints and out with an export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG = "generation_config.json"

# safetensors dtype names; the floating ones are what a weight may be stored as.
FLOAT_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
DTYPE_NAMES = {v: k for k, v in FLOAT_DTYPES.items()}

# hdp's parameter names and transformers', for every architecture hdp computes.
_TO_HF = [
    (re.compile(r"embed\.weight"), "model.embed_tokens.weight"),
    (re.compile(r"norm\.weight"), "model.norm.weight"),
    (re.compile(r"lm_head\.weight"), "lm_head.weight"),
    (re.compile(r"layers\.(\d+)\.attn_norm\.weight"), r"model.layers.\1.input_layernorm.weight"),
    (
        re.compile(r"layers\.(\d+)\.mlp_norm\.weight"),
        r"model.layers.\1.post_attention_layernorm.weight",
    ),
    (re.compile(r"layers\.(\d+)\.attn\.(\w+)\.(weight|bias)"), r"model.layers.\1.self_attn.\2.\3"),
    (re.compile(r"layers\.(\d+)\.mlp\.(\w+)\.(weight|bias)"), r"model.layers.\1.mlp.\2.\3"),
]
# Tensors of old checkpoints that transformers recomputes and ignores too.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_READ_BYTES = 64 << 20


class WeightsError(ValueError):
    """A checkpoint directory hdp cannot load: one line naming the file and the tensor."""


def hf_name(name: str) -> str:
    """transformers' name of hdp's parameter ``name`` (``layers.0.attn.q_proj.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``)."""
    for pattern, replacement in _TO_HF:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    raise KeyError(f"no transformers name for hdp parameter {name!r}")


def hf_parameters(model: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
    """{transformers name: (hdp name, parameter)} of ``model``; a tied LM head appears once, as
    the embedding."""
    return {hf_name(name): (name, p) for name, p in model.named_parameters()}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in a safetensors file: absolute byte range, dtype name, shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _differ(a: StoredTensor | None, b: StoredTensor | None, chunk: int = 1 << 26) -> bool:
    """Whether two stored tensors hold different bytes (``False`` where either is absent), read
    a chunk at a time."""
    if a is None or b is None:
        return False
    if (a.dtype, a.shape, a.end - a.begin) != (b.dtype, b.shape, b.end - b.begin):
        return True
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        fa.seek(a.begin)
        fb.seek(b.begin)
        left = a.end - a.begin
        while left > 0:
            n = min(chunk, left)
            if fa.read(n) != fb.read(n):
                return True
            left -= n
    return False


def _regular_file(path: Path, what: str) -> None:
    """Raise :class:`WeightsError` unless ``path`` is a regular file (not a directory, a FIFO
    that would block the read, or a broken or looping link)."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise WeightsError(f"{path}: cannot read {what}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise WeightsError(f"{path}: {what} is not a regular file")


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its header alone, each checked to lie in the
    file's data, apart from the others."""
    _regular_file(path, "the weights file")
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise WeightsError(f"{path}: not a safetensors file (shorter than its header)")
            (size,) = struct.unpack("<Q", raw)
            if size > 100 << 20:
                raise WeightsError(f"{path}: not a safetensors file (header of {size} bytes)")
            header = json.loads(f.read(size))
            file_size = f.seek(0, 2)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError:
        raise WeightsError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: not a safetensors file (its header is not a JSON object)")
    base = 8 + size
    out = {name: _entry(path, name, entry, base) for name, entry in header.items()}
    out.pop("__metadata__", None)
    previous = None
    for t in sorted(out.values(), key=lambda t: (t.begin, t.end)):
        if t.end > file_size:
            raise WeightsError(
                f"{path}: tensor {_name_of(out, t)} ends at byte {t.end} but the file has "
                f"{file_size} bytes (truncated?)"
            )
        if previous is not None and t.begin < previous.end:
            raise WeightsError(
                f"{path}: tensors {_name_of(out, previous)} and {_name_of(out, t)} overlap"
            )
        previous = t
    return out


def _entry(path: Path, name: str, entry: object, base: int) -> StoredTensor | None:
    """One header entry, its fields checked (``None`` for ``__metadata__``)."""
    if name == "__metadata__":
        return None
    try:
        begin, end = entry["data_offsets"]
        shape, dtype = entry["shape"], entry["dtype"]
        ints = [begin, end, *shape]
        valid = all(type(x) is int and x >= 0 for x in ints) and isinstance(dtype, str)
    except (KeyError, TypeError, ValueError):
        valid = False
    if not valid or begin > end:
        raise WeightsError(f"{path}: tensor {name}: malformed header entry")
    return StoredTensor(path, dtype, tuple(shape), base + begin, base + end)


def _name_of(tensors: dict[str, StoredTensor], t: StoredTensor) -> str:
    return next(n for n, x in tensors.items() if x is t)


class HFCheckpoint:
    """A Hugging Face model directory: ``config.json``, ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json``, and optionally tokenizer files. Opening it reads the config
    and every weight file's header, nothing more; :meth:`check` compares them with a model,
    :meth:`load_into` fills the model."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise WeightsError(f"--init-from {self.directory}: not a directory")
        self.config: dict[str, Any] = read_config(self.directory / "config.json")
        self.spec: ModelSpec = spec_from_config(
            self.config,
            name=self.directory.resolve().name,
            where=str(self.directory / "config.json"),
        )
        self.tensors = self._tensors()
        # transformers 5 unties a tied head whose checkpoint stores other values for it
        # (tests/test_hf_models.py shows it): train the model it loads.
        self.untied_head = self.spec.tied_embeddings and _differ(
            self.tensors.get("lm_head.weight"), self.tensors.get("model.embed_tokens.weight")
        )
        if self.untied_head:
            self.spec = replace(self.spec, tied_embeddings=False)

    def _tensors(self) -> dict[str, StoredTensor]:
        single, index = self.directory / WEIGHTS, self.directory / INDEX
        if os.path.lexists(index):
            return self._indexed(index)
        if os.path.lexists(single):
            return read_header(single)
        if any(self.directory.glob("*.bin")):
            raise WeightsError(
                f"{self.directory}: holds PyTorch .bin weights; hdp reads safetensors (convert "
                "with transformers: from_pretrained, then save_pretrained)"
            )
        raise WeightsError(f"{self.directory}: no {WEIGHTS} or {INDEX}")

    def _indexed(self, index: Path) -> dict[str, StoredTensor]:
        """The tensors of the shards an index lists, each where the index places it."""
        _regular_file(index, "the index")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            pairs = list(weight_map.items())
        except OSError as e:
            raise WeightsError(f"{index}: cannot read: {e.strerror}") from None
        except (ValueError, KeyError, TypeError, AttributeError):
            raise WeightsError(f"{index}: not a safetensors index (no weight_map)") from None
        for name, file in pairs:
            if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                raise WeightsError(
                    f"{index}: places tensor {name} in {file!r}, not a file name in "
                    f"{self.directory}"
                )
        found: dict[str, StoredTensor] = {}
        for file in sorted({f for _, f in pairs}):
            if not os.path.lexists(self.directory / file):
                raise WeightsError(f"{index}: lists {file}, which is not in {self.directory}")
            for name, stored in read_header(self.directory / file).items():
                if name in found:
                    raise WeightsError(
                        f"{self.directory}: tensor {name} is in both {found[name].file.name} "
                        f"and {file}"
                    )
                found[name] = stored
        for name, file in pairs:
            if name not in found or found[name].file.name != file:
                raise WeightsError(
                    f"{self.directory / file}: lacks tensor {name}, which {index.name} places there"
                )
        return found

    def check(self, model: nn.Module) -> None:
        """Raise :class:`WeightsError`, naming the file and the tensor, unless the checkpoint holds
        exactly ``model``'s weights in floating-point dtypes of the right shapes."""
        wanted = hf_parameters(model)
        for name, (_, p) in wanted.items():
            stored = self.tensors.get(name)
            if stored is None:
                raise WeightsError(f"{self.directory}: lacks tensor {name}, which the model needs")
            if stored.dtype not in FLOAT_DTYPES:
                raise WeightsError(
                    f"{stored.file}: tensor {name} has dtype {stored.dtype}; weights must be "
                    f"floating point ({', '.join(FLOAT_DTYPES)})"
                )
            if stored.shape != tuple(p.shape):
                raise WeightsError(
                    f"{stored.file}: tensor {name} has shape {list(stored.shape)}, but "
                    f"config.json makes it {list(p.shape)}"
                )
            elements = math.prod(stored.shape)
            if stored.end - stored.begin != elements * FLOAT_DTYPES[stored.dtype].itemsize:
                raise WeightsError(
                    f"{stored.file}: tensor {name}: its byte range does not fit its shape"
                )
        tied = getattr(model, "spec", None) is not None and model.spec.tied_embeddings
        for name, stored in sorted(self.tensors.items()):
            # A tied checkpoint may still carry its LM head (equal to the embedding: a different
            # one unties the model when the checkpoint opens).
            if name in wanted or _IGNORED.fullmatch(name) or (tied and name == "lm_head.weight"):
                continue
            raise WeightsError(
                f"{stored.file}: unexpected tensor {name}: hdp's {self.spec.architecture} model "
                "has no such weight"
            )

    @torch.no_grad()
    def load_into(self, model: nn.Module) -> None:
        """Fill ``model``'s parameters (plain tensors, or FSDP2 shards) from the checkpoint, one
        file at a time, each rank reading only its own rows (Note [Loading a checkpoint into
        shards])."""
        self.check(model)
        by_file: dict[Path, list[tuple[str, nn.Parameter]]] = {}
        for name, (_, p) in hf_parameters(model).items():
            by_file.setdefault(self.tensors[name].file, []).append((name, p))
        staging = torch.empty(0, dtype=torch.uint8)
        for file in sorted(by_file):
            with open(file, "rb", buffering=0) as f:
                for name, p in by_file[file]:
                    local, first_row = local_rows(p)
                    staging = _read_rows(f, self.tensors[name], local, first_row, staging)


def local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's part of ``p``, the index of its first row in the whole tensor): all of a plain
    tensor, a DTensor's ``Shard(0)`` chunk (Note [Loading a checkpoint into shards])."""
    if not hasattr(p, "device_mesh"):
        return p.data, 0
    placements = tuple(p.placements)
    if len(placements) != 1 or getattr(placements[0], "dim", None) != 0:
        raise NotImplementedError(f"loading into placements {placements}: only Shard(0) is read")
    local = p.to_local()
    chunk = math.ceil(p.shape[0] / p.device_mesh.size()) if p.shape[0] else 0
    first = p.device_mesh.get_coordinate()[0] * chunk
    if first + local.shape[0] > p.shape[0] or (local.shape[0] and first >= p.shape[0]):
        raise RuntimeError(
            f"shard of {local.shape[0]} rows at row {first} lies outside {tuple(p.shape)}"
        )
    return local, first


def _read_rows(
    f, stored: StoredTensor, out: torch.Tensor, first_row: int, staging: torch.Tensor
) -> torch.Tensor:
    """Rows ``[first_row, first_row + len(out))`` of ``stored`` into ``out``: straight into a CPU
    tensor of the stored dtype, else through ``staging`` (grown as needed, returned for the next
    call) in pieces of at most ``_READ_BYTES``, converted on the copy."""
    rows = out.shape[0] if out.dim() else 1
    if rows == 0:
        return staging
    dtype = FLOAT_DTYPES[stored.dtype]
    row_elems = math.prod(stored.shape[1:])
    row_bytes = row_elems * dtype.itemsize
    flat = out.view(rows, row_elems)
    f.seek(stored.begin + first_row * row_bytes)
    if out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous():
        _read_exactly(f, flat.view(torch.uint8).view(-1), stored.file)
        return staging
    step = max(1, _READ_BYTES // max(row_bytes, 1))
    if staging.numel() < min(rows, step) * row_bytes:
        staging = torch.empty(min(rows, step) * row_bytes, dtype=torch.uint8)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        piece = staging[: (b - a) * row_bytes]
        _read_exactly(f, piece, stored.file)
        flat[a:b].copy_(piece.view(dtype).view(b - a, row_elems))
    return staging


def _read_exactly(f, into: torch.Tensor, file: Path) -> None:
    """Fill the bytes of the CPU uint8 tensor ``into`` from ``f``."""
    view = memoryview(into.numpy())
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise WeightsError(f"{file}: ends inside a tensor (truncated?)")
        done += n


def open_checkpoint(directory: str | Path) -> HFCheckpoint:
    """:class:`HFCheckpoint` of ``directory``, its weights checked against its config's model (on
    the meta device: nothing is read but headers). A config hdp cannot train is a
    :class:`WeightsError` too, so callers catch one kind."""
    from .model import Llama

    try:
        checkpoint = HFCheckpoint(directory)
    except ConfigError as e:
        raise WeightsError(str(e)) from None
    with torch.device("meta"):
        checkpoint.check(Llama(checkpoint.spec))
    return checkpoint


__all__ = [
    "DTYPE_NAMES",
    "GENERATION_CONFIG",
    "FLOAT_DTYPES",
    "HFCheckpoint",
    "StoredTensor",
    "TOKENIZER_FILES",
    "WeightsError",
    "hf_name",
    "hf_parameters",
    "local_rows",
    "open_checkpoint",
    "read_header",
]
