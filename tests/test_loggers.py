"""Every metrics field reaches TensorBoard and Weights & Biases as a scalar; both are optional and
their absence is one line at start."""

import importlib.machinery
import json
import math
import sys
import types

import pytest
import torch

from hdp.launch import loggers
from hdp.launch.cli import parse_config
from hdp.launch.train import train

RUN = ["--model", "tiny", "--tokens-per-step", "2K", "--max-seq", "1K", "--steps", "2"]


def run(argv, tmp_path) -> list[dict]:
    metrics = tmp_path / "m.jsonl"
    args = parse_config(RUN + ["--metrics", str(metrics)] + argv)
    assert train(args, rank=0, world=1, per_node=1, device=torch.device("cpu")) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_scalars_are_the_numbers_with_one_per_rank():
    record = {"step": 3, "loss": 2.5, "busy_s": [1.0, 2.0], "kv_exchange": "rank"}
    record |= {"update_skipped": False, "nic": float("nan"), "waves": 2}
    assert loggers.scalars(record) == {
        "loss": 2.5,
        "busy_s/rank0": 1.0,
        "busy_s/rank1": 2.0,
        "waves": 2.0,
    }


def test_tensorboard_holds_every_step_of_every_field(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = run(["--tensorboard", str(tmp_path / "tb")], tmp_path)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(loggers.scalars(rows[0])) <= tags and "peak_mem_bytes/rank0" in tags
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [1, 2]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)


def test_wandb_gets_every_step_when_installed(tmp_path, monkeypatch):
    logged, runs = [], []

    class Run:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            runs.append("finished")

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # installed, as far as
    fake.init = lambda **kw: runs.append(kw) or Run()  # importlib can tell
    monkeypatch.setitem(sys.modules, "wandb", fake)
    rows = run(["--wandb", "long-context"], tmp_path)
    assert runs[0]["project"] == "long-context" and "model" in runs[0]["config"]
    assert [s for s, _ in logged] == [1, 2] and runs[-1] == "finished"
    assert all(math.isclose(v["loss"], r["loss"]) for (_, v), r in zip(logged, rows))


@pytest.mark.parametrize("flag, value", [("--wandb", "p"), ("--tensorboard", "tb")])
def test_a_logger_without_its_package_is_one_line(monkeypatch, capsys, flag, value):
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as e:
        parse_config([flag, value])
    assert e.value.code == 2
    package = flag.removeprefix("--")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"pretrain.py: error: {flag} needs the {package} package: pip install {package}"


@pytest.mark.parametrize(
    "text, line",
    [
        ('{"input_ids": [1, 2, 3]}\n', 1),  # a corpus copy
        ("notes about the run\n", 1),
        ('{"step": 1, "loss": 6.2}\n{"step": "2", "loss": 6.1}\n', 2),  # not an integer step
        ('{"step": 1, "loss": 6.2}\nsomething else\n{"step": 2, "loss": 6.1}\n', 2),
    ],
)
def test_a_metrics_file_that_is_not_a_metrics_log_is_refused_untouched(tmp_path, text, line):
    from hdp.launch.cli import parse_config

    path = tmp_path / "m.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit) as stop:
        parse_config(["--metrics", str(path)])
    assert stop.value.code == 2
    assert path.read_text() == text


def test_a_metrics_log_cut_short_by_a_kill_is_continued(tmp_path):
    from hdp.launch.cli import parse_config
    from hdp.launch.resume import check_metrics_file

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 6.2}\n\n{"step": 2, "loss": 6.1}\n{"step": 3, "lo')
    check_metrics_file(path)
    assert parse_config(["--metrics", str(path)]).output.metrics == path
    with pytest.raises(ValueError, match=f"--metrics {path}: line 1 is not an hdp metrics row"):
        path.write_text('{"note": 1}\n{"step": 2, "loss": 6.1}\n')
        check_metrics_file(path)
