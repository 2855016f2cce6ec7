"""Test doubles of Megatron-LM's ``pretrain_gpt.get_batch`` under ``--hybrid-context-parallel``,
one per contract, written from a reading of each release's source (Megatron-LM tags
core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0). Megatron-LM's training code is not in the
megatron-core wheel, so these stand in for it; each fails where that release's code fails.

``flat`` (0.16.1, 0.17.1: ``pretrain_gpt.get_batch`` -> ``training/utils.get_batch_on_this_tp_rank``
-> ``core/utils.get_batch_on_this_hybrid_cp_rank``): reads tokens, labels, loss_mask,
position_ids and max_seqlen (``int32 [1]``: with tensor parallelism the receiving ranks always
take one from the broadcast), optional cu_seqlens and local_cp_size; a cu_seqlens must be
``int32 [1, n]`` (asserted on broadcast); with local_cp_size the hybrid path stacks every tensor
from ``[L]`` to ``[1, L]``, looks up the CP group of that size and views the sequence as ``2k``
equal chunks (an error unless ``2k`` divides ``L``); PackedSeqParams ``sbhd`` with the group.

``packed`` (0.18.2, 0.19.0: ``get_batch`` -> ``core/utils.get_batch_on_this_tp_rank`` ->
``get_batch_on_this_cp_rank(is_hybrid_cp=True)``; ``forward_step`` builds the params): reads
per-token tensors of ``[micro_batch, L]`` (``tokens.shape[1]`` is the broadcast length); the
hybrid split happens only where ``cu_seqlens`` is present (``int32``, ``[1, n]``, squeezed by
``forward_step``), with ``max_seqlen`` read by ``.item()``; same ``2k``-chunk view; PackedSeqParams
``thd`` over ``cu_seqlens`` with ``local_cp_size`` and the group.
"""

from __future__ import annotations

import torch

PER_TOKEN = ("tokens", "labels", "loss_mask", "position_ids")


def _zigzag(value: torch.Tensor, k: int, rank: int) -> torch.Tensor:
    """This rank's two of ``2k`` equal chunks along dim 1 (the view fails unless 2k | L)."""
    chunks = value.view(value.shape[0], 2 * k, value.shape[1] // (2 * k), *value.shape[2:])
    return torch.cat([chunks[:, rank], chunks[:, 2 * k - 1 - rank]], dim=1)


def _group(k: int):
    from megatron.core import parallel_state

    return parallel_state.get_hybrid_data_context_parallel_groups(group_size=k) if k > 1 else None


def get_batch_flat(data_iterator):
    """0.16.x / 0.17.x. Returns ``(batch, packed_seq_params)``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    data = next(data_iterator)
    batch = {key: data[key] for key in PER_TOKEN}
    if data.get("cu_seqlens") is not None:
        cu = data["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu.shape[0] == 1, "micro-batch-size must be 1"
    # The other TP ranks always receive an int32 [1] max_seqlen under hybrid CP; a sender
    # without one shifts every later broadcast (found by scripts/check_megatron_tags.py).
    max_seqlen = data.get("max_seqlen")
    assert max_seqlen is not None and max_seqlen.dtype == torch.int32, "max_seqlen int32 [1]"
    assert max_seqlen.shape == (1,), "max_seqlen int32 [1]"
    k = int(data["local_cp_size"].item())
    batch = {key: torch.stack([v], 0) for key, v in batch.items()}
    length = batch["tokens"].shape[1]
    group = _group(k)
    if group is not None and group.size() > 1:
        assert group.size() == k
        batch = {key: _zigzag(v, k, group.rank()) for key, v in batch.items()}
    params = PackedSeqParams(
        qkv_format="sbhd", max_seqlen_q=length, max_seqlen_kv=length, local_cp_size=k
    )
    params.cp_group = group
    return batch, params


def get_batch_packed(data_iterator):
    """0.18.x / 0.19.x. Returns ``(batch, packed_seq_params)``; the params are None (no hybrid
    split at all) where ``cu_seqlens`` is missing, as in those releases."""
    from megatron.core.packed_seq_params import PackedSeqParams

    data = next(data_iterator)
    batch = {key: data[key] for key in PER_TOKEN}
    assert batch["tokens"].dim() == 2 and batch["tokens"].shape[0] == 1, "tokens must be [1, L]"
    cu, max_seqlen = data.get("cu_seqlens"), data.get("max_seqlen")
    k = int(data["local_cp_size"].item())
    if cu is None:
        return batch, None
    assert cu.dtype == torch.int32 and cu.dim() == 2 and cu.shape[0] == 1, cu.shape
    group = _group(k)
    if k > 1:
        batch = {key: _zigzag(v, k, group.rank()) for key, v in batch.items()}
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu[0],
        cu_seqlens_kv=cu[0],
        max_seqlen_q=int(max_seqlen.item()),
        max_seqlen_kv=int(max_seqlen.item()),
        local_cp_size=k,
    )
    params.cp_group = group
    return batch, params


GET_BATCH = {"flat": get_batch_flat, "packed": get_batch_packed}
