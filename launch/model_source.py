"""Where a run's model comes from: a preset, a transformers ``config.json``, or a Hugging Face
checkpoint (``--init-from``), with ``--rope-theta`` / ``--rope-scaling`` applied; and what of it
travels with every checkpoint so that ``hdp-export`` can write a Hugging Face model back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hdp import MODEL_PRESETS, ModelSpec, model_spec
from hdp.hf_config import (
    MODEL_FIELDS,
    WEIGHT_FIELDS,
    export_config,
    read_config,
    shape_differences,
    spec_from_config,
    with_rope_overrides,
)

from .hf_weights import GENERATION_CONFIG, TOKENIZER_FILES, HFCheckpoint, open_checkpoint

if TYPE_CHECKING:
    from .config import ModelConfig

DEFAULT_MODEL = "tiny"


@dataclass(frozen=True)
class ModelSource:
    """The run's model: its spec (RoPE overrides applied), the transformers config it came from
    (``None`` for a preset), the checkpoint it starts from (``--init-from``), the tokenizer for
    ``text`` records and the tokenizer and generation files an export carries."""

    spec: ModelSpec
    config: dict[str, Any] | None = None
    checkpoint: HFCheckpoint | None = None
    tokenizer: Path | None = None
    companions: dict[str, Path] = field(default_factory=dict)
    rope_overridden: bool = False

    def fingerprint(self) -> dict[str, Any]:
        """The resume fingerprint's ``model`` section: the preset's name alone (as before
        configs could be read), or the architecture and RoPE that define the weights' meaning."""
        spec = self.spec
        if self.config is None and not self.rope_overridden:
            return {"model": spec.name}
        shape = {f: getattr(spec, f) for f in WEIGHT_FIELDS}
        shape.update(norm_eps=spec.norm_eps, padding_idx=spec.padding_idx)
        return {"model": spec.architecture, "shape": shape, "rope": spec.rope.to_hf()}

    def hf_files(self, max_seq: int) -> dict[str, bytes]:
        """What a checkpoint's ``hf/`` folder holds: the config an export writes (fp32 weights,
        ``max_position_embeddings`` at least ``max_seq``) and the companion files, read now so
        that checkpoints never depend on the source directory staying in place."""
        config = export_config(
            self.spec, source=self.config, max_positions=max_seq, dtype="float32"
        )
        files = {"config.json": json.dumps(config, indent=2).encode()}
        files.update({name: path.read_bytes() for name, path in self.companions.items()})
        return files


def model_source(model: ModelConfig, tokenizer: Path | None = None) -> ModelSource:
    """The :class:`ModelSource` of the model's flags (``--model``, ``--init-from``,
    ``--rope-theta``, ``--rope-scaling``) and ``--tokenizer``. Raises ValueError with one line
    naming the flag, file and field at fault."""
    checkpoint = open_checkpoint(model.init_from) if model.init_from else None
    config: dict[str, Any] | None = None
    if checkpoint is not None:
        spec, config = checkpoint.spec, checkpoint.config
        if model.name_or_config is not None:
            named = model_spec(model.name_or_config)
            differ = shape_differences(named, spec, MODEL_FIELDS)
            if differ:
                raise ValueError(
                    f"--model {model.name_or_config} is not the model of "
                    f"--init-from {model.init_from} "
                    f"({'; '.join(differ[:3])}): leave --model out, the checkpoint's config.json "
                    "sets the architecture (--rope-theta and --rope-scaling change its RoPE)"
                )
    elif model.name_or_config is not None and model.name_or_config not in MODEL_PRESETS:
        file = Path(model.name_or_config)
        file = file / "config.json" if file.is_dir() else file
        config = read_config(file)
        spec = spec_from_config(config, name=file.resolve().parent.name, where=str(file))
    else:
        spec = model_spec(model.name_or_config or DEFAULT_MODEL)
    overridden = model.rope_theta is not None or model.rope_scaling is not None
    if overridden:
        spec = with_rope_overrides(
            spec,
            theta=model.rope_theta,
            scaling=model.rope_scaling,
            max_positions=(config or {}).get("max_position_embeddings"),
            where="--rope-scaling",
        )
    tokenizer = tokenizer_file(tokenizer, checkpoint)
    companions = companion_files(tokenizer, checkpoint)
    return ModelSource(spec, config, checkpoint, tokenizer, companions, overridden)


def tokenizer_file(flag: str | Path | None, checkpoint: HFCheckpoint | None) -> Path | None:
    """The ``tokenizer.json`` for ``text`` records: ``--tokenizer`` (the file, or a directory
    holding one), else the ``--init-from`` directory's own, else ``None`` (UTF-8 bytes)."""
    if flag is not None:
        path = Path(flag)
        if path.is_dir():
            path = path / "tokenizer.json"
            if not path.is_file():
                raise ValueError(f"--tokenizer {flag}: the directory holds no tokenizer.json")
        return path
    if checkpoint is not None and (checkpoint.directory / "tokenizer.json").is_file():
        return checkpoint.directory / "tokenizer.json"
    return None


def companion_files(tokenizer: Path | None, checkpoint: HFCheckpoint | None) -> dict[str, Path]:
    """{name in an export: file}: the tokenizer's files (those beside it in its directory; the
    tokenizer itself as ``tokenizer.json``) and the ``--init-from`` directory's generation
    config."""
    found: dict[str, Path] = {}
    if tokenizer is not None:
        folder = tokenizer.parent
        found = {n: folder / n for n in TOKENIZER_FILES if (folder / n).is_file()}
        found["tokenizer.json"] = tokenizer
    if checkpoint is not None and (checkpoint.directory / GENERATION_CONFIG).is_file():
        found[GENERATION_CONFIG] = checkpoint.directory / GENERATION_CONFIG
    return found


__all__ = ["DEFAULT_MODEL", "ModelSource", "companion_files", "model_source"]
