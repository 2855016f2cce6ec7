"""hdp-sim and hdp-plan end to end, and their errors (clear, non-zero, no hang)."""

import json
import subprocess
import sys

import pytest

from hdp import Plan
from hdp.planner.cli import plan_main, sim_main
from hdp.testing.ranks import patient


def run_cli(*args, timeout=120):
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from hdp.planner.cli import sim_main, plan_main; "
            f"sys.exit({args[0]}(sys.argv[1:]))",
            *args[1:],
        ],
        capture_output=True,
        text=True,
        timeout=patient(timeout),
    )


def test_sim_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = sim_main(
        [
            "--workload",
            "wlb-128k",
            "--gpus",
            "16",
            "--tokens-per-step",
            "1M",
            "--steps",
            "2",
            "--hybridcp-impl",
            "ours",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for col in (
        "step s",
        "vs static",
        "step/LB",
        "imbalance",
        "exposed comm s",
        "peak mem GB",
        "plan s",
        "MFU",
    ):
        assert col in text
    d = json.loads(out_json.read_text())
    assert d["config"]["gpus"] == 16 and d["config"]["tokens_per_step"] == 1 << 20
    for name in ("static", "hybridcp", "bytescale", "hdp"):
        r = d["results"][name]
        for key in (
            "step_time_s",
            "lower_bound_s",
            "imbalance",
            "exposed_comm_s",
            "comm_bytes",
            "peak_mem_bytes",
            "plan_time_s",
            "mfu",
        ):
            assert isinstance(r[key], float)
        assert r["step_time_s"] >= r["lower_bound_s"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_with_lengths_file(tmp_path, capsys):
    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(str(x) for x in [100, 2000, 30000, 500, 70000]) + "\n")
    assert (
        sim_main(
            [
                "--lengths",
                str(lens),
                "--gpus",
                "8",
                "--tokens-per-step",
                "256K",
                "--strategies",
                "hdp,static",
                "--steps",
                "1",
            ]
        )
        == 0
    )
    assert "hdp" in capsys.readouterr().out


def test_plan_writes_a_plan_that_reads_back(tmp_path, capsys):
    lens = tmp_path / "lens.txt"
    lens.write_text("100\n5000\n300000\n70000\n")
    out = tmp_path / "PLAN.json"
    assert plan_main(["--lengths", str(lens), "--gpus", "16", "--out", str(out)]) == 0
    plan = Plan.from_json(json.loads(out.read_text()))
    plan.validate()
    assert plan.seq_lens.tolist() == [100, 5000, 300000, 70000] and plan.num_ranks == 16
    assert set(plan.predicted) >= {"step_time_s", "lower_bound_s"}
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["sim_main", "--workload", "nope", "--gpus", "8"], "unknown workload 'nope'"),
        (
            ["sim_main", "--workload", "wlb-128k", "--gpus", "8", "--model", "gpt-5"],
            "unknown model 'gpt-5'",
        ),
        (
            ["sim_main", "--workload", "wlb-128k", "--gpus", "8", "--gpu", "tpu"],
            "unknown GPU preset 'tpu'",
        ),
        (
            ["sim_main", "--workload", "wlb-128k", "--gpus", "8", "--strategies", "ring"],
            "unknown strategy ring",
        ),
        (["sim_main", "--workload", "wlb-128k", "--gpus", "0"], "must be >= 1"),
        (
            ["sim_main", "--workload", "wlb-128k", "--gpus", "8", "--max-seq", "2X"],
            "invalid size '2X'",
        ),
        (
            ["plan_main", "--lengths", "{bad}", "--gpus", "8", "--out", "{out}"],
            "line 2: 'x12' is not an integer",
        ),
        (
            ["plan_main", "--lengths", "{neg}", "--gpus", "8", "--out", "{out}"],
            "line 3: sequence length -4 is negative",
        ),
        (
            ["plan_main", "--lengths", "{huge}", "--gpus", "2", "--out", "{out}"],
            "cannot hold a 3000000-token sequence",
        ),
        (
            ["plan_main", "--lengths", "{overflow}", "--gpus", "8", "--out", "{out}"],
            "line 2: sequence length 100000000000000000000000 is above 68,719,476,736 tokens",
        ),
        (
            ["sim_main", "--workload", "wlb-128k", "--gpus", "8", "--model", "{absurd}"],
            "hdp-sim: error: absurd does not fit on h100 in 'wave' sync",
        ),
        (
            ["sim_main", "--lengths", "{overflow}", "--gpus", "8"],
            "line 2: sequence length 100000000000000000000000 is above 68,719,476,736 tokens",
        ),
        (  # both hung, sampling and planning tens of millions of sequences
            ["sim_main", "--workload", "byted-2m", "--gpus", "64", "--tokens-per-step", "64G"],
            "holds about 10,504,238 sequences, past the 4,194,304 hdp-sim plans",
        ),
        (
            ["sim_main", "--workload", "byted-2m", "--gpus", "64", "--max-seq", "1"],
            "in sequences of at most 1 holds about 33,554,432 sequences",
        ),
    ],
)
def test_errors_are_clear(tmp_path, args, message):
    (tmp_path / "bad.txt").write_text("10\nx12\n")
    (tmp_path / "neg.txt").write_text("10\n20\n-4\n")
    (tmp_path / "huge.txt").write_text("3000000\n")
    (tmp_path / "overflow.txt").write_text("1000\n" + "1" + "0" * 23 + "\n")
    # A model no strategy can place (10^7 layers): one line, not one failure per strategy.
    absurd = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176}
    absurd |= {"num_hidden_layers": 10**7, "num_attention_heads": 4, "vocab_size": 512}
    (tmp_path / "absurd").mkdir()
    (tmp_path / "absurd" / "config.json").write_text(json.dumps(absurd))
    args = [
        a.format(
            bad=tmp_path / "bad.txt",
            neg=tmp_path / "neg.txt",
            huge=tmp_path / "huge.txt",
            overflow=tmp_path / "overflow.txt",
            absurd=tmp_path / "absurd",
            out=tmp_path / "o.json",
        )
        for a in args
    ]
    res = run_cli(*args)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("prog", ["hdp-sim", "hdp-plan"])
def test_help(prog):
    fn = "sim_main" if prog == "hdp-sim" else "plan_main"
    res = run_cli(fn, "--help")
    assert res.returncode == 0 and prog in res.stdout and "--gpus" in res.stdout


def test_plan_hdp_forms(tmp_path):
    """--hdp-form megatron: every sequence on one rank or an aligned power-of-two block;
    --hdp-form whole: every sequence on one rank."""
    lens = tmp_path / "lens.txt"
    lens.write_text(
        "\n".join(str(x) for x in [300000, 120000, 60000, 9000, 4000, 2500, 700] * 3) + "\n"
    )
    for form in ("megatron", "whole"):
        out = tmp_path / f"{form}.json"
        extra = ["--capacity", "320K"] if form == "whole" else []
        assert (
            plan_main(
                [
                    "--lengths",
                    str(lens),
                    "--gpus",
                    "16",
                    "--hdp-form",
                    form,
                    "--out",
                    str(out),
                    *extra,
                ]
            )
            == 0
        )
        plan = Plan.load(out)
        holders = {}
        for s, r in zip(plan.seq.tolist(), plan.rank.tolist()):
            holders.setdefault(s, set()).add(r)
        for ranks in holders.values():
            k, lo = len(ranks), min(ranks)
            if form == "whole":
                assert k == 1
            else:
                assert ranks == set(range(lo, lo + k)) and k & (k - 1) == 0 and lo % k == 0
    res = run_cli(
        "plan_main",
        "--lengths",
        str(lens),
        "--gpus",
        "16",
        "--hdp-form",
        "whole",
        "--capacity",
        "160K",
        "--out",
        str(tmp_path / "x.json"),
    )
    assert res.returncode == 2 and "does not fit one rank's 163840 tokens" in res.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly():
    # hdp-data stats X | head: the pipe closes before the command has written everything.
    code = "import sys; from hdp.dataloader.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "stats", "synthetic:wlb-128k"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=patient(120)) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_outputs_in_missing_folders_are_created_as_training_metrics_are(tmp_path, capsys):
    (tmp_path / "l.txt").write_text("1000\n3000\n")
    out = tmp_path / "new" / "dir" / "PLAN.json"
    assert plan_main(["--lengths", str(tmp_path / "l.txt"), "--gpus", "2", "--out", str(out)]) == 0
    assert Plan.load(out).num_ranks == 2


def test_a_cpu_profile_for_a_large_cluster_is_questioned(capsys):
    argv = ["--workload", "wlb-128k", "--model", "tiny", "--steps", "1", "--strategies", "static"]
    assert sim_main([*argv, "--gpus", "16", "--gpu", "cpu"]) == 0
    assert "warning: the cpu profile prices CPU ranks" in capsys.readouterr().err
    assert sim_main([*argv, "--gpus", "2", "--gpu", "cpu"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_sim_prices_compiled_layers_where_asked(tmp_path, capsys):
    """``--compile`` prices hdp-train's CUDA default: the same batch steps faster, its
    memory-bound work at the h100 profile's compiled share."""
    steps = []
    for extra in ([], ["--compile"]):
        out = tmp_path / f"sim{len(extra)}.json"
        argv = ["--workload", "wlb-128k", "--gpus", "8", "--tokens-per-step", "256K"]
        argv += ["--strategies", "static", "--steps", "1", "--json", str(out), *extra]
        assert sim_main(argv) == 0
        data = json.loads(out.read_text())
        steps.append(data["results"]["static"]["step_time_s"])
        assert data["config"]["compiled"] is bool(extra)
    capsys.readouterr()
    assert steps[1] < steps[0]
