"""Megatron-LM integration (``hdp.dataloader.megatron``) against the real megatron-core (0.16.1).

Schedules are checked by an independent reading of Megatron's execution rules (lock-step CP
partners inside a group, aligned power-of-two CP groups, a sub-sample on every rank in the last
group); the wrapper runs on gloo ranks over a ``GPTDataset`` built with Megatron's own
``IndexedDatasetBuilder`` and is compared with Megatron's ``HybridCPDataLoaderWrapper``.
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hdp.planner import PlanningError
from hdp.planner.hybridcp import GroupOfSize, megatron_available
from hdp.testing.ranks import run_ranks

pytestmark = pytest.mark.skipif(
    not megatron_available(), reason="megatron-core not installed (pip install 'hdp-llm[megatron]')"
)


def check_megatron_can_run(
    sample_id_groups, groups, id_len: dict[int, int], n: int, cap: int
) -> None:
    """What Megatron's hybrid_context_parallel_forward_backward needs of a schedule."""
    seen: dict[int, int] = {}
    for g, (ids_group, lens_group) in enumerate(zip(sample_id_groups, groups)):
        assert len(ids_group) == n and len(lens_group) == n
        holders: dict[int, list[int]] = {}
        for r, ids in enumerate(ids_group):
            assert len(set(ids)) == len(ids), f"rank {r} lists a sample twice in group {g}"
            assert lens_group[r] == [id_len[s] for s in ids]
            for s in ids:
                holders.setdefault(s, []).append(r)
        for s, ranks in holders.items():
            assert s not in seen, f"sample {s} in groups {seen[s]} and {g}"
            seen[s] = g
            k = len(ranks)
            # One rank, all ranks, or a block Megatron builds: 2^i consecutive ranks at a
            # multiple of 2^i, for 2^i < 2^floor(log2 n) (create_hybrid_dp_cp_groups).
            assert ranks == list(range(ranks[0], ranks[0] + k))
            pow2_below = k & (k - 1) == 0 and k < 2 ** int(np.floor(np.log2(n)))
            assert k == n or (pow2_below and ranks[0] % k == 0 and ranks[0] + k <= n), ranks
            assert id_len[s] <= cap * k, f"sample {s}: {id_len[s]} tokens on {k} ranks of {cap}"
        # Lock-step: a rank runs its list in order; a sample starts when all its holders reach it.
        pos = [0] * n
        while any(pos[r] < len(ids_group[r]) for r in range(n)):
            moved = False
            for r in range(n):
                if pos[r] < len(ids_group[r]):
                    s = ids_group[r][pos[r]]
                    if all(
                        pos[q] < len(ids_group[q]) and ids_group[q][pos[q]] == s for q in holders[s]
                    ):
                        for q in holders[s]:
                            pos[q] += 1
                        moved = True
            assert moved, f"group {g} deadlocks"
    assert set(seen) == {s for s, L in id_len.items() if L > 0}
    assert all(sample_id_groups[-1][r] for r in range(n)), (
        "a rank has no sub-sample in the last group"
    )


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([2, 4, 6, 8, 10, 12, 16]), cap=st.integers(256, 4096), data=st.data())
def test_megatron_scheduler_schedules_run_in_megatron(n, cap, data):
    from hdp.dataloader.megatron import HDPScheduler

    count = data.draw(st.integers(n, 4 * n))
    lens = data.draw(st.lists(st.integers(1, cap * n), min_size=count, max_size=count))
    ids = data.draw(st.permutations(list(range(1000, 1000 + count))))
    id_len = dict(zip(ids, lens))
    groups, sample_id_groups = HDPScheduler(cap, GroupOfSize(n)).get_groups_and_subsamples(
        list(id_len.items()), None
    )
    check_megatron_can_run(sample_id_groups, groups, id_len, n, cap)


def test_megatron_scheduler_falls_back_instead_of_raising():
    from hdp.dataloader.megatron import HDPScheduler

    # Two short sub-samples on 8 ranks: each is split over a CP group, so every rank runs one
    # (the cost model prices the split as cheaper than ranks waiting with nothing to run).
    id_len = {0: 100, 1: 200}
    groups, sample_id_groups = HDPScheduler(1024, GroupOfSize(8)).get_groups_and_subsamples(
        list(id_len.items()), None
    )
    check_megatron_can_run(sample_id_groups, groups, id_len, 8, 1024)
    # Too few tokens to give every rank a share: hdp's plan cannot run, the fallback can.
    sched = HDPScheduler(1024, GroupOfSize(8))
    id_len = {0: 3, 1: 2}
    groups, sample_id_groups = sched.get_groups_and_subsamples(list(id_len.items()), None)
    check_megatron_can_run(sample_id_groups, groups, id_len, 8, 1024)
    assert sched.stats.fallbacks == 1 and sched.stats.last_source != "hdp"
    assert sum(sched.stats.reasons.values()) >= 1
    with pytest.raises(PlanningError, match="no sub-sample"):
        HDPScheduler(1024, GroupOfSize(8)).get_groups_and_subsamples([(0, 0)], None)
    with pytest.raises(PlanningError, match="raise --max-seqlen-per-dp-cp-rank to at least 1125"):
        HDPScheduler(1024, GroupOfSize(8)).get_groups_and_subsamples(
            [(i, 600) for i in range(8)] + [(9, 9000)], None
        )
    # 5000 tokens at 1024 per rank need 5 ranks: on 6 ranks Megatron builds groups of 2 and the
    # whole group, so the sequence runs on all 6.
    id_len = {**{i: 600 for i in range(8)}, 9: 5000}
    groups, sample_id_groups = HDPScheduler(1024, GroupOfSize(6)).get_groups_and_subsamples(
        list(id_len.items()), None
    )
    check_megatron_can_run(sample_id_groups, groups, id_len, 6, 1024)
    assert sum(9 in ids for g in sample_id_groups for ids in g) == 6


def test_megatron_group_sizes_are_the_groups_megatron_builds(monkeypatch):
    """Megatron's own group construction, with its process-group factory recording the ranks."""
    import megatron.core.parallel_state as ps

    from hdp.planner.common import megatron_group_sizes
    from hdp.planner.dynamic.megatron import megatron_cp_groups

    built: list[list[int]] = []
    monkeypatch.setattr(ps, "create_group", lambda ranks, **kw: built.append(list(ranks)))
    for n in range(2, 65, 2):
        built.clear()
        ps.create_hybrid_dp_cp_groups(0, list(range(n)), None)
        ours = {
            tuple(b) for k in megatron_group_sizes(n) if 1 < k < n for b in megatron_cp_groups(n, k)
        }
        # Megatron also builds each size's trailing partial group (ranks 16-21 of 22 as the
        # "group of 8" there); hdp uses only groups whose size is what it asks for, and a
        # power-of-two partial group is an aligned group of a smaller size.
        assert ours == {tuple(r) for r in built if len(r) & (len(r) - 1) == 0}, n
        assert megatron_group_sizes(n)[-1] == n


def test_megatron_scheduler_never_raises_where_megatron_succeeds():
    """1000 random batches on 2 to 64 ranks (odd and non-powers of two included): wherever
    Megatron's BalancedCPScheduler returns a schedule, ours returns one Megatron can run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from hdp.dataloader.megatron import HDPScheduler

    rng = np.random.default_rng(19)
    theirs_ok = 0
    for _ in range(1000):
        n, cap = int(rng.integers(2, 65)), int(rng.integers(64, 2048))
        if rng.random() < 0.4:  # few short sub-samples
            lens = rng.integers(1, cap + 1, size=int(rng.integers(1, max(2, n // 4) + 1)))
        else:
            lens = rng.integers(1, cap * n + 1, size=int(rng.integers(1, n + 1)))
        items = list(enumerate(lens.tolist()))
        try:
            BalancedCPScheduler(cap, GroupOfSize(n)).get_groups_and_subsamples(items, None)
            theirs_ok += 1
        except Exception:  # noqa: BLE001 -- only whether it returns matters here
            pass
        # Every sub-sample fits on all n ranks, so ours must always return a runnable schedule.
        groups, sample_id_groups = HDPScheduler(cap, GroupOfSize(n)).get_groups_and_subsamples(
            items, None
        )
        check_megatron_can_run(sample_id_groups, groups, dict(items), n, cap)
    assert theirs_ok > 100


@pytest.mark.parametrize(
    "workload, ranks, cap",
    [
        ("wlb-128k", 64, 16384),
        ("byted-2m", 64, 65536),
        ("wlb-128k", 256, 16384),
        ("github-2m", 256, 65536),
    ],
)
def test_megatron_scheduler_beats_balanced_cp_scheduler(workload, ranks, cap):
    """Same batches, same cost model, both schedules priced as Megatron executes them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from hdp.dataloader.megatron import HDPScheduler, megatron_plan
    from hdp.workloads import get_workload

    w = get_workload(workload)
    for seed in range(2):
        lens = w.sample_batch(np.random.default_rng(seed), ranks * cap, min(w.max_seq, ranks * cap))
        items = list(enumerate(int(x) for x in lens))
        ours = HDPScheduler(cap, GroupOfSize(ranks))
        groups, sample_id_groups = ours.get_groups_and_subsamples(items, None)
        check_megatron_can_run(sample_id_groups, groups, dict(items), ranks, cap)
        _, theirs = BalancedCPScheduler(cap, GroupOfSize(ranks)).get_groups_and_subsamples(
            items, None
        )
        t_ours = ours.executed_plan().predicted["step_time_s"]
        t_theirs = megatron_plan(ours.cost, items, theirs).predicted["step_time_s"]
        assert t_ours < t_theirs, (workload, ranks, seed, t_ours, t_theirs)


# ---------------------------------------------------------------- the wrapper on gloo ranks

SEQ = 1024  # GPTDataset sample length
PER_REPLICA = 3  # packed samples each DP replica reads per step
CAP = 512  # max_seqlen_per_dp_cp_rank


def write_corpus(prefix: str, docs: int = 300, seed: int = 0) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(docs):
        n = int(rng.choice([rng.integers(20, 200), rng.integers(200, 1500)]))
        builder.add_document(
            torch.from_numpy(np.append(rng.integers(1, 999, n - 1), 0).astype(np.int32)), [n]
        )
    builder.finalize(prefix + ".idx")


def gpt_dataset(prefix: str, cache: str):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    class Tokenizer:  # what GPTDataset reads of a tokenizer
        eod, pad, vocab_size = 0, 1000, 1001
        unique_identifiers = {"class": "TestTokenizer"}

    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=SEQ,
        tokenizer=Tokenizer(),
        reset_position_ids=True,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=cache,
    )
    indexed = IndexedDataset(prefix)
    return GPTDataset(indexed, prefix, np.arange(len(indexed)), 64, Split.train, config)


class Config:
    max_seqlen_per_dp_cp_rank = CAP


def _wrapper_ranks(rank, world, prefix, cp, out_dir):
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    from megatron.core.process_groups_config import ProcessGroupCollection

    from hdp.dataloader.megatron import HDPDataLoaderWrapper, add_cu_seqlens

    dp = world // cp
    # Megatron's rank order with TP = 1: cp fastest, then dp.
    dp_groups = [dist.new_group([c + cp * d for d in range(dp)]) for c in range(cp)]
    tp_groups = [dist.new_group([r]) for r in range(world)]
    pgs = ProcessGroupCollection()
    pgs.dp_cp, pgs.dp, pgs.tp = dist.group.WORLD, dp_groups[rank % cp], tp_groups[rank]
    ds = gpt_dataset(prefix, os.path.join(out_dir, "cache"))  # built by the test process
    replica = rank // cp
    batch = [add_cu_seqlens(ds[replica * PER_REPLICA + i]) for i in range(PER_REPLICA)]

    ours = HDPDataLoaderWrapper(iter([batch]), Config(), pg_collection=pgs, contract="flat")
    samples, sample_id_groups = next(ours)
    # Every rank sees the same schedule; it received exactly its sub-samples, with their tokens.
    all_groups = [None] * world
    dist.all_gather_object(all_groups, sample_id_groups)
    assert all(g == sample_id_groups for g in all_groups)
    mine = {s for g in sample_id_groups for s in g[rank]}
    assert set(samples) == mine
    # The sub-samples in global id order: DP replica 0's samples first, each split at position
    # resets.
    expected = []
    for d in range(dp):
        for i in range(PER_REPLICA):
            s = ds[d * PER_REPLICA + i]
            starts = [int(x) for x in torch.nonzero(s["position_ids"] == 0).flatten()] + [SEQ]
            expected += [
                {k: v[a:b] for k, v in s.items()} for a, b in zip(starts[:-1], starts[1:]) if b > a
            ]
    lengths = {i: int(e["tokens"].numel()) for i, e in enumerate(expected)}
    cp_of = {s: sum(s in ids for ids in g) for g in sample_id_groups for s in set().union(*g)}
    for gid, sample in samples.items():
        n_real, n_all = lengths[gid], int(sample["tokens"].numel())
        # Padded at the end to a multiple of 2 x its CP size where it is split, loss-free.
        k = cp_of[gid]
        assert n_all == (n_real if k == 1 else -(-n_real // (2 * k)) * 2 * k), (gid, k)
        assert sample["max_seqlen"].dtype == torch.int32 and sample["max_seqlen"].tolist() == [
            n_all
        ]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(sample[key][:n_real], expected[gid][key]), (gid, key)
        assert not sample["loss_mask"][n_real:].any()
        assert torch.equal(
            sample["position_ids"][n_real:],
            expected[gid]["position_ids"][-1] + 1 + torch.arange(n_all - n_real),
        )
    groups_lens = [[[lengths[s] for s in ids] for ids in g] for g in sample_id_groups]
    check_megatron_can_run(sample_id_groups, groups_lens, lengths, world, CAP)

    # Megatron's own wrapper on the same batch (CUDA calls patched to the CPU, nothing else).
    from unittest import mock

    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper

    with (
        mock.patch.object(torch.Tensor, "cuda", lambda t, *a, **k: t),
        mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
    ):
        theirs_samples, theirs_groups = next(
            HybridCPDataLoaderWrapper(iter([batch]), Config(), pg_collection=pgs)
        )
    assert {s for g in theirs_groups for s in g[rank]} == set(theirs_samples)
    # Same keys, plus the max_seqlen that Megatron's own wrapper drops and the receiving TP ranks
    # of 0.16 / 0.17 need in the broadcast.
    assert set(next(iter(theirs_samples.values()))) | {"max_seqlen"} == set(
        next(iter(samples.values()))
    )
    if rank == 0:
        from hdp.dataloader.megatron import megatron_plan

        items = list(lengths.items())
        cost = ours.cp_balancing_scheduler.cost
        t_ours = megatron_plan(cost, items, sample_id_groups).predicted["step_time_s"]
        t_theirs = megatron_plan(cost, items, theirs_groups).predicted["step_time_s"]
        with open(os.path.join(out_dir, "times.txt"), "w") as f:
            f.write(f"{t_ours} {t_theirs}")


@pytest.mark.parametrize("world, cp", [(4, 2), (2, 1)])
def test_megatron_wrapper_on_gloo(tmp_path, world, cp):
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix)
    gpt_dataset(
        prefix, str(tmp_path / "cache")
    )  # GPTDataset builds its index cache on global rank 0 only
    run_ranks(_wrapper_ranks, world, prefix, cp, str(tmp_path), timeout=240)
    t_ours, t_theirs = map(float, (tmp_path / "times.txt").read_text().split())
    assert t_ours <= t_theirs * 1.0001, (t_ours, t_theirs)


def test_megatron_packed_batch_iterator(tmp_path):
    """The external-dataloader path: whole sequences per DP replica, THD PackedSeqParams whose
    cu_seqlens cut the micro-batch into the documents, each padded to a multiple of 2 * cp."""
    from hdp import ClusterSpec, model_preset
    from hdp.dataloader import BatchStream, HDPDataLoader, SyntheticSource
    from hdp.dataloader.megatron import PackedBatchIterator

    src = SyntheticSource("wlb-128k", 200, 2048, 0)
    stream = BatchStream([src.lengths], 8192, 2048)
    loader = HDPDataLoader(
        [src],
        stream,
        ClusterSpec.preset("cpu", 1),
        model_preset("tiny"),
        plan_options={"form": "whole", "capacity": 4096},
    )
    it = PackedBatchIterator(loader, num_microbatches=6, pad_multiple=4)
    batches = [next(it) for _ in range(6)]
    step = it.step_data
    loader.close()
    real = [b for b in batches if b["loss_mask"].sum() > 0]
    assert len(real) == sum(1 for w in step.waves if w.input_ids.numel())
    trained = 0
    for b in batches:
        p = b["packed_seq_params"]
        assert b["cu_seqlens"].shape[0] == 1 and b["cu_seqlens"].dtype == torch.int32
        cu = b["cu_seqlens"][0].tolist()
        assert p.qkv_format == "thd" and torch.equal(p.cu_seqlens_q, b["cu_seqlens"][0])
        assert b["max_seqlen"].shape == (1,) and b["max_seqlen"].dtype == torch.int32
        assert cu[-1] == b["tokens"].shape[1] and all(
            (y - x) % 4 == 0 for x, y in zip(cu[:-1], cu[1:])
        )
        assert p.max_seqlen_q == max(y - x for x, y in zip(cu[:-1], cu[1:]))
        for x in cu[:-1]:  # positions restart with every document
            assert b["position_ids"][0, x] == 0
        trained += int(b["loss_mask"].sum())
    assert trained == sum(int((w.labels != -100).sum()) for w in step.waves)
    with pytest.raises(PlanningError, match="raise --global-batch-size"):
        it2 = PackedBatchIterator(
            HDPDataLoader(
                [src],
                BatchStream([src.lengths], 8192, 2048),
                ClusterSpec.preset("cpu", 1),
                model_preset("tiny"),
                plan_options={"form": "whole", "capacity": 2048},
            ),
            num_microbatches=1,
        )
        next(it2)


def test_megatron_install_replaces_the_wrapper(monkeypatch):
    """After install(), the name Megatron's training loop calls builds our wrapper."""
    import megatron.core.datasets.data_schedule as data_schedule

    from hdp.dataloader.megatron import HDPDataLoaderWrapper, install

    monkeypatch.setattr(
        data_schedule, "HybridCPDataLoaderWrapper", data_schedule.HybridCPDataLoaderWrapper
    )
    install(model="llama-70b")

    class Pgs:
        dp_cp, dp, tp = GroupOfSize(8), GroupOfSize(4), GroupOfSize(1)

    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    w = data_schedule.HybridCPDataLoaderWrapper(iter([]), Config(), pg_collection=Pgs())
    assert isinstance(w, HDPDataLoaderWrapper)
    assert w.cp_balancing_scheduler.cost.model.name == "llama-70b"
    assert w.cp_balancing_scheduler.max_seq_len_per_rank == CAP


@settings(max_examples=40, deadline=None)
@given(
    n=st.sampled_from([2, 4, 6, 8, 12, 16]),
    sync=st.sampled_from(["peer", "wave"]),
    cap=st.integers(256, 2048),
    data=st.data(),
)
def test_the_megatron_form_predicts_the_step_megatron_runs(n, sync, cap, data):
    """Megatron runs each sequence of a schedule as a micro-batch of its own: the form's
    predicted step (its local search included) is the step of the plan Megatron executes for
    the form's schedule, and neither it nor Megatron's own schedule beats the form's bound."""
    from hdp import ClusterSpec, model_preset
    from hdp.dataloader.megatron import (
        megatron_plan,
        sample_id_groups_from_plan,
        schedule_problem,
    )
    from hdp.planner import StepPricing, get_strategy, plan_and_evaluate

    lens = data.draw(st.lists(st.integers(1, cap * n), min_size=n, max_size=6 * n))
    pricing = StepPricing.build(
        model_preset("llama-7b"), ClusterSpec.preset("h100", n, 4), capacity=cap, sync=sync
    )
    plan, report = plan_and_evaluate(lens, pricing, "hdp", form="megatron")
    hdp = get_strategy("hdp")
    cost = pricing.settle(hdp, max(lens), hdp.options(form="megatron")).cost
    items = list(enumerate(lens))
    groups = sample_id_groups_from_plan(plan, np.arange(len(lens)))
    ran = megatron_plan(cost, items, groups, plan.sync).predicted["step_time_s"]
    assert ran == pytest.approx(plan.predicted["padded_step_time_s"], rel=1e-9)
    bound = plan.predicted["bound_s"]
    assert bound <= report.step_time_s * (1 + 1e-9)
    # The bound holds for Megatron's own schedule too, where it is a plan of the form (for some
    # sizes it takes CP groups Megatron does not build: 8 of 12 ranks).
    try:
        their_plan, _ = plan_and_evaluate(lens, pricing, "hybridcp", hybridcp_impl="ours")
    except PlanningError:
        return
    their_groups = sample_id_groups_from_plan(their_plan, np.arange(len(lens)))
    if schedule_problem(their_groups, dict(items), n, cap) is None:
        theirs = megatron_plan(cost, items, their_groups, plan.sync).predicted["step_time_s"]
        assert bound <= theirs * (1 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(
    n=st.sampled_from([2, 4, 8, 16]),
    sync=st.sampled_from(["peer", "wave"]),
    cap=st.integers(256, 2048),
    data=st.data(),
)
def test_the_megatron_form_keeps_to_its_budget(n, sync, cap, data):
    """The Megatron form prices its layouts while its budget lasts: past its first plan it
    charges no more than it has, a larger budget never steps slower, and with no limit (and no
    stop at its bound) its step is the least of every layout of its degree choices, each
    priced as Megatron runs it."""
    from hdp import ClusterSpec, model_preset
    from hdp.planner import StepPricing, get_strategy, plan_and_evaluate
    from hdp.planner.common import Context
    from hdp.planner.degrees import relaxation_bound
    from hdp.planner.dynamic import DynamicOptions, megatron

    lens = data.draw(st.lists(st.integers(1, cap * n), min_size=n, max_size=6 * n))
    pricing = StepPricing.build(
        model_preset("llama-7b"), ClusterSpec.preset("h100", n, 4), capacity=cap, sync=sync
    )
    steps = []
    for budget in (0.0, 2e-3, None, math.inf):
        options = DynamicOptions(form="megatron", plan_budget_s=budget, gap=-1.0)
        plan, _ = plan_and_evaluate(lens, pricing, "hdp", hdp_options=options)
        assert plan.predicted["search_s"] <= plan.predicted["budget_s"] + 1e-12
        steps.append(plan.predicted["padded_step_time_s"])
    assert all(a >= b for a, b in zip(steps, steps[1:]))  # (the same order, more of it)
    hdp = get_strategy("hdp")
    cost, sync, cap = pricing.settle(hdp, max(lens), hdp.options(form="megatron"))
    seq_lens = np.asarray(lens, dtype=np.int64)
    ctx = Context(seq_lens, cost, sync, cap, int(seq_lens.max()), int(seq_lens.sum()))
    rel = relaxation_bound(cost, seq_lens, sync, cap, n, pow2=True)
    lay_out = megatron._place_waves if sync == "wave" else megatron._place_one_group
    every = [
        megatron.price(ctx, lay_out(ctx, degree, job_time))[0]
        for degree, job_time in megatron._degree_choices(ctx, rel)
    ]
    assert steps[-1] == pytest.approx(min(every), rel=1e-12)
