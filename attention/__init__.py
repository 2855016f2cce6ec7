"""Block-level P2P distributed attention that executes any :class:`hdp.Plan` exactly.

``dist_attn(q, k, v, plan, wave, group=None, softmax_scale=None)`` is the entry point; kernels
(``flash_attn``, PyTorch FlashAttention, a pure-torch reference) live in :mod:`attention.kernels`,
the log-sum-exp merge in :mod:`attention.merge`.
"""

from .dist import COMM, CommCounter, dist_attn
from .kernels import AttentionBackend, ReferenceBackend, get_backend, select_backend
from .layout import WaveLayout, wave_layout
from .merge import PartialAttention

__all__ = [
    "COMM",
    "AttentionBackend",
    "CommCounter",
    "PartialAttention",
    "ReferenceBackend",
    "WaveLayout",
    "dist_attn",
    "get_backend",
    "select_backend",
    "wave_layout",
]
