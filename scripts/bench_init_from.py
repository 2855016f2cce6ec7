r"""Loading a Hugging Face checkpoint: ``--init-from`` on N gloo ranks beside transformers'
``from_pretrained`` in one process, both in bf16, on a random llama-7b-shaped checkpoint this
script writes itself (5 GB safetensors shards with an index, as the Hub stores them).

Each load runs in a fresh process (transformers) or a fresh torchrun job (hdp: build on the meta
device, FSDP2, fill each rank's shards with :meth:`launch.hf_weights.HFCheckpoint.load_into`),
which prints its load time and its peak resident memory (Linux's VmHWM, file-backed pages
included). The script prints one row per loader and the ratio of a rank's peak to the single
process's. The checkpoint is written once and kept in ``--dir`` for later runs.

    python scripts/bench_init_from.py --dir /tmp/hdp-bench-llama7b
    python scripts/bench_init_from.py --dir /tmp/hdp-bench-small --layers 4   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hdp import model_preset  # noqa: E402
from hdp.hf_config import export_config  # noqa: E402

SHARD_BYTES = 5 * 10**9


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def write_checkpoint(directory: Path, layers: int) -> None:
    """A random llama-7b-shaped bf16 checkpoint (``layers`` decoder layers) in 5 GB shards."""
    from safetensors.torch import save_file

    from launch.hf_weights import hf_parameters
    from launch.model import Llama

    spec = replace(model_preset("llama-7b"), layers=layers)
    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, (_, p) in hf_parameters(Llama(spec)).items()]
    directory.mkdir(parents=True, exist_ok=True)
    groups, size = [[]], 0
    for name, shape in names:
        nbytes = 2 * torch.Size(shape).numel()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    gen = torch.Generator().manual_seed(0)
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {}
        for name, shape in group:
            t = torch.empty(shape, dtype=torch.bfloat16)
            for row in range(0, shape[0], 1024):  # in pieces: no fp32 copy of a whole tensor
                t[row : row + 1024] = torch.randn(t[row : row + 1024].shape, generator=gen) * 0.02
            part[name] = t
            weight_map[name] = file
            total += t.numel() * 2
        save_file(part, str(directory / file), metadata={"format": "pt"})
        print(
            f"wrote {file} ({sum(t.numel() for t in part.values()) * 2 / 1e9:.2f} GB)", flush=True
        )
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    config = export_config(spec, source=None, max_positions=4096, dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def load_transformers(directory: Path) -> None:
    """(child) transformers' load in bf16; prints a JSON line."""
    import transformers

    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"load_s": seconds, "peak_rss": peak_rss_bytes(), "params": params}))


def load_hdp(directory: Path) -> None:
    """(child, one torchrun rank) hdp's load into FSDP2 shards in bf16; rank 0 prints each rank's
    JSON line."""
    import torch.distributed as dist

    from launch.hf_weights import open_checkpoint
    from launch.model import Llama
    from launch.runtime import exit_without_teardown, shard_model

    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    checkpoint = open_checkpoint(directory)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = Llama(checkpoint.spec)
    shard_model(model, "peer")
    model.materialize(torch.device("cpu"))
    checkpoint.load_into(model)
    seconds = time.perf_counter() - t0
    local = sum(p.to_local().numel() for p in model.parameters())
    mine = {
        "rank": dist.get_rank(),
        "load_s": seconds,
        "peak_rss": peak_rss_bytes(),
        "params": local,
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    if dist.get_rank() == 0:
        for row in rows:
            print(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown(0)


def _child(args: list[str], ranks: int | None = None) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
        cmd += [str(ranks), __file__, *args]
    else:
        cmd = [sys.executable, __file__, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/hdp-bench-llama7b"))
    p.add_argument("--layers", type=int, default=32, help="decoder layers (llama-7b: 32)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--child", choices=("transformers", "hdp"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "transformers":
        return load_transformers(args.dir)
    if args.child == "hdp":
        return load_hdp(args.dir)
    if not (args.dir / "config.json").exists():
        write_checkpoint(args.dir, args.layers)
    (ref,) = _child(["--child", "transformers", "--dir", str(args.dir)])
    ranks = _child(["--child", "hdp", "--dir", str(args.dir)], ranks=args.ranks)
    print(f"checkpoint: {args.dir}, {ref['params'] / 1e9:.2f}B parameters, bf16")
    print(f"{'loader':<30} {'load s':>8} {'peak RSS GB':>12} {'vs transformers':>16}")
    rows = [("transformers, 1 process", ref)]
    rows += [(f"hdp --init-from, rank {r['rank']}/{args.ranks}", r) for r in ranks]
    for name, r in rows:
        ratio = r["peak_rss"] / ref["peak_rss"]
        print(f"{name:<30} {r['load_s']:>8.1f} {r['peak_rss'] / 1e9:>12.2f} {ratio:>16.2f}")
    print(json.dumps({"transformers": ref, "hdp": ranks}))


if __name__ == "__main__":
    main()
