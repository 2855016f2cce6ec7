"""Megatron-LM adapter: our planner inside Megatron's hybrid context parallelism.

Every megatron-core import of the project lives in this package, behind
:func:`require_megatron` (version check, clear error).

* :class:`HDPScheduler` (:mod:`.scheduler`) -- a drop-in for megatron-core's
  ``BalancedCPScheduler``: ``plan_step(..., "hdp", form="megatron")`` as ``sample_id_groups``,
  only on CP groups Megatron builds, falling back to a schedule Megatron runs rather than raising.
* :class:`HDPDataLoaderWrapper` (:mod:`.wrapper`) -- a drop-in for ``HybridCPDataLoaderWrapper``
  (same constructor, same ``(samples_this_rank_with_id, sample_id_groups)`` items) yielding each
  sub-sample as the installed version's ``get_batch`` reads it (:mod:`.versions`), padded for its
  CP split; runs on NCCL/CUDA and on gloo/CPU.
* :func:`install` -- makes Megatron-LM's training loop build :class:`HDPDataLoaderWrapper` where it
  builds ``HybridCPDataLoaderWrapper`` (one line in ``pretrain_gpt.py``).
* :class:`PackedBatchIterator` (:mod:`.packed`) -- for Megatron without hybrid CP: our
  dataloader's micro-batches as THD batches the stock ``get_batch`` reads.
* :func:`add_cu_seqlens` -- the packed-sample ``cu_seqlens`` of a ``GPTDataset`` sample built with
  ``reset_position_ids``.

See docs/megatron.md for what a Megatron-LM user changes.
"""

from .packed import PackedBatchIterator
from .scheduler import (
    HDPScheduler,
    SchedulerStats,
    megatron_plan,
    sample_id_groups_from_plan,
    schedule_problem,
)
from .versions import (
    MIN_MEGATRON_CORE,
    MegatronVersion,
    contract_for,
    installed_version,
    require_megatron,
)
from .wrapper import PACKING_KEYS, HDPDataLoaderWrapper, add_cu_seqlens, install

__all__ = [
    "MIN_MEGATRON_CORE",
    "PACKING_KEYS",
    "HDPDataLoaderWrapper",
    "HDPScheduler",
    "MegatronVersion",
    "PackedBatchIterator",
    "SchedulerStats",
    "add_cu_seqlens",
    "contract_for",
    "install",
    "installed_version",
    "megatron_plan",
    "require_megatron",
    "sample_id_groups_from_plan",
    "schedule_problem",
]
