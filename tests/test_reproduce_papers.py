"""``scripts/reproduce_papers.py``: every paper row is simulated or says why it is not, and the
error is measured against the published figure or the nearer end of a published range."""

import importlib.util
import sys
from pathlib import Path

import pytest

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
    Megatron at three TP sizes) and the rows not modelled: the table's shape, not its figures,
    which docs/benchmarks.md records."""
    chosen = [1, 5, len(papers.ROWS) - 1, len(papers.ROWS)]
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
