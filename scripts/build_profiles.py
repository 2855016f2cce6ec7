"""Build the shipped GPU profiles (hdp/data/profiles/*.json) from the shared H100 measurements.

    python scripts/build_profiles.py --measurements ../shared/data/profiles --out hdp/data/profiles

``h100`` holds the measured tables as they are: attention (flash and cuDNN), GEMMs, memory-bound
ops and the fused AdamW step, all forward + backward in bf16 on one H100 80GB HBM3. ``h200``
(the same compute, faster HBM) and the A100s (slower compute and HBM) are *scaled* from it, not
measured: their tables are H100 times scaled by the ratio of peak FLOP/s (GEMMs, attention; on an
A100 FlashAttention's also by FlashAttention-2's larger share of that peak) or of HBM bandwidth
(memory-bound ops, optimizer). Each file says so in its ``source``. The CPU profile is
measured on the machine by ``hdp-calibrate measure --device cpu``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

from hdp.profile import FORMAT, TABLE_COLUMNS

MEASURED = "one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, bf16, 2026-11-23"
# Our model's RMSNorm upcasts to fp32; the plain bf16 norm is kept under its own name.
MEMORY_OPS = {
    "rmsnorm_fp32_upcast": "rmsnorm",
    "rmsnorm": "rmsnorm_bf16",
    "swiglu": "swiglu",
    "residual_add": "residual_add",
    "cast_fp32_to_bf16": "cast",
}
# FlashAttention-2's share of peak FLOP/s: 50-73% on an A100 (its paper, arXiv 2307.08691), 35%
# on an H100 (FlashAttention-3's paper, arXiv 2407.08608; our H100 tables measure 33% at 128K
# tokens). Scaling H100 attention by peak FLOP/s alone would make an A100's 1.8x too slow.
FA2_PEAK_SHARE = {"h100": 0.35, "a100": (0.50 + 0.73) / 2}
# The memory-bound ops in --compile's fused regions (and the loss) over these tables' eager time:
# fitted to llama-1b training steps with and without --compile on an H200 (docs/benchmarks.md);
# the presets scaled from the h100 tables by HBM bandwidth carry it by the same rule.
COMPILED_MEMORY_BOUND_SCALE = 0.25
LINKS = {  # achievable per-GPU, per-direction figures (see docs/cost_model.md)
    "h100": dict(nvlink_bw=360e9, nic_bw=45e9, nvlink_latency=5e-6, nic_latency=12e-6),
    "a100": dict(nvlink_bw=240e9, nic_bw=22.5e9, nvlink_latency=6e-6, nic_latency=15e-6),
}


def measured_tables(folder: Path) -> dict[str, list[list]]:
    """The shared measurement CSVs as profile tables (seconds, forward + backward)."""
    tables: dict[str, list[list]] = {name: [] for name in TABLE_COLUMNS}
    for name, backend in (
        ("h100_measured.csv", "torch_flash"),
        ("h100_cudnn_measured.csv", "cudnn"),
    ):
        with open(folder / name) as f:
            for r in csv.DictReader(f):
                s = float(r["ms"]) / 1e3
                if r["kind"] == "gemm":
                    tables["gemm"].append([int(r["a"]), int(r["b"]), int(r["c"]), s])
                    continue
                kind = "causal" if r["kind"] == "attn_doc" else "full"
                row = [r.get("backend") or backend, kind, int(r["heads"]), int(r["kv_heads"])]
                tables["attention"].append(row + [int(r["head_dim"]), int(r["a"]), int(r["b"]), s])
    with open(folder / "h100_memory_bound.csv") as f:
        for r in csv.DictReader(f):
            s = float(r["ms"]) / 1e3
            if r["kind"] == "optimizer":
                tables["optimizer"].append([int(r["tokens_or_params"]), s])
                continue
            width = int(r["ffn"]) if r["op"] == "swiglu" else int(r["hidden"])
            tables["memory_bound"].append(
                [MEMORY_OPS[r["op"]], width, int(r["tokens_or_params"]), s]
            )
    return tables


def scaled(
    tables: dict[str, list[list]], compute: float, memory: float, flash: float | None = None
) -> dict[str, list[list]]:
    """Times multiplied by ``compute`` (GEMMs and attention; FlashAttention's rows by ``flash``
    where given) or ``memory`` (the rest)."""

    def factor(name: str, row: list) -> float:
        if name == "attention" and row[0] == "torch_flash" and flash is not None:
            return flash
        return compute if name in ("gemm", "attention") else memory

    return {
        name: [row[:-1] + [row[-1] * factor(name, row)] for row in rows]
        for name, rows in tables.items()
    }


def profile(name: str, source: str, tables: dict[str, list[list]], **figures) -> dict:
    return {
        "format": FORMAT,
        "name": name,
        "source": source,
        "device": figures.pop("device"),
        **figures,
        "attention_backend": "torch_flash",
        "tables": {
            t: {
                "columns": list(cols),
                "rows": [r[:-1] + [float(f"{r[-1]:.6g}")] for r in tables[t]],
            }
            for t, cols in TABLE_COLUMNS.items()
        },
    }


def build(folder: Path) -> list[dict]:
    h100 = measured_tables(folder)
    common = dict(
        usable_memory_fraction=0.92,
        reserved_bytes=3e9,
        layer_overhead_s=40e-6,
        compiled_memory_bound_scale=COMPILED_MEMORY_BOUND_SCALE,
    )
    scaled_from = "scaled from the h100 profile (measured on " + MEASURED + "): "
    out = [
        profile(
            "h100",
            "measured on " + MEASURED + " (../shared/data/profiles)",
            h100,
            device="NVIDIA H100 80GB HBM3",
            peak_flops=989e12,
            memory_bytes=80e9,
            hbm_bw=3.35e12,
            pcie_bw=40e9,
            **LINKS["h100"],
            **common,
        ),
        profile(
            "h200",
            scaled_from + "same compute; memory-bound ops and the optimizer x 3.35 / 4.8 (HBM)",
            scaled(h100, 1.0, 3.35 / 4.8),
            device="NVIDIA H200 141GB HBM3e",
            peak_flops=989e12,
            memory_bytes=141e9,
            hbm_bw=4.8e12,
            pcie_bw=40e9,
            **LINKS["h100"],
            **common,
        ),
    ]
    flash = 989 / 312 * FA2_PEAK_SHARE["h100"] / FA2_PEAK_SHARE["a100"]
    for name, memory, hbm in (("a100-80g", 80e9, 2.04e12), ("a100-40g", 40e9, 1.56e12)):
        out.append(
            profile(
                name,
                scaled_from + f"GEMMs and cuDNN attention x 989 / 312 (peak), FlashAttention x "
                f"{flash:.3f} (peak, and FlashAttention-2's 35% of it on an H100 against 50-73% "
                f"on an A100), memory-bound x 3.35 / {hbm / 1e12:.2f}",
                scaled(h100, 989 / 312, 3.35e12 / hbm, flash),
                device=f"NVIDIA A100 {name[-3:-1]}GB",
                peak_flops=312e12,
                memory_bytes=memory,
                hbm_bw=hbm,
                pcie_bw=20e9,
                **LINKS["a100"],
                **common,
            )
        )
    return out


def dumps(profile: dict) -> str:
    """JSON with one table row per line."""
    text = json.dumps(profile, indent=1)
    return (
        re.sub(r"\[\s+([^\[\]]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
        + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--measurements", type=Path, default=Path("../shared/data/profiles"))
    ap.add_argument("--out", type=Path, default=Path("hdp/data/profiles"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for p in build(args.measurements):
        path = args.out / f"{p['name']}.json"
        path.write_text(dumps(p))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
