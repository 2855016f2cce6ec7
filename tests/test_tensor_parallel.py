"""Tensor parallelism folded into a rank (``hdp-sim --tp``), against counts made by hand for
Megatron's layout of llama-7b and llama3-8b, and the ``ulysses`` baseline's mesh."""

import numpy as np
import pytest

from hdp import ClusterSpec, model_preset
from hdp.planner import PlanningError, StepPricing, plan_step
from hdp.planner.cli import sim_main

H, FFN, VOCAB, LAYERS = 4096, 11008, 32000, 32  # llama-7b


def test_a_gpus_shard_holds_its_share_of_megatrons_layout():
    for tp in (2, 4, 8):
        shard = model_preset("llama-7b").tensor_shard(tp)
        # Column-parallel q, k, v and gate/up, row-parallel o and down; both norms whole.
        layer = 4 * H * H // tp + 3 * H * FFN // tp + 2 * H
        embedding = 2 * (VOCAB // tp) * H + H  # vocabulary-parallel embedding and head
        assert shard.total_params == LAYERS * layer + embedding
        assert shard.kv_bytes_per_token == 2 * (32 // tp) * 128 * 2
        assert shard.hidden == H


def test_gqa_key_value_heads_are_replicated_past_their_count():
    shard = model_preset("llama3-8b").tensor_shard(8)  # 32 query heads, 8 key/value heads
    assert (shard.heads, shard.kv_heads) == (4, 1)
    assert model_preset("llama3-70b").tensor_shard(8).kv_bytes_per_token == 2 * 1 * 128 * 2


def test_the_collectives_of_a_layer_are_priced_on_nvlink():
    cluster = ClusterSpec.preset("h100", 16)
    one = StepPricing.build(model_preset("llama-7b"), cluster).cost
    four = StepPricing.build(model_preset("llama-7b"), cluster, tensor_parallel=4).cost
    assert (four.cluster.num_ranks, four.cluster.ranks_per_node) == (4, 2)
    g, T = cluster.gpu, 8192.0
    # Sequence parallelism: 4 all-gathers and 4 reduce-scatters of T x hidden bf16 activations
    # per layer forward and backward, 4 more for the recomputed forward; 3/4 of each moves.
    by_hand = 12 * (0.75 * T * H * 2 / g.nvlink_bw + g.nvlink_latency)
    assert four.compute.tensor_comm_time(T) == pytest.approx(by_hand, rel=1e-12)
    assert one.compute.tensor_comm_time(T) == 0.0
    # Layer inputs are split over the group: a quarter of the checkpointed bytes per token.
    assert four.ckpt_bytes_per_token == pytest.approx(one.ckpt_bytes_per_token / 4)
    # Model FLOPs per GPU shard times the group size: the model's, but for the norms.
    L = np.array([4096, 70000])
    norms = (4 - 1) * 2 * H * LAYERS * 2 * 3 * L.sum()
    assert 4 * four.model_flops(L) == pytest.approx(one.model_flops(L) + norms, rel=1e-3)


@pytest.mark.parametrize(
    ("model", "tp", "gpus", "words"),
    [
        ("llama-7b", 3, 24, "32 attention heads do not split into 3"),
        ("llama-7b", 16, 32, "16 does not divide its 8 GPUs"),
        ("llama-7b", 4, 30, "30 GPUs do not split into groups of 4"),
        ("llama3-8b", 2, 8, None),
    ],
)
def test_tp_that_does_not_split_is_one_line(capsys, model, tp, gpus, words):
    argv = ["--workload", "wlb-128k", "--model", model, "--gpus", str(gpus), "--tp", str(tp)]
    code = sim_main([*argv, "--steps", "1", "--strategies", "static", "--tokens-per-step", "256K"])
    out, err = capsys.readouterr()
    if words is None:
        assert code == 0, err
        assert f"{gpus} x h100 as {gpus // tp} tensor-parallel groups of {tp}" in out
        return
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith(f"hdp-sim: error: --tp {tp}: ") and words in line, line


def test_ulysses_groups_stay_within_the_head_count():
    lens = [16_000, 9000, 500, 40, 12_000, 7000]
    plan = plan_step(
        lens, ClusterSpec.preset("h100", 16), model_preset("tiny"), "ulysses", capacity=4096
    )
    assert plan.kv_exchange == "ulysses" and plan.strategy == "ulysses"
    group = int(plan.predicted["cp_size"])
    assert group <= model_preset("tiny").heads
    # DeepSpeed splits the heads evenly: llama-13b's 40 heads allow groups of at most 8.
    with pytest.raises(PlanningError, match="40 heads evenly over at most 8"):
        plan_step(
            [300_000],
            ClusterSpec.preset("h100", 64),
            model_preset("llama-13b"),
            "ulysses",
            capacity=16_384,
        )
    # Every sequence is spread over one whole group of the mesh, as DeepSpeed packs it.
    for s in range(len(lens)):
        ranks = np.unique(plan.rank[plan.seq == s])
        assert ranks.size == group and ranks[0] % group == 0
    with pytest.raises(PlanningError, match="Ulysses splits"):
        plan_step(
            [20_000], ClusterSpec.preset("h100", 64), model_preset("tiny"), "ulysses", capacity=4096
        )


def test_flexsp_in_zero3_runs_the_fewest_micro_batches_that_hold_the_batch():
    """Note [FlexSP's micro-batches]: FlexSP's GPT-7B (64 heads of 64, no checkpointing) on 8
    A100-40GB in ZeRO-3, a Wikipedia batch of 64K tokens: one solve for the whole batch packed 5
    micro-batches, each paying its parameter gathers; the batch fits in 3."""
    from hdp import ModelSpec, gpu_preset
    from hdp.workloads import get_workload

    gpt = ModelSpec("gpt-7b", 32, 4096, 64, 64, 64, 11008, 50257)
    pricing = StepPricing.build(
        gpt, ClusterSpec(8, 8, gpu_preset("a100-40g")), activation_checkpointing=False
    )
    lens = get_workload("wikipedia-384k").sample_batch(
        np.random.default_rng(0), 64 << 10, 192 << 10
    )
    plan = plan_step(lens, pricing, "flexsp")
    cap = pricing.cost.capacity("wave")
    assert plan.sync == "wave"
    assert plan.num_waves == -(-int(lens.sum()) // (8 * cap)) == 3
