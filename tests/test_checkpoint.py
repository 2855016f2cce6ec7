"""Checkpoint integrity, in one process: every damaged newest checkpoint falls back to the newest
valid one with a warning naming the damage; nothing valid is overwritten or ignored; resume refuses
a changed setup, a --steps it has passed, and a folder it cannot read."""

import hashlib
import json
import os

import pytest
import torch

from hdp.launch import checkpoint
from hdp.launch.checkpoint import CheckpointError
from hdp.launch.config import CheckpointingConfig
from hdp.launch.resume import check_setup, find_resume, open_metrics

# DCP's note that it saves and loads in one process, as these tests mean it to.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt, sched


SETUP = {"model": {"model": "tiny"}, "data": {"seed": 0}, "planning": {"strategy": "hdp"}}


def _save(folder, step, setup=SETUP):
    model, opt, sched = _parts()
    state = {"data": {"step": step}, "accounting": {"trained_tokens": 100 * step}}
    return checkpoint.save(folder, step, model, opt, sched, {**state, "fingerprint": setup})


@pytest.fixture
def ck(tmp_path):
    """A folder with valid checkpoints after steps 2 and 4."""
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    return tmp_path


def test_save_writes_a_manifest_of_every_file(ck):
    path = ck / "step_00000004"
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = sorted(n for n in os.listdir(path) if n != "manifest.json")
    assert sorted(manifest["files"]) == on_disk and "train_state.json" in on_disk
    assert any(n.endswith(".distcp") for n in on_disk) and ".metadata" in on_disk
    for name, entry in manifest["files"].items():
        assert entry["size"] == (path / name).stat().st_size
    assert (ck / "latest").read_text() == "step_00000004\n"
    found = checkpoint.select(ck)
    assert found.path == path and found.warnings == []


def _shard(path):
    return next(n for n in os.listdir(path) if n.endswith(".distcp"))


def _flip_a_byte(path):
    f = path / _shard(path)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {
    "no train_state.json": (lambda p: (p / "train_state.json").unlink(), "train_state.json is"),
    "no .metadata": (lambda p: (p / ".metadata").unlink(), "file .metadata is missing"),
    "no shard": (lambda p: (p / _shard(p)).unlink(), ".distcp is missing"),
    "truncated shard": (
        lambda p: os.truncate(p / _shard(p), 100),
        "the manifest says",
    ),
    "flipped byte": (_flip_a_byte, "does not match its checksum"),
    "save killed before the manifest": (
        lambda p: (p / "manifest.json").unlink(),
        "no manifest.json: its save did not finish",
    ),
    "garbage manifest": (
        lambda p: (p / "manifest.json").write_text("{nope"),
        "manifest.json is not a manifest",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(ck, case):
    damage, problem = DAMAGE[case]
    damage(ck / "step_00000004")
    found = checkpoint.select(ck)
    assert found.path == ck / "step_00000002"
    assert len(found.warnings) == 2  # the damaged step, and 'latest' naming it
    assert "step_00000004" in found.warnings[0] and problem in found.warnings[0]
    assert "newest valid checkpoint is step_00000002" in found.warnings[1]


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"garbage\n", "holds 'garbage', not a step_NNNNNNNN name"),
        (b"\xff\xfe\x00junk", "latest is not text"),
        (b"step_00000009\n", "names step_00000009, but the newest valid checkpoint is"),
        (b"step_00000002\n", "names step_00000002, but the newest valid checkpoint is"),
    ],
)
def test_a_bad_latest_is_named_and_the_newest_valid_checkpoint_used(ck, content, problem):
    (ck / "latest").write_bytes(content)
    found = checkpoint.select(ck)
    assert found.path == ck / "step_00000004"  # never an older one: that would redo steps
    assert len(found.warnings) == 1 and problem in found.warnings[0]


def test_only_unfinished_saves_start_from_step_0_with_a_warning_each(ck):
    # What a kill -9 during a job's first save leaves: an auto-requeued job must start again.
    for step in (2, 4):
        (ck / f"step_{step:08d}" / "manifest.json").unlink()
    found = checkpoint.select(ck)
    assert found.path is None
    assert [w.split(": ", 1)[1] for w in found.warnings[:2]] == [
        f"skipped the unfinished checkpoint {ck}/step_0000000{s}: no manifest.json: its save "
        "did not finish"
        for s in (4, 2)
    ]


def test_a_finished_damaged_checkpoint_with_nothing_valid_left_is_refused(ck):
    (ck / "step_00000004" / "manifest.json").unlink()  # unfinished
    _flip_a_byte(ck / "step_00000002")  # finished, then damaged: that loses work
    with pytest.raises(CheckpointError, match=r"no valid checkpoint in .*step_00000002: file .*"):
        checkpoint.select(ck)


def test_a_new_save_removes_an_unfinished_one_in_its_place(ck, capsys):
    (ck / "step_00000004" / "manifest.json").unlink()
    _save(ck, 4)
    assert "removed the unfinished save" in capsys.readouterr().out
    assert checkpoint.select(ck).path == ck / "step_00000004"
    assert not list(ck.glob("*.damaged*"))


@pytest.mark.parametrize(
    "error, reason",
    [
        (OSError(28, "No space left on device"), "no space left on device"),
        # What torch.save raises when the disk fills under it.
        (
            RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed\nat"),
            "a write was cut short, as on a full disk (torch's writer: PytorchStreamWriter "
            "failed writing file data/0: file write failed)",
        ),
        (
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
            "a write was cut short, as on a full disk (torch's writer: [enforce fail at "
            "inline_container.cc:672] . unexpected pos 704 vs 598)",
        ),
    ],
)
def test_a_failed_write_is_one_line_and_leaves_no_partial_directory(ck, monkeypatch, error, reason):
    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointError) as caught:
        _save(ck, 6)
    assert str(caught.value) == f"cannot save step 6 to {ck}: {reason}"
    assert not (ck / "step_00000006").exists()
    assert checkpoint.select(ck).path == ck / "step_00000004"


def test_a_save_warns_when_the_disk_has_less_room_than_the_last_checkpoint(ck, monkeypatch, capsys):
    usage = checkpoint.shutil.disk_usage(ck)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    _save(ck, 6)
    out = capsys.readouterr().out
    assert f"warning: 0.0 MiB free in {ck}, and step_00000004 took" in out
    assert "this save may fail" in out


def test_an_empty_or_missing_folder_has_no_checkpoint(tmp_path):
    assert checkpoint.select(tmp_path).path is None
    assert checkpoint.select(tmp_path / "new").path is None


def test_an_unreadable_folder_is_refused(tmp_path, monkeypatch):
    # Tests run as root, where chmod cannot make a folder unreadable: the listing fails instead.
    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint.os, "listdir", denied)
    with pytest.raises(CheckpointError, match="cannot read --checkpoint-dir .*: Permission denied"):
        checkpoint.select(tmp_path)


def test_saving_never_writes_over_a_valid_checkpoint(ck):
    before = (ck / "step_00000004" / "manifest.json").read_bytes()
    with pytest.raises(CheckpointError, match="is a valid checkpoint; hdp never writes over one"):
        _save(ck, 4)
    assert (ck / "step_00000004" / "manifest.json").read_bytes() == before


def test_saving_over_a_damaged_checkpoint_keeps_it_aside(ck, capsys):
    (ck / "step_00000004" / _shard(ck / "step_00000004")).unlink()
    _save(ck, 4)
    assert checkpoint.select(ck).path == ck / "step_00000004"
    assert (ck / "step_00000004.damaged" / "train_state.json").exists()
    # Only a checksum wrong: the warning names it.
    shard = ck / "step_00000004" / _shard(ck / "step_00000004")
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    capsys.readouterr()
    _save(ck, 4)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "step_00000004.damaged2 (file" in line and "does not match its checksum" in line, line


def _args(ck, steps=10, **kw):
    """(the checkpointing section of ``--checkpoint-dir ck --resume``, with ``kw``), ``steps``."""
    base = dict(dir=ck, save_every=0, resume=True, resume_step=None, allow_changed_setup=False)
    return CheckpointingConfig(**{**base, **kw}), steps


def test_find_resume_continues_the_accounting(ck):
    lines = []
    res = find_resume(*_args(ck), SETUP, lines.append)
    assert res.step == 4 and res.trained_tokens == 400 and res.data_state == {"step": 4}
    assert lines == []


def test_a_fresh_run_refuses_a_folder_with_checkpoints(ck):
    with pytest.raises(CheckpointError, match="already holds checkpoints .*pass --resume"):
        find_resume(*_args(ck, resume=False), SETUP, print)


@pytest.mark.parametrize("steps", [3, 4])
def test_steps_at_or_below_the_resumed_step_is_an_error(ck, steps):
    with pytest.raises(CheckpointError, match=f"--steps {steps} is not above step 4"):
        find_resume(*_args(ck, steps=steps), SETUP, print)


def test_a_changed_setup_is_refused_unless_allowed(ck):
    data = {**SETUP, "data": {"seed": 1}}
    with pytest.raises(CheckpointError, match=r"data.seed: 0 -> 1\): restore it, or pass --allow"):
        find_resume(*_args(ck), data, print)
    lines = []
    res = find_resume(*_args(ck, allow_changed_setup=True), data, lines.append)
    assert res.step == 4 and res.data_state is None and "data position starts afresh" in lines[0]
    planning = {**SETUP, "planning": {"strategy": "static"}}
    with pytest.raises(CheckpointError, match="planning.strategy: 'hdp' -> 'static'"):
        find_resume(*_args(ck), planning, print)
    res = find_resume(*_args(ck, allow_changed_setup=True), planning, print)
    assert res.data_state == {"step": 4}  # the data did not change: its position is kept
    model = {**SETUP, "model": {"model": "llama-1b"}}
    with pytest.raises(CheckpointError, match="holds another model"):
        check_setup(SETUP, model, allow=True, where=ck)


def test_a_changed_optimizer_is_refused_unless_allowed(ck):
    saved = {**SETUP, "optimizer": {"lr": 3e-4, "warmup": 10}}
    _save(ck, 6, saved)
    now = {**SETUP, "optimizer": {"lr": 1e-4, "warmup": 10}}
    with pytest.raises(CheckpointError, match=r"optimizer.lr: 0.0003 -> 0.0001\): restore it"):
        find_resume(*_args(ck), now, print)
    res = find_resume(*_args(ck, allow_changed_setup=True), now, print)
    assert res.step == 6 and res.data_state == {"step": 6}
    # The checkpoints of steps 2 and 4 predate the optimizer section: it is not compared.
    os.rename(ck / "step_00000006", ck.parent / "kept_step_6")
    assert find_resume(*_args(ck), now, print).step == 4


def test_resume_step_picks_that_checkpoint_when_nothing_newer_is_valid(ck):
    with pytest.raises(CheckpointError, match=r"holds newer checkpoints \(step_00000004\) that"):
        find_resume(*_args(ck, resume_step=2), SETUP, print)
    os.rename(ck / "step_00000004", ck.parent / "kept_step_4")
    res = find_resume(*_args(ck, resume_step=2), SETUP, print)
    assert res.step == 2 and res.path == ck / "step_00000002"


def test_resume_step_refuses_a_missing_or_damaged_one_without_falling_back(ck):
    with pytest.raises(CheckpointError, match=r"no step_00000003 in .*step_00000004, step_000"):
        find_resume(*_args(ck, resume_step=3), SETUP, print)
    _flip_a_byte(ck / "step_00000004")
    with pytest.raises(CheckpointError, match="step_00000004 is damaged .*checksum"):
        find_resume(*_args(ck, resume_step=4), SETUP, print)
    # A damaged newer checkpoint is no obstacle: saving moves it aside.
    assert find_resume(*_args(ck, resume_step=2), SETUP, print).step == 2


def test_metrics_rows_of_redone_steps_are_replaced(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    path.parent.mkdir()
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4, 5)]
    path.write_text("\n".join(rows) + '\n{"step": 6, "lo')  # the last row cut by a kill
    lines = []
    with open_metrics(path, 3, lines.append) as f:
        f.write(json.dumps({"step": 4}) + "\n")
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert "replaced 3 rows of steps after 3" in lines[0]
    with open_metrics(tmp_path / "new" / "m.jsonl", 0, lines.append):
        pass  # a missing folder is created
    assert (tmp_path / "new" / "m.jsonl").exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(step=7), "'step' is 7 but the directory holds step 4"),
        (lambda m: m.update(step="4"), "'step' must be an integer >= 1, got '4'"),
        (lambda m: m.pop("data"), "'data' \\(the data position\\) is missing"),
        (lambda m: m["accounting"].update(trained_tokens=-5), "'accounting.trained_tokens' must"),
        (lambda m: m.update(schedule={"warmup": "10", "decay_steps": 20}), "'schedule' must hold"),
    ],
)
def test_an_edited_state_is_one_line_naming_its_field(ck, edit, message):
    """Checkpoints are trusted input, but one edited by hand (its manifest too) is refused with
    the field named, never resumed wrong or ended by a traceback."""
    path = ck / "step_00000004"
    meta = json.loads((path / checkpoint.STATE).read_text())
    edit(meta)
    (path / checkpoint.STATE).write_text(json.dumps(meta))
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    entry = manifest["files"][checkpoint.STATE]
    entry["size"] = (path / checkpoint.STATE).stat().st_size
    entry["sha256"] = hashlib.sha256((path / checkpoint.STATE).read_bytes()).hexdigest()
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    flags = CheckpointingConfig(dir=ck, resume=True)
    with pytest.raises(CheckpointError, match=f"train_state.json: {message}"):
        find_resume(flags, 10, SETUP, print)
