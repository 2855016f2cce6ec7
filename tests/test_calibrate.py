"""``hdp-calibrate measure``: a quick CPU run writes a complete ``hdp.profile/1`` file in time, and
bad arguments fail with one line and exit status 2 before anything is measured."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hdp
from hdp.launch import calibrate
from hdp.testing.ranks import patient

ROOT = Path(__file__).resolve().parents[1]
SCALARS = (
    "peak_flops",
    "memory_bytes",
    "usable_memory_fraction",
    "reserved_bytes",
    "hbm_bw",
    "pcie_bw",
    "nvlink_bw",
    "nic_bw",
    "nvlink_latency",
    "nic_latency",
    "layer_overhead_s",
)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``measure --device cpu --quick`` run: (completed process, profile path)."""
    out = tmp_path_factory.mktemp("calibrate") / "profile.json"
    cmd = [sys.executable, "-m", "hdp.launch.calibrate", "measure", "--device", "cpu", "--quick"]
    done = subprocess.run(
        [*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=patient(300)
    )
    return done, out


def test_quick_cpu_measure_writes_a_complete_profile(quick_run):
    done, out = quick_run
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["format"] == "hdp.profile/1"
    assert data["name"] == "cpu" and data["attention_backend"] == "reference"
    assert data["source"].startswith("measured by hdp-calibrate measure --device cpu --quick on ")
    assert data["device"].startswith("cpu: ")
    for key in SCALARS:
        assert isinstance(data[key], float) and math.isfinite(data[key]) and data[key] >= 0, key
    assert data["peak_flops"] > 0 and data["memory_bytes"] > 0 and data["hbm_bw"] > 0
    assert set(data["tables"]) == set(calibrate.TABLE_COLUMNS)
    for name, columns in calibrate.TABLE_COLUMNS.items():
        table = data["tables"][name]
        assert table["columns"] == list(columns), name
        assert table["rows"], f"table {name} has no rows"
        for row in table["rows"]:
            assert len(row) == len(columns) and row[-1] > 0, (name, row)
    kinds = {row[1] for row in data["tables"]["attention"]["rows"]}
    assert kinds == {"causal", "full"}
    ops = {row[0] for row in data["tables"]["memory_bound"]["rows"]}
    assert ops == {"rmsnorm", "swiglu", "residual_add", "rope", "cast", "cross_entropy"}
    assert {row[0] for row in data["tables"]["collective"]["rows"]} >= {"all_gather", "p2p"}
    # the tiny model's linear layers, all of them
    shapes = {(row[1], row[2]) for row in data["tables"]["gemm"]["rows"]}
    assert shapes == {(64, 64), (64, 32), (64, 176), (176, 64), (64, 512)}
    # how it was measured: the host, and every row's spread in row order
    measured = data["measurement"]
    assert measured["cpus"] == os.cpu_count()
    assert len(measured["load_before"]) == len(measured["load_after"]) == 3
    for name, table in data["tables"].items():
        spreads = measured["spread"][name]
        assert len(spreads) == len(table["rows"]) and all(s >= 0 for s in spreads), name


def test_quick_cpu_measure_reports_each_table(quick_run):
    done, _ = quick_run
    for name in calibrate.TABLE_COLUMNS:
        assert f"hdp-calibrate: {name}: " in done.stderr, done.stderr
    assert "elapsed" in done.stderr


def test_the_profile_reads_back_where_hdp_has_a_reader(quick_run, monkeypatch):
    _, out = quick_run
    if not hasattr(hdp.GPUProfile, "load"):
        pytest.skip("this hdp has no profile reader (GPUProfile.load)")
    # The test host runs other tests beside this one: its rows may be too noisy to plan with,
    # which tests/test_calibrate_noise.py checks; here the file's format is what is read back.
    monkeypatch.setenv("HDP_FORCE_PROFILE", "1")
    profile = hdp.GPUProfile.load(out)
    assert profile.name == "cpu" and profile.attention_backend == "reference"


def test_help(capsys):
    for argv in (["--help"], ["measure", "--help"], ["check", "--help"]):
        with pytest.raises(SystemExit) as e:
            calibrate.main(argv)
        assert e.value.code == 0
    text = capsys.readouterr().out
    words = ("measure", "check", "--quick", "--models", "--base", "examples:", "--table", "--force")
    for word in (*words, "spread", "ETA", "HDP_FORCE_PROFILE"):
        assert word in text


def _fails_with_one_line(capsys, argv: list[str], words: str) -> None:
    assert calibrate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hdp-calibrate: error: "), err
    assert words in err[0], err


def test_bad_out_path(tmp_path, capsys):
    out = tmp_path / "missing" / "profile.json"
    _fails_with_one_line(capsys, ["measure", "--device", "cpu", "--out", str(out)], "not exist")
    assert not out.parent.exists()
    _fails_with_one_line(capsys, ["measure", "--device", "cpu", "--out", str(tmp_path)], "--out")


def test_cuda_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "profile.json"
    _fails_with_one_line(capsys, ["measure", "--device", "cuda", "--out", str(out)], "CUDA")
    assert not out.exists()


def test_unknown_device_model_and_base(tmp_path, capsys):
    out = str(tmp_path / "profile.json")
    _fails_with_one_line(capsys, ["measure", "--device", "tpu", "--out", out], "unknown device")
    argv = ["measure", "--device", "cpu", "--out", out]
    _fails_with_one_line(capsys, [*argv, "--models", "tiny,nope"], "nope")
    _fails_with_one_line(capsys, [*argv, "--base", "nope"], "nope")


def test_source_line_leaves_out_the_output_path():
    argv = ["measure", "--out", "/x/p.json", "--device", "cpu", "--out=/y", "--quick"]
    assert calibrate._command_line(argv) == "hdp-calibrate measure --device cpu --quick"


HEADER = "kind,heads,kv_heads,head_dim,a,b,c,ms\n"
GEMM = "gemm,0,0,0,4096,2048,3072,0.347\n"  # a row of the H100 measurements the h100 preset holds


def _check(tmp_path, capsys, table: str, *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "t.csv"
    path.write_text(table)
    code = calibrate.main(["check", "h100", "--table", str(path), *flags])
    out, err = capsys.readouterr()
    return code, out, err.replace(str(path), "T")


def test_check_prices_a_measured_row(tmp_path, capsys):
    code, out, _ = _check(tmp_path, capsys, HEADER + GEMM)
    summary = json.loads(out.splitlines()[-1])
    assert code == 0 and summary["rows"] == 1 and summary["max_rel_err"] < 1e-3


@pytest.mark.parametrize(
    "table, flags, message",
    [
        (HEADER, (), "T: no rows below the header"),
        ("kind,heads,a,b,c,ms\n" + GEMM, (), "T, line 1: the header lacks column head_dim"),
        (HEADER + GEMM.replace("0.347", "0"), (), "line 2, column ms: expected a finite time"),
        (HEADER + GEMM.replace("0.347", "nan"), (), "line 2, column ms: expected a finite time"),
        (HEADER + GEMM.replace("0.347", "-1"), (), "line 2, column ms: expected a finite time"),
        (HEADER + GEMM.replace("0.347", "inf"), (), "line 2, column ms: expected a finite time"),
        (
            HEADER + GEMM.replace("4096", "-5"),
            (),
            "line 2, column a: expected a whole number from 1",
        ),
        (HEADER + GEMM.replace("4096", "4.5"), (), "line 2, column a: expected a whole number"),
        (
            HEADER + GEMM.replace("4096", "1e20"),
            (),
            "column a: expected a whole number from 1 to 68",
        ),
        (HEADER + GEMM.replace("4096", "1e400"), (), "column a: expected a whole number from 1 to"),
        (
            HEADER + GEMM + "attn_doc,32,8,0,128,512,0,3.7\n",
            (),
            "line 3, column head_dim: expected a whole number from 1 to 68,719,476,736, got '0'",
        ),
        (HEADER + "conv,0,0,0,1,1,1,1\n", (), "line 2, column kind: 'conv' is not one of"),
        (HEADER + GEMM, ("--backend", "foo"), "--backend foo: T has attention rows of no backend"),
    ],
)
def test_check_refuses_a_bad_table_with_one_line(tmp_path, capsys, table, flags, message):
    code, out, err = _check(tmp_path, capsys, table, *flags)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


def test_check_without_step_relevant_rows_fails_instead_of_printing_nan(tmp_path, capsys):
    code, _, err = _check(tmp_path, capsys, HEADER + "gemm,0,0,0,512,2048,3072,0.2\n")
    assert code == 1 and "has no step-relevant rows" in err
