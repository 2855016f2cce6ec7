"""What hdp-sim prints under its table: what planned each baseline, for ``hybridcp`` which
scheduler formed its groups, and what each baseline's knobs were searched over."""

import re

import pytest

from hdp import ClusterSpec, model_preset
from hdp.planner import StepPricing
from hdp.planner.hybridcp import megatron_available
from hdp.planner.sim import format_table, simulate
from hdp.planner.strategies import STRATEGIES
from hdp.workloads import get_workload


def simulated(strategies: list[str], implementation: str = "auto", tune_knobs: bool = False):
    pricing = StepPricing.build(model_preset("llama-7b"), ClusterSpec.preset("h100", 16))
    hybridcp = STRATEGIES["hybridcp"].options(implementation=implementation)
    return simulate(
        get_workload("wlb-128k"),
        pricing,
        strategies,
        steps=1,
        tokens_per_step=1 << 20,
        options={"hybridcp": hybridcp},
        tune_knobs=tune_knobs,
    )


def test_the_lines_under_the_table_name_what_planned_each_baseline():
    sim = simulated(["static", "bytescale", "hybridcp", "hdp"])
    *_, models, hybridcp = format_table(sim).splitlines()
    assert models == "static, bytescale: planned by hdp's models of their systems"
    assert hybridcp.startswith("hybridcp: planned by hdp's copy of Megatron's BalancedCPScheduler")
    assert "--hybridcp-impl megatron" in hybridcp
    alone = format_table(simulated(["hdp"]))
    assert "planned by" not in alone  # no baseline to say what planned it


def test_auto_plans_hybridcp_with_ours_whether_or_not_megatron_core_is_installed():
    plan = simulated(["hybridcp"]).results["hybridcp"].first_plan
    assert plan.predicted["megatron_scheduler"] == 0.0


@pytest.mark.skipif(
    not megatron_available(), reason="megatron-core not installed (pip install 'hdp-llm[megatron]')"
)
def test_megatron_core_s_scheduler_is_named_and_plans_the_same_groups():
    ours = simulated(["hybridcp"], "ours").results["hybridcp"]
    theirs = simulated(["hybridcp"], "megatron")
    plan = theirs.results["hybridcp"].first_plan
    assert plan.predicted["megatron_scheduler"] == 1.0
    assert plan.to_json()["waves"] == ours.first_plan.to_json()["waves"]
    (line,) = [x for x in format_table(theirs).splitlines() if x.startswith("hybridcp: planned")]
    assert re.match(r"hybridcp: planned by megatron-core [0-9.]+'s BalancedCPScheduler", line)
    assert "--hybridcp-impl ours" in line


def test_hdp_plan_names_the_scheduler_of_a_hybridcp_plan(tmp_path, capsys):
    from hdp.planner.cli import plan_main

    lengths = tmp_path / "batch.txt"
    lengths.write_text("\n".join(str(n) for n in (70_000, 30_000, 5_000, 800)) + "\n")
    out = tmp_path / "PLAN.json"
    args = ["--lengths", str(lengths), "--gpus", "16", "--out", str(out)]
    assert plan_main([*args, "--strategy", "hybridcp"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("; planned by hdp's copy of Megatron's BalancedCPScheduler"), first
    assert plan_main([*args, "--strategy", "static"]) == 0
    assert "planned by" not in capsys.readouterr().out


def test_each_searched_knob_is_named_with_every_value_tried():
    """Tuning keeps the value of the least mean step, and says so: the line lists every value
    with its step, and the chosen value's step is the table's."""
    sim = simulated(["static", "bytescale", "hybridcp", "hdp"], tune_knobs=True)
    lines = format_table(sim).splitlines()
    for name, knob in (("bytescale", "tokens per rank"), ("hybridcp", "max_seqlen_per_dp_cp_rank")):
        (line,) = [x for x in lines if x.startswith(f"{name}: tuned to {knob} ")]
        tried = dict(re.findall(r"(\d+): ([0-9.]+) s", line.split("(of ", 1)[1]))
        chosen = line.split(f"tuned to {knob} ", 1)[1].split(" ", 1)[0]
        step = sim.results[name].mean()["step_time_s"]
        assert float(tried[chosen]) == pytest.approx(step, abs=0.05)
        assert float(tried[chosen]) == min(float(t) for t in tried.values())
    assert not [x for x in lines if x.startswith("hdp: tuned")]  # hdp searches per step itself
