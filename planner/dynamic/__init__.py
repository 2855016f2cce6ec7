"""``hdp``: one search from the malleable-job relaxation (Note [One search] in :mod:`.search`).

Read in this order:

1. :mod:`hdp.planner.menus` prices a menu of degrees for every sequence that may split;
   :mod:`hdp.planner.degrees` solves the relaxation over them (and :mod:`.milp` where lengths
   repeat).
2. :mod:`.search` rounds the relaxation at a few heights (:mod:`.rounding`), places each
   rounding, and improves the fastest by a local search under the cost model, within a budget
   spent in levels.
3. :mod:`.place` places one choice of degrees: :mod:`.wave` in ``wave`` sync (a step is the sum
   of its waves' slowest cells), :mod:`.peer` in ``peer`` sync (ranks wait only for their
   partners); :mod:`.local` moves whole sequences off the cells that end the step.
4. :mod:`.groups` and :mod:`.mixed` lay the batch out on rank groups where the budget allows.
5. :mod:`.megatron` is the form Megatron's hybrid context parallelism executes.
"""

from .candidates import Candidate
from .megatron import plan_megatron_form
from .options import DynamicOptions
from .rounding import rounding_heights
from .search import NATIVE_SYNC, plan_dynamic

__all__ = [
    "NATIVE_SYNC",
    "Candidate",
    "DynamicOptions",
    "plan_dynamic",
    "plan_megatron_form",
    "rounding_heights",
]
