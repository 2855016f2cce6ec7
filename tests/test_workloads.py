"""Workloads shipped in the package, global-batch sampling, and lengths files."""

import gzip
from pathlib import Path

import numpy as np
import pytest

from hdp.workloads import file_workload, get_workload, read_lengths, split_long, workload_names

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def test_standard_workloads_ship_in_the_package():
    assert workload_names() == ["byted-2m", "github-2m", "wikipedia-384k", "wlb-128k"]
    w = get_workload("wikipedia-384k")
    assert w.lengths.size == 1_000_000 and w.max_seq == 384 * 1024 and w.tokens_per_step == 4 << 20
    assert get_workload("byted-2m").max_seq == 2 << 20


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/data not beside the checkout")
def test_packaged_data_equals_shared_data():
    for name in ("wikipedia_flexsp.txt.gz", "wlbllm.txt.gz"):
        assert (SHARED / "lengths" / name).read_bytes() == (
            Path(__file__).parents[1] / "hdp" / "data" / "lengths" / name
        ).read_bytes()


@pytest.mark.parametrize("name", ["byted-2m", "github-2m", "wikipedia-384k", "wlb-128k"])
def test_batches_have_exactly_the_token_budget(name):
    w = get_workload(name)
    rng = np.random.default_rng(3)
    for _ in range(2):
        b = w.sample_batch(rng)
        assert b.sum() == w.tokens_per_step
        assert b.min() >= 1 and b.max() <= w.max_seq
    # Same seed, same batches.
    assert (
        get_workload(name).sample_batch(np.random.default_rng(3))
        == w.sample_batch(np.random.default_rng(3))
    ).all()


def test_bucket_sampling_follows_the_token_shares():
    w = get_workload("byted-2m")
    lens = w.sample_lengths(400_000, np.random.default_rng(0)).astype(float)
    # README facts: ~80% of samples <= 4K; the >= 1M bucket carries ~12.1% of tokens.
    assert 0.75 < (lens <= 4096).mean() < 0.85
    share = lens[lens >= 1 << 20].sum() / lens.sum()
    assert 0.08 < share < 0.16


def test_split_long():
    assert split_long(np.array([5, 12, 3]), 5).tolist() == [5, 5, 5, 2, 3]
    assert split_long(np.array([4]), 5).tolist() == [4]


def test_read_lengths_errors_name_the_line(tmp_path):
    p = tmp_path / "lens.txt"
    p.write_text("10\n20\n# a comment\n\nabc\n")
    with pytest.raises(ValueError, match=r"lens.txt, line 5: 'abc' is not an integer"):
        read_lengths(p)
    p.write_text("10\n\n-3\n")
    with pytest.raises(ValueError, match=r"lens.txt, line 3: sequence length -3 is negative"):
        read_lengths(p)
    p.write_text("0\n0\n")
    with pytest.raises(ValueError, match="no sequence of positive length"):
        read_lengths(p)
    with pytest.raises(ValueError, match="no such lengths file"):
        read_lengths(tmp_path / "missing.txt")
    g = tmp_path / "lens.txt.gz"
    with gzip.open(g, "wt") as f:
        f.write("7\n9\n")
    assert read_lengths(g).tolist() == [7, 9]
    g.write_bytes(b"\x1f\x8b\x08broken")
    with pytest.raises(ValueError, match="cannot read lengths"):
        read_lengths(g)


def test_file_workload(tmp_path):
    p = tmp_path / "lens.txt"
    p.write_text("100\n3000\n0\n")
    w = file_workload(p, tokens_per_step=10_000)
    assert w.max_seq == 4096 and sorted(set(w.lengths.tolist())) == [100, 3000]
    assert w.sample_batch(np.random.default_rng(0)).sum() == 10_000
