"""A rank's memory: the measured activation scale, CPU ranks' share of the host, and the
measured-over-predicted ratios ``scripts/bench_fidelity.py metrics`` reports."""

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from hdp import BLOCK_TOKENS, DEFAULT_KV_BLOCK_TOKENS, ClusterSpec, CostModel, model_preset
from hdp.launch.memory import host_memory_bytes, rank_profile
from hdp.specs import GPUProfile, gpu_preset

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fidelity", ROOT / "scripts" / "bench_fidelity.py")
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)


def _cost(gpu: GPUProfile, checkpointing: bool = True) -> CostModel:
    return CostModel(
        model_preset("llama-7b"), ClusterSpec(8, 8, gpu), activation_checkpointing=checkpointing
    )


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("scale", [0.5, 1.85, 3.0])
def test_the_activation_scale_multiplies_activations_only(scale, checkpointing):
    h100 = gpu_preset("h100")
    base = _cost(h100, checkpointing)
    scaled = _cost(replace(h100, activation_memory_scale=scale), checkpointing)
    tokens = np.array([0, 4096, 65536])
    np.testing.assert_allclose(
        scaled.activation_bytes(tokens, 0.25), scale * base.activation_bytes(tokens, 0.25)
    )
    # States, the loss buffer and K/V in flight are counted as before.
    extra = scaled.memory(tokens, 0.25, 8192) - scaled.activation_bytes(tokens, 0.25)
    np.testing.assert_allclose(
        extra, base.memory(tokens, 0.25, 8192) - base.activation_bytes(tokens, 0.25)
    )
    # The capacity is the most whole blocks whose scaled activations fit.
    cap = scaled.capacity("wave")
    assert (
        scaled.memory(cap, sync="wave", max_in_block=DEFAULT_KV_BLOCK_TOKENS)
        <= scaled.memory_budget
    )
    assert (
        scaled.memory(cap + BLOCK_TOKENS, sync="wave", max_in_block=DEFAULT_KV_BLOCK_TOKENS)
        > scaled.memory_budget
    )


def test_profiles_without_the_scale_keep_their_activations():
    for name in ("h100", "h200", "a100-80g", "a100-40g"):
        assert gpu_preset(name).activation_memory_scale == 1.0
    data = gpu_preset("h100").to_json()
    del data["activation_memory_scale"]
    assert GPUProfile.from_json(data).activation_memory_scale == 1.0
    assert gpu_preset("cpu").activation_memory_scale > 1.0


def test_cpu_ranks_share_the_host_and_gpus_keep_their_memory():
    cpu = gpu_preset("cpu")
    host = min(cpu.memory_bytes, host_memory_bytes())
    for local in (1, 2, 3):
        mine = rank_profile(cpu, device=torch.device("cpu"), local_ranks=local)
        assert mine.memory_bytes == pytest.approx(host / local)
    h100 = gpu_preset("h100")
    assert rank_profile(h100, device=torch.device("cuda", 0), local_ranks=8) == h100


def test_two_cpu_ranks_plan_within_the_host():
    cpu = rank_profile(gpu_preset("cpu"), device=torch.device("cpu"), local_ranks=2)
    tiny = replace(model_preset("tiny"), dtype_bytes=4)
    cost = CostModel(tiny, ClusterSpec(2, 2, cpu), activation_checkpointing=False)
    per_rank = cost.memory(cost.capacity("peer"), sync="peer") + cpu.reserved_bytes
    assert 2 * per_rank <= host_memory_bytes()


def test_cpu_peak_memory_counts_what_a_step_allocates():
    # In a fresh process, as a training rank is.
    code = (
        "import torch\n"
        "from hdp.launch.memory import PeakMemory\n"
        "memory = PeakMemory(torch.device('cpu'))\n"
        "memory.start_step()\n"
        "block = torch.ones(256 << 20, dtype=torch.uint8)\n"  # 256 MiB, touched
        "print(memory.step_peak())\n"
        "del block\n"
        "memory.start_step()\n"  # a new step: the high-water mark starts again
        "print(memory.step_peak())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    first, second = (float(x) for x in done.stdout.split())
    assert 240 << 20 <= first < 512 << 20
    assert second < 128 << 20


def test_fidelity_ratios_of_memory():
    row = {
        "peak_mem_bytes": [3.0e9, 2.0e9],
        "predicted_mem_bytes": [2.0e9, 2.0e9],
        "predicted_activation_bytes": [1.0e9, 0.5e9],
    }
    assert fidelity.memory_ratios(row) == [1.5, 1.0]
    # Measured activations: the peak less the 1.0e9 and 1.5e9 the model counts besides them.
    assert fidelity.activation_ratios(row) == [2.0, 1.0]
    assert fidelity.memory_ratios({}) == [] == fidelity.activation_ratios({})
