"""The MILP solver the planner's strategies share (hdp's degree MILP, FlexSP's group MILP)."""

from __future__ import annotations

import functools
import os
import sys

NODE_LIMIT = 2000  # branch-and-bound nodes per solve


@functools.cache
def solver_name() -> str:
    """``highs`` where highspy is importable, else ``cbc``. HiGHS prints its banner to stdout
    when a process makes its first solver, above whatever table a command prints: that first
    one is made here, with stdout pointed at /dev/null."""
    try:
        import highspy
    except ImportError:
        return "cbc"
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no stdout to silence
        saved = None
    try:
        if saved is not None:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
        highspy.Highs()
    except Exception:  # noqa: BLE001 - a highspy that cannot make a solver: CBC plans instead
        return "cbc"
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
    return "highs"


solver_name()  # at import, before a planner thread or a table prints anything


def make_solver(name: str, time_limit_s: float, mip: bool = True):
    """A pulp solver of ``name`` (:func:`solver_name`): one thread, seeded, a node limit (a time
    limit alone would let two runs disagree) and ``time_limit_s`` as a safety net."""
    import pulp

    if name == "highs":
        return pulp.HiGHS(
            mip=mip,
            msg=False,
            threads=1,
            timeLimit=time_limit_s,
            mip_max_nodes=NODE_LIMIT,
            random_seed=0,
        )
    return pulp.PULP_CBC_CMD(
        mip=mip,
        msg=False,
        threads=1,
        timeLimit=time_limit_s,
        maxNodes=NODE_LIMIT,
        warmStart=mip,
        options=["randomSeed 0", "randomCbcSeed 0"],
    )
