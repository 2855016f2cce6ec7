"""Every flag of every CLI is checked before any work: a bad value is one line naming the flag and
exit status 2, never a traceback or a silent default. In process: argparse's exit is SystemExit."""

import sys
from pathlib import Path

import pytest

from hdp import model_preset, parse_size
from hdp.dataloader.cli import main as data_main
from hdp.launch.cli import parse_config
from hdp.planner.cli import plan_main, sim_main

ROOT = Path(__file__).resolve().parents[1]


def _usage_error(fn, argv, capsys) -> str:
    """The error line of a command that must stop at its flags with status 2."""
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e400", "1e400K"])
def test_parse_size_refuses_what_is_not_finite(text):
    with pytest.raises(ValueError, match=f"invalid size {text!r}: must be a finite number"):
        parse_size(text)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-seq", "inf"], "argument --max-seq: invalid size 'inf': must be a finite"),
        (["--max-seq", "1e400"], "argument --max-seq: invalid size '1e400': must be a finite"),
        (["--capacity", "inf"], "argument --capacity: invalid size 'inf'"),
        (["--max-seq", "1"], "argument --max-seq: must be >= 2, got '1'"),
        (["--tokens-per-step", "0"], "argument --tokens-per-step: must be >= 1, got '0'"),
        (["--capacity", "0"], "argument --capacity: must be >= 1, got '0'"),
        (["--strategy", "bogus"], "argument --strategy: unknown strategy 'bogus': choose from"),
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--save-every", "-1"], "argument --save-every: must be >= 0, got -1"),
        (["--lr", "nan"], "argument --lr: must be a finite number, got 'nan'"),
        (["--lr", "0"], "argument --lr: must be > 0, got 0"),
        (["--rope-theta", "0.5"], "argument --rope-theta: must be > 1, got 0.5"),
        (["--lr", "4e37"], "argument --lr: must be at most 1e+06, got 4e37"),
        (["--weight-decay", "1e42"], "argument --weight-decay: must be at most 10, got 1e42"),
        (["--grad-clip", "1e9"], "argument --grad-clip: must be at most 1e+06, got 1e9"),
        (["--grad-clip", "-1"], "argument --grad-clip: must be >= 0, got -1"),
        (["--synthetic-docs", "0"], "argument --synthetic-docs: must be >= 1, got 0"),
        (["--synthetic-docs", "1" + "0" * 20], "argument --synthetic-docs: must be <= 100000000"),
        (["--tokens-per-step", "1" + "0" * 20], "argument --tokens-per-step: must be <= 64G"),
        (["--gpus-per-node", "1" + "0" * 20], "argument --gpus-per-node: must be <= 1048576"),
        (["--seed", "1" + "0" * 20], "argument --seed: must be <= 4294967295"),
        (["--steps", "1" + "0" * 20], "argument --steps: must be <= 9223372036854775807"),
        (["--workload", "nope"], "argument --workload: unknown workload 'nope'"),
        (["--gpu", "tpu"], "argument --gpu: unknown GPU preset 'tpu'"),
        (["--tokenizer", "/no/tok.json"], "argument --tokenizer: /no/tok.json: no such file"),
        (
            ["--data", "a.jsonl", "--data-weights", "0.5,x"],
            "argument --data-weights: item 2 of '0.5,x': 'x' is not a number",
        ),
        (
            ["--data", "a.jsonl", "--data-weights", "1,2"],
            "--data-weights has 2 weights for 1 --data sources",
        ),
        (["--data-weights", "1"], "--data-weights has 1 weights for 0 --data sources"),
        (["--max-seq", "2M", "--tokens-per-step", "64K"], "--max-seq (2M) exceeds --tokens-per"),
        (["--allow-changed-setup"], "--allow-changed-setup only applies with --resume"),
        (["--resume-step", "3"], "--resume-step needs --checkpoint-dir"),
        (["--resume-step", "0"], "argument --resume-step: must be >= 1, got 0"),
        (
            ["--keep-attention", "--no-activation-checkpointing"],
            "--keep-attention applies with --activation-checkpointing",
        ),
        (
            ["--checkpointed-layers", "4", "--no-activation-checkpointing"],
            "--checkpointed-layers applies with activation checkpointing",
        ),
        (["--nnodes", "2"], "--nnodes applies only with --nproc-per-node"),
        (["--fused-loss"], "--fused-loss needs liger-kernel: pip install 'hdp-llm[liger]'"),
        (["--checkpoint-dir", "{file}"], "argument --checkpoint-dir: {file} exists and is not a"),
        (["--metrics", "{file}/m.jsonl"], "argument --metrics: cannot create {file}/m.jsonl: "),
    ],
)
def test_pretrain_flags(tmp_path, capsys, argv, message):
    (tmp_path / "f").write_text("a file")
    argv = [a.format(file=tmp_path / "f") for a in argv]
    assert message.format(file=tmp_path / "f") in _usage_error(parse_config, argv, capsys)


def test_a_bad_kill_point_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("HDP_KILL_AT", "abc")
    assert "HDP_KILL_AT='abc': expected RANK:STEP" in _usage_error(parse_config, [], capsys)


def test_the_headline_command_fits_one_sequence_per_step():
    """`torchrun --nproc-per-node 2 launch/pretrain.py --max-seq 2M`: the default step holds one
    2M sequence, and two CPU ranks of the tiny model hold it, with activation checkpointing
    turned on for it, within the host's memory shared by both."""
    import torch

    from hdp.launch.memory import host_memory_bytes
    from hdp.launch.setup import build_pricing, checkpointing_needed
    from hdp.planner import get_strategy

    cpu = torch.device("cpu")
    args = parse_config(["--max-seq", "2M"])
    assert args.data.tokens_per_step == 2 << 20
    assert parse_config([]).data.tokens_per_step == 64 << 10
    assert parse_config(["--max-seq", "4K"]).data.tokens_per_step == 64 << 10
    assert args.planning.activation_checkpointing is None
    tiny = model_preset("tiny")
    assert checkpointing_needed(args, spec=tiny, world=2, per_node=2, device=cpu)
    assert not checkpointing_needed(
        parse_config(["--max-seq", "64K"]), spec=tiny, world=2, per_node=2, device=cpu
    )
    args = args.resolved(planning={"activation_checkpointing": True})
    pricing = build_pricing(args, spec=tiny, world=2, per_node=2, device=cpu)
    cost, sync, cap = pricing.settle(get_strategy("hdp"), args.data.max_seq)
    assert sync in ("peer", "wave") and 2 * cap >= args.data.max_seq
    assert 2 * (cost.memory(cap, sync=sync) + cost.cluster.gpu.reserved_bytes) < host_memory_bytes()


def test_activation_checkpointing_flags():
    def checkpointing(argv):
        return parse_config(argv).planning.activation_checkpointing

    assert checkpointing(["--activation-checkpointing"]) is True
    assert checkpointing(["--no-activation-checkpointing"]) is False
    assert checkpointing(["--keep-attention"]) is True


def test_pretrain_help_lists_every_strategy(capsys):
    from hdp.planner import STRATEGIES

    with pytest.raises(SystemExit):
        parse_config(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    assert all(name in out for name in STRATEGIES) and "--allow-changed-setup" in out
    # Every flag with a default shows it.
    for default in ("train until this step (default: 20)", "data order (default: 0)"):
        assert default in out
    assert "peak learning rate (default: 0.0003)" in out


SIM = ["--workload", "wlb-128k", "--gpus", "8"]
BIG = "99999999999999999999"


@pytest.mark.parametrize(
    "fn, argv, message",
    [
        (sim_main, SIM + ["--max-seq", "0"], "argument --max-seq: must be >= 1, got '0'"),
        (sim_main, SIM + ["--tokens-per-step", "0"], "argument --tokens-per-step: must be >= 1"),
        (sim_main, SIM + ["--max-seq", "inf"], "argument --max-seq: invalid size 'inf'"),
        (sim_main, SIM + ["--capacity", "1e400"], "argument --capacity: invalid size '1e400'"),
        (sim_main, SIM + ["--capacity", "0"], "argument --capacity: must be >= 1, got '0'"),
        (sim_main, SIM + ["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (
            sim_main,
            SIM + ["--json", "{tmp}/f/x.json"],
            "argument --json: cannot create {tmp}/f/x.json: {tmp}/f is not a directory",
        ),
        (sim_main, SIM + ["--plot", "{tmp}"], "argument --plot: {tmp} is a directory"),
        (
            plan_main,
            ["--lengths", "l.txt", "--gpus", "8", "--out", "{tmp}/f/PLAN.json"],
            "argument --out: cannot create {tmp}/f/PLAN.json: {tmp}/f is not a directory",
        ),
        (
            plan_main,
            ["--lengths", "l.txt", "--gpus", "8", "--out", "p.json", "--max-seq", "0"],
            "argument --max-seq: must be >= 1, got '0'",
        ),
        (data_main, ["stats", "x.jsonl", "--vocab-size", "-1"], "--vocab-size: must be >= 1"),
        (data_main, ["stats", "x.jsonl", "--max-seq", "0"], "argument --max-seq: must be >= 1"),
        (data_main, ["stats", "x.jsonl", "--max-seq", "inf"], "argument --max-seq: invalid size"),
        (data_main, ["stats", "x.jsonl", "--model", "gpt-9"], "unknown model 'gpt-9'"),
        # Overflowing numbers: one line naming the flag and its range, never a numpy error.
        (sim_main, SIM[:-2] + ["--gpus", BIG], "argument --gpus: must be <= 1048576, got " + BIG),
        (sim_main, SIM + ["--gpus-per-node", BIG], "argument --gpus-per-node: must be <= 1048576"),
        (sim_main, SIM + ["--tokens-per-step", BIG], "--tokens-per-step: must be <= 64G tokens"),
        (sim_main, SIM + ["--max-seq", "1T"], "argument --max-seq: must be <= 64G tokens"),
        (sim_main, SIM + ["--seed", BIG], "argument --seed: must be <= 4294967295"),
        (sim_main, SIM + ["--steps", BIG], "argument --steps: must be <= 100000"),
        (
            plan_main,
            ["--lengths", "l.txt", "--gpus", "1e20", "--out", "p.json"],
            "argument --gpus: '1e20' is not an integer",
        ),
        (
            data_main,
            ["stats", "x.jsonl", "--vocab-size", BIG],
            "--vocab-size: must be <= 2147483648",
        ),
    ],
)
def test_planner_and_data_flags(tmp_path, capsys, fn, argv, message):
    (tmp_path / "f").write_text("a file where a folder is asked for")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert message.format(tmp=tmp_path) in _usage_error(fn, argv, capsys)


def test_plot_without_matplotlib_is_one_line_before_any_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    line = _usage_error(sim_main, SIM + ["--plot", str(tmp_path / "x.png")], capsys)
    assert "--plot needs matplotlib: pip install matplotlib" in line
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "path, message",
    [
        ("synthetic:wlb-128k:abc", "DOCUMENTS must be a whole number from 1 to 100,000,000"),
        ("synthetic:wlb-128k:-5", "DOCUMENTS must be a whole number from 1 to 100,000,000"),
        (
            "synthetic:wlb-128k:99999999999",
            "DOCUMENTS must be a whole number from 1 to 100,000,000, got '99999999999'",
        ),
        ("synthetic:nope", "unknown workload 'nope'"),
        ("synthetic:wlb-128k:5:6", "expected synthetic:WORKLOAD[:DOCUMENTS]"),
    ],
)
def test_bad_synthetic_sources_are_one_line(capsys, path, message):
    assert data_main(["stats", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"hdp-data: error: {path}: {message}" in err


@pytest.mark.parametrize("threads", ["0", "-2", "x", "99999999999", "1e20"])
def test_calibrate_threads(capsys, threads):
    from hdp.launch.calibrate import main as calibrate_main

    line = _usage_error(
        calibrate_main, ["measure", "--out", "p.json", "--threads", threads], capsys
    )
    assert "argument --threads: " in line


@pytest.mark.parametrize("sync", ["wave", "peer"])
def test_a_model_that_cannot_fit_suggests_only_what_would_change(sync):
    from hdp import GPU_PRESETS, MODEL_PRESETS, ClusterSpec
    from hdp.planner import PlanningError, StepPricing, get_strategy

    cluster = ClusterSpec(num_ranks=1, ranks_per_node=1, gpu=GPU_PRESETS["h100"])
    pricing = StepPricing.build(MODEL_PRESETS["llama-70b"], cluster, sync=sync)
    with pytest.raises(PlanningError, match="no room for activations") as err:
        pricing.settle(get_strategy("static"), 1024)
    assert ("--sync wave" in str(err.value)) == (sync != "wave")


def test_a_config_file_gives_flags_that_the_command_line_replaces(tmp_path):
    args = parse_config(["--config", str(ROOT / "examples" / "run.toml"), "--steps", "40"])
    assert args.model.name_or_config == "tiny"
    assert (args.data.workload, args.data.max_seq, args.data.tokens_per_step) == (
        "wlb-128k",
        4096,
        16384,
    )
    assert args.training.steps == 40 and args.checkpointing.save_every == 10
    assert args.planning.activation_checkpointing is False
    (tmp_path / "data.toml").write_text('data = ["a.jsonl", "b.jsonl"]\ntruncate = true\n')
    args = parse_config(["--config", str(tmp_path / "data.toml"), "--data-weights", "1,2"])
    assert args.data.paths == ("a.jsonl", "b.jsonl") and args.data.truncate is True
    assert args.data.weights == (1.0, 2.0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("stepz = 3\n", "run.toml: stepz is not a flag of pretrain.py"),
        ("[training]\nlr = -1\n", "argument --lr: must be > 0, got -1"),
        ("[training]\nsteps = true\n", "run.toml: [training] steps must be a number or a string"),
        ("truncate = 1\n", "run.toml: truncate must be true or false, got 1"),
        ("steps = [1, 2]\n", "run.toml: steps takes one value, got a list"),
        ("[a]\n[a.b]\nsteps = 1\n", "run.toml: [a.b]: tables nest one level deep"),
        ("steps = \n", "run.toml: not TOML"),
    ],
)
def test_a_bad_config_file_is_one_line(tmp_path, capsys, text, message):
    (tmp_path / "run.toml").write_text(text)
    assert message in _usage_error(parse_config, ["--config", str(tmp_path / "run.toml")], capsys)


def test_a_step_past_the_hosts_memory_is_one_line_before_any_work(capsys):
    """--tokens-per-step 64G on one rank: 1.5 TB of token ids, labels and positions; it ran
    minutes into a MemoryError."""
    import torch

    import hdp.launch.train as lt

    config = parse_config(["--model", "tiny", "--tokens-per-step", "64G", "--max-seq", "1K"])
    assert lt.train(config, rank=0, world=1, per_node=1, device=torch.device("cpu")) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("pretrain.py: error: --tokens-per-step 64G on 1 rank: the node's")
    assert "lower --tokens-per-step or add ranks" in lines[-1]
