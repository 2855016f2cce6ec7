"""A rank's memory: the share of the host that CPU ranks plan with, and what a step measured.

Note [CPU ranks share the host]
A GPU profile's ``memory_bytes`` is one device's own memory. The ``cpu`` profile's is the whole
host's RAM, and every local rank lives in it: planned as if each rank had it all, two ranks each
take most of the machine and the kernel kills one mid-step. So a CPU run plans each rank with
the host's RAM (this machine's, or the profile's where that is smaller) over its local ranks.
"""

from __future__ import annotations

import os
import resource
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
    peak resident size so far above its size before the model was built (the operating system
    keeps no per-step peak).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0.0 if device.type == "cuda" else _peak_rss_bytes()

    def start_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_peak(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        return max(0.0, _peak_rss_bytes() - self.baseline)


def _peak_rss_bytes() -> float:
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
