"""Baselines at their best (Note [Tuning the baselines] in ``hdp.planner.tuning``): on random
long-tailed batches at 8-64 ranks, the systems whose papers claim to beat the static DP x CP mesh
do so once their knobs are searched, and ByteScale's step falls as GPUs are added. The reference
is the static mesh itself, searched the same way and priced by the same cost model."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hdp import ClusterSpec, gpu_preset, model_preset
from hdp.planner import StepPricing, get_strategy
from hdp.planner.tuning import tune

MODEL = model_preset("llama-7b")
# Papers that claim a faster step than the static mesh on long-context data of varied lengths
# (ByteScale's Fig. 17, FlexSP's Fig. 4; Megatron's hybrid CP publishes no such figure).
CLAIMED = ("bytescale", "flexsp")
# The claims are about steps on average at scale. On one setting of a few dozen sequences on a
# node or two the static mesh's ring may fit them well enough to win by a little; no more than
# this.
ONE_SETTING = 1.15


def pricing(ranks: int) -> StepPricing:
    return StepPricing.build(MODEL, ClusterSpec(ranks, 8, gpu_preset("h100")))


def batches(rng: np.random.Generator, max_seq: int, tokens: int) -> list[tuple[np.ndarray, None]]:
    """Two global batches of ``tokens`` tokens, lengths log-normal with a long tail up to
    ``max_seq``, as documents of real corpora are."""
    out = []
    for _ in range(2):
        lens = np.minimum(max_seq, np.maximum(64, rng.lognormal(np.log(max_seq / 40), 1.5, 4096)))
        lens = lens.astype(np.int64)
        k = int(np.searchsorted(np.cumsum(lens), tokens))
        batch = lens[: k + 1].copy()
        batch[-1] -= int(batch.sum()) - tokens
        out.append((batch[batch > 0], None))
    return out


def mean_step(name: str, ranks: int, work: list, max_seq: int) -> float:
    strategy = get_strategy(name)
    tuned = tune(strategy, pricing(ranks).for_strategy(strategy), work, None, max_seq)
    return float(np.mean([report.step_time_s for _, report in tuned.planned]))


@given(
    seed=st.integers(0, 2**32 - 1),
    ranks=st.sampled_from([8, 16, 32, 64]),
    spread=st.sampled_from([4, 8]),
    steps_of_longest=st.integers(4, 8),
)
@settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
def test_tuned_baselines_beat_the_static_mesh_where_their_papers_say(
    seed, ranks, spread, steps_of_longest
):
    """The longest sequence spans 1/4 or 1/8 of the cluster's memory and a step holds 4-8 of
    them, the regime of the papers' long-context runs."""
    capacity = pricing(ranks).cost.capacity("peer")
    max_seq = capacity * ranks // spread
    work = batches(np.random.default_rng(seed), max_seq, max_seq * steps_of_longest)
    static = mean_step("static", ranks, work, max_seq)
    for name in CLAIMED:
        assert mean_step(name, ranks, work, max_seq) <= ONE_SETTING * static, name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tuned_baselines_beat_the_static_mesh_on_average(seed):
    rng = np.random.default_rng(seed)
    ratios = {name: [] for name in CLAIMED}
    for ranks in (8, 16, 32, 64):
        max_seq = pricing(ranks).cost.capacity("peer") * ranks // 8
        work = batches(rng, max_seq, 6 * max_seq)
        static = mean_step("static", ranks, work, max_seq)
        for name in CLAIMED:
            ratios[name].append(mean_step(name, ranks, work, max_seq) / static)
    for name, r in ratios.items():
        assert np.exp(np.mean(np.log(r))) < 1.0, (name, r)


@given(seed=st.integers(0, 2**32 - 1), ranks=st.sampled_from([8, 16, 32]))
@settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
def test_bytescale_s_step_falls_as_gpus_are_added(seed, ranks):
    """The same batches on twice the GPUs: ByteScale, its capacity searched at each size,
    spreads its long sequences wider and takes a shorter step (it scales, as its paper shows
    up to 12,000 GPUs)."""
    max_seq = pricing(ranks).cost.capacity("peer") * ranks // 2
    work = batches(np.random.default_rng(seed), max_seq, 4 * max_seq)
    assert mean_step("bytescale", 2 * ranks, work, max_seq) < mean_step(
        "bytescale", ranks, work, max_seq
    )
