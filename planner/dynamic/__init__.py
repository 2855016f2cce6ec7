"""``hdp``: malleable-job degrees from the relaxation, node-aware placement, gaps filled.

Read in this order:

1. :mod:`hdp.planner.menus` prices a menu of degrees for every long sequence (compute at the
   kernel efficiency of its blocks, exposed K/V traffic over NVLink and the NIC, host offload
   where its members hold more than the capacity); :mod:`hdp.planner.degrees` solves the
   relaxation: the height ``M`` minimising ``max(M, area / ranks)`` and, for each sequence, the
   smallest-area degree no taller than ``M``. Short sequences stay whole.
2. :mod:`.search` turns the relaxation into candidates (Note [The candidate families]), places
   each once, skips those that cannot win and keeps the fastest by the cost model.
3. :mod:`.place` places one candidate: :mod:`.wave` in ``wave`` sync (a step is the sum of its
   waves' slowest cells), :mod:`.peer` in ``peer`` sync (ranks wait only for their partners).
   Multi-rank jobs take the least-loaded ranks of one node where they fit in one, in zigzag
   head/tail shares of whole 128-token blocks (:func:`hdp.planner.common.use_blocks`).
4. :mod:`.megatron` is the form Megatron's hybrid context parallelism executes.
"""

from .candidates import Candidate, Placement
from .megatron import aligned_groups, plan_megatron_form
from .options import DynamicOptions
from .search import NATIVE_SYNC, CandidateSearch, candidate_heights, plan_dynamic

__all__ = [
    "NATIVE_SYNC",
    "Candidate",
    "CandidateSearch",
    "DynamicOptions",
    "Placement",
    "aligned_groups",
    "candidate_heights",
    "plan_dynamic",
    "plan_megatron_form",
]
