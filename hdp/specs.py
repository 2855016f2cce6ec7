"""Model and cluster descriptions shared by the planner, the simulator and the runtime.

Units: parameters and tokens are counts; memory and message sizes are bytes; bandwidths are
bytes per second *per rank and per direction*; latencies and times are seconds; compute is
FLOP/s (dense bf16 tensor-core peak unless the profile says otherwise).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import resources

import numpy as np

_SIZE_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse a token or byte count such as ``2M`` (2,097,152), ``64K``, ``32m`` or ``1000``.

    Suffixes are binary (K = 1024). Raises ``ValueError`` with the offending text otherwise.
    """
    if isinstance(text, int):
        return text
    s = str(text).strip().replace("_", "").replace(",", "")
    if not s:
        raise ValueError("empty size: expected a number such as 2M, 64K or 4096")
    mult = 1
    if s[-1].upper() in _SIZE_SUFFIXES:
        mult = _SIZE_SUFFIXES[s[-1].upper()]
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise ValueError(
            f"invalid size {text!r}: expected a number with an optional K/M/G suffix (e.g. 2M, 64K)"
        ) from None
    result = value * mult
    if result < 0 or result != int(result):
        raise ValueError(f"invalid size {text!r}: must be a non-negative whole number of units")
    return int(result)


def format_size(n: float) -> str:
    """Human form of a token count: 2097152 -> '2M', 65536 -> '64K', 1500 -> '1500'."""
    n = int(n)
    for suffix, mult in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

    ``dtype_bytes`` is the size of one element of parameters and activations used in compute
    (2 for bf16 on GPUs, 4 for fp32 on CPU).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads "
                f"({self.kv_heads})"
            )

    @property
    def params_per_layer(self) -> int:
        """Parameters of one decoder layer (attention projections, SwiGLU MLP, two RMSNorms)."""
        q_out = self.heads * self.head_dim
        kv_out = 2 * self.kv_heads * self.head_dim
        attn = self.hidden * q_out + self.hidden * kv_out + q_out * self.hidden
        mlp = 3 * self.hidden * self.ffn
        return attn + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """Token embedding plus the LM head (shared when ``tied_embeddings``) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def total_params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token in one layer: ``2 * kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


# Real shapes: Llama 3.2 1B, Llama 2 7B/13B, LLaMA 30B (32.5B), Llama 2 70B.
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
    ]
}


def _load_attention_curve() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Relative causal-attention efficiency versus document length, from the measured H100 table.

    Efficiency is proportional to work / time = L^2 / duration (cp = tp = 1 rows), normalised to 1
    at the longest measured length. Only the *shape* is used (see hdp/data/README in docs).
    """
    rows = []
    with resources.files("hdp").joinpath("data/attention_h100_distca.csv").open() as f:
        for row in csv.DictReader(f):
            if row["cp"] == "1" and row["tp"] == "1":
                length = float(row["L"])
                rows.append((length, length * length / float(row["duration_per_doc"])))
    rows.sort()
    top = rows[-1][1]
    return tuple(r[0] for r in rows), tuple(r[1] / top for r in rows)


@dataclass(frozen=True)
class GPUProfile:
    """One accelerator model and its links.

    ``attn_max_efficiency`` is the fraction of ``peak_flops`` the attention kernel reaches on
    long blocks (forward + backward); ``attn_curve`` scales it down for short blocks.
    ``linear_max_efficiency`` is the GEMM fraction of peak; it falls for small micro-batches as
    ``n / (n + linear_half_tokens)``.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    nvlink_bw: float
    nic_bw: float
    nvlink_latency: float
    nic_latency: float
    pcie_bw: float
    attn_max_efficiency: float = 0.45
    linear_max_efficiency: float = 0.70
    linear_half_tokens: float = 128.0
    usable_memory_fraction: float = 0.92
    reserved_bytes: float = 3.0e9
    layer_overhead_s: float = 40e-6
    attn_curve: tuple[tuple[float, ...], tuple[float, ...]] = field(
        default_factory=_load_attention_curve
    )

    @cached_property
    def _log_curve(self) -> tuple[np.ndarray, np.ndarray]:
        lengths, rel = self.attn_curve
        return np.log2(np.asarray(lengths, dtype=np.float64)), np.asarray(rel, dtype=np.float64)

    def attn_efficiency(self, block_tokens: np.ndarray | float) -> np.ndarray | float:
        """Fraction of peak reached by attention on query blocks of ``block_tokens`` tokens."""
        xs, ys = self._log_curve
        x = np.log2(np.maximum(np.asarray(block_tokens, dtype=np.float64), 1.0))
        return self.attn_max_efficiency * np.interp(x, xs, ys)

    def linear_efficiency(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """Fraction of peak reached by the dense layers on a micro-batch of ``tokens`` tokens."""
        n = np.asarray(tokens, dtype=np.float64)
        return self.linear_max_efficiency * n / (n + self.linear_half_tokens)


# Achievable (not marketing) per-GPU, per-direction figures. NVLink: H100/H200 NVLink 4 (450 GB/s
# per direction nominal, ~360 achievable), A100 NVLink 3 (300 nominal, ~240). NIC: one 400 Gb/s
# (H100/H200) or 200 Gb/s (A100) adapter per GPU, ~90% achievable. PCIe Gen5 / Gen4 host copies.
GPU_PRESETS: dict[str, GPUProfile] = {
    g.name: g
    for g in [
        GPUProfile(
            "h100",
            peak_flops=989e12,
            memory_bytes=80e9,
            nvlink_bw=360e9,
            nic_bw=45e9,
            nvlink_latency=5e-6,
            nic_latency=12e-6,
            pcie_bw=40e9,
        ),
        GPUProfile(
            "h200",
            peak_flops=989e12,
            memory_bytes=141e9,
            nvlink_bw=360e9,
            nic_bw=45e9,
            nvlink_latency=5e-6,
            nic_latency=12e-6,
            pcie_bw=40e9,
        ),
        GPUProfile(
            "a100-80g",
            peak_flops=312e12,
            memory_bytes=80e9,
            nvlink_bw=240e9,
            nic_bw=22.5e9,
            nvlink_latency=6e-6,
            nic_latency=15e-6,
            pcie_bw=20e9,
            attn_max_efficiency=0.55,
        ),
        GPUProfile(
            "a100-40g",
            peak_flops=312e12,
            memory_bytes=40e9,
            nvlink_bw=240e9,
            nic_bw=22.5e9,
            nvlink_latency=6e-6,
            nic_latency=15e-6,
            pcie_bw=20e9,
            attn_max_efficiency=0.55,
        ),
        # A CPU "device" for the gloo tests: modest, and memory large enough for the tiny model.
        GPUProfile(
            "cpu",
            peak_flops=2e11,
            memory_bytes=16e9,
            nvlink_bw=5e9,
            nic_bw=1e9,
            nvlink_latency=20e-6,
            nic_latency=50e-6,
            pcie_bw=1e12,
            attn_max_efficiency=0.5,
            linear_max_efficiency=0.5,
            reserved_bytes=0.5e9,
            layer_overhead_s=20e-6,
        ),
    ]
}


@dataclass(frozen=True)
class ClusterSpec:
    """``num_ranks`` GPUs, ``ranks_per_node`` to a node, all of one ``gpu`` profile.

    Ranks ``[k * ranks_per_node, (k + 1) * ranks_per_node)`` form node ``k``: traffic between them
    uses NVLink, traffic between nodes the NIC.
    """

    num_ranks: int
    ranks_per_node: int = 8
    gpu: GPUProfile = field(default_factory=lambda: GPU_PRESETS["h100"])

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    @classmethod
    def preset(cls, gpu: str, num_ranks: int, ranks_per_node: int = 8) -> ClusterSpec:
        return cls(num_ranks=num_ranks, ranks_per_node=ranks_per_node, gpu=gpu_preset(gpu))

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.num_ranks / self.ranks_per_node)

    def node_of(self, rank: np.ndarray | int) -> np.ndarray | int:
        return (
            np.asarray(rank) // self.ranks_per_node
            if isinstance(rank, np.ndarray)
            else rank // self.ranks_per_node
        )

    def with_ranks(self, num_ranks: int) -> ClusterSpec:
        return replace(self, num_ranks=num_ranks)


def _lookup(kind: str, name: str, table: dict):
    try:
        return table[name]
    except KeyError:
        raise ValueError(
            f"unknown {kind} {name!r}: choose one of {', '.join(sorted(table))}"
        ) from None


def model_preset(name: str) -> ModelSpec:
    """The named model preset; ``ValueError`` listing the valid names otherwise."""
    return _lookup("model preset", name, MODEL_PRESETS)


def gpu_preset(name: str) -> GPUProfile:
    """The named GPU profile; ``ValueError`` listing the valid names otherwise."""
    return _lookup("GPU preset", name, GPU_PRESETS)
