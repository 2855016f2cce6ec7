"""``PackedBatchIterator``: hdp's balanced micro-batches for Megatron without hybrid context
parallelism (a fixed ``--context-parallel-size``), in the packed (THD) layout every supported
``pretrain_gpt.get_batch`` reads."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hdp.planner import PlanningError

from ..loader import IGNORE_INDEX


class PackedBatchIterator:
    """Megatron batches for ``--dataloader-type external`` (and Megatron versions without hybrid
    CP): each ``next()`` is one micro-batch of this DP replica, packed in THD form.

    ``loader`` is an :class:`hdp.dataloader.HDPDataLoader` over the **data-parallel** group: one
    loader rank per DP replica, its ``ClusterSpec`` one rank per replica, its capacity the tokens
    a replica holds at once. It plans with ``plan_options={"form": "whole"}``. Megatron's static
    CP splits every document of a micro-batch over the replica's CP group itself, so sequences
    must stay whole on one replica; the planner balances the quadratic work over replicas and
    micro-batches. Each step yields the replica's waves in order, each wave one micro-batch::

        {"tokens", "labels", "position_ids": int64 [1, T], "loss_mask": float32 [1, T],
         "cu_seqlens": int32 [1, n + 1], "max_seqlen": int32 [1],
         "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens,
                                               cu_seqlens_kv=cu_seqlens, max_seqlen_q=..., ...)}

    ``cu_seqlens`` keeps the batch dimension, as the stock ``get_batch`` of megatron-core 0.16 to
    0.19 expects (it checks ``[1, n + 1]``, "micro-batch-size must be 1", and squeezes it);
    ``packed_seq_params`` (1-D) is for a ``forward_step`` of your own.
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
            # Ignored labels become pad_id with loss_mask 0, Megatron's convention.
            keep = lab != IGNORE_INDEX
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
        out["cu_seqlens"] = cu_t.unsqueeze(0)
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
                torch.full((m,), IGNORE_INDEX, dtype=torch.int64),
                torch.arange(m),
            )
            batches += [self._batch([filler]) for _ in range(self.num_microbatches - len(batches))]
        self._pending = batches

    def __next__(self) -> dict:
        while not self._pending:
            self._fill()
        return self._pending.pop(0)
