r"""Loading a Hugging Face checkpoint: ``--init-from`` on N gloo ranks beside transformers'
``from_pretrained`` in one process, both in bf16, on a random llama-7b-shaped checkpoint this
script writes itself (5 GB safetensors shards with an index, as the Hub stores them).

Each load runs in a fresh process (transformers) or a fresh torchrun job (hdp: build on the meta
device, FSDP2, fill each rank's shards with :meth:`hdp.launch.hf_weights.HFCheckpoint.load_into`),
which prints its load time, its resident memory before loading and its peak resident memory
(Linux's VmHWM, file-backed pages included). transformers maps the files and reads a weight's
pages when it is first used, so its peak is taken after every weight has been read once (as a
first forward pass reads them); the peak right after ``from_pretrained`` is printed too. The
script prints one row per loader and the ratio of a rank's peak to the single process's. The
checkpoint is written once and kept in ``--dir`` for later runs.

    python scripts/bench_init_from.py --dir /tmp/hdp-bench-llama7b [--cold]
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

import torch

from hdp import model_preset
from hdp.hf_config import export_config

SHARD_BYTES = 5 * 10**9


def status_bytes(field: str = "VmHWM") -> int:
    """A memory figure of this process from /proc/self/status: ``VmHWM`` (peak resident) or
    ``VmRSS`` (resident now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def write_checkpoint(directory: Path, layers: int) -> None:
    """A random llama-7b-shaped bf16 checkpoint (``layers`` decoder layers) in 5 GB shards."""
    from safetensors.torch import save_file

    from hdp.launch.hf_weights import hf_parameters
    from hdp.launch.model import Llama

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

    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    lazy = status_bytes()
    # The weights may still be pages of the memory-mapped files, read on first use: read each
    # once, as a first forward pass would, and take the peak again.
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[:: max(1, 2048 // p.element_size())].sum()
    read_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    row = {"load_s": seconds, "read_s": read_s, "before_rss": before, "lazy_peak_rss": lazy}
    print(json.dumps({**row, "peak_rss": status_bytes(), "params": params}))


def load_hdp(directory: Path) -> None:
    """(child, one torchrun rank) hdp's load into FSDP2 shards in bf16; rank 0 prints each rank's
    JSON line."""
    import torch.distributed as dist

    from hdp.launch.hf_weights import open_checkpoint
    from hdp.launch.model import Llama
    from hdp.launch.runtime import exit_without_teardown, shard_model

    dist.init_process_group("gloo")
    before = status_bytes("VmRSS")
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
    mine = {"rank": dist.get_rank(), "load_s": seconds, "before_rss": before}
    mine.update(peak_rss=status_bytes(), params=local)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    if dist.get_rank() == 0:
        for row in rows:
            print(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown(0)


def drop_page_cache() -> None:
    """Empty the kernel's page cache, so that a load reads the files from disk (needs root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(
            f"--cold: cannot drop the page cache ({e.strerror}): run as root"
        ) from None


def _child(args: list[str], ranks: int | None = None, cold: bool = False) -> list[dict]:
    if cold:
        drop_page_cache()
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
    p.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each load (root): both loaders read from disk",
    )
    p.add_argument("--child", choices=("transformers", "hdp"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "transformers":
        return load_transformers(args.dir)
    if args.child == "hdp":
        return load_hdp(args.dir)
    if not (args.dir / "config.json").exists():
        write_checkpoint(args.dir, args.layers)
    (ref,) = _child(["--child", "transformers", "--dir", str(args.dir)], cold=args.cold)
    ranks = _child(["--child", "hdp", "--dir", str(args.dir)], ranks=args.ranks, cold=args.cold)
    cache = "cold page cache" if args.cold else "page cache as left by the previous load"
    print(f"checkpoint: {args.dir}, {ref['params'] / 1e9:.2f}B parameters, bf16, {cache}")
    lazy = ref["lazy_peak_rss"] / 1e9
    print(
        f"transformers: from_pretrained {ref['load_s']:.1f} s, peak RSS {lazy:.2f} GB (weights "
        "mapped, not yet read); below, with every weight read once"
    )
    head = f"{'loader':<30} {'load s':>7} {'RSS before GB':>14} {'peak RSS GB':>12}"
    print(f"{head} {'vs transformers':>16}")
    rows = [("transformers, 1 process", {**ref, "load_s": ref["read_s"]})]
    rows += [(f"hdp --init-from, rank {r['rank']}/{args.ranks}", r) for r in ranks]
    for name, r in rows:
        ratio = r["peak_rss"] / ref["peak_rss"]
        line = f"{name:<30} {r['load_s']:>7.1f} {r['before_rss'] / 1e9:>14.2f}"
        print(f"{line} {r['peak_rss'] / 1e9:>12.2f} {ratio:>16.2f}")
    print(json.dumps({"transformers": ref, "hdp": ranks}))


if __name__ == "__main__":
    main()
