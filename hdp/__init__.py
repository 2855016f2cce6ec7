"""hdp: hybrid data parallelism for long-context training on variable-length data.

Core types shared by every part: :class:`ModelSpec`, :class:`ClusterSpec` (with
:class:`GPUProfile`), :class:`Shard`, :class:`Plan`, and the one :class:`CostModel`. The parts
themselves are the sub-packages :mod:`hdp.planner`, :mod:`hdp.attention`, :mod:`hdp.dataloader`
and :mod:`hdp.launch`; importing ``hdp`` loads none of them (the core needs numpy only).
"""

from .cost import CostModel, KVTraffic, StepReport
from .exchange import KV_EXCHANGES, KVTransfer
from .hf_config import ConfigError
from .models import MODEL_PRESETS, model_preset, model_spec
from .plan import BLOCK_TOKENS, DEFAULT_KV_BLOCK_TOKENS, Plan, PlanError
from .profile import BACKEND_NAMES, KernelTables, ProfileError
from .rounds import edge_colour_rounds
from .shard import Shard
from .specs import (
    GPU_PRESETS,
    ClusterSpec,
    GPUProfile,
    ModelSpec,
    RoPE,
    format_size,
    gpu_preset,
    gpu_profile,
    parse_size,
    plural,
)

# The one place the version is written: pyproject.toml reads it from here.
__version__ = "0.2.0"

__all__ = [
    "BACKEND_NAMES",
    "BLOCK_TOKENS",
    "DEFAULT_KV_BLOCK_TOKENS",
    "ClusterSpec",
    "ConfigError",
    "CostModel",
    "GPUProfile",
    "GPU_PRESETS",
    "KVTraffic",
    "KernelTables",
    "KV_EXCHANGES",
    "KVTransfer",
    "MODEL_PRESETS",
    "ModelSpec",
    "Plan",
    "PlanError",
    "ProfileError",
    "RoPE",
    "Shard",
    "StepReport",
    "edge_colour_rounds",
    "format_size",
    "plural",
    "gpu_preset",
    "gpu_profile",
    "model_preset",
    "model_spec",
    "parse_size",
]
