r"""hdp's plans of one commit against another's, both priced by this checkout's cost model.

Each commit's own "step / bound" stops comparing once the cost model or the bound changes
between them. So ``plan`` plans fixed batches with the hdp of any checkout (``--source``, or
the one installed) and writes each plan's PLAN.json with what that checkout reported;
``compare`` prices the hdp plans of two such folders with *this* checkout's cost model and
divides both by this checkout's bound (the second folder must be this checkout's own plans:
each is priced again and must give the step it reported).

Batches: ``grid``, the plan-quality grid of ``bench_planner.py`` (llama-7b and llama-70b on 64,
256 and 1,024 H100s, each workload's batch of seed 0, hdp's free and Megatron forms; the
Megatron form's plans are compared as each checkout priced them); ``2m``, llama-7b batches of
2M tokens of each workload, seeds 0-2, on 256 and 1,024 H100s.

    git worktree add /tmp/before 8bd6d64
    python scripts/reprice_plans.py plan /tmp/plans-before --source /tmp/before
    python scripts/reprice_plans.py plan /tmp/plans-after
    python scripts/reprice_plans.py compare /tmp/plans-before /tmp/plans-after
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SETS = ("grid", "2m")
FORMS = {"hdp": {}, "hdp-megatron": {"form": "megatron"}}


def rows(sets: list[str]) -> list[dict]:
    """The batches of ``sets``: model, workload, GPUs, seed, tokens (None: the workload's own)
    and the forms planned."""
    out = []
    from hdp.workloads import workload_names

    if "grid" in sets:
        for model in ("llama-7b", "llama-70b"):
            for wl in workload_names():
                for gpus in (64, 256, 1024):
                    out.append(dict(set="grid", model=model, workload=wl, gpus=gpus, seed=0))
                    out[-1]["tokens"] = None
    if "2m" in sets:
        for gpus in (256, 1024):
            for wl in workload_names():
                for seed in (0, 1, 2):
                    out.append(dict(set="2m", model="llama-7b", workload=wl, gpus=gpus, seed=seed))
                    out[-1]["tokens"] = 1 << 21
    for row in out:
        row["name"] = "_".join(str(row[k]) for k in ("model", "workload", "gpus", "seed"))
        row["name"] += "" if row["tokens"] is None else f"_{row['tokens']}"
    return out


def use_source(root: Path) -> None:
    """Import ``hdp`` from the checkout at ``root``: a folder of links where the checkout's
    other top-level packages (``planner``, ``attention``, ...) sit inside ``hdp``, as its
    ``pyproject.toml`` installs them."""
    top = Path(tempfile.mkdtemp(prefix="hdp-source-")) / "hdp"
    top.mkdir()
    for entry in (root / "hdp").iterdir():
        (top / entry.name).symlink_to(entry)
    for package in root.glob("*/__init__.py"):
        if not (top / package.parent.name).exists():
            (top / package.parent.name).symlink_to(package.parent)
    sys.path.insert(0, str(top.parent))
    importlib.invalidate_caches()


def plan(out: Path, sets: list[str]) -> None:
    from hdp import ClusterSpec, model_preset
    from hdp.planner import StepPricing, plan_and_evaluate
    from hdp.workloads import get_workload

    out.mkdir(parents=True, exist_ok=True)
    done = []
    for row in rows(sets):
        forms = FORMS if row["set"] == "grid" else {"hdp": {}}
        rng = np.random.default_rng(row["seed"])
        sample = get_workload(row["workload"]).sample_batch
        lens = sample(rng) if row["tokens"] is None else sample(rng, tokens_per_step=row["tokens"])
        cluster = ClusterSpec.preset("h100", row["gpus"])
        pricing = StepPricing.build(model_preset(row["model"]), cluster)
        for form, options in forms.items():
            c0 = time.process_time()
            p, rep = plan_and_evaluate(lens, pricing, "hdp", **options)
            cpu = time.process_time() - c0
            p.save(out / f"{row['name']}_{form}.json")
            row[form] = {"step_s": rep.step_time_s, "bound_s": p.predicted["bound_s"], "cpu_s": cpu}
        done.append(row)
        print(f"{row['name']}: hdp x bound {row['hdp']['step_s'] / row['hdp']['bound_s']:.3f}")
    (out / "rows.json").write_text(json.dumps(done, indent=1) + "\n")


def compare(before: Path, after: Path) -> None:
    old, new = (json.loads((d / "rows.json").read_text()) for d in (before, after))
    if [r["name"] for r in old] != [r["name"] for r in new]:
        raise SystemExit(f"{before} and {after} planned different batches: plan both alike")
    for name in SETS:
        pairs = [(o, n) for o, n in zip(old, new) if n["set"] == name]
        if not pairs:
            continue
        megatron = "hdp-megatron" in pairs[0][1]
        cols = ["model", "workload", "GPUs", "seed", "hdp x bound, before / after"]
        cols += ["Megatron form x bound, each as priced then"] if megatron else []
        cols += ["hdp plan CPU s, before / after"]
        print(f"\n{name}:\n\n| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
        for o, n in pairs:
            print(_line(before, after, o, n, megatron))


def _line(before: Path, after: Path, o: dict, n: dict, megatron: bool) -> str:
    """One batch's table row: both hdp plans priced by this checkout, over its bound."""
    from hdp import ClusterSpec, Plan, model_preset
    from hdp.planner import StepPricing

    pricing = StepPricing.build(model_preset(n["model"]), ClusterSpec.preset("h100", n["gpus"]))
    steps = []
    for folder in (before, after):
        p = Plan.load(folder / f"{n['name']}_hdp.json")
        steps.append(pricing.cost.with_exchange(p.kv_exchange).evaluate(p).step_time_s)
    if abs(steps[1] / n["hdp"]["step_s"] - 1) > 1e-9:
        raise SystemExit(
            f"{after} was not planned by this checkout: {n['name']} steps {steps[1]:.6g} s "
            f"priced here, {n['hdp']['step_s']:.6g} s then"
        )
    bound = n["hdp"]["bound_s"]
    line = f"| {n['model']} | {n['workload']} | {n['gpus']:,} | {n['seed']} | "
    line += f"{steps[0] / bound:.3f} / {steps[1] / bound:.3f} | "
    if megatron:
        m = [r["hdp-megatron"]["step_s"] / r["hdp-megatron"]["bound_s"] for r in (o, n)]
        line += f"{m[0]:.3f} / {m[1]:.3f} | "
    return line + f"{o['hdp']['cpu_s']:.2f} / {n['hdp']['cpu_s']:.2f} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("plan", help="plan the batches and write each plan's PLAN.json")
    a.add_argument("out", type=Path, help="folder for the plans and rows.json")
    a.add_argument("--source", type=Path, help="an hdp checkout to plan with (default: this)")
    a.add_argument("--sets", default=",".join(SETS), help=f"batches: {', '.join(SETS)}")
    b = sub.add_parser("compare", help="price two folders' plans with this checkout")
    b.add_argument("before", type=Path)
    b.add_argument("after", type=Path, help="plans of this checkout")
    args = p.parse_args()
    if args.command == "compare":
        return compare(args.before, args.after)
    sets = [s for s in args.sets.split(",") if s]
    if unknown := set(sets) - set(SETS):
        p.error(f"--sets: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SETS)}")
    if args.source is not None:
        if not (args.source / "pyproject.toml").is_file():
            p.error(f"--source {args.source}: no pyproject.toml there; give an hdp checkout")
        use_source(args.source.resolve())
    plan(args.out, sets)


if __name__ == "__main__":
    main()
