"""Model and cluster descriptions shared by the planner, the simulator and the runtime.

Units: parameters and tokens are counts; memory and message sizes are bytes; bandwidths are
bytes per second *per rank and per direction*; latencies and times are seconds; compute is
FLOP/s (dense bf16 tensor-core peak unless the profile says otherwise).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .profile import FORMAT, KernelTables, ProfileError, backend_name, read_profile_json

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
    # float() accepts 'inf', 'nan' and '1e400' (inf): name them here, as int() would not.
    if not math.isfinite(result):
        raise ValueError(f"invalid size {text!r}: must be a finite number such as 2M or 4096")
    if result < 0 or result != int(result):
        raise ValueError(f"invalid size {text!r}: must be a non-negative whole number of units")
    return int(result)


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural where ``n`` is not 1: ``1 rank``, ``8 ranks``, ``1,024 steps``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def format_size(n: float) -> str:
    """Human form of a token count: 2097152 -> '2M', 65536 -> '64K', 1500 -> '1500' (G above)."""
    n = int(n)
    for suffix, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


@dataclass(frozen=True)
class RoPE:
    """Rotary position embeddings: base ``theta`` and a scaling ``type`` with its parameters, all
    resolved (Note [Two spellings of RoPE]). ``attention_factor`` multiplies cos and sin (yarn)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_positions: int | None = None  # llama3, yarn
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions

    def to_hf(self) -> dict[str, Any]:
        """The 5.x ``rope_parameters`` dict, every value explicit (nothing left to derive)."""
        out: dict[str, Any] = {"rope_type": self.type, "rope_theta": self.theta}
        if self.type in ("linear", "llama3", "yarn"):
            out["factor"] = self.factor
        if self.type in ("llama3", "yarn"):
            out["original_max_position_embeddings"] = self.original_max_positions
        if self.type == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
        if self.type == "yarn":
            out["attention_factor"] = self.attention_factor
            if self.beta_fast != 32.0 or self.beta_slow != 1.0:
                out["beta_fast"], out["beta_slow"] = self.beta_fast, self.beta_slow
            if not self.truncate:
                out["truncate"] = False
        return out

    def describe(self) -> str:
        """One phrase for logs: ``theta 500000, llama3 x8``."""
        scaled = "" if self.type == "default" else f", {self.type} x{self.factor:g}"
        return f"theta {self.theta:g}{scaled}"


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

    ``dtype_bytes`` is the size of one element of parameters and activations used in compute
    (2 for bf16 on GPUs, 4 for fp32 on CPU). ``architecture`` is the transformers ``model_type``
    the decoder computes and exports as (``llama``, ``mistral``, ``qwen2``, ``qwen3``); the fields
    after it are what those differ in: RMSNorm epsilon, RoPE, biases, Qwen3's per-head q/k norm,
    and the embedding row that gets no gradient (transformers' ``pad_token_id``).
    :func:`hdp.hf_config.spec_of` reads them from a ``config.json``.
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
    architecture: str = "llama"
    norm_eps: float = 1e-5
    rope: RoPE = field(default_factory=RoPE)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    padding_idx: int | None = None

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
        attn += (q_out + kv_out) * self.qkv_bias + self.hidden * self.o_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = 3 * self.hidden * self.ffn + (2 * self.ffn + self.hidden) * self.mlp_bias
        return attn + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """Token embedding plus the LM head (shared when ``tied_embeddings``) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def total_params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params

    def tensor_shard(self, tp: int) -> ModelSpec:
        """What one GPU of a tensor-parallel group of ``tp`` GPUs computes and holds, as Megatron
        splits a layer: ``heads / tp`` query heads, ``kv_heads / tp`` key/value heads (one,
        replicated, where ``tp`` exceeds them), ``ffn / tp`` and a vocabulary-parallel embedding
        and head of ``ceil(vocab / tp)`` rows; ``hidden`` stays whole. ValueError where the
        heads or the MLP do not split evenly."""
        if tp == 1:
            return self
        problem = ""
        if tp < 1:
            problem = "it must be at least 1"
        elif self.heads % tp:
            problem = (
                f"{self.name}'s {self.heads} attention heads do not split into {tp} equal parts"
            )
        elif self.kv_heads % tp and tp % self.kv_heads:
            problem = (
                f"{self.name}'s {self.kv_heads} key/value heads neither split into {tp} equal "
                f"parts nor divide {tp}"
            )
        elif self.ffn % tp:
            problem = (
                f"{self.name}'s MLP of {self.ffn} channels does not split into {tp} equal parts"
            )
        if problem:
            raise ValueError(f"--tp {tp}: {problem}; choose another tensor-parallel size")
        return replace(
            self,
            name=f"{self.name}/tp{tp}",
            heads=self.heads // tp,
            kv_heads=max(1, self.kv_heads // tp),
            ffn=self.ffn // tp,
            vocab=-(-self.vocab // tp),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token in one layer: ``2 * kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


# The shares of a link FlexSP's all-to-alls attain, from the bandwidths its solver uses, which
# it measured on its cluster of 8 nodes of 8 A100s with two 200 Gb/s NICs a node ("4k seq,
# 2 IB"): 96.5 GB/s per member at 8 ranks and 4.87 GB/s at 64, each over the member's whole
# share of the tensor. A member sends (g - 1) / g of that: 84.4 GB/s, 35% of the A100's NVLink
# (240 GB/s); at 64 ranks 56 of its 63 peers are off the node, 4.26 GB/s of the 5.6 GB/s a
# GPU's share of the NICs carries at 90% of their rate (76%).
FLEXSP_ALLTOALL_NVLINK_SHARE = 0.35
FLEXSP_ALLTOALL_NIC_SHARE = 0.76


@dataclass(frozen=True)
class GPUProfile:
    """One accelerator model and its links; its compute comes from measured kernel tables.

    A profile is data: a ``hdp.profile/1`` JSON file (:meth:`load`, :meth:`to_json`). The presets
    live in ``hdp/data/profiles/``: ``h100`` holds tables measured on an H100, ``h200`` and the
    A100s are scaled from it (each file's ``source`` says how), ``cpu`` was measured on this
    project's CI machine by ``hdp-calibrate measure --device cpu``. ``peak_flops`` serves MFU.
    ``activation_memory_scale`` is what a training step's activations measure over what the cost
    model counts for them on this device (``scripts/bench_fidelity.py metrics`` reports it).
    ``compiled_memory_bound_scale`` is the time of the memory-bound ops (norms, residual adds,
    SwiGLU, RoPE, the loss's cross-entropy) in ``--compile``'s fused regions over their eager
    time in the tables: fitted to training steps measured with and without ``--compile`` on the
    device (Note [What a layer costs] in :mod:`hdp.compute`); 1.0, no gain, where not measured.
    ``alltoall_nic_share`` and ``alltoall_nvlink_share``: the share of ``nic_bw`` and
    ``nvlink_bw`` a head-parallel all-to-all attains (every member sends to every other at once,
    so it moves slower than a ring). A profile states them where it measured them; the others,
    every shipped preset among them (ours are not measured yet), take FlexSP's measurements
    (:data:`FLEXSP_ALLTOALL_NVLINK_SHARE`, :data:`FLEXSP_ALLTOALL_NIC_SHARE`).
    """

    name: str
    peak_flops: float
    memory_bytes: float
    nvlink_bw: float
    nic_bw: float
    nvlink_latency: float
    nic_latency: float
    pcie_bw: float
    hbm_bw: float = 2.0e12
    usable_memory_fraction: float = 0.92
    reserved_bytes: float = 3.0e9
    layer_overhead_s: float = 40e-6
    activation_memory_scale: float = 1.0
    compiled_memory_bound_scale: float = 1.0
    alltoall_nic_share: float = FLEXSP_ALLTOALL_NIC_SHARE
    alltoall_nvlink_share: float = FLEXSP_ALLTOALL_NVLINK_SHARE
    attention_backend: str = "torch_flash"
    tables: KernelTables = field(default_factory=KernelTables)
    source: str = ""
    device: str = ""

    def __post_init__(self) -> None:
        _check_shares(vars(self), self.name)

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "profile") -> GPUProfile:
        """A profile from its JSON object (``where`` names it in errors)."""
        if data.get("format") != FORMAT:
            raise ProfileError(f'{where}: not a GPU profile (expected "format": "{FORMAT}")')
        fields = {f.name for f in dataclasses.fields(cls)} - {"tables"}
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ProfileError(f"{where}: lacks {', '.join(missing)}")
        kw = {k: v for k, v in data.items() if k in fields}
        if "attention_backend" in kw:
            kw["attention_backend"] = backend_name(kw["attention_backend"])
        for k, v in kw.items():
            if k not in ("name", "attention_backend", "source", "device") and not (
                isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
            ):
                raise ProfileError(f"{where}: {k} must be a finite number >= 0, got {v!r}")
        _check_shares(kw, where)  # (before __post_init__, to name the file)
        tables = KernelTables.from_json(data.get("tables", {}), where)
        profile = cls(**kw, tables=tables)
        if profile.attention_backend not in tables.attention_backends:
            raise ProfileError(
                f"{where}: attention_backend {profile.attention_backend!r} has no attention rows "
                f"(the tables have {', '.join(tables.attention_backends) or 'none'})"
            )
        if not tables.gemm:
            raise ProfileError(f"{where}: the profile has no gemm rows")
        return profile

    @classmethod
    def load(cls, path: str | Path) -> GPUProfile:
        """The profile in a ``hdp.profile/1`` JSON file."""
        return cls.from_json(read_profile_json(path), str(path))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT}
        for f in dataclasses.fields(self):
            if f.name != "tables":
                out[f.name] = getattr(self, f.name)
        out["tables"] = self.tables.to_json()
        return out


def _check_shares(fields: dict[str, Any], where: str) -> None:
    """ProfileError naming ``where`` unless each all-to-all share, and the compiled ops' scale,
    is above 0 and at most 1."""
    for k in ("alltoall_nic_share", "alltoall_nvlink_share", "compiled_memory_bound_scale"):
        if not 0 < fields.get(k, 1.0) <= 1:
            raise ProfileError(f"{where}: {k} must be above 0 and at most 1, got {fields[k]!r}")


_REQUIRED = ("name", "peak_flops", "memory_bytes", "nvlink_bw", "nic_bw", "nvlink_latency")
_REQUIRED += ("nic_latency", "pcie_bw", "tables")


def _load_presets() -> dict[str, GPUProfile]:
    folder = resources.files("hdp").joinpath("data/profiles")
    presets = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            data = json.loads(entry.read_text())
            presets[data["name"]] = GPUProfile.from_json(data, f"hdp/data/profiles/{entry.name}")
    return presets


GPU_PRESETS: dict[str, GPUProfile] = _load_presets()


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

    def tensor_groups(self, tp: int) -> ClusterSpec:
        """This cluster seen as its tensor-parallel groups of ``tp`` GPUs, one rank each: a
        group stays inside a node (its collectives use NVLink). ValueError where ``tp`` does not
        divide the GPUs of a node."""
        if tp == 1:
            return self
        if tp < 1 or self.ranks_per_node % tp:
            raise ValueError(
                f"--tp {tp}: a tensor-parallel group must fit a node evenly, and {tp} does not "
                f"divide its {self.ranks_per_node} GPUs; choose a divisor of {self.ranks_per_node}"
            )
        if self.num_ranks % tp:
            raise ValueError(
                f"--tp {tp}: {self.num_ranks} GPUs do not split into groups of {tp}; use a "
                f"multiple of {tp} GPUs"
            )
        return replace(
            self, num_ranks=self.num_ranks // tp, ranks_per_node=self.ranks_per_node // tp
        )


def lookup_preset(kind: str, name: str, table: dict):
    try:
        return table[name]
    except KeyError:
        raise ValueError(
            f"unknown {kind} {name!r}: choose one of {', '.join(sorted(table))}"
        ) from None


def gpu_preset(name: str) -> GPUProfile:
    """The named GPU profile; ``ValueError`` listing the valid names otherwise."""
    return lookup_preset("GPU preset", name, GPU_PRESETS)


def gpu_profile(name_or_path: str | Path) -> GPUProfile:
    """A preset by name, or the profile JSON file at a path (``--gpu-profile``)."""
    if str(name_or_path) in GPU_PRESETS:
        return GPU_PRESETS[str(name_or_path)]
    if Path(name_or_path).suffix == ".json" or Path(name_or_path).exists():
        return GPUProfile.load(name_or_path)
    raise ValueError(
        f"unknown GPU profile {str(name_or_path)!r}: give a profile JSON file or one of "
        f"{', '.join(sorted(GPU_PRESETS))}"
    )
