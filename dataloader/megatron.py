"""Megatron-LM adapter: our planner inside Megatron's hybrid context parallelism.

Every megatron-core import of the project lives here, behind :func:`require_megatron` (version
check, clear error).

* :class:`HDPScheduler` -- a drop-in for megatron-core's ``BalancedCPScheduler``:
  ``get_groups_and_subsamples(sample_id_seqlens, config)`` returns ``(groups, sample_id_groups)``
  with ``groups[g][r]`` the sub-sample lengths and ``sample_id_groups[g][r]`` the sub-sample ids
  rank ``r`` of the DPxCP group runs in group ``g`` (in order, one micro-batch each). A sample
  listed by several ranks of a group runs zigzag-split over them: always an aligned power-of-two
  block of consecutive ranks (size ``2^i`` starting at a multiple of ``2^i``), the only CP groups
  Megatron builds. The schedule is ``plan_step(..., "hdp", form="megatron")``.
* :class:`HDPDataLoaderWrapper` -- a drop-in for ``HybridCPDataLoaderWrapper`` (same constructor,
  same ``(samples_this_rank_with_id, sample_id_groups)`` items), using :class:`HDPScheduler`; runs
  on NCCL/CUDA and on gloo/CPU.
* :class:`PackedBatchIterator` -- for ``--dataloader-type external`` and Megatron versions
  without hybrid CP: our dataloader's micro-batches as Megatron batch dicts with THD
  ``PackedSeqParams``.
* :func:`install` -- makes Megatron-LM's training loop build :class:`HDPDataLoaderWrapper` where it
  builds ``HybridCPDataLoaderWrapper`` (one line in ``pretrain_gpt.py``).
* :func:`add_cu_seqlens` -- the packed-sample ``cu_seqlens`` of a ``GPTDataset`` sample built with
  ``reset_position_ids``.

See docs/megatron.md for what a Megatron-LM user changes.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hdp import ClusterSpec, CostModel, Plan, gpu_preset, model_preset
from planner import PlanningError, plan_step
from planner.common import Context
from planner.hybridcp import plan_from_sample_id_groups

MIN_MEGATRON_CORE = (0, 16)
# Keys of a packed sample that describe the packing rather than hold one entry per token.
PACKING_KEYS = ("cu_seqlens", "cu_seqlens_padded", "batch_idx", "max_seqlen")


def require_megatron():
    """megatron-core's module, or ImportError saying what to install: hybrid context parallelism
    (``HybridCPDataLoaderWrapper``, ``BalancedCPScheduler``) first shipped in megatron-core 0.16."""
    try:
        with warnings.catch_warnings():  # it warns at import about missing TransformerEngine / Apex
            warnings.simplefilter("ignore")
            import megatron.core as mcore
    except ImportError as e:
        raise ImportError(
            "dataloader.megatron needs megatron-core >= 0.16: pip install 'hdp[megatron]' "
            f"(or megatron-core>=0.16) ({e})"
        ) from e
    version = tuple(int(x) for x in mcore.__version__.split(".")[:2] if x.isdigit())
    if version < MIN_MEGATRON_CORE:
        raise ImportError(
            f"megatron-core {mcore.__version__} has no hybrid context parallelism: "
            "HDPDataLoaderWrapper needs >= 0.16 (pip install -U 'megatron-core>=0.16'); "
            "with older versions use dataloader.megatron.PackedBatchIterator"
        )
    return mcore


def install(**scheduler_options: Any) -> None:
    """Make Megatron-LM use :class:`HDPDataLoaderWrapper` wherever it would build
    ``HybridCPDataLoaderWrapper`` (``--hybrid-context-parallel``). Call it once in
    ``pretrain_gpt.py`` before ``pretrain(...)``; ``scheduler_options`` go to :class:`HDPScheduler`
    (model, gpu, gpus_per_node, sync)."""
    import sys

    require_megatron()
    import megatron.core.datasets.data_schedule as data_schedule

    def wrapper(data_iterator, config, pg_collection=None):
        return HDPDataLoaderWrapper(
            data_iterator, config, pg_collection, scheduler_options=scheduler_options
        )

    data_schedule.HybridCPDataLoaderWrapper = wrapper
    # Megatron-LM's training loop imports the name at module load: rebind it there too.
    training = sys.modules.get("megatron.training.training")
    if training is not None and hasattr(training, "HybridCPDataLoaderWrapper"):
        training.HybridCPDataLoaderWrapper = wrapper


class HDPScheduler:
    """Drop-in for megatron-core's ``BalancedCPScheduler`` (see the module docstring).

    Args:
        max_seq_len_per_rank: tokens one rank holds at once (``config.max_seqlen_per_dp_cp_rank``).
        dp_cp_group: the DPxCP process group; only its ``size()`` is used.
        model, gpu, gpus_per_node: what the cost model prices (a preset name or a ``ModelSpec``;
            a GPU profile name; ranks per node, for the NVLink / NIC split).
        sync: ``"peer"`` (what Megatron's hybrid-CP schedule runs: ranks wait only for their CP
            partners inside a group) or ``"wave"``; default: peer where memory allows.

    After each call ``last_schedule_s`` is the wall time it took and :meth:`executed_plan` prices
    what Megatron will run.
    """

    def __init__(
        self,
        max_seq_len_per_rank: int,
        dp_cp_group: Any,
        *,
        model: Any = "llama-7b",
        gpu: str = "h100",
        gpus_per_node: int = 8,
        sync: str | None = None,
    ) -> None:
        self.max_seq_len_per_rank = int(max_seq_len_per_rank)
        self.total_hdp_gpus = int(dp_cp_group.size())
        spec = model_preset(model) if isinstance(model, str) else model
        cluster = ClusterSpec(
            self.total_hdp_gpus, min(gpus_per_node, self.total_hdp_gpus), gpu_preset(gpu)
        )
        self.cost = CostModel(spec, cluster, capacity_override=self.max_seq_len_per_rank)
        self.sync = sync
        self.last_schedule_s = 0.0
        self._last: tuple | None = None

    def get_groups_and_subsamples(
        self, sample_id_seqlens: Sequence[tuple[int, int]], config: Any = None
    ) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
        """``(groups, sample_id_groups)`` as ``BalancedCPScheduler`` returns them; ``config`` is
        accepted for the same signature and not needed."""
        t0 = time.perf_counter()
        items = [(int(i), int(L)) for i, L in sample_id_seqlens if int(L) > 0]
        if not items:
            raise PlanningError("HDPScheduler: no sub-sample with a positive length to schedule")
        ids = np.array([i for i, _ in items], dtype=np.int64)
        lens = np.array([L for _, L in items], dtype=np.int64)
        plan = plan_step(
            lens,
            self.cost.cluster,
            self.cost.model,
            "hdp",
            form="megatron",
            cost=self.cost,
            sync=self.sync,
        )
        length = dict(items)
        id_groups = _runnable(sample_id_groups_from_plan(plan, ids), length, self.total_hdp_gpus)
        groups = [[[length[s] for s in ranks] for ranks in g] for g in id_groups]
        self.last_schedule_s = time.perf_counter() - t0
        self._last = (items, id_groups, plan.sync)
        return groups, id_groups

    def executed_plan(self) -> Plan:
        """The plan Megatron executes for the last schedule, priced by the cost model
        (``predicted["step_time_s"]``); see :func:`megatron_plan`."""
        if self._last is None:
            raise RuntimeError("HDPScheduler.executed_plan: nothing scheduled yet")
        return megatron_plan(self.cost, *self._last)


def megatron_plan(
    cost: CostModel,
    sample_id_seqlens: Sequence[tuple[int, int]],
    sample_id_groups: list[list[list[int]]],
    sync: str = "peer",
) -> Plan:
    """The plan Megatron executes for a schedule (ours or ``BalancedCPScheduler``'s), priced by
    ``cost``: ``plan.predicted["step_time_s"]`` is its step time. Sequence ``k`` of the plan is
    the ``k``-th entry of ``sample_id_seqlens``."""
    ids = [int(i) for i, _ in sample_id_seqlens]
    lens = np.array([int(L) for _, L in sample_id_seqlens], dtype=np.int64)
    index_of = {i: k for k, i in enumerate(ids)}
    ctx = Context(
        seq_lens=lens,
        cost=cost,
        sync=sync,
        capacity=cost.capacity(sync),
        max_seq=int(lens.max()),
        tokens_per_step=int(lens.sum()),
    )
    local = [[[index_of[s] for s in ranks] for ranks in g] for g in sample_id_groups]
    plan = plan_from_sample_id_groups(ctx, local, None, "hdp")
    plan.predicted.update(cost.evaluate(plan).summary())
    return plan


def sample_id_groups_from_plan(plan: Plan, ids: np.ndarray) -> list[list[list[int]]]:
    """Megatron's ``sample_id_groups`` of a Megatron-form plan: one group per barrier-separated run
    of waves; each rank lists its sequences (as ``ids[seq]``) by wave, ties by sequence index, so
    the CP partners of a sequence list it in the same relative order."""
    n = plan.num_ranks
    bounds = [0, *sorted(b for b in plan.barriers if 0 < b < plan.num_waves), plan.num_waves]
    pairs = np.unique(
        np.stack([plan.wave, plan.seq, plan.rank], axis=1), axis=0
    )  # sorted by wave, seq
    groups: list[list[list[int]]] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        lists: list[list[int]] = [[] for _ in range(n)]
        for _, s, r in pairs[(pairs[:, 0] >= a) & (pairs[:, 0] < b)].tolist():
            if not lists[r] or lists[r][-1] != int(ids[s]):
                lists[r].append(int(ids[s]))
        if any(lists):
            groups.append(lists)
    return groups


def _runnable(
    id_groups: list[list[list[int]]], length: dict[int, int], n: int
) -> list[list[list[int]]]:
    """Make a schedule one Megatron can run: its forward-backward runs the last sub-sample of the
    last group on every rank outside ``no_sync`` (to trigger the gradient reduction), so every rank
    needs a sub-sample in the last group.

    A rank with nothing at all takes a single-rank sample from the rank with the most work (a
    rank that keeps at least one); then trailing groups merge until the last group covers every
    rank. Merging drops a barrier: harmless, because every rank lists samples in the plan's wave
    order, so CP partners never wait for each other in a cycle."""
    groups = [[list(r) for r in g] for g in id_groups]
    holders: dict[int, set[int]] = {}
    for g in groups:
        for r, ids in enumerate(g):
            for s in ids:
                holders.setdefault(s, set()).add(r)
    work = [sum(length[s] ** 2 / len(holders[s]) for g in groups for s in g[r]) for r in range(n)]
    for r in range(n):
        if any(g[r] for g in groups):
            continue
        donors = [
            (work[d], d)
            for d in range(n)
            if sum(len(holders[s]) == 1 for g in groups for s in g[d]) >= 1
            and sum(len(g[d]) for g in groups) >= 2
        ]
        if not donors:
            raise PlanningError(
                f"HDPScheduler: {len(holders)} sub-samples cannot give each of {n} ranks one "
                "(Megatron's schedule needs a sub-sample on every rank): use more or longer samples"
            )
        _, d = max(donors)
        g_idx, s = max(
            ((gi, s) for gi, g in enumerate(groups) for s in g[d] if len(holders[s]) == 1),
            key=lambda t: (t[0], length[t[1]]),
        )
        groups[g_idx][d].remove(s)
        groups[-1][r].append(s)
        holders[s] = {r}
        work[d] -= length[s] ** 2
        work[r] += length[s] ** 2
    while len(groups) > 1 and not all(groups[-1]):
        last = groups.pop()
        groups[-1] = [a + b for a, b in zip(groups[-1], last)]
    return [g for g in groups if any(g)]


def add_cu_seqlens(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sample with ``cu_seqlens`` (int32) of its documents, read off ``position_ids`` resets:
    a ``GPTDataset`` sample built with ``reset_position_ids=True`` restarts positions at 0 after
    every end-of-document token."""
    pos = sample["position_ids"].reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([torch.zeros(1, dtype=starts.dtype), starts])
    out = dict(sample)
    out["cu_seqlens"] = torch.cat([starts, torch.tensor([pos.numel()])]).to(torch.int32)
    return out


class HDPDataLoaderWrapper:
    """Drop-in for megatron-core's ``HybridCPDataLoaderWrapper`` with :class:`HDPScheduler`.

    Each ``next()``: every DP rank pulls its batch (a list of packed samples, each a dict of
    per-token tensors plus ``cu_seqlens``), the sub-sample lengths are all-gathered over the DP
    group, the scheduler assigns sub-samples to DPxCP ranks, and an all-to-all over the DPxCP
    group moves each sub-sample's tokens to the ranks that run it. Yields
    ``(samples_this_rank_with_id, sample_id_groups)``: ``{global id: {key: tensor [L]}}`` and the
    schedule, exactly what Megatron's ``hybrid_context_parallel_forward_backward`` consumes.

    Tensors travel on the current CUDA device where the DPxCP group is NCCL, else on the CPU.
    ``scheduler_options`` go to :class:`HDPScheduler` (model, gpu, gpus_per_node, sync).
    """

    def __init__(
        self,
        data_iterator: Iterator | None,
        config: Any,
        pg_collection: Any = None,
        scheduler_options: dict | None = None,
    ) -> None:
        require_megatron()
        self.data_iterator = data_iterator
        self.config = config
        if pg_collection is None:
            from megatron.core import parallel_state

            self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            self.dp_group = parallel_state.get_data_parallel_group()
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        else:
            self.dp_cp_group, self.dp_group, self.tp_group = (
                pg_collection.dp_cp,
                pg_collection.dp,
                pg_collection.tp,
            )
        if self.dp_cp_group is None or self.dp_group is None or self.tp_group is None:
            raise ValueError(
                "HDPDataLoaderWrapper needs the dp_cp, dp and tp process groups "
                "(initialise Megatron's parallel state or pass pg_collection)"
            )
        if not getattr(config, "max_seqlen_per_dp_cp_rank", None):
            raise ValueError(
                "config.max_seqlen_per_dp_cp_rank is not set: hybrid context parallelism needs the "
                "tokens one rank can hold (--max-seqlen-per-dp-cp-rank)"
            )
        self.cp_balancing_scheduler = HDPScheduler(
            config.max_seqlen_per_dp_cp_rank, self.dp_cp_group, **(scheduler_options or {})
        )
        self.total_hdp_gpus = self.dp_cp_group.size()
        nccl = dist.get_backend(self.dp_cp_group) == "nccl"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        )

    def __iter__(self) -> HDPDataLoaderWrapper:
        return self

    def _gather_lengths(self, local: list[int]) -> tuple[list[int], list[int]]:
        """All sub-sample lengths of the global batch (DP rank order), each DP rank's first id."""
        world = self.dp_group.size()
        count = torch.tensor([len(local)], dtype=torch.int64, device=self.device)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=self.dp_group)
        counts_l = [int(c.item()) for c in counts]
        padded = torch.zeros(max(counts_l), dtype=torch.int64, device=self.device)
        padded[: len(local)] = torch.tensor(local, dtype=torch.int64)
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.dp_group)
        lengths = [int(x) for g, c in zip(gathered, counts_l) for x in g[:c].tolist()]
        return lengths, np.concatenate([[0], np.cumsum(counts_l)[:-1]]).astype(int).tolist()

    def _hdp_rank(self, global_rank: int) -> int:
        return dist.get_group_rank(self.dp_cp_group, global_rank)

    def _reroute(
        self,
        subsamples: list[dict],
        first_id: int,
        lengths: list[int],
        sample_id_groups: list[list[list[int]]],
        offsets: list[int],
    ) -> dict[int, dict]:
        """All-to-all over the DPxCP group: each rank receives the sub-samples it runs from the
        member of its own DP group that read them (all CP ranks of a DP replica read the same
        batch, so only ranks with the same CP index exchange data)."""
        me = self.dp_cp_group.rank()
        n = self.total_hdp_gpus
        needs = [sorted({s for g in sample_id_groups for s in g[d]}) for d in range(n)]
        my_dp = [self._hdp_rank(g) for g in dist.get_process_group_ranks(self.dp_group)]
        mine = range(first_id, first_id + len(subsamples))
        send = [[s for s in needs[d] if s in mine] if d in my_dp else [] for d in range(n)]
        src_of_id = np.searchsorted(np.asarray(offsets), np.arange(len(lengths)), side="right") - 1
        recv = [[s for s in needs[me] if my_dp[src_of_id[s]] == src] for src in range(n)]
        # Which per-token tensors a sub-sample carries (dtype, trailing shape): ranks whose DP
        # replica read nothing learn it from the others.
        local_meta = (
            {k: (v.dtype, tuple(v.shape[1:])) for k, v in subsamples[0].items()}
            if subsamples
            else None
        )
        metas: list = [None] * n
        dist.all_gather_object(metas, local_meta, group=self.dp_cp_group)
        meta = next((m for m in metas if m is not None), {})
        received: dict[int, dict] = {s: {} for src in recv for s in src}
        for key, (dtype, rest) in meta.items():
            chunks = [
                subsamples[s - first_id][key].to(self.device) for d in range(n) for s in send[d]
            ]
            send_t = (
                torch.cat(chunks)
                if chunks
                else torch.empty((0, *rest), dtype=dtype, device=self.device)
            )
            recv_t = torch.empty(
                (sum(lengths[s] for src in recv for s in src), *rest),
                dtype=dtype,
                device=self.device,
            )
            dist.all_to_all_single(
                recv_t,
                send_t,
                [sum(lengths[s] for s in src) for src in recv],
                [sum(lengths[s] for s in d) for d in send],
                group=self.dp_cp_group,
            )
            cursor = 0
            for src in recv:
                for s in src:
                    received[s][key] = recv_t[cursor : cursor + lengths[s]]
                    cursor += lengths[s]
        return received

    def __next__(self) -> tuple[dict[int, dict] | None, list[list[list[int]]] | None]:
        if self.data_iterator is None:  # only the first TP rank reads; the others get broadcasts
            return None, None
        batch = next(self.data_iterator)
        subsamples = []
        for sample in batch:
            cu = [int(x) for x in sample["cu_seqlens"].tolist()]
            for a, b in zip(cu[:-1], cu[1:]):
                if b > a:
                    subsamples.append(
                        {
                            k: v[a:b]
                            for k, v in sample.items()
                            if k not in PACKING_KEYS and isinstance(v, torch.Tensor)
                        }
                    )
        lengths, offsets = self._gather_lengths(
            [int(next(iter(s.values())).shape[0]) for s in subsamples]
        )
        _, sample_id_groups = self.cp_balancing_scheduler.get_groups_and_subsamples(
            list(enumerate(lengths)), self.config
        )
        samples = self._reroute(
            subsamples, offsets[self.dp_group.rank()], lengths, sample_id_groups, offsets
        )
        return samples, sample_id_groups


class PackedBatchIterator:
    """Megatron batches for ``--dataloader-type external`` (and Megatron versions without hybrid
    CP): each ``next()`` is one micro-batch of this DP replica, packed in THD form.

    ``loader`` is an :class:`dataloader.HDPDataLoader` over the **data-parallel** group: one
    loader rank per DP replica, its ``ClusterSpec`` one rank per replica, its capacity the tokens
    a replica holds at once. It plans with ``plan_options={"form": "whole"}``. Megatron's static
    CP splits every document of a micro-batch over the replica's CP group itself, so sequences
    must stay whole on one replica; the planner balances the quadratic work over replicas and
    micro-batches. Each step yields the replica's waves in order, each wave one micro-batch::

        {"tokens", "labels", "position_ids": int64 [1, T], "loss_mask": float32 [1, T],
         "cu_seqlens": int32 [n + 1], "max_seqlen": int32 [1],
         "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens,
                                               cu_seqlens_kv=cu_seqlens, max_seqlen_q=..., ...)}

    Every document is padded to a multiple of ``pad_multiple`` tokens (TransformerEngine's THD
    context parallelism needs ``2 * cp_size``) with ``pad_id`` tokens whose ``loss_mask`` is 0.
    Megatron runs a fixed ``num_microbatches`` per step: where a replica has fewer waves, loss-free
    padding micro-batches of ``pad_multiple`` tokens fill the step; more waves than that is an
    error saying what to change.
    """

    def __init__(
        self,
        loader: Iterator,
        num_microbatches: int | None = None,
        pad_multiple: int = 1,
        pad_id: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.loader = loader
        self.num_microbatches = num_microbatches
        self.pad_multiple = max(1, int(pad_multiple))
        self.pad_id = int(pad_id)
        self.device = torch.device(device)
        self._pending: list[dict] = []
        self.step_data = None  # the StepData of the micro-batches being yielded (loss_tokens etc.)

    def __iter__(self) -> PackedBatchIterator:
        return self

    def _batch(self, docs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict:
        from megatron.core.packed_seq_params import PackedSeqParams

        tokens, labels, positions, mask, cu = [], [], [], [], [0]
        for ids, lab, pos in docs:
            pad = -len(ids) % self.pad_multiple
            tokens.append(torch.cat([ids, torch.full((pad,), self.pad_id, dtype=ids.dtype)]))
            # Labels -100 (ignored) become pad_id with loss_mask 0, Megatron's convention.
            keep = lab != -100
            labels.append(
                torch.cat(
                    [
                        torch.where(keep, lab, self.pad_id),
                        torch.full((pad,), self.pad_id, dtype=lab.dtype),
                    ]
                )
            )
            mask.append(torch.cat([keep.float(), torch.zeros(pad)]))
            positions.append(
                torch.cat([pos, pos[-1:] + 1 + torch.arange(pad)])
                if len(pos)
                else torch.arange(pad)
            )
            cu.append(cu[-1] + len(ids) + pad)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=self.device)
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
        out = {
            "tokens": torch.cat(tokens),
            "labels": torch.cat(labels),
            "position_ids": torch.cat(positions),
            "loss_mask": torch.cat(mask),
        }
        out = {k: v.to(self.device).unsqueeze(0) for k, v in out.items()}
        out["cu_seqlens"] = cu_t
        out["max_seqlen"] = torch.tensor([longest], dtype=torch.int32, device=self.device)
        out["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_t,
            cu_seqlens_kv=cu_t,
            cu_seqlens_q_padded=cu_t,
            cu_seqlens_kv_padded=cu_t,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        return out

    def _fill(self) -> None:
        step = next(self.loader)
        self.step_data = step
        batches = []
        for wave in step.waves:
            cu = wave.cu_seqlens.tolist()
            if any(s.start != 0 or s.end != int(step.plan.seq_lens[s.seq]) for s in wave.shards):
                raise PlanningError(
                    "PackedBatchIterator: the plan splits a sequence over data-parallel replicas, "
                    "which Megatron's static context parallelism cannot run: plan with "
                    "plan_options={'form': 'whole'} and a capacity that holds --max-seq"
                )
            docs = [
                (wave.input_ids[a:b], wave.labels[a:b], wave.position_ids[a:b])
                for a, b in zip(cu[:-1], cu[1:])
            ]
            if docs:
                batches.append(self._batch(docs))
        if self.num_microbatches is not None:
            if len(batches) > self.num_microbatches:
                raise PlanningError(
                    f"PackedBatchIterator: step {step.step} needs {len(batches)} micro-batches on "
                    f"this replica but Megatron runs {self.num_microbatches}: raise "
                    "--global-batch-size (more micro-batches) or lower the loader's tokens per step"
                )
            m = self.pad_multiple
            filler = (
                torch.full((m,), self.pad_id, dtype=torch.int64),
                torch.full((m,), -100, dtype=torch.int64),
                torch.arange(m),
            )
            batches += [self._batch([filler]) for _ in range(self.num_microbatches - len(batches))]
        self._pending = batches

    def __next__(self) -> dict:
        while not self._pending:
            self._fill()
        return self._pending.pop(0)
