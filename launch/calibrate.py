"""``hdp-calibrate``: a GPU profile (``hdp.profile/1`` JSON) calibrated to this machine.

``measure`` times, on the local device and with the kernels the runtime calls, the tables the cost
model prices compute from (attention calls, GEMMs, memory-bound ops, the optimizer step,
collectives; :mod:`hdp.launch.calibrate_tables`, :mod:`hdp.launch.calibrate_comm`) and the scalars
around them (peak FLOP/s, memory, memory bandwidth, a decoder layer's fixed cost), and copies the
links from a base preset. Every row is repeated until its spread is small or its time is up, and
the profile records the spreads and the host's load (:mod:`hdp.profile_quality`); a busy host or
noisy rows are named on stderr at the end. ``check`` (:mod:`hdp.planner.calibration`) checks that a
profile's rows agree with each other, and prices a table of measured kernel times with it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from hdp import GPU_PRESETS, MODEL_PRESETS, ModelSpec, gpu_profile, model_preset
from hdp.argtypes import command, integer
from hdp.attention.kernels import select_backend
from hdp.profile import (
    FORMAT,
    TABLE_COLUMNS,
    KernelTables,
    check_profile,
    measurement_of,
    write_profile,
)
from hdp.profile_quality import (
    FORCE_ENV,
    SPREAD_LIMIT,
    SPREAD_TARGET,
    Measurement,
    load_average,
    measurement_warnings,
)

from . import calibrate_tables as tables
from .calibrate_comm import collective_rows

PROG = "hdp-calibrate"
# Dense bf16 tensor-core peaks by device name (first match wins); others use the best GEMM rate.
KNOWN_PEAKS = (("H100 PCIE", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
LINK_FIELDS = ("pcie_bw", "nvlink_bw", "nic_bw", "nvlink_latency", "nic_latency")
BASE_FIELDS = (*LINK_FIELDS, "usable_memory_fraction", "reserved_bytes", "activation_memory_scale")
# The cpu preset is itself measured by this tool; until it exists, its links come from here (a
# modest machine: gloo over loopback, memory copies as "PCIe").
FALLBACK_BASES = {
    "cpu": dict(
        pcie_bw=1e12,
        nvlink_bw=5e9,
        nic_bw=1e9,
        nvlink_latency=20e-6,
        nic_latency=50e-6,
        usable_memory_fraction=0.8,
        reserved_bytes=0.5e9,
        activation_memory_scale=1.0,
    )
}
_FULL, _QUICK = tables.FULL_REPEATS, tables.QUICK_REPEATS
PROGRESS_EVERY_S = 15.0  # a line at least this often, a call allowing: no 30 s of silence
MEASURE_DESCRIPTION = f"""\
Measure the kernel tables of an hdp.profile/1 GPU profile on the local device, with
the kernels the runtime calls: attention calls (causal documents and full blocks),
GEMMs, memory-bound ops, the AdamW step and, where two local devices (or CPU
processes) can talk, collectives. Every time is forward + backward, in bf16 on
CUDA and fp32 on CPU. Shapes come from the model presets; links, the memory
reserve and the activation memory scale come from a base preset.

Each row is repeated after warm-up until its three fastest repeats agree within
{SPREAD_TARGET:.0%} (spread = 3rd fastest / fastest - 1), or its repeats add up to its time
limit ({_FULL.limit_s:g} s; {_QUICK.limit_s:g} s with --quick) and number at least \
{_FULL.min_repeats + 2}, or at {_FULL.max_repeats} repeats ({_QUICK.max_repeats}
with --quick); its time is the median of its three fastest repeats.
The profile's "measurement" object records every row's spread, the repeat rule,
the CPU count and the load average before and after.

Progress goes to stderr: one line per table, and at least every {PROGRESS_EVERY_S:g} s a line
with the rows done and an ETA. At the end, warnings name a busy host (load
average above the CPU count), rows whose spread stayed above the target, and
rows that disagree with each other (hdp-calibrate check): hdp-sim, hdp-plan and
hdp-train refuse a profile whose rows disagree unless {FORCE_ENV}=1.
"""
MEASURE_EXAMPLES = """examples:
  hdp-calibrate measure --out h100.json                 # CUDA: llama-1b, -7b, -70b shapes
  hdp-calibrate measure --device cpu --quick --out cpu.json
  hdp-calibrate measure --models llama-7b --base h200 --name h200-lab --out h200.json
"""


class UsageError(Exception):
    """A bad argument: reported as one line, exit status 2."""


@dataclass(frozen=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    models: tuple[ModelSpec, ...]
    base: dict[str, float]  # BASE_FIELDS of the base preset
    name: str
    out: Path


# ----------------------------------------------------------------------------- command line


def add_measure_parser(sub) -> None:
    p = sub.add_parser(
        "measure",
        help="measure this machine's kernel tables into a profile JSON",
        description=MEASURE_DESCRIPTION,
        epilog=MEASURE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="profile to write")
    p.add_argument(
        "--device",
        default=None,
        help="cuda (bf16) or cpu (fp32) (default: cuda where available, else cpu)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"fewer points per table, and {_QUICK.limit_s:g} s per row (not {_FULL.limit_s:g} s) "
        "to reach the spread target (CPU: about 10 s for the tiny model on an idle machine)",
    )
    p.add_argument(
        "--models",
        default=None,
        help=f"comma-separated model presets whose shapes to measure ({', '.join(MODEL_PRESETS)};"
        " default: tiny on cpu, llama-1b,llama-7b,llama-70b on cuda)",
    )
    p.add_argument(
        "--base",
        default=None,
        metavar="PRESET",
        help="GPU preset (or profile JSON) the links and memory reserve are copied from "
        f"({', '.join(GPU_PRESETS)}; default: cpu on cpu; on cuda the preset of the device, "
        "else h100)",
    )
    p.add_argument(
        "--name", default=None, help="profile name (default: from the device, e.g. h100)"
    )
    p.add_argument(
        "--no-collectives",
        action="store_true",
        help="skip the collective table (two local processes)",
    )
    p.add_argument(
        "--threads",
        type=integer(1, 4096),
        default=None,
        help="CPU: threads to measure with, the threads each rank gets in training (default: "
        "$OMP_NUM_THREADS, else 1, as torchrun gives each of several ranks on a node)",
    )
    p.set_defaults(handler=_run_measure)


CHECK_DESCRIPTION = f"""\
Check that a profile's rows agree with each other: between neighbouring sizes of
one kernel, the larger call may take no less than a third of the smaller's time
and run at no less than a third of its rate; the fastest GEMM row must reach a
tenth of peak_flops and at most 1.1x it; no row's recorded spread may exceed
{SPREAD_LIMIT:.0%}. The profile's measurement record (host load, spreads) is printed
too. A profile that fails is refused (exit status 1) unless --force;
hdp-sim, hdp-plan and hdp-train refuse it too unless {FORCE_ENV}=1.

With --table, then price every row of a table of measured kernel times (the
columns of hdp/data/measured/h100_measured.csv, an optional backend column).
The last line printed is one JSON object: without --table {{"disagreements": N,
"table_rows": M, "max_spread": s}}; with it {{"rows": N, "median_rel_err": x,
"max_rel_err": y, "disagreements": D}} over the step-relevant rows, with
leave-one-out errors where the profile holds the rows.
"""


def add_check_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help="check that a profile's rows agree; optionally price a table of measured times",
        description=CHECK_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("profile", metavar="PROFILE", help="a profile JSON path or a GPU preset name")
    p.add_argument(
        "--table", default=None, metavar="CSV", help="measured kernel times (CSV) to price"
    )
    p.add_argument("--backend", default=None, metavar="NAME", help="attention backend to price")
    p.add_argument(
        "--force",
        action="store_true",
        help="report rows that disagree but go on (exit status 0; --table still prices)",
    )
    p.set_defaults(handler=_run_check)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Calibrate the cost model to this machine: measure a GPU profile's kernel "
        "tables (measure), or check that a profile's rows agree and price measured kernel times "
        "with it (check).",
        epilog="example: hdp-calibrate measure --device cpu --quick --out cpu.json",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_measure_parser(sub)
    add_check_parser(sub)
    return parser


@command
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args, argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def _run_check(args: argparse.Namespace, argv: list[str]) -> int:
    from hdp.planner.calibration import check_main  # hdp-calibrate check

    return check_main(args)


def _run_measure(args: argparse.Namespace, argv: list[str]) -> int:
    setup = resolve(args)
    if setup.device.type == "cpu":
        threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
        if threads < 1:
            raise UsageError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    profile = measure(setup, quick=args.quick, collectives=not args.no_collectives, argv=argv)
    write_profile(profile, setup.out)
    rows = sum(len(t["rows"]) for t in profile["tables"].values())
    print(
        f"{PROG}: wrote {setup.out} ({rows} rows) in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    for line in noise_warnings(profile, str(setup.out)):
        tables.note(f"warning: {line}")
    return 0


# ----------------------------------------------------------------------------- validation


def _device(text: str | None) -> torch.device:
    text = text or ("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise UsageError(f"unknown device {text!r}: choose cuda or cpu")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: this machine has {torch.cuda.device_count()} GPUs")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_out(path: Path) -> Path:
    """``path`` if a profile can be written there, else :class:`UsageError`."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"--out {path}: is a directory")
    if not parent.is_dir():
        raise UsageError(f"--out {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--out {path}: not writable")
    return path


def _device_key(device: torch.device) -> str:
    """A short name for the device: cpu, h100, h200, a100, else its name in lower-case words."""
    if device.type == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    for key in ("H100", "H200", "A100"):
        if key in name.upper():
            return key.lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"


def _default_base(device: torch.device) -> str:
    key = _device_key(device)
    if key == "a100":
        big = torch.cuda.get_device_properties(device).total_memory > 48 * 2**30
        return "a100-80g" if big else "a100-40g"
    if key in GPU_PRESETS:
        return key
    return "cpu" if device.type == "cpu" else "h100"


def _base_fields(name: str) -> dict[str, float]:
    """The links and memory fields of the preset ``name`` (or a profile JSON path)."""
    try:
        profile = gpu_profile(name)
    except ValueError as e:
        if name in FALLBACK_BASES:
            return dict(FALLBACK_BASES[name])
        raise UsageError(f"--base: {e}") from None
    return {f: float(getattr(profile, f)) for f in BASE_FIELDS}


def resolve(args: argparse.Namespace) -> Setup:
    """Every argument checked before anything is measured."""
    device = _device(args.device)
    default_models = "tiny" if device.type == "cpu" else "llama-1b,llama-7b,llama-70b"
    names = [m.strip() for m in (args.models or default_models).split(",") if m.strip()]
    if not names:
        raise UsageError("--models: name at least one model preset")
    try:
        models = tuple(model_preset(m) for m in dict.fromkeys(names))
    except ValueError as e:
        raise UsageError(str(e)) from None
    base = _base_fields(args.base or _default_base(device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = _check_out(Path(args.out))
    return Setup(device, dtype, models, base, args.name or _device_key(device), out)


# ----------------------------------------------------------------------------- measuring


def _duration(seconds: float) -> str:
    """``4.2 s``, ``3 min 5 s``, ``2 h 4 min``."""
    if seconds < 59.95:
        return f"{seconds:.1f} s"
    s = round(seconds)
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class _Progress:
    """Lines on stderr: one per table when it is done, and in between, at least every
    ``PROGRESS_EVERY_S`` seconds, the rows done and an ETA. The ETA assumes the rows left take as
    long as the rows done on average: rough (large rows come last in each table)."""

    def __init__(self, planned: dict[str, int], clock=time.monotonic, write=tables.note) -> None:
        self.planned = planned  # rows (timings) of each step, in the order they run
        self.clock, self.write = clock, write
        self.start = self.last_step = self.last_line = clock()
        self.step, self.step_rows, self.rows = next(iter(planned)), 0, 0

    def begin(self, step: str) -> None:
        self.step, self.step_rows = step, 0

    def repeat(self) -> None:
        """A chance to report: a line where ``PROGRESS_EVERY_S`` passed since the last one."""
        now = self.clock()
        if now - self.last_line >= PROGRESS_EVERY_S:
            self.write(
                f"{self.step}: {self.step_rows} of {self.planned[self.step]} rows done; "
                f"elapsed {_duration(now - self.start)}, {self._eta(now)}"
            )
            self.last_line = now

    def row(self) -> None:
        """One row of the step is done (timed or skipped)."""
        self.step_rows += 1
        self.rows += 1
        self.repeat()

    def done(self, step: str, detail: str) -> None:
        """The step ``step`` is over (its rows all count as done, skipped ones too)."""
        names = list(self.planned)
        self.rows = sum(self.planned[n] for n in names[: names.index(step) + 1])
        now = self.clock()
        left = f", {self._eta(now)}" if self.rows < sum(self.planned.values()) else ""
        self.write(
            f"{step}: {detail} in {_duration(now - self.last_step)} "
            f"(elapsed {_duration(now - self.start)}{left})"
        )
        self.last_step = self.last_line = now

    def _eta(self, now: float) -> str:
        if not self.rows:
            return "ETA unknown until a row is done"
        left = sum(self.planned.values()) - self.rows
        return f"ETA ~{_duration((now - self.start) / self.rows * max(left, 0))}"


def _table(columns: tuple[str, ...], rows: list[list]) -> dict:
    return {"columns": list(columns), "rows": rows}


def measure_tables(bench: tables.Bench, models, collectives: bool, progress: _Progress):
    """The five tables of the profile, each timed and reported on stderr, and their spreads."""
    backend = select_backend(bench.device, bench.dtype)
    if bench.device.type == "cuda" and backend.name == "reference":
        tables.note("no flash attention kernel for this device: timing the (slow) reference one")
    shapes = tables.attention_shapes(models)
    out, spreads = {}, {}
    steps = (
        ("attention", lambda: tables.attention_rows(bench, backend, shapes)),
        ("gemm", lambda: tables.gemm_rows(bench, models)),
        ("memory_bound", lambda: tables.memory_rows(bench, models)),
        ("optimizer", lambda: tables.optimizer_rows(bench)),
    )
    for name, run in steps:
        progress.begin(name)
        measured = run()
        out[name], spreads[name] = _table(TABLE_COLUMNS[name], measured.rows), measured.spread
        progress.done(name, f"{len(measured.rows)} rows")
    progress.begin("collective")
    rows, why = [], "--no-collectives"
    if collectives:
        rule, sizes = bench.grids.repeats, bench.grids.collective_bytes
        rows, why = collective_rows(bench.device.type, sizes, rule, tick=progress.repeat)
    out["collective"] = _table(
        TABLE_COLUMNS["collective"], [[op, n, size, tables.sig(s)] for op, n, size, s, _ in rows]
    )
    spreads["collective"] = [round(r[-1], 4) for r in rows]
    progress.done("collective", f"{len(rows)} rows" if why is None else f"skipped ({why})")
    return out, spreads


def measure(
    setup: Setup, quick: bool, collectives: bool, argv: list[str], clock=time.monotonic
) -> dict:
    """The whole profile: tables, then the scalars, then how they were measured (``clock``: the
    progress lines' clock)."""
    load_before = load_average()
    memory = _memory_bytes(setup.device)
    # One point may use 60% of a GPU's memory (the rest: the caching allocator's slack), 40% of
    # the host's.
    share = 0.6 if setup.device.type == "cuda" else 0.4
    grids = tables.grids_for(setup.device.type, quick)
    planned = tables.planned_rows(grids, setup.models, setup.device.type)
    scalar_timings = planned.pop("scalars")  # the collectives run before the scalars
    planned |= {
        "collective": 3 * len(grids.collective_bytes) * collectives,
        "scalars": scalar_timings,
    }
    progress = _Progress(planned, clock)
    bench = tables.Bench(setup.device, setup.dtype, grids, share * memory, progress)
    if setup.device.type == "cuda":
        torch.cuda.set_device(setup.device)
    names = ", ".join(m.name for m in setup.models)
    tables.note(f"measuring on {_device_description(setup.device)} ({names})")
    torch.manual_seed(0)
    tabs, spreads = measure_tables(bench, setup.models, collectives, progress)
    progress.begin("scalars")
    scalars = _scalars(setup, bench, tabs["gemm"]["rows"], memory)
    progress.done(
        "scalars",
        f"peak {scalars['peak_flops']:.3g} FLOP/s, memory bandwidth {scalars['hbm_bw']:.3g} B/s",
    )
    measured = Measurement(
        os.cpu_count() or 1, load_before, load_average(), grids.repeats.to_json(), spreads
    )
    return {
        "format": FORMAT,
        "name": setup.name,
        "source": f"measured by {_command_line(argv)} on {socket.gethostname()}, "
        f"{datetime.now().astimezone():%Y-%m-%d}",
        "device": _device_description(setup.device),
        **scalars,
        "attention_backend": select_backend(setup.device, setup.dtype).name,
        "measurement": measured.to_json(),
        "tables": tabs,
    }


def _scalars(setup: Setup, bench: tables.Bench, gemm_rows: list[list], memory: int) -> dict:
    """The profile's numbers besides its tables: measured, or copied from the base preset."""
    smallest = min(setup.models, key=lambda m: m.params_per_layer)
    overhead = tables.layer_overhead(bench, smallest)
    peak = _known_peak(setup.device) or tables.best_gemm_rate(bench, gemm_rows)
    hbm = tables.copy_bandwidth(bench)
    links = {f: setup.base[f] for f in LINK_FIELDS}
    if setup.device.type == "cuda":
        links["pcie_bw"] = tables.pcie_bandwidth(bench)
    return {
        "peak_flops": tables.sig(peak),
        "memory_bytes": float(memory),
        "usable_memory_fraction": setup.base["usable_memory_fraction"],
        "reserved_bytes": setup.base["reserved_bytes"],
        "activation_memory_scale": setup.base["activation_memory_scale"],
        "hbm_bw": tables.sig(hbm),
        **{f: tables.sig(v) for f, v in links.items()},
        "layer_overhead_s": tables.sig(overhead),
    }


def noise_warnings(profile: dict, where: str) -> list[str]:
    """Warnings about how ``profile`` (just measured, to be written to ``where``) was measured."""
    tables_ = KernelTables.from_json(profile["tables"], where)
    found = check_profile(profile, where)
    return measurement_warnings(measurement_of(profile, tables_, where), found, where)


def _command_line(argv: list[str]) -> str:
    """``hdp-calibrate`` and its arguments, less ``--out PATH`` (a local detail)."""
    kept, skip = [], False
    for a in argv:
        if skip or a.startswith("--out="):
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        kept.append(a)
    return shlex.join([PROG, *kept])


def _known_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    return next((peak for key, peak in KNOWN_PEAKS if key in name), None)


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"cuda: {props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
            f", CUDA {torch.version.cuda}"
        )
    return f"cpu: {_cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


if __name__ == "__main__":
    sys.exit(main())
