"""Who runs a plan decides its price: a baseline's system (``hdp-sim``) or hdp's runtime
(training, where ``dist_attn`` runs every strategy's plans). The reference for hdp's runtime is
the same placement labelled as hdp's own plan, which the cost model prices per block."""

import copy

import numpy as np

from hdp import ClusterSpec, gpu_preset, model_preset
from hdp.planner import StepPricing, get_strategy, plan_step

LENS = np.array([2048] * 64 + [200_000, 90_000, 30_000])


def pricing(own_runtimes: bool) -> StepPricing:
    return StepPricing.build(
        model_preset("llama-7b"), ClusterSpec(64, 8, gpu_preset("h100")), own_runtimes=own_runtimes
    )


def test_training_prices_a_static_plan_as_hdp_runs_it():
    static = get_strategy("static")
    on_hdp = pricing(False).for_strategy(static)
    plan = plan_step(LENS, on_hdp, "static")
    relabelled = copy.copy(plan)
    relabelled.strategy = "hdp"
    as_hdp = on_hdp.cost.with_exchange(plan.kv_exchange).evaluate(relabelled).step_time_s
    assert plan.predicted["step_time_s"] == as_hdp
    assert on_hdp.cost.dkv_bytes == 4  # dist_attn sums dK/dV in fp32 whatever planned it


def test_the_simulator_prices_a_static_plan_as_its_ring_runs_it():
    static = get_strategy("static")
    own = pricing(True).for_strategy(static)
    assert own.cost.dkv_bytes == 2  # TransformerEngine's ring keeps dK/dV in bf16
    plan = plan_step(LENS, own, "static")
    on_hdp = pricing(False).for_strategy(static).cost.with_exchange(plan.kv_exchange)
    # The ring's one call per step over packed chunks beats hdp's calls per block here.
    assert plan.predicted["step_time_s"] < on_hdp.evaluate(plan).step_time_s
