"""A rank's memory: the share of the host that CPU ranks plan with, and what a step measured.

Note [CPU ranks share the host]
A GPU profile's ``memory_bytes`` is one device's own memory. The ``cpu`` profile's is the whole
host's RAM, and every local rank lives in it: planned as if each rank had it all, two ranks each
take most of the machine and the kernel kills one mid-step. So a CPU run plans each rank with
the host's RAM (this machine's, or the profile's where that is smaller) over its local ranks.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from hdp import GPUProfile


def host_memory_bytes() -> float:
    """This machine's physical RAM, bytes."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def rank_profile(gpu: GPUProfile, *, device: torch.device, local_ranks: int) -> GPUProfile:
    """``gpu`` with the memory one rank has on ``device``: on CPU, the host's share of one of
    ``local_ranks`` ranks (Note [CPU ranks share the host]); on a GPU, the profile's."""
    if device.type != "cpu":
        return gpu
    host = min(gpu.memory_bytes, host_memory_bytes())
    return replace(gpu, memory_bytes=host / max(1, local_ranks))


class PeakMemory:
    """The most memory a rank's step used, in the cost model's terms (without the runtime's own
    footprint, which the profile's ``reserved_bytes`` stands for).

    On a GPU: the caching allocator's peak allocation during the step. On CPU: the process's
    peak resident size in the step (Linux's high-water mark, reset at each step's start) above
    its size before the model was built.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0.0 if device.type == "cuda" else _status_bytes("VmRSS")

    def start_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()

    def step_peak(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        return max(0.0, _status_bytes("VmHWM") - self.baseline)


def _status_bytes(field: str) -> float:
    """A size from ``/proc/self/status`` (in kB there), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    # "5" resets the high-water mark (proc(5)); where the kernel refuses, the peak stays the
    # process's own, which still bounds the step's.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
