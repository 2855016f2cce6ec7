"""``hdp-export``: a checkpoint of ``pretrain.py`` (written by any number of ranks) as a Hugging
Face model directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    hdp-export --checkpoint-dir out/ckpt --out out/hf-model [--step N] [--dtype bf16]

One CPU process reads the checkpoint's weights tensor by tensor (DCP reads only the byte ranges
of each), converts them, and writes safetensors shards of at most ``--max-shard-size``: it holds
at most one shard's tensors. ``config.json`` is the run's (``hf/config.json`` in the checkpoint:
the source model's config with the run's RoPE and ``max_position_embeddings``, or one built from
the preset), and the run's tokenizer and generation files are copied beside it. The checkpoint is
checked against its manifest before anything in it is unpickled; the output directory is written
under a temporary name and renamed when complete, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from hdp import model_preset
from hdp.argtypes import byte_size, choice, command, input_dir, integer, output_dir
from hdp.hf_config import ConfigError, export_config, read_config, spec_from_config, with_dtype

from . import checkpoint
from .checkpoint import HF_FOLDER, CheckpointError
from .hf_weights import hf_parameters
from .model import Llama

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CONFIG_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_SHARD_BYTES = 5 * 10**9


class ExportError(Exception):
    """What stops an export: one line naming the file or flag."""


@dataclass(frozen=True)
class Tensor:
    """One weight of the export: hdp's key in the checkpoint, transformers' name, its shape."""

    key: str
    name: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def chosen_checkpoint(folder: Path, step: int | None, log) -> Path:
    """The checkpoint to export: ``step``'s, or the newest valid one; checked whole against its
    manifest (sizes and SHA-256) before any file of it is read."""
    if step is None:
        try:
            found = checkpoint.select(folder)
        except CheckpointError as e:
            raise ExportError(str(e)) from None
        for line in found.warnings:
            log(line)
        if found.path is None:
            raise ExportError(f"--checkpoint-dir {folder}: holds no step_* checkpoint")
        return found.path
    path = folder / f"step_{step:08d}"
    if not path.is_dir():
        held = ", ".join(d.name for d in checkpoint.step_dirs(folder)) or "none"
        raise ExportError(f"--step {step}: no {path.name} in {folder} (it holds: {held})")
    manifest, problem = checkpoint.check_listing(path)
    problem = problem or checkpoint.hash_problem(path, manifest, shared=False)
    if problem:
        raise ExportError(f"{path} is damaged ({problem})")
    return path


def run_config(path: Path) -> dict:
    """The transformers config the checkpoint's run trains: ``hf/config.json``, or, for a
    checkpoint saved before runs carried one, the config of its preset."""
    file = path / HF_FOLDER / "config.json"
    if file.exists():
        return read_config(file)
    state = checkpoint.read_state(path)
    model = state.get("fingerprint", {}).get("model", {})
    try:
        spec = model_preset(model.get("model"))
    except ValueError:
        raise ExportError(
            f"{path}: no {HF_FOLDER}/config.json and no model preset named in its state"
        ) from None
    max_seq = int(state.get("fingerprint", {}).get("data", {}).get("max_seq") or 4096)
    return export_config(spec, source=None, max_positions=max_seq, dtype="float32")


def tensors_of(path: Path, config: dict) -> list[Tensor]:
    """The weights to export, in transformers' names, checked against what the config's model
    holds: every one of them, with its shape."""
    from torch.distributed.checkpoint import FileSystemReader

    spec = spec_from_config(config, name="export", where=str(path / HF_FOLDER / "config.json"))
    with torch.device("meta"):
        model = Llama(spec)
    wanted = {hdp: (hf, tuple(p.shape)) for hf, (hdp, p) in hf_parameters(model).items()}
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    left = {k for k in stored if k.startswith("model.")} - {f"model.{n}" for n in wanted}
    # A tied LM head is saved under both names; it is the embedding.
    left -= {"model.lm_head.weight"} if spec.tied_embeddings else set()
    if left:
        raise ExportError(
            f"{path}: holds {sorted(left)[0]}, which config.json's {spec.architecture} model has "
            "no place for"
        )
    out = []
    for name, (hf, shape) in wanted.items():
        meta = stored.get(f"model.{name}")
        if meta is None or not hasattr(meta, "size"):
            raise ExportError(f"{path}: lacks the weight model.{name} that config.json's model has")
        if tuple(meta.size) != shape:
            raise ExportError(
                f"{path}: model.{name} has shape {list(meta.size)}, config.json makes it "
                f"{list(shape)}"
            )
        out.append(Tensor(f"model.{name}", hf, shape))
    return out


def shard(tensors: list[Tensor], max_bytes: int, itemsize: int) -> list[list[Tensor]]:
    """Consecutive groups of at most ``max_bytes`` each (a larger tensor alone in its group)."""
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.elements * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups


def export(
    folder: Path,
    out: Path,
    *,
    step: int | None = None,
    dtype: str = "bf16",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    log=print,
) -> Path:
    """Write the checkpoint in ``folder`` (``step``'s, or the newest valid) as a Hugging Face
    model directory ``out``; returns the checkpoint exported. Raises :class:`ExportError`."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory: choose a new one")
    if out.resolve().is_relative_to(folder.resolve()):
        raise ExportError(
            f"--out {out} lies inside --checkpoint-dir {folder}: choose another place"
        )
    path = chosen_checkpoint(folder, step, log)
    config = with_dtype(run_config(path), _CONFIG_DTYPE[dtype])
    tensors = tensors_of(path, config)
    torch_dtype = DTYPES[dtype]
    groups = shard(tensors, max_shard_bytes, torch_dtype.itemsize)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        weight_map, total = {}, 0
        for i, group in enumerate(groups):
            t0 = time.perf_counter()
            name = (
                "model.safetensors"
                if len(groups) == 1
                else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            )
            part = {}
            for t in group:
                full = torch.empty(t.shape, dtype=torch.float32)
                with warnings.catch_warnings():  # "assuming the intent is to load in a single..."
                    warnings.filterwarnings("ignore", "torch.distributed is disabled")
                    dcp.load(
                        {t.key: full}, storage_reader=FileSystemReader(str(path)), no_dist=True
                    )
                if checkpoint.first_non_finite({t.key: full}):
                    raise ExportError(
                        f"{path}: {t.key} holds non-finite values (no valid checkpoint does): "
                        "export another step with --step"
                    )
                part[t.name] = full.to(torch_dtype)
                del full
            save_file(part, str(tmp / name), metadata={"format": "pt"})
            nbytes = sum(x.numel() * x.element_size() for x in part.values())
            total += nbytes
            weight_map.update({t.name: name for t in group})
            del part
            log(
                f"wrote {name}: {len(group)} tensors, {nbytes / 1e6:,.1f} MB in "
                f"{time.perf_counter() - t0:.1f} s"
            )
        if len(groups) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in sorted((path / HF_FOLDER).glob("*")):
            if file.name != "config.json" and file.is_file():
                shutil.copyfile(file, tmp / file.name)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


@command
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hdp-export",
        description="Write a pretrain.py checkpoint as a Hugging Face model directory "
        "(config.json, safetensors shards and index, tokenizer files).",
        epilog="example: hdp-export --checkpoint-dir out/ckpt --out out/hf-model --dtype bf16",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=input_dir,
        required=True,
        help="pretrain.py's --checkpoint-dir (trusted input: its metadata is a pickle; the "
        "manifest's checksums are checked before it is read)",
    )
    p.add_argument(
        "--step",
        type=integer(1),
        default=None,
        help="the checkpoint of this step (default: the newest valid one)",
    )
    p.add_argument(
        "--out", type=output_dir, required=True, help="the new model directory (new or empty)"
    )
    p.add_argument(
        "--max-shard-size",
        type=byte_size,
        default=DEFAULT_SHARD_BYTES,
        metavar="SIZE",
        help="largest safetensors file, e.g. 5GB (default), 500MB, 2GiB",
    )
    p.add_argument(
        "--dtype",
        type=choice(list(DTYPES), "dtype"),
        default="bf16",
        help="dtype of the exported weights: bf16 (default), fp16, fp32",
    )
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        path = export(
            args.checkpoint_dir,
            args.out,
            step=args.step,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_size,
        )
    except (ExportError, CheckpointError, ConfigError) as e:
        print(f"hdp-export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {path} to {args.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
