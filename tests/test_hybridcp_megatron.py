"""Our BalancedCPSchedule re-implementation makes exactly megatron-core's decisions."""

import numpy as np
import pytest

from hdp.planner.hybridcp import BalancedCPSchedule, megatron_available, megatron_groups
from hdp.workloads import get_workload

pytestmark = pytest.mark.skipif(
    not megatron_available(), reason="megatron-core not installed (pip install 'hdp-llm[megatron]')"
)


@pytest.mark.parametrize(
    "workload, ranks, cap, tokens",
    [
        ("wlb-128k", 64, 16384, 1 << 20),
        ("wikipedia-384k", 64, 16384, 1 << 20),
        ("byted-2m", 256, 65536, 8 << 20),
        ("github-2m", 128, 65536, 4 << 20),
        ("wlb-128k", 8, 4096, 1 << 17),
    ],
)
def test_same_groups_as_megatron(workload, ranks, cap, tokens):
    w = get_workload(workload)
    rng = np.random.default_rng(7)
    for _ in range(2):
        lens = w.sample_batch(rng, tokens, min(w.max_seq, ranks * cap)).tolist()
        assert BalancedCPSchedule(cap, ranks).groups(lens) == megatron_groups(lens, cap, ranks)


def test_same_groups_on_random_small_batches():
    rng = np.random.default_rng(0)
    for _ in range(200):
        ranks = int(2 ** rng.integers(0, 5))
        cap = int(rng.integers(50, 500))
        lens = rng.integers(1, cap * ranks + 1, size=int(rng.integers(1, 40))).tolist()
        assert BalancedCPSchedule(cap, ranks).groups(lens) == megatron_groups(lens, cap, ranks), (
            ranks,
            cap,
            lens,
        )
