"""Megatron's real ``hybrid_context_parallel_forward_backward`` (the installed megatron-core) on
gloo ranks, fed by ``HDPDataLoaderWrapper``, with each release's ``get_batch`` contract
(``tests/megatron_contracts.py``) and a stand-in model that checks, on
``packed_seq_params.cp_group``, that all CP partners run the same sub-sample together and hold
all of it between them.

Megatron's CUDA calls (``.cuda()``, ``device="cuda"``, ``pin_memory``) run on the CPU here.

``test_newest_release_forward_backward`` runs the ``packed`` case again on the newest
megatron-core release (``NEWEST``), whose wheels need Python 3.12: it downloads the wheel once
(cached under ``~/.cache/hdp``), and runs this file's case in a subprocess with the unpacked
wheel on ``PYTHONPATH`` ahead of the installed megatron-core. Its code runs on Python 3.11 as it
is; the one thing its import needs that this CPU venv lacks is Triton (see
``_stand_in_for_triton_kernels``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
import types
import warnings
import zipfile
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hdp.planner.hybridcp import megatron_available
from hdp.testing.ranks import patient, run_ranks

NEWEST = "0.19.2"  # the newest megatron-core release (cp312 wheels only)
# Set in the subprocess of test_newest_release_forward_backward (and so in its rank processes):
# the megatron-core version that must be the one imported.
ON_PATH = "HDP_TEST_MEGATRON_CORE"
PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def _stand_in_for_triton_kernels() -> None:
    """megatron-core 0.19's pipeline schedules import its MoE paged-stash module, which defines
    two Triton kernels at import; hdp's CPU venv has no Triton. A module with the same names
    stands in (nothing here runs MoE; calling one raises). Only where Triton is missing, only in
    the processes of test_newest_release_forward_backward."""
    if importlib.util.find_spec("triton") is not None:
        return
    stand_in = types.ModuleType(PAGED_STASH)
    stand_in.__spec__ = importlib.machinery.ModuleSpec(PAGED_STASH, None)

    def no_triton(*_args, **_kwargs):
        raise RuntimeError("Triton is not installed: the paged-stash kernel is a test stand-in")

    stand_in.GLOBAL_BLOCK_SIZE = 1024
    stand_in.paged_stash_copy_kernel = stand_in.paged_stash_pop_kernel = no_triton
    sys.modules[PAGED_STASH] = stand_in


if os.environ.get(ON_PATH):
    _stand_in_for_triton_kernels()

pytestmark = pytest.mark.skipif(
    not megatron_available(), reason="megatron-core not installed (pip install 'hdp-llm[megatron]')"
)

CAP = 256  # max_seqlen_per_dp_cp_rank
DOC = 100_000  # token value = doc * DOC + position: any rank can tell which sub-sample it holds


def _cuda_on_cpu() -> None:
    """Megatron's CUDA calls on the CPU, in this (spawned) rank process only."""
    real_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if str(kwargs.get("device", "cpu")).startswith("cuda"):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return real_tensor(*args, **kwargs)

    torch.tensor = tensor
    torch.Tensor.cuda = lambda t, *a, **k: t
    torch.cuda.current_device = lambda: "cpu"


class PartnerCheckModel(torch.nn.Module):
    """One weight; checks the sub-sample against its CP partners and returns a per-token loss."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.seen: list[tuple[int, int, int]] = []  # (doc, padded length, CP size)

    def set_input_tensor(self, _tensor) -> None:
        pass

    def forward(self, tokens, loss_mask, params):
        import torch.distributed as dist

        k = params.local_cp_size
        group = params.cp_group
        assert (group.size() if group is not None else 1) == k, "CP group of the wrong size"
        local = tokens[0]
        parts = [local]
        if k > 1:
            parts = [torch.empty_like(local) for _ in range(k)]
            dist.all_gather(parts, local, group=group)
        # Undo the zigzag: partner r holds chunks r and 2k-1-r.
        half = local.numel() // 2
        chunks = [None] * (2 * k)
        for r, p in enumerate(parts):
            chunks[r], chunks[2 * k - 1 - r] = p[:half], p[half:]
        full = torch.cat(chunks) if k > 1 else local
        doc = int(full[0]) // DOC
        real = int((full // DOC == doc).sum())
        # Every partner has the same sub-sample, whole and in order; the padding is after it.
        assert torch.equal(full[:real], doc * DOC + torch.arange(real)), "partners disagree"
        assert real == full.numel() or int(full[real:].abs().sum()) == 0
        self.seen.append((doc, full.numel(), k))
        return (self.weight * loss_mask.float()).reshape(1, -1)


def _forward_step_func(get_batch):
    def forward_step(data_iterator, model):
        batch, params = get_batch(data_iterator)
        assert params is not None, "get_batch built no hybrid-CP params: cu_seqlens missing?"
        out = model(batch["tokens"], batch["loss_mask"], params)
        mask = batch["loss_mask"].float().reshape(-1)

        def loss_func(output):
            loss = (output.reshape(-1) * mask).sum()
            n = mask.sum().to(torch.int)
            return loss, n, {"lm loss": torch.stack([loss.detach(), n.float()])}

        return out, loss_func

    return forward_step


def _batch(replica: int, rng: np.random.Generator, world: int) -> list[dict]:
    """Two packed samples of documents whose tokens say which document they are."""
    samples, doc = [], replica * 1000 + 1  # 0 is the padding token
    for _ in range(2):
        lens = rng.integers(1, 3 * CAP, size=int(rng.integers(1, world + 1))).tolist()
        tokens = torch.cat(
            [doc + i + torch.zeros(L, dtype=torch.int64) for i, L in enumerate(lens)]
        )
        pos = torch.cat([torch.arange(L) for L in lens])
        doc += len(lens)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
        samples.append(
            {
                "tokens": tokens * DOC + pos,
                "labels": tokens,
                "loss_mask": torch.ones(int(cu[-1])),
                "position_ids": pos,
                "cu_seqlens": cu,
            }
        )
    return samples


def _ranks(rank, world, contract, cp, seed, out):
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    _cuda_on_cpu()
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import hybrid_cp_schedule
    from megatron_contracts import GET_BATCH

    from hdp.dataloader.megatron import HDPDataLoaderWrapper, installed_version

    if os.environ.get(ON_PATH):  # the newest release from its wheel, and its own contract
        import megatron.core

        found = (megatron.core.__version__, installed_version().contract)
        assert found == (os.environ[ON_PATH], contract), f"imported {found} from {megatron.core}"
    ps.initialize_model_parallel(context_parallel_size=cp, hybrid_context_parallel=True)
    config = SimpleNamespace(
        max_seqlen_per_dp_cp_rank=CAP,
        sequence_parallel=False,
        timers=None,
        enable_autocast=False,
        calculate_per_token_loss=True,
        grad_scale_func=None,
        num_moe_experts=None,
        mtp_num_layers=None,
        deallocate_pipeline_outputs=False,
        variable_seq_lengths=True,
    )
    replica = ps.get_data_parallel_rank()
    batch = _batch(replica, np.random.default_rng([seed, replica]), world)
    wrapper = HDPDataLoaderWrapper(iter([batch]), config, contract=contract)
    model = PartnerCheckModel()
    kwargs = dict(
        forward_step_func=_forward_step_func(GET_BATCH[contract]),
        data_iterator=wrapper,
        model=model,
        num_microbatches=1,
        input_tensor=None,
        output_tensor_grad=None,
        forward_data_store=[],
        config=config,
        collect_non_loss_data=False,
        first_val_step=None,
        forward_only=False,
        no_sync_func=nullcontext,
        total_num_tokens=torch.zeros((), dtype=torch.int),
        check_first_val_step=lambda first, only, cond: cond,
        model_type=None,
    )
    fb = hybrid_cp_schedule.hybrid_context_parallel_forward_backward
    names = inspect.signature(fb).parameters
    fb(**{k: v for k, v in kwargs.items() if k in names})
    # Every rank ran what the schedule gave it, and the gradient counts its real tokens.
    sched = wrapper.cp_balancing_scheduler
    mine = [s for g in sched._last[1] for s in g[ps.get_data_parallel_rank(True)]]
    assert len(model.seen) == len(mine)
    assert all(length % (2 * k) == 0 for _, length, k in model.seen if k > 1)
    seen = [None] * world
    dist.all_gather_object(seen, model.seen)
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(sorted({(d, k) for r in seen for d, _, k in r})))
    ps.destroy_model_parallel()


@pytest.mark.parametrize(
    "contract, world, cp, seed",
    [("flat", 4, 1, 0), ("flat", 6, 2, 1), ("packed", 4, 2, 2), ("packed", 6, 1, 3)],
)
def test_forward_backward_runs_hdp_schedule(tmp_path, contract, world, cp, seed):
    out = tmp_path / "seen.txt"
    run_ranks(_ranks, world, contract, cp, seed, str(out), timeout=240)
    seen = eval(out.read_text())  # noqa: S307 -- written by the test above
    assert len({d for d, _ in seen}) == len(seen), "a sub-sample ran with two CP sizes"
    assert any(k > 1 for _, k in seen), "no sub-sample was split over CP partners"


def _newest_wheel() -> Path:
    """megatron-core ``NEWEST`` unpacked, downloaded once into ``~/.cache/hdp`` (or
    ``$XDG_CACHE_HOME/hdp``); skips the test when pip cannot download it."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hdp"
    unpacked = cache / f"megatron-core-{NEWEST}"
    if (unpacked / "megatron/core/package_info.py").exists():
        return unpacked
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--python-version", "3.12"]
        cmd += ["--only-binary=:all:", "--retries", "1", "--timeout", "20", "-d", tmp]
        try:
            got = subprocess.run(
                [*cmd, f"megatron-core=={NEWEST}"],
                capture_output=True,
                text=True,
                timeout=patient(180),
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f"pip download of megatron-core {NEWEST} took over 180 s")
        wheels = list(Path(tmp).glob("megatron_core-*.whl"))
        if got.returncode or not wheels:
            why = (got.stderr.strip().splitlines() or ["no wheel"])[-1]
            pytest.skip(f"cannot download megatron-core {NEWEST}: {why}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(Path(tmp, "unpacked"))
        os.replace(Path(tmp, "unpacked"), unpacked)  # whole or not at all
    return unpacked


def test_newest_release_forward_backward():
    """The packed case above on megatron-core NEWEST's own code (its wheels need Python 3.12;
    its code runs on 3.11): in a subprocess with the unpacked wheel ahead of the installed
    megatron-core on PYTHONPATH."""
    wheel = _newest_wheel()
    here = Path(__file__).resolve()
    case = f"{here}::test_forward_backward_runs_hdp_schedule[packed-4-2-2]"
    path = [str(wheel), str(here.parents[1]), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), **{ON_PATH: NEWEST})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", case]
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=patient(400))
    tail = (ran.stdout + ran.stderr)[-4000:]
    assert ran.returncode == 0 and "1 passed" in ran.stdout, tail


def test_contract_doubles_refuse_the_other_layout():
    """What made 0.18/0.19 crash: a flat sub-sample (no cu_seqlens, ``[L]``) reaches a packed
    get_batch; and a packed one lacking cu_seqlens gets no hybrid split."""
    from megatron_contracts import get_batch_flat, get_batch_packed

    flat = {k: torch.arange(8) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    flat["local_cp_size"] = torch.tensor(1, dtype=torch.int32)
    with pytest.raises(AssertionError, match=r"tokens must be \[1, L\]"):
        get_batch_packed(iter([flat]))
    packed = {k: v.unsqueeze(0) for k, v in flat.items() if k != "local_cp_size"}
    packed["local_cp_size"] = flat["local_cp_size"]
    assert get_batch_packed(iter([packed]))[1] is None
    one_d_cu = dict(flat, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(AssertionError, match="micro-batch-size must be 1"):
        get_batch_flat(iter([one_d_cu]))
    # What broke 0.16.1 / 0.17.1 with TP > 1 (scripts/check_megatron_tags.py): no max_seqlen.
    with pytest.raises(AssertionError, match=r"max_seqlen int32 \[1\]"):
        get_batch_flat(iter([flat]))
    flat["max_seqlen"] = torch.tensor([8], dtype=torch.int32)
    assert get_batch_flat(iter([flat]))[1].local_cp_size == 1
