"""The model presets by name, and :func:`model_spec`: a preset or a transformers ``config.json``.

The presets are real shapes; a ``config.json`` is read by :mod:`hdp.hf_config`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .hf_config import spec_from_path
from .specs import ModelSpec, RoPE, lookup_preset

# Llama 3.1's RoPE (Llama 3.2 1B's has factor 32).
_LLAMA31_ROPE = RoPE(
    theta=500000.0,
    type="llama3",
    factor=8.0,
    original_max_positions=8192,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
)

# Real shapes: Llama 3.2 1B, Llama 2 7B/13B, LLaMA 30B (32.5B), Llama 2 70B, Llama 3 8B/70B,
# Llama 3.1 8B, Mistral 7B v0.3, Qwen2.5 7B/72B, Qwen3 8B.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(
            "tiny",
            layers=2,
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            ffn=176,
            vocab=512,
            dtype_bytes=4,
        ),
        ModelSpec(
            "llama-1b",
            layers=16,
            hidden=2048,
            heads=32,
            kv_heads=8,
            head_dim=64,
            ffn=8192,
            vocab=128256,
            tied_embeddings=True,
            rope=replace(_LLAMA31_ROPE, factor=32.0),
        ),
        ModelSpec(
            "llama-7b",
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=32,
            head_dim=128,
            ffn=11008,
            vocab=32000,
        ),
        ModelSpec(
            "llama-13b",
            layers=40,
            hidden=5120,
            heads=40,
            kv_heads=40,
            head_dim=128,
            ffn=13824,
            vocab=32000,
        ),
        ModelSpec(
            "llama-30b",
            layers=60,
            hidden=6656,
            heads=52,
            kv_heads=52,
            head_dim=128,
            ffn=17920,
            vocab=32000,
        ),
        ModelSpec(
            "llama-70b",
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            head_dim=128,
            ffn=28672,
            vocab=32000,
        ),
        ModelSpec(
            "llama3-8b",
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            ffn=14336,
            vocab=128256,
            rope=RoPE(theta=500000.0),
        ),
        ModelSpec(
            "llama3.1-8b",
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            ffn=14336,
            vocab=128256,
            rope=_LLAMA31_ROPE,
        ),
        ModelSpec(
            "llama3-70b",
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            head_dim=128,
            ffn=28672,
            vocab=128256,
            rope=RoPE(theta=500000.0),
        ),
        ModelSpec(
            "mistral-7b",
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            ffn=14336,
            vocab=32768,
            architecture="mistral",
            rope=RoPE(theta=1e6),
        ),
        ModelSpec(
            "qwen2.5-7b",
            layers=28,
            hidden=3584,
            heads=28,
            kv_heads=4,
            head_dim=128,
            ffn=18944,
            vocab=152064,
            architecture="qwen2",
            norm_eps=1e-6,
            rope=RoPE(theta=1e6),
            qkv_bias=True,
        ),
        ModelSpec(
            "qwen2.5-72b",
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            head_dim=128,
            ffn=29568,
            vocab=152064,
            architecture="qwen2",
            norm_eps=1e-6,
            rope=RoPE(theta=1e6),
            qkv_bias=True,
        ),
        ModelSpec(
            "qwen3-8b",
            layers=36,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            ffn=12288,
            vocab=151936,
            architecture="qwen3",
            norm_eps=1e-6,
            rope=RoPE(theta=1e6),
            qk_norm=True,
        ),
    ]
}


def model_preset(name: str) -> ModelSpec:
    """The named model preset; ``ValueError`` listing the valid names otherwise."""
    return lookup_preset("model preset", name, MODEL_PRESETS)


def model_spec(name_or_path: str | Path) -> ModelSpec:
    """A preset by name, or the architecture of a transformers ``config.json`` (the file or its
    directory; ``--model``). ``ValueError`` (a :class:`hdp.hf_config.ConfigError` for a config
    hdp cannot train) says what is wrong."""
    if str(name_or_path) in MODEL_PRESETS:
        return MODEL_PRESETS[str(name_or_path)]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_dir() or path.exists():
        return spec_from_path(path)
    raise ValueError(
        f"unknown model {str(name_or_path)!r}: give a transformers config.json (or its "
        f"directory) or one of {', '.join(MODEL_PRESETS)}"
    )
