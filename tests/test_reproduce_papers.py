"""``scripts/reproduce_papers.py``: every paper row is simulated or says why it is not, and the
error is measured against the published figure or the nearer end of a published range."""

import gzip
import importlib.util
import re
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
    """One global batch of a cheap row (FlexSP's over Megatron-LM at 192K, two meshes) and the
    rows not modelled: the table's shape, its citations and the figures dropped, not its figures,
    which docs/benchmarks.md records."""
    megatron = next(k for k, r in enumerate(papers.ROWS, 1) if "Megatron" in r.setting)
    chosen = [megatron] + [k for k, r in enumerate(papers.ROWS, 1) if r.not_modelled]
    assert papers.main(["--steps", "1", "--rows", ",".join(map(str, chosen))]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("| ") and "---" not in x]
    header, rows = lines[0], lines[1:]
    assert "cited from" in header and "other figures" in header
    assert len(rows) == len(chosen)
    for row, line in zip([papers.ROWS[k - 1] for k in chosen], rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[3] == row.cited and cells[4] == (row.others or "-")
        if row.not_modelled:
            assert cells[5] == f"not modelled: {row.not_modelled}"
        else:
            assert cells[5].endswith("x") and float(cells[5][:-1]) > 0
            assert cells[7].endswith("x") and float(cells[7][:-1]) > 0
    for paper, figures, _, why in papers.DROPPED:
        assert f"- {paper}: {figures[0]:.2f}x" in out and why in out


def test_bytescale_rows_simulate_its_own_7b():
    """ByteScale's LLaMA-7B as its Table 1 has it: 32 layers, 32 heads, 8 KV groups, hidden
    4096, and 7B parameters within 5%; a quarter of the K/V of the llama-7b preset (Llama-2 7B,
    full multi-head attention). Every simulated ByteScale row runs it."""
    from hdp import model_preset

    m = papers.BYTESCALE_7B
    assert (m.layers, m.heads, m.kv_heads, m.hidden) == (32, 32, 8, 4096)
    assert m.heads * m.head_dim == m.hidden
    assert abs(m.total_params / 7e9 - 1) < 0.05, m.total_params
    llama2 = model_preset("llama-7b")
    assert llama2.kv_heads * llama2.head_dim == 4 * m.kv_heads * m.head_dim
    rows = [r for r in papers.ROWS if r.paper.startswith("ByteScale") and not r.not_modelled]
    assert rows and all(r.model is papers.BYTESCALE_7B for r in rows)


def test_bytescale_rows_run_on_the_ring_speed_the_paper_measured():
    """The ByteScale rows' NIC is what Fig. 18(a)'s ring steps imply: a 16.8 MB block a GPU
    (8K tokens of 8 groups of 128, K and V in bf16, halved by TP 2) in 1.4-1.9 ms."""
    block = 8192 * 8 * 128 * 2 * 2 / 2
    assert block == pytest.approx(16.8e6, rel=0.01)
    rows = [r for r in papers.ROWS if r.paper.startswith("ByteScale") and not r.not_modelled]
    assert rows
    for row in rows:
        assert block / 1.9e-3 <= row.gpu.nic_bw <= block / 1.4e-3


def test_bytescale_beats_the_static_mesh_on_its_own_7b():
    """One GitHub 2M batch on 1,024 GPUs with the paper's 7B and network: ByteScale's step is
    shorter than the static mesh's (docs/benchmarks.md records the 12-batch means)."""
    (row,) = [r for r in papers.ROWS if "GitHub data, 2M" in r.setting and not r.not_modelled]
    static, bytescale = (
        papers.mean_step(row, s, (2, None), steps=1, seed=0, progress=lambda m: None)
        for s in ("static", "bytescale")
    )
    assert static > bytescale


def test_every_row_cites_where_its_figure_is_printed():
    """Each row names the table, figure or section that prints its figure (DistCA's, whose text
    was not found, says that it cites the abstract as ../shared/REFERENCES.md quotes it), and no
    row cites a figure listed as dropped at its paper."""
    for row in papers.ROWS:
        named = re.search(r"\b(Table|Fig\.|Sec\.) \d+", row.cited)
        quoted = "abstract" in row.cited and "REFERENCES.md" in row.cited
        assert named or quoted, row.setting
        low, high = row.published
        assert 1 < low <= high, row.setting
    for paper, figures, _, why in papers.DROPPED:
        assert why
        for row in papers.ROWS:
            if row.paper == paper:
                assert not set(figures) & set(row.published), (paper, row.setting)


def test_flexsps_figures_are_fig_4s_labels_at_each_setting():
    """FlexSP's rows cite Fig. 4's labels on Wikipedia: for GPT-7B 1.98x and 1.72x over
    Megatron-LM and DeepSpeed at 192K, 1.77x and 1.46x at 384K; for GPT-13B 1.79x, 1.59x, 1.77x,
    1.43x; for GPT-30B 1.95x, 1.64x, 1.85x, 1.53x."""
    expected = {
        ("GPT-7B", "192K", "Megatron"): 1.98,
        ("GPT-7B", "192K", "DeepSpeed"): 1.72,
        ("GPT-7B", "384K", "Megatron"): 1.77,
        ("GPT-7B", "384K", "DeepSpeed"): 1.46,
        ("GPT-13B", "192K", "Megatron"): 1.79,
        ("GPT-13B", "192K", "DeepSpeed"): 1.59,
        ("GPT-13B", "384K", "Megatron"): 1.77,
        ("GPT-13B", "384K", "DeepSpeed"): 1.43,
        ("GPT-30B", "192K", "Megatron"): 1.95,
        ("GPT-30B", "192K", "DeepSpeed"): 1.64,
        ("GPT-30B", "384K", "Megatron"): 1.85,
        ("GPT-30B", "384K", "DeepSpeed"): 1.53,
    }
    rows = [r for r in papers.ROWS if r.system == "flexsp"]
    assert len(rows) == len(expected)
    for (model, context, baseline), figure in expected.items():
        (row,) = [
            r
            for r in rows
            if r.setting.startswith(f"{model},") and context in r.setting and baseline in r.setting
        ]
        assert row.published == (figure, figure)
        assert row.cited.startswith(f"Fig. 4, {model},") and context in row.cited


def test_flexsps_bigger_models_are_its_released_configs():
    """GPT-13B and GPT-30B as FlexSP's released configs (gpt-13b.json, gpt-30b.json, branch
    flexsp of Hetu-Galvatron) and its Appendix Table 5 give them: 40 layers, hidden 5120, 64
    heads of 80; 60 layers, hidden 6656, 64 heads of 104; GPT-2's vocabulary of 50257."""
    for spec, (layers, hidden, heads, head_dim) in (
        (papers.GPT_13B, (40, 5120, 64, 80)),
        (papers.GPT_30B, (60, 6656, 64, 104)),
    ):
        assert (spec.layers, spec.hidden, spec.heads, spec.head_dim) == (
            layers,
            hidden,
            heads,
            head_dim,
        )
        assert spec.kv_heads == spec.heads and spec.vocab == 50257
        rows = [r for r in papers.ROWS if r.model == spec]
        assert len(rows) == 4


def test_30b_over_megatron_does_not_fit_on_the_papers_tp8_meshes():
    """The 30B's Megatron-LM rows are not modelled because every TP 8 mesh the paper names is
    short of memory in our model even recomputing every layer, which the search confirms."""
    rows = [r for r in papers.ROWS if r.model == papers.GPT_30B and r.baseline == "static"]
    assert len(rows) == 2
    cluster = ClusterSpec(64, 8, papers.FLEXSP_A100)
    for row in rows:
        assert row.not_modelled
        for mesh in row.baseline_meshes:
            with pytest.raises(papers.PlanningError, match="every layer"):
                papers._recomputed(row, papers.GPT_30B, cluster, mesh)


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
    rows = [r for r in papers.ROWS if context in r.setting and r.model == papers.GPT_7B]
    system = papers.mean_step(rows[0], "flexsp", (1, None), 40, 0, lambda m: None)
    for baseline in baselines:
        (row,) = [r for r in rows if baseline in r.setting]
        base, _ = papers.baseline_step(row, steps=40, seed=0, progress=lambda m: None)
        assert abs(papers.error(base / system, row.published)) <= papers.TOLERANCE, (
            baseline,
            base / system,
        )


def test_a_head_parallel_plan_keeps_its_own_capacity():
    """FlexSP's setting (GPT-7B, no activation checkpointing, 64 A100-40GB), the eighth of its
    released batches the paper averages: hdp's head-parallel plan fills ranks past the P2P
    capacity to the Ulysses one, and was once checked against the P2P one."""
    from hdp import model_preset
    from hdp.planner import plan_step
    from hdp.specs import gpu_preset

    row = next(r for r in papers.ROWS if r.system == "flexsp" and r.max_seq == 192 << 10)
    model = row.model if not isinstance(row.model, str) else model_preset(row.model)
    gpu = gpu_preset(row.gpu) if isinstance(row.gpu, str) else row.gpu
    pricing = StepPricing.build(
        model,
        ClusterSpec(row.gpus, 8, gpu),
        capacity=row.capacity,
        activation_checkpointing=row.checkpointing,
        kv_exchange="ulysses",
    )
    batch = papers.trace_batches(row, 10)[7]
    plan = plan_step(batch, pricing, "hdp", max_seq=row.max_seq)  # validates the plan
    assert plan.kv_exchange == "ulysses"
    p2p = pricing.cost.with_exchange("node").capacity(plan.sync)  # where hdp plans P2P here
    assert p2p < plan.tokens_per_cell().max() <= plan.predicted["capacity"]
