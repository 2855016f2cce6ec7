#!/usr/bin/env python3
"""A plain packed-sequence training loop on one device: the baseline of hdp's step efficiency.

With ``--impl hdp`` (the default) the model is hdp's (``hdp.launch.model.Llama``, same presets,
same chunked loss and activation checkpointing), with its attention swapped for one varlen call
per layer over the packed sequences: no plan, no ``dist_attn``, no FSDP. With ``--impl minimal``
it is ``scripts/minimal_llama.py``, a decoder of the preset's shape written in torch alone, as a
user writes it first: the independent yardstick. Training runs in bf16 autocast on CUDA (fp32
parameters, fused AdamW), fp32 on CPU, on the global batches ``launch/pretrain.py`` forms from
the same synthetic corpus and seed (``--workload``, ``--max-seq``, ``--tokens-per-step``), and
prints tokens/s and MFU with hdp's formula (``CostModel.model_flops`` over the GPU preset's peak).

    python scripts/plain_loop.py --model llama-1b --workload wlb-128k --max-seq 32K \\
        --tokens-per-step 64K --steps 8 --compare /tmp/hdp-gpu-check/train_metrics_32K.jsonl
    python scripts/plain_loop.py --device cpu --model tiny --max-seq 512 --tokens-per-step 1K \\
        --steps 2 --impl minimal
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn

from hdp import MODEL_PRESETS, ClusterSpec, gpu_preset, model_preset
from hdp.argtypes import choice, input_file, integer, number, size
from hdp.attention import BACKEND_NAMES, BackendUnavailable, resolve_backend
from hdp.dataloader import IGNORE_INDEX, BatchStream, SyntheticSource
from hdp.launch.model import Llama
from hdp.launch.setup import detect_gpu
from hdp.planner import StepPricing
from hdp.workloads import workload_names

WARMUP_STEPS = 2  # steps left out of the summary (allocator and kernel warm-up)


@dataclass
class Packed:
    """What the swapped attention needs of a packed batch; stands in for ``AttentionContext``
    (``Llama.forward`` reads ``offload`` and hands the object to every layer)."""

    cu: torch.Tensor  # int32 [sequences + 1]
    max_len: int
    offload: float = 0.0


class _Varlen(torch.autograd.Function):
    """Causal attention of the packed sequences with one backend call each way."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float, backend):
        out, lse = backend.forward(q, k, v, cu, cu, max_len, max_len, True, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_len, ctx.scale, ctx.backend = max_len, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, True, ctx.scale
        )
        return dq, dk, dv, None, None, None, None


def varlen_attend(spec, backend):
    """An attention layer's ``attend`` as one varlen kernel call over the packed sequences."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Packed) -> torch.Tensor:
        return _Varlen.apply(q, k, v, ctx.cu, ctx.max_len, spec.head_dim**-0.5, backend)

    return attend


def plain_model(spec, backend, loss_chunk_tokens: int, checkpointing: bool = True) -> Llama:
    """hdp's Llama (its projections, RoPE, MLP and loss) with every layer's attention one
    varlen kernel call instead of ``dist_attn``."""
    model = Llama(spec, activation_checkpointing=checkpointing, loss_chunk_tokens=loss_chunk_tokens)
    for layer in model.layers:
        layer.attn.attend = varlen_attend(spec, backend)
    return model


def minimal_model(spec) -> nn.Module:
    """``scripts/minimal_llama.py``'s decoder of ``spec``'s shape (a sibling module: this script
    runs from scripts/)."""
    from minimal_llama import MinimalLlama

    return MinimalLlama(
        layers=spec.layers,
        hidden=spec.hidden,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        ffn=spec.ffn,
        vocab=spec.vocab,
        theta=spec.rope.theta,
        eps=spec.norm_eps,
    )


def packed_batch(source: SyntheticSource, seqs, device: torch.device):
    """(input_ids, position_ids, labels, Packed, lengths) of a global batch's sequences: tokens
    from pinned host memory with non-blocking copies on CUDA; the last token of each sequence
    has no label."""
    ids, pos, labels, lens = [], [], [], []
    for s in seqs:
        tok = source.read(s.doc, s.offset, s.offset + s.length)
        ids.append(tok)
        pos.append(np.arange(s.length))
        labels.append(np.append(tok[1:], IGNORE_INDEX))
        lens.append(s.length)
    pin = device.type == "cuda"
    host = [torch.from_numpy(np.concatenate(x)) for x in (ids, pos, labels)]
    dev = [(t.pin_memory() if pin else t).to(device, non_blocking=pin) for t in host]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    return (*dev, Packed(cu.to(device, non_blocking=pin), max(lens)), np.asarray(lens))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=choice(list(MODEL_PRESETS), "model"), default="llama-1b")
    p.add_argument(
        "--impl",
        choices=("hdp", "minimal"),
        default="hdp",
        help="hdp's model with one varlen call per layer, or scripts/minimal_llama.py",
    )
    p.add_argument("--workload", type=choice(workload_names(), "workload"), default="wlb-128k")
    p.add_argument("--synthetic-docs", type=integer(1), default=20000)
    p.add_argument("--max-seq", type=size(1), default=32 << 10)
    p.add_argument("--tokens-per-step", type=size(1), default=64 << 10)
    p.add_argument("--steps", type=integer(1), default=8)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--lr", type=number(0.0, exclusive=True), default=3e-4)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--attention-backend",
        type=choice(["auto", *BACKEND_NAMES], "attention backend"),
        default=None,
        help="default: torch_flash on CUDA, reference on CPU",
    )
    p.add_argument("--no-checkpointing", action="store_true", help="keep every activation")
    p.add_argument(
        "--compare", type=input_file, default=None, help="hdp's --metrics file of the same run"
    )
    args = p.parse_args(argv)
    if args.max_seq > args.tokens_per_step:
        p.error("--max-seq exceeds --tokens-per-step: a sequence must fit in one step")
    return args


def setup(args):
    """(device, model, optimizer, cost model, source, stream, autocast dtype)."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    name = args.attention_backend or ("torch_flash" if cuda else "reference")
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = resolve_backend(name, device, dtype)
    spec = model_preset(args.model)
    if not cuda:
        spec = replace(spec, dtype_bytes=4)
    cost = StepPricing.build(spec, ClusterSpec(1, 1, gpu_preset(detect_gpu(device)))).cost
    torch.manual_seed(args.seed)
    if args.impl == "minimal":
        model = minimal_model(spec)
    else:
        model = plain_model(spec, backend, cost.loss_chunk_tokens, not args.no_checkpointing)
    model = model.to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda
    )
    source = SyntheticSource(args.workload, args.synthetic_docs, spec.vocab, args.seed)
    stream = BatchStream([source.lengths], args.tokens_per_step, args.max_seq, seed=args.seed)
    return device, model, optimizer, cost, source, stream, (dtype if cuda else None), backend


def train(args) -> list[dict]:
    """Run ``--steps`` steps; returns one record per step (and prints it)."""
    device, model, optimizer, cost, source, stream, autocast, backend = setup(args)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"plain loop ({args.impl}): {cost.model.name} ({params / 1e6:.1f}M parameters) on "
        f"{device.type}, attention {backend.name if args.impl == 'hdp' else 'varlen'}, "
        f"{'bf16 autocast' if autocast else 'fp32'}, "
        f"{args.tokens_per_step} tokens/step, max_seq {args.max_seq}, {args.workload}",
        flush=True,
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    records = []
    for step in range(1, args.steps + 1):
        # Reading the synthetic tokens is left out of the step time: hdp's loader prefetches.
        batch = stream.next_batch()
        ids, pos, labels, packed, lens = packed_batch(source, batch.seqs, device)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            loss = model(ids, pos, packed, labels) / max(batch.loss_tokens, 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        rec = {
            "step": step,
            "loss": float(loss.detach()),
            "tokens": batch.tokens,
            "tokens_per_s": batch.tokens / dt,
            "mfu": cost.model_flops(lens) / (dt * cost.cluster.gpu.peak_flops),
        }
        records.append(rec)
        print(
            f"step {step:>5}  loss {rec['loss']:.4f}  tokens/s {rec['tokens_per_s']:,.0f}  "
            f"MFU {100 * rec['mfu']:.2f}%  sequences {len(lens)}",
            flush=True,
        )
    return records


def summary(records: list[dict]) -> tuple[float, float, str]:
    """Mean tokens/s and MFU of the steps after the warm-up (all steps when there are few)."""
    kept = records[WARMUP_STEPS:] or records
    steps = f"steps {kept[0]['step']}-{kept[-1]['step']}"
    tps = sum(r["tokens"] for r in kept) / sum(r["tokens"] / r["tokens_per_s"] for r in kept)
    return tps, sum(r["mfu"] for r in kept) / len(kept), steps


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        records = train(args)
    except (ValueError, BackendUnavailable) as e:  # a forced backend that cannot run here
        print(f"plain_loop.py: error: {e}", file=sys.stderr)
        return 2
    tps, mfu, steps = summary(records)
    name = "plain" if args.impl == "hdp" else "minimal"
    print(f"{name + ' loop:':<13}{tps:>10,.0f} tokens/s  MFU {100 * mfu:5.2f}%  ({steps})")
    if args.compare:
        rows = [json.loads(line) for line in args.compare.read_text().splitlines() if line]
        h_tps, h_mfu, h_steps = summary(rows)
        print(f"hdp:         {h_tps:>10,.0f} tokens/s  MFU {100 * h_mfu:5.2f}%  ({h_steps})")
        print(f"hdp / {name}: {h_tps / tps:.2f}x tokens/s, {h_mfu / mfu:.2f}x MFU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
