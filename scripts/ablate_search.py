r"""Which parts of hdp's search earn their place: each switched off in turn, the same batches
planned again, and each batch's step compared with the whole search's.

A part is switched off by replacing its entry point in :mod:`hdp.planner.dynamic.search` (or
:mod:`~hdp.planner.dynamic.rounding`) for that run (the search has no option per part, by
design). Batches, all at the default budget:

- ``grid``: the plan-quality grid of ``bench_planner.py`` (llama-7b and llama-70b on 64, 256
  and 1,024 H100s, four workloads, each workload's own batch of ``--seed``, or ``--tokens``);
- ``peer`` and ``wave``: ``--random`` small batches a sync mode, drawn as
  ``tests/test_bounds.py`` draws them (2 to 64 ranks, a few long sequences among short ones);
- ``repeats``: the same with lengths drawn from four values, as in bucketed corpora.

A row per part and set: how many steps grew or fell by over 1%, the worst ratio and their
geometric mean (over 1: the search is slower without the part).

    python scripts/ablate_search.py
    python scripts/ablate_search.py --parts milp,join --random 50 --tokens 8M
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from unittest import mock

import numpy as np

from hdp import ClusterSpec, argtypes, model_preset
from hdp.planner import PlanningError, StepPricing, plan_step
from hdp.planner.dynamic import rounding, search
from hdp.workloads import get_workload

MODELS = {"cpu": "tiny", "h100": "llama-7b", "a100-80g": "llama-7b", "h100-70b": "llama-70b"}


def _without_layouts(first: bool) -> Callable[[], contextlib.AbstractContextManager]:
    """Group layouts without the mixed family (``first``) or without the equal ones."""
    layouts = search.group_layouts

    def some(ctx):
        return [f for k, f in enumerate(layouts(ctx)) if (k == 0) != first]

    return lambda: mock.patch.object(search, "group_layouts", some)


_ROUNDING_HEIGHTS = rounding.rounding_heights  # the search's own, whatever is switched off


def _one_height(rel, sync: str) -> list[float]:
    """:func:`rounding.rounding_heights` cut to one: ``M`` (``peer``), the top (``wave``)."""
    heights = _ROUNDING_HEIGHTS(rel, sync)
    return heights[-1:] if sync == "wave" else heights[:1]


def _never(*args, **kwargs) -> bool:
    return False


def _without_placing_again(field: str) -> contextlib.AbstractContextManager:
    """:meth:`search.Search.place_again` refusing the variant that sets ``field``."""
    place_again = search.Search.place_again

    def some(self, **variant) -> bool:
        return field not in variant and place_again(self, **variant)

    return mock.patch.object(search.Search, "place_again", some)


PARTS: dict[str, tuple[str, Callable[[], contextlib.AbstractContextManager]]] = {
    "milp": ("the MILP's degrees", lambda: mock.patch.object(search.milp, "repeats", _never)),
    "mixed": ("mixed-size group layouts", _without_layouts(first=True)),
    "equal": ("equal-size group layouts", _without_layouts(first=False)),
    "packed": (
        "the packed rounding",
        lambda: mock.patch.object(rounding, "packed_rounding", lambda ctx, rel: None),
    ),
    "heights": (
        "roundings at more than one height",
        lambda: mock.patch.object(rounding, "rounding_heights", _one_height),
    ),
    "per-wave": (
        "roundings of the relaxation over ranks x waves",
        lambda: mock.patch.object(rounding, "per_wave_roundings", lambda ctx, waves: []),
    ),
    "widen": ("widen", lambda: mock.patch.object(search.Search, "widen", _never)),
    "unstack": ("unstack", lambda: _without_placing_again("stack_share")),
    "jobs-first": ("jobs first", lambda: _without_placing_again("jobs_first")),
    "move": ("move", lambda: mock.patch.object(search.Search, "move", _never)),
    "regroup": ("regroup", lambda: mock.patch.object(search.Search, "regroup", _never)),
}


def batches(args: argparse.Namespace) -> Iterator[tuple[str, np.ndarray, StepPricing]]:
    """(set, lengths, pricing) of every batch, the grid's first."""
    for model in ("llama-7b", "llama-70b"):
        for workload in ("byted-2m", "wikipedia-384k", "github-2m", "wlb-128k"):
            rng = np.random.default_rng(args.seed)
            size = {} if args.tokens is None else {"tokens_per_step": args.tokens}
            lens = get_workload(workload).sample_batch(rng, **size)
            for n in (64, 256, 1024):
                yield (
                    "grid",
                    lens,
                    StepPricing.build(model_preset(model), ClusterSpec.preset("h100", n)),
                )
    for sync in ("peer", "wave"):
        for seed in range(args.random):
            rng = np.random.default_rng(seed)
            profile = str(rng.choice(sorted(MODELS)))
            n = int(rng.choice([2, 4, 8, 12, 16, 32, 64]))
            per_node = int(rng.choice([2, 4, 8]))
            cap = int(rng.choice([1024, 2048, 4096]))
            longs = rng.integers(cap // 2, 8 * cap, int(rng.integers(0, 4)))
            lens = np.concatenate([longs, rng.integers(1, cap, int(rng.integers(1, 6 * n)))])
            cluster = ClusterSpec.preset(profile.removesuffix("-70b"), n, per_node)
            capacity = None if profile == "h100-70b" else cap
            model = model_preset(MODELS[profile])
            pricing = StepPricing.build(model, cluster, capacity=capacity, sync=sync)
            yield sync, lens, pricing
            # (Bucketed corpora: lengths repeat, where the MILP can choose what the sweep cannot.)
            values = np.concatenate([longs[:1], rng.integers(1, cap, 3)])
            yield "repeats", values[rng.integers(0, values.size, lens.size)], pricing


def steps(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(set, hdp's step) of every batch hdp can plan (nan where it cannot)."""
    out = []
    for kind, lens, pricing in batches(args):
        try:
            out.append((kind, plan_step(lens, pricing, "hdp").predicted["step_time_s"]))
        except PlanningError:
            out.append((kind, float("nan")))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"parts to switch off, one at a time (default: all of {', '.join(PARTS)})",
    )
    p.add_argument(
        "--tokens",
        type=argtypes.size(),
        help="grid tokens a step (default: as bench_planner.py's quality part)",
    )
    p.add_argument(
        "--random", type=argtypes.integer(0), default=200, help="random batches a sync mode (200)"
    )
    p.add_argument("--seed", type=argtypes.integer(0), default=0, help="the grid batches' seed (0)")
    args = p.parse_args()
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - PARTS.keys())
    if unknown:
        p.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    t0 = time.process_time()
    whole = steps(args)
    print(f"whole search: {len(whole)} batches planned in {time.process_time() - t0:.0f} s of CPU")
    print("without      set     batches >1% slower >1% faster   worst  geomean")
    for name in parts:
        what, switch_off = PARTS[name]
        with switch_off():
            alone = steps(args)
        for kind in ("grid", "peer", "wave", "repeats"):
            ratio = np.array([a / w for (k, w), (_, a) in zip(whole, alone) if k == kind])
            ratio = ratio[np.isfinite(ratio)]
            if ratio.size == 0:
                continue
            print(
                f"{name:12s} {kind:7s} {ratio.size:7d} {(ratio > 1.01).sum():10d} "
                f"{(ratio < 0.99).sum():10d} {ratio.max():7.3f} {np.exp(np.log(ratio).mean()):8.4f}"
                f"   ({what})",
                flush=True,
            )


if __name__ == "__main__":
    main()
