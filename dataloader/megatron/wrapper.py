"""``HDPDataLoaderWrapper``: megatron-core's hybrid-CP data-loader wrapper with hdp's schedule,
yielding each sub-sample as the installed version's ``get_batch`` consumes it
(:mod:`.versions`), padded as its CP split needs; and :func:`install`, which makes Megatron-LM's
training loop build it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hdp.planner.dynamic.megatron import padded_length

from .scheduler import HDPScheduler
from .versions import CONTRACTS, installed_version, require_megatron

# Keys of a packed sample that describe the packing rather than hold one entry per token.
PACKING_KEYS = ("cu_seqlens", "cu_seqlens_padded", "batch_idx", "max_seqlen")


def install(**scheduler_options: Any) -> None:
    """Make Megatron-LM use :class:`HDPDataLoaderWrapper` wherever it would build
    ``HybridCPDataLoaderWrapper`` (``--hybrid-context-parallel``). Call it once in
    ``pretrain_gpt.py`` before ``pretrain(...)``; ``scheduler_options`` go to :class:`HDPScheduler`
    (model, gpu, gpus_per_node, sync)."""
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
        contract: str | None = None,
        pad_token: int = 0,
    ) -> None:
        self.contract = contract or installed_version().contract
        if self.contract not in CONTRACTS:
            raise ValueError(
                f"contract {contract!r} is not one of {', '.join(CONTRACTS)}: 'flat' for "
                "megatron-core 0.16-0.17, 'packed' for 0.18-0.19 (default: the installed one's)"
            )
        self.pad_token = int(pad_token)
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
        # Sequence parallelism splits each CP rank's tokens over the TP group too.
        sp = bool(getattr(config, "sequence_parallel", False))
        self.token_multiple = self.tp_group.size() if sp else 1
        options = {"token_multiple": self.token_multiple, **(scheduler_options or {})}
        self.cp_balancing_scheduler = HDPScheduler(
            config.max_seqlen_per_dp_cp_rank, self.dp_cp_group, **options
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
            if sample.get("attention_mask") is not None:
                raise ValueError(
                    "HDPDataLoaderWrapper: the samples carry an attention_mask, which hybrid "
                    "context parallelism does not split per sub-sample: build the dataset "
                    "without one (--no-create-attention-mask-in-dataloader)"
                )
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
        cp_size = {}
        for group in sample_id_groups:
            for ranks in group:
                for s in ranks:
                    cp_size[s] = cp_size.get(s, 0) + 1
        return {
            s: self._layout(sample, cp_size[s]) for s, sample in samples.items()
        }, sample_id_groups

    def _layout(self, sample: dict[str, torch.Tensor], cp: int) -> dict[str, torch.Tensor]:
        """One sub-sample padded for its CP size and shaped as the contract says."""
        length = int(next(iter(sample.values())).shape[0])
        pad = padded_length(length, cp, self.token_multiple) - length
        out = {}
        for key, value in sample.items():
            if pad:
                fill = torch.zeros((pad, *value.shape[1:]), dtype=value.dtype, device=value.device)
                if key in ("tokens", "labels"):
                    fill.fill_(self.pad_token)
                elif key == "position_ids" and length:
                    fill = value[-1] + 1 + torch.arange(pad, dtype=value.dtype, device=value.device)
                value = torch.cat([value, fill])
            out[key] = value.unsqueeze(0) if self.contract == "packed" else value
        total = length + pad
        # Both contracts carry max_seqlen: under --hybrid-context-parallel the receiving
        # tensor-parallel ranks of 0.16 and 0.17 always take an int32 [1] max_seqlen from the
        # broadcast, so a sender without one desynchronises every later broadcast (TP > 1).
        out["max_seqlen"] = torch.tensor([total], dtype=torch.int32, device=self.device)
        if self.contract == "packed":
            out["cu_seqlens"] = torch.tensor([[0, total]], dtype=torch.int32, device=self.device)
        return out
