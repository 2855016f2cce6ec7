"""Block-level P2P distributed attention that executes any :class:`hdp.Plan` exactly.

``dist_attn(q, k, v, plan, wave, group=None, softmax_scale=None, backend=None)`` is the entry
point; kernels (cuDNN, ``flash_attn``, PyTorch FlashAttention, a pure-torch reference) live in
:mod:`hdp.attention.kernels` and :mod:`hdp.attention.cudnn`, the log-sum-exp merge in
:mod:`hdp.attention.merge`.
"""

from .dist import dist_attn
from .kernels import (
    BACKEND_NAMES,
    AttentionBackend,
    BackendUnavailable,
    ReferenceBackend,
    get_backend,
    resolve_backend,
    select_backend,
)
from .layout import WaveLayout, wave_layout
from .merge import PartialAttention
from .messages import COMM, CommCounter

__all__ = [
    "BACKEND_NAMES",
    "COMM",
    "AttentionBackend",
    "BackendUnavailable",
    "CommCounter",
    "PartialAttention",
    "ReferenceBackend",
    "WaveLayout",
    "dist_attn",
    "get_backend",
    "resolve_backend",
    "select_backend",
    "wave_layout",
]
