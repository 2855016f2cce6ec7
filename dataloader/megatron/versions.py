"""Which megatron-core is installed, and what its ``pretrain_gpt.get_batch`` consumes.

Megatron-LM's ``hybrid_context_parallel_forward_backward`` hands ``get_batch`` one sub-sample per
micro-batch, exactly as the data-loader wrapper yielded it (plus ``local_cp_size``). Two contracts
exist among the releases with hybrid context parallelism:

* ``flat`` (megatron-core 0.16.x, 0.17.x): per-token tensors of shape ``[L]``; no ``cu_seqlens``
  (its ``get_batch_on_this_tp_rank`` requires a packed ``cu_seqlens`` to be ``[1, n]``, and the
  hybrid path never reads one), and ``max_seqlen`` (``int32 [1]``), which the hybrid path
  ignores but the other tensor-parallel ranks always receive in the broadcast (without it TP > 1
  breaks). ``get_batch`` stacks the tensors to ``[1, L]`` and splits over the CP group.
* ``packed`` (0.18.x, 0.19.x): per-token tensors of shape ``[1, L]`` with ``cu_seqlens``
  (``int32 [1, 2]``) and ``max_seqlen`` (``int32 [1]``): the hybrid split and the
  ``PackedSeqParams`` (with the sub-sample's CP group) are built only where ``cu_seqlens`` is
  present, and receiving tensor-parallel ranks allocate ``[micro_batch_size, L]``.

In both, a sub-sample on ``k > 1`` ranks is split into ``2k`` equal chunks (zigzag), so its
length must be a multiple of ``2k``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

MIN_MEGATRON_CORE = (0, 16)
# Releases whose get_batch contract was read from Megatron-LM's source at their release tags.
KNOWN_MINORS = {(0, 16): "flat", (0, 17): "flat", (0, 18): "packed", (0, 19): "packed"}
CONTRACTS = ("flat", "packed")


@dataclass(frozen=True)
class MegatronVersion:
    """An installed megatron-core: its version string, (major, minor), and the ``get_batch``
    contract of the Megatron-LM release that goes with it."""

    text: str
    minor: tuple[int, int]
    contract: str


def parse_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``0.16.1`` or ``0.19.0rc2``."""
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            raise ValueError(f"cannot read a megatron-core version from {text!r}")
        parts.append(int(digits))
    if len(parts) < 2:
        raise ValueError(f"cannot read a megatron-core version from {text!r}")
    return parts[0], parts[1]


def contract_for(text: str) -> str:
    """The ``get_batch`` contract of megatron-core ``text``: ``flat`` or ``packed``. Releases after
    0.19 are assumed to keep 0.19's contract; before 0.16 there is no hybrid CP."""
    minor = parse_version(text)
    if minor < MIN_MEGATRON_CORE:
        raise ImportError(
            f"megatron-core {text} has no hybrid context parallelism: HDPDataLoaderWrapper needs "
            ">= 0.16 (pip install -U 'megatron-core>=0.16'); with older versions use "
            "hdp.dataloader.megatron.PackedBatchIterator"
        )
    return KNOWN_MINORS.get(minor, "packed")


def require_megatron():
    """megatron-core's module, or ImportError saying what to install: hybrid context parallelism
    (``HybridCPDataLoaderWrapper``, ``BalancedCPScheduler``) first shipped in megatron-core 0.16."""
    try:
        with warnings.catch_warnings():  # it warns at import about missing TransformerEngine / Apex
            warnings.simplefilter("ignore")
            import megatron.core as mcore
    except ImportError as e:
        raise ImportError(
            "hdp.dataloader.megatron needs megatron-core >= 0.16: pip install 'hdp-llm[megatron]' "
            f"(or megatron-core>=0.16) ({e})"
        ) from e
    contract_for(mcore.__version__)
    return mcore


def installed_version() -> MegatronVersion:
    """The installed megatron-core (raises ImportError as :func:`require_megatron`)."""
    mcore = require_megatron()
    text = str(mcore.__version__)
    return MegatronVersion(text, parse_version(text), contract_for(text))
