"""Model architectures from Hugging Face ``config.json`` files, and config files for exports.

hdp's decoder (:class:`hdp.ModelSpec`) covers four ``model_type`` values of transformers: ``llama``
(Llama 2, 3, 3.1, 3.2), ``mistral``, ``qwen2`` (biases on q, k and v) and ``qwen3`` (RMSNorm on
each head's q and k, an explicit ``head_dim``). A config is read into a spec or refused with one
line naming the file and the field: MoE, MLA, sliding windows, other activations and every other
``model_type`` are outside what the decoder computes.

Note [Two spellings of RoPE]
----------------------------
transformers 4.x wrote RoPE as a top-level ``rope_theta`` plus an optional ``rope_scaling`` dict
whose kind is ``type`` (older) or ``rope_type``; 5.x writes one ``rope_parameters`` dict holding
``rope_type``, ``rope_theta`` and the scaling's parameters. Both are read into one :class:`RoPE`,
and an export writes the spelling its source used, so a 4.x checkpoint stays readable by 4.x.
For example, Llama 3.1 8B in 4.x form::

    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

reads as ``RoPE(theta=5e5, type="llama3", factor=8.0, original_max_positions=8192, ...)``, the
same value as its 5.x form ``"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
...}``. Values transformers derives are resolved here: a ``yarn`` ``attention_factor`` left out
is ``0.1 ln(factor) + 1`` (or the ``mscale`` ratio), and an ``original_max_position_embeddings``
left out is ``max_position_embeddings``. ``dynamic`` NTK scaling is refused: transformers changes
its frequencies with the longest sequence seen so far, a state no distributed step shares.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from .specs import ModelSpec, RoPE

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Each architecture's class name in transformers, written into an export's "architectures".
ARCHITECTURE_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Keys of a RoPE dict other than its kind and theta, per kind (HF names).
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
}

# Fields whose presence (with a value that turns them on) means an architecture hdp's decoder
# does not compute: mixture of experts, multi-head latent attention.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")


# Above any real model's dimension, below what a tensor shape takes on every platform.
_LARGEST = 1 << 31


class ConfigError(ValueError):
    """A config hdp cannot train: one line naming the file and the field."""


def _number(value: Any, field: str, where: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: {field} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{where}: {field} must be above 0, got {value!r}")
    return float(value)


def _count(value: Any, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < _LARGEST:
        raise ConfigError(
            f"{where}: {field} must be a whole number from 1 to {_LARGEST - 1}, got {value!r}"
        )
    return value


def _flag(c: dict[str, Any], field: str, where: str) -> bool:
    value = c.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {field} must be true or false, got {value!r}")
    return value


def rope_kind(params: Any, where: str) -> str:
    """The kind of a RoPE dict in either spelling, its keys checked against the kind's."""
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: the RoPE parameters must be a JSON object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if "type" in params and "rope_type" in params and params["type"] != params["rope_type"]:
        raise ConfigError(
            f"{where}: type {params['type']!r} and rope_type {params['rope_type']!r} disagree: "
            "keep one"
        )
    if kind == "dynamic":
        raise ConfigError(
            f"{where}: rope_type 'dynamic' is not supported: transformers rescales its frequencies "
            "with the longest sequence seen so far; use 'yarn' or 'linear' for context extension"
        )
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: rope_type {kind!r} is not supported (hdp computes {', '.join(ROPE_TYPES)})"
        )
    known = _ROPE_KEYS[kind] | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(
            f"{where}: RoPE field {unknown[0]!r} does not apply to rope_type {kind!r} "
            f"(it takes {', '.join(sorted(_ROPE_KEYS[kind])) or 'only rope_theta'})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"{where}: partial_rotary_factor {params['partial_rotary_factor']!r} is not "
            "supported: hdp rotates the whole head"
        )
    return kind


def rope_from_dict(
    params: dict[str, Any], *, theta: float | None, max_positions: int | None, where: str
) -> RoPE:
    """A :class:`RoPE` from one RoPE dict in either spelling (``type`` or ``rope_type``; its
    ``rope_theta``, else ``theta``, else 10000). ``max_positions`` is the config's
    ``max_position_embeddings``, which some kinds default to."""
    kind = rope_kind(params, where)
    base = params.get("rope_theta", theta if theta is not None else 10000.0)
    rope = RoPE(theta=_theta(base, where), type=kind)
    if kind == "default":
        return rope

    def get(key: str, default: Any = None) -> Any:
        value = params.get(key)
        return default if value is None else value

    original = get("original_max_position_embeddings", max_positions)
    factor = get("factor")
    if factor is None:
        raise ConfigError(f"{where}: rope_type {kind!r} needs 'factor'")
    rope = replace(rope, factor=_number(factor, "factor", where))
    if kind == "linear":
        return rope
    if original is None:
        raise ConfigError(f"{where}: rope_type {kind!r} needs 'original_max_position_embeddings'")
    rope = replace(
        rope, original_max_positions=_count(original, "original_max_position_embeddings", where)
    )
    if kind == "llama3":
        low, high = get("low_freq_factor"), get("high_freq_factor")
        if low is None or high is None:
            raise ConfigError(
                f"{where}: rope_type 'llama3' needs low_freq_factor and high_freq_factor"
            )
        low, high = _number(low, "low_freq_factor", where), _number(high, "high_freq_factor", where)
        if high <= low:
            raise ConfigError(
                f"{where}: high_freq_factor {high} must be above low_freq_factor {low}"
            )
        return replace(rope, low_freq_factor=low, high_freq_factor=high)
    attention = get("attention_factor")
    if attention is None:
        mscale, all_dim = get("mscale"), get("mscale_all_dim")
        attention = (
            _yarn_mscale(rope.factor, mscale) / _yarn_mscale(rope.factor, all_dim)
            if mscale and all_dim
            else _yarn_mscale(rope.factor)
        )
    truncate = get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}: truncate must be true or false, got {truncate!r}")
    fast = _number(get("beta_fast", 32.0), "beta_fast", where)
    slow = _number(get("beta_slow", 1.0), "beta_slow", where)
    if fast <= slow:
        raise ConfigError(f"{where}: beta_fast {fast:g} must be above beta_slow {slow:g}")
    return replace(
        rope,
        attention_factor=_number(attention, "attention_factor", where),
        beta_fast=fast,
        beta_slow=slow,
        truncate=truncate,
    )


def _theta(value: Any, where: str) -> float:
    theta = _number(value, "rope_theta", where)
    if theta <= 1:  # every frequency would be at least 1 radian per position
        raise ConfigError(f"{where}: rope_theta must be above 1, got {value!r}")
    return theta


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_of_config(config: dict[str, Any], where: str) -> RoPE:
    """The RoPE of a whole config, in either spelling (Note [Two spellings of RoPE])."""
    max_positions = config.get("max_position_embeddings")
    if "rope_parameters" in config and config["rope_parameters"] is not None:
        params = config["rope_parameters"]
        if (
            isinstance(params, dict)
            and params
            and all(isinstance(v, dict) for v in params.values())
        ):
            raise ConfigError(
                f"{where}: rope_parameters per layer type ({', '.join(params)}) is not supported: "
                "every hdp layer uses one RoPE"
            )
        return rope_from_dict(
            params, theta=config.get("rope_theta"), max_positions=max_positions, where=where
        )
    scaling = config.get("rope_scaling") or {"rope_type": "default"}
    return rope_from_dict(
        scaling, theta=config.get("rope_theta"), max_positions=max_positions, where=where
    )


# Values transformers assumes when a config leaves a field out, per model_type.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "attention_bias": False, "mlp_bias": False},
    "mistral": {"rms_norm_eps": 1e-6, "sliding_window": 4096, "num_key_value_heads": 8},
    "qwen2": {"rms_norm_eps": 1e-6, "num_key_value_heads": 32, "use_sliding_window": False},
    "qwen3": {
        "rms_norm_eps": 1e-6,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "attention_bias": False,
        "use_sliding_window": False,
    },
}


_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a ``config.json`` file."""
    path = Path(path)
    if not os.path.lexists(path):
        raise ConfigError(
            f"{path}: no such file (a Hugging Face model directory holds a config.json)"
        )
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path}: not a regular file")
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data


def spec_from_config(config: dict[str, Any], *, name: str, where: str = "config.json"):
    """The :class:`hdp.ModelSpec` of a transformers config dict, or :class:`ConfigError` naming
    ``where`` and the first field hdp's decoder cannot compute."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported: hdp trains "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (dense decoders with full causal attention)"
        )
    c = {**_DEFAULTS[model_type], **config}  # an explicit null stays null (sliding_window)
    _refuse_unsupported(c, model_type, where)
    for key in _REQUIRED:
        if key not in c:
            raise ConfigError(f"{where}: lacks {key}")
    hidden = _count(c["hidden_size"], "hidden_size", where)
    heads = _count(c["num_attention_heads"], "num_attention_heads", where)
    kv = c.get("num_key_value_heads")
    kv_heads = _count(heads if kv is None else kv, "num_key_value_heads", where)
    if heads % kv_heads:
        raise ConfigError(
            f"{where}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )
    head_dim = _count(
        hidden // heads if c.get("head_dim") is None else c["head_dim"], "head_dim", where
    )
    if head_dim % 2:
        raise ConfigError(f"{where}: head_dim {head_dim} is odd: RoPE rotates pairs of dimensions")
    bias = _flag(c, "attention_bias", where)
    pad = c.get("pad_token_id")
    vocab = _count(c["vocab_size"], "vocab_size", where)
    if pad is not None and not (type(pad) is int and 0 <= pad < vocab):
        raise ConfigError(
            f"{where}: pad_token_id {pad!r} is not a token of the vocabulary [0, {vocab})"
        )
    if c.get("max_position_embeddings") is not None:
        _count(c["max_position_embeddings"], "max_position_embeddings", where)
    return ModelSpec(
        name=name,
        layers=_count(c["num_hidden_layers"], "num_hidden_layers", where),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=_count(c["intermediate_size"], "intermediate_size", where),
        vocab=vocab,
        tied_embeddings=_flag(c, "tie_word_embeddings", where),
        architecture=model_type,
        norm_eps=_number(c["rms_norm_eps"], "rms_norm_eps", where),
        rope=rope_of_config(c, where),
        qkv_bias=model_type == "qwen2" or bias,
        o_bias=bias and model_type != "qwen2",
        mlp_bias=_flag(c, "mlp_bias", where) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3",
        padding_idx=pad,
    )


def _refuse_unsupported(c: dict[str, Any], model_type: str, where: str) -> None:
    """:class:`ConfigError` for the first field that asks for what hdp's decoder lacks."""
    for key in _MOE_FIELDS:
        if c.get(key):
            raise ConfigError(
                f"{where}: {key} {c[key]!r}: mixture-of-experts models are not supported"
            )
    for key in _MLA_FIELDS:
        if c.get(key):
            raise ConfigError(
                f"{where}: {key} {c[key]!r}: multi-head latent attention is not supported"
            )
    if c.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ConfigError(
            f"{where}: partial_rotary_factor {c['partial_rotary_factor']!r} is not supported: "
            "hdp rotates the whole head"
        )
    if (c.get("hidden_act") or "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (hdp: silu)")
    if c.get("attention_dropout") not in (None, 0, 0.0):
        raise ConfigError(
            f"{where}: attention_dropout {c['attention_dropout']!r} is not supported: set it to 0.0"
        )
    _refuse_sliding_window(c, model_type, where)


def _refuse_sliding_window(c: dict[str, Any], model_type: str, where: str) -> None:
    if model_type == "mistral" and c.get("sliding_window") is not None:
        raise ConfigError(
            f"{where}: sliding_window {c['sliding_window']!r} is set: hdp's attention is full "
            "causal; set it to null to train with full attention"
        )
    if model_type in ("qwen2", "qwen3"):
        if _flag(c, "use_sliding_window", where) and c.get("sliding_window") is not None:
            raise ConfigError(
                f"{where}: use_sliding_window is true: hdp's attention is full causal; set it to "
                "false to train with full attention"
            )
        if "sliding_attention" in (c.get("layer_types") or []):
            raise ConfigError(
                f"{where}: layer_types holds 'sliding_attention': hdp's attention is full causal"
            )


def spec_from_path(path: str | Path):
    """The :class:`hdp.ModelSpec` of a ``config.json`` (or the directory holding it), named after
    that directory."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() and path.name != "config.json" else path
    name = file.resolve().parent.name or "model"
    return spec_from_config(read_config(file), name=name, where=str(file))


def spec_of(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
    """The spec of a transformers ``config.json``: a dict (named after its ``model_type``), the
    file, or its directory (named after the directory); ``name`` renames it. Raises
    :class:`ConfigError` naming the field it cannot represent."""
    if isinstance(config, dict):
        return spec_from_config(config, name=name or str(config.get("model_type")))
    spec = spec_from_path(config)
    return replace(spec, name=name) if name else spec


def with_rope_overrides(
    spec,
    *,
    theta: float | None = None,
    scaling: dict[str, Any] | None = None,
    max_positions: int | None = None,
    where: str = "--rope-scaling",
):
    """``spec`` with ``--rope-theta`` and ``--rope-scaling`` applied: the scaling dict replaces
    the scaling (``{"rope_type": "default"}`` removes it), theta the base. ``max_positions`` is
    the source config's ``max_position_embeddings``, which a scaling may default to."""
    rope = spec.rope
    if scaling is not None:
        rope = rope_from_dict(scaling, theta=rope.theta, max_positions=max_positions, where=where)
    if theta is not None:
        rope = replace(rope, theta=_theta(theta, "--rope-theta"))
    return replace(spec, rope=rope)


def parse_rope_scaling(text: str) -> dict[str, Any]:
    """The JSON object of ``--rope-scaling``, checked as a RoPE dict; ``ValueError`` says why."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if data is None:
        return {"rope_type": "default"}
    if not isinstance(data, dict):
        raise ValueError(
            f'expected a JSON object such as \'{{"rope_type": "yarn", ...}}\', got {text!r}'
        )
    try:
        rope_kind(data, "--rope-scaling")
    except ConfigError as e:
        raise ValueError(str(e).removeprefix("--rope-scaling: ")) from None
    return data


def export_config(spec, *, source: dict[str, Any] | None, max_positions: int, dtype: str) -> dict:
    """The ``config.json`` of an export: the ``source`` config (or one built from ``spec``) with
    ``spec``'s RoPE written in the source's spelling, ``max_position_embeddings`` at least
    ``max_positions`` and ``torch_dtype`` set to ``dtype``."""
    if source is None:
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURE_CLASSES[spec.architecture]],
            "model_type": spec.architecture,
            "hidden_size": spec.hidden,
            "intermediate_size": spec.ffn,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "head_dim": spec.head_dim,
            "vocab_size": spec.vocab,
            "hidden_act": "silu",
            "rms_norm_eps": spec.norm_eps,
            "tie_word_embeddings": spec.tied_embeddings,
            "attention_dropout": 0.0,
            "max_position_embeddings": max_positions,
            "pad_token_id": spec.padding_idx,
        }
        if spec.architecture in ("llama", "qwen3"):
            config["attention_bias"] = spec.o_bias
        if spec.architecture == "llama":
            config["mlp_bias"] = spec.mlp_bias
        if spec.architecture == "mistral":
            config["sliding_window"] = None
        if spec.architecture in ("qwen2", "qwen3"):
            config["use_sliding_window"] = False
    else:
        config = json.loads(json.dumps(source))  # a deep copy
    rope = spec.rope.to_hf()
    if source is not None and "rope_parameters" in source:
        config["rope_parameters"] = rope
        config.pop("rope_theta", None)
        config.pop("rope_scaling", None)
    else:  # the 4.x spelling, which 5.x reads too
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    config["max_position_embeddings"] = max(
        int(config.get("max_position_embeddings") or 0), max_positions
    )
    return with_dtype(config, dtype)


def with_dtype(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``config`` stating that its weights are stored as ``dtype`` (``bfloat16``, ...)."""
    # transformers 5 names it "dtype", 4.x "torch_dtype" (which 5 still reads).
    return {**config, ("dtype" if "dtype" in config else "torch_dtype"): dtype}


# The fields of a spec that set its weights' names and shapes.
WEIGHT_FIELDS = (
    "architecture",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn",
    "vocab",
    "tied_embeddings",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "qk_norm",
)


# ... and with them, every field that changes the function the model computes.
MODEL_FIELDS = (*WEIGHT_FIELDS, "norm_eps", "rope", "padding_idx")


def shape_differences(a, b, fields: tuple[str, ...] = WEIGHT_FIELDS) -> list[str]:
    """``field: a -> b`` for each of ``fields`` (default: those that give the weights other names
    or shapes, :data:`WEIGHT_FIELDS`) that differs between two specs."""
    return [
        f"{f}: {getattr(a, f)!r} -> {getattr(b, f)!r}"
        for f in fields
        if getattr(a, f) != getattr(b, f)
    ]


__all__ = [
    "ARCHITECTURE_CLASSES",
    "ConfigError",
    "ROPE_TYPES",
    "RoPE",
    "SUPPORTED_MODEL_TYPES",
    "MODEL_FIELDS",
    "WEIGHT_FIELDS",
    "export_config",
    "parse_rope_scaling",
    "read_config",
    "rope_from_dict",
    "rope_of_config",
    "shape_differences",
    "spec_from_config",
    "spec_from_path",
    "with_dtype",
    "with_rope_overrides",
]
