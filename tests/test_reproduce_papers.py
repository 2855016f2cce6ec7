"""``scripts/reproduce_papers.py``: every paper row is simulated or says why it is not, and the
error is measured against the published figure or the nearer end of a published range."""

import gzip
import importlib.util
import sys
from pathlib import Path

import pytest

from hdp import ClusterSpec
from hdp.planner import StepPricing
from hdp.planner.sim import simulate
from hdp.workloads import get_workload

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "reproduce_papers", ROOT / "scripts" / "reproduce_papers.py"
)
papers = importlib.util.module_from_spec(_spec)
sys.modules["reproduce_papers"] = papers  # its dataclasses look their module up
_spec.loader.exec_module(papers)


@pytest.mark.parametrize(
    "simulated, published, expected",
    [
        (3.0, (3.31, 3.31), 3.0 / 3.31 - 1),
        (7.0, (6.21, 7.89), 0.0),
        (9.0, (6.21, 7.89), 9 / 7.89 - 1),
    ],
)
def test_error_against_a_figure_or_a_range(simulated, published, expected):
    assert papers.error(simulated, published) == pytest.approx(expected)


def test_every_row_is_simulated_or_says_why_not(capsys):
    """One global batch of the cheapest rows (ByteScale's at 256K context, FlexSP's over
    Megatron-LM on two meshes) and the rows not modelled: the table's shape, not its figures,
    which docs/benchmarks.md records."""
    megatron = next(k for k, r in enumerate(papers.ROWS, 1) if "Megatron" in r.setting)
    chosen = [1, megatron] + [k for k, r in enumerate(papers.ROWS, 1) if r.not_modelled]
    assert papers.main(["--steps", "1", "--rows", ",".join(map(str, chosen))]) == 0
    lines = [
        x for x in capsys.readouterr().out.splitlines() if x.startswith("| ") and "---" not in x
    ]
    rows = lines[1:]
    assert len(rows) == len(chosen)
    for row, line in zip([papers.ROWS[k - 1] for k in chosen], rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        if row.not_modelled:
            assert cells[3] == f"not modelled: {row.not_modelled}"
        else:
            assert cells[3].endswith("x") and float(cells[3][:-1]) > 0
            assert cells[5].endswith("x") and float(cells[5][:-1]) > 0


def test_bytescales_github_row_is_within_the_goal(capsys):
    """The cheapest row within 15% of its paper: ByteScale's 7.89x over the static mesh on GitHub
    data at 2M context, 1,024 GPUs, over 4 seeded global batches (the script's 12 give +14%)."""
    (k,) = [k for k, r in enumerate(papers.ROWS, 1) if "GitHub data, 2M" in r.setting]
    out = papers.run_row(papers.ROWS[k - 1], steps=4, seed=0, progress=lambda m: None)
    assert abs(out["error"]) <= papers.TOLERANCE, out


def test_flexsp_rows_plan_the_papers_own_batches():
    """FlexSP's rows plan its batches as its code forms them: the released trace in file order,
    each length padded to a multiple of 2 x 64 GPUs, those over 192K - 128 left out, 512 a batch
    from the 11th on (a plain loop over the gzip file is the reference)."""
    row = next(r for r in papers.ROWS if r.trace_batches and r.max_seq == 192 << 10)
    got = papers.trace_batches(row, steps=3)
    kept = []
    with gzip.open(ROOT / "hdp" / "data" / "lengths" / "wikipedia_flexsp.txt.gz", "rt") as f:
        for line in f:
            padded = ((int(line) - 1) // 128 + 1) * 128
            if padded <= (192 << 10) - 128:
                kept.append(padded)
            if len(kept) == 13 * 512:
                break
    assert len(got) == 3
    for k, batch in enumerate(got):
        assert batch.tolist() == kept[(10 + k) * 512 : (11 + k) * 512]
    pricing = StepPricing.build(
        papers.GPT_7B, ClusterSpec(64, 8, papers.FLEXSP_A100), activation_checkpointing=False
    )
    sim = simulate(
        get_workload(row.workload), pricing, ["ulysses"], max_seq=row.max_seq, batches=got[:2]
    )
    assert sim.results["ulysses"].error is None, sim.results["ulysses"].error
    assert [s["sequences"] for s in sim.results["ulysses"].per_step] == [512, 512]
    with pytest.raises(ValueError, match="over max_seq"):
        simulate(get_workload(row.workload), pricing, ["static"], batches=got[:1], max_seq=1000)
    for empty in ([], [got[0][:0]]):
        with pytest.raises(ValueError, match="at least one global batch"):
            simulate(get_workload(row.workload), pricing, ["static"], batches=empty)


@pytest.mark.parametrize(
    "context,baselines", [("192K", ("Megatron", "DeepSpeed")), ("384K", ("DeepSpeed",))]
)
def test_flexsps_rows_are_within_the_goal(context, baselines):
    """FlexSP's speed-ups (GPT-7B, Wikipedia, 64 A100-40GB) over Megatron-LM at 192K (1.98x) and
    over DeepSpeed at 192K and 384K (1.72x, 1.46x) within 15%, over the paper's 40 batches; hdp
    is not planned (Megatron-LM at 384K misses, for reasons its row states)."""
    rows = [r for r in papers.ROWS if context in r.setting and r.system == "flexsp"]
    system = papers.mean_step(rows[0], "flexsp", (1, None), 40, 0, lambda m: None)
    for baseline in baselines:
        (row,) = [r for r in rows if baseline in r.setting]
        base, _ = papers.baseline_step(row, steps=40, seed=0, progress=lambda m: None)
        assert abs(papers.error(base / system, row.published)) <= papers.TOLERANCE, (
            baseline,
            base / system,
        )


def test_a_head_parallel_plan_keeps_its_own_capacity():
    """FlexSP's setting (GPT-7B, no activation checkpointing, 64 A100-40GB), the tenth of its
    released batches the paper averages: hdp's head-parallel plan, planned beside its P2P one,
    fills ranks past the P2P capacity to the Ulysses one, and was once checked against the P2P
    one."""
    from hdp import model_preset
    from hdp.planner import plan_step
    from hdp.specs import gpu_preset

    row = papers.ROWS[8]
    model = row.model if not isinstance(row.model, str) else model_preset(row.model)
    gpu = gpu_preset(row.gpu) if isinstance(row.gpu, str) else row.gpu
    pricing = StepPricing.build(
        model,
        ClusterSpec(row.gpus, 8, gpu),
        capacity=row.capacity,
        activation_checkpointing=row.checkpointing,
    )
    batch = papers.trace_batches(row, 10)[9]
    plan = plan_step(batch, pricing, "hdp", max_seq=row.max_seq)  # validates the plan
    assert plan.kv_exchange == "ulysses"
    p2p = pricing.cost.with_exchange("node").capacity(plan.sync)  # where hdp plans P2P here
    assert p2p < plan.tokens_per_cell().max() <= plan.predicted["capacity"]
