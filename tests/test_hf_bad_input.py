"""Bad Hugging Face checkpoints and exports: one line naming the file and the tensor or field, exit
status 2, nothing trained and nothing overwritten."""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hdp.launch.cli import parse_config
from hdp.testing.hf_models import run_export, train_in_process, write_checkpoint, write_corpus
from hdp.testing.ranks import patient

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_checkpoint("llama", tmp_path_factory.mktemp("good") / "llama")


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "ck"))


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _rewrite(directory: Path, edit) -> None:
    """Apply ``edit`` to the tensors of ``model.safetensors`` and write them back."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


Q = "model.layers.0.self_attn.q_proj.weight"


def _rewrite_header(directory: Path, edit) -> None:
    """Apply ``edit`` to the JSON header of ``model.safetensors`` (the data stays)."""
    path = directory / "model.safetensors"
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    edited = edit(header)
    header = header if edited is None else edited
    text = json.dumps(header).encode()
    text += b" " * (size - len(text)) if len(text) <= size else b""
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])


def _replace(path: Path, make) -> None:
    """``path`` replaced by what ``make(path)`` creates (a FIFO, a directory)."""
    path.unlink(missing_ok=True)
    make(path)


def _index(directory: Path, edit) -> None:
    """An index beside ``model.safetensors`` whose weight_map is ``edit`` of the true one."""
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "pt") as f:
        names = list(f.keys())
    weight_map = edit(dict.fromkeys(names, "model.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda d: (d / "config.json").unlink(), "config.json: no such file"),
        (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors or"),
        (
            lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
            "holds PyTorch .bin weights",
        ),
        (lambda d: _rewrite(d, lambda t: t.pop(Q)), f"lacks tensor {Q}, which the model needs"),
        (
            lambda d: _rewrite(d, lambda t: t.update(extra=torch.zeros(2))),
            "model.safetensors: unexpected tensor extra",
        ),
        (
            lambda d: _rewrite(d, lambda t: t.update({Q: torch.zeros(64, 32)})),
            f"model.safetensors: tensor {Q} has shape [64, 32], but config.json makes it [64, 64]",
        ),
        (
            lambda d: _rewrite(d, lambda t: t.update({Q: t[Q].to(torch.int64)})),
            f"model.safetensors: tensor {Q} has dtype I64; weights must be floating point",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes(
                (d / "model.safetensors").read_bytes()[:-100]
            ),
            "(truncated?)",
        ),
        (lambda d: (d / "model.safetensors").write_bytes(b"12345"), "not a safetensors file"),
        (lambda d: _rewrite_header(d, lambda h: []), "its header is not a JSON object"),
        (
            lambda d: _rewrite_header(d, lambda h: h[Q].update(data_offsets=[-8, 0])),
            f"tensor {Q}: malformed header entry",
        ),
        (
            lambda d: _rewrite_header(d, lambda h: h[Q].update(shape=["64", 64])),
            f"tensor {Q}: malformed header entry",
        ),
        (
            lambda d: _rewrite_header(
                d, lambda h: h[Q].update(data_offsets=h["model.norm.weight"]["data_offsets"])
            ),
            "overlap",
        ),
        (lambda d: _replace(d / "model.safetensors", os.mkfifo), "is not a regular file"),
        (lambda d: _replace(d / "model.safetensors", Path.mkdir), "is not a regular file"),
        (lambda d: _replace(d / "config.json", os.mkfifo), "config.json: not a regular file"),
        (lambda d: _index(d, lambda m: dict.fromkeys(m, 7)), "in 7, not a file name"),
        (lambda d: _index(d, lambda m: dict.fromkeys(m, "/etc/passwd")), "'/etc/passwd', not a"),
        (lambda d: _index(d, lambda m: dict.fromkeys(m, ".")), "in '.', not a file name"),
        (
            lambda d: _replace(d / "model.safetensors.index.json", Path.mkdir),
            "the index is not a regular file",
        ),
        (
            lambda d: (d / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {Q: "model-00002-of-00002.safetensors"}})
            ),
            "lists model-00002-of-00002.safetensors, which is not in",
        ),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps({**json.loads((d / "config.json").read_text()), "model_type": "mixtral"})
            ),
            "config.json: model_type 'mixtral' is not supported",
        ),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps({**json.loads((d / "config.json").read_text()), "num_hidden_layers": 3})
            ),
            "lacks tensor model.layers.2.input_layernorm.weight",
        ),
    ],
)
def test_a_bad_checkpoint_is_one_line_naming_file_and_tensor(
    good, tmp_path, capsys, damage, expected
):
    ck = _copy(good, tmp_path)
    damage(ck)
    line = _error(["--init-from", str(ck)], capsys)
    assert line.startswith("pretrain.py: error: "), line
    assert expected in line, line
    assert str(ck) in line, line


def test_init_from_flags_that_do_not_fit_are_refused(good, tmp_path, capsys):
    line = _error(["--init-from", str(good), "--model", "llama-7b"], capsys)
    assert "--model llama-7b is not the model of --init-from" in line
    assert "layers: 32 -> 2" in line
    assert "--init-from" in _error(["--init-from", str(tmp_path / "absent")], capsys)
    line = _error(["--init-from", str(good), "--rope-scaling", '{"rope_type": "dynamic"}'], capsys)
    assert "argument --rope-scaling: rope_type 'dynamic' is not supported" in line
    line = _error(["--init-from", str(good), "--model", "llama3-8b"], capsys)
    assert "is not the model of --init-from" in line and "--rope-theta" in line
    assert "not JSON" in _error(["--rope-scaling", "{yarn"], capsys)
    assert "argument --rope-theta" in _error(["--rope-theta", "-5"], capsys)
    line = _error(["--init-from", str(good), "--rope-scaling", '{"rope_type": "yarn"}'], capsys)
    assert "rope_type 'yarn' needs 'factor'" in line
    # the same shape by its config.json is allowed, and sets nothing new
    parse_config(["--init-from", str(good), "--model", str(good / "config.json")])


def test_a_bad_checkpoint_trains_nothing(good, tmp_path):
    """Through torchrun's entry point: exit status 2 and no metrics row, no checkpoint."""
    ck = _copy(good, tmp_path)
    _rewrite(ck, lambda t: t.pop(Q))
    write_corpus(tmp_path / "c.jsonl")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "pretrain.py"),
            "--init-from",
            str(ck),
            "--data",
            str(tmp_path / "c.jsonl"),
            "--metrics",
            str(tmp_path / "m.jsonl"),
            "--checkpoint-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=patient(300),
    )
    assert done.returncode == 2
    assert f"lacks tensor {Q}" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "out").exists()


def _tiny(tmp_path: Path, *extra: str) -> list[list[int]]:
    """Training of the ``tiny`` preset on the test corpus, one whole-corpus step per step."""
    docs = write_corpus(tmp_path / "c.jsonl")
    argv = ["--model", "tiny", "--data", str(tmp_path / "c.jsonl"), "--max-seq", "128"]
    train_in_process([*argv, "--tokens-per-step", "608", *extra])
    return docs


def test_export_refuses_what_it_cannot_write(tmp_path):
    """A target that holds files, a folder without checkpoints, a missing or damaged step: one
    line, exit 2, the target untouched."""
    ck, x = str(tmp_path / "ck"), str(tmp_path / "x")
    _tiny(tmp_path, "--steps", "1", "--checkpoint-dir", ck)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    cases = [
        (["--checkpoint-dir", ck, "--out", str(busy)], "exists and is not an empty directory"),
        (["--checkpoint-dir", str(tmp_path / "c.jsonl"), "--out", x], "is not a directory"),
        (["--checkpoint-dir", str(busy), "--out", x], "holds no step_* checkpoint"),
        (["--checkpoint-dir", ck, "--step", "7", "--out", x], "--step 7: no step_00000007"),
        (["--checkpoint-dir", ck, "--dtype", "int8", "--out", x], "unknown dtype 'int8'"),
        (["--checkpoint-dir", ck, "--max-shard-size", "5XB", "--out", x], "'5XB' is not a size"),
        (["--checkpoint-dir", ck, "--out", f"{ck}/step_00000009"], "lies inside --checkpoint-dir"),
        (["--checkpoint-dir", ck, "--out", str(tmp_path / "c.jsonl" / "x")], "cannot create"),
    ]
    for argv, expected in cases:
        done = run_export(argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert expected in done.stderr.strip().splitlines()[-1], (argv, done.stderr)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    # A config that has no place for some of the weights: refused, not a partial export.
    step = tmp_path / "ck" / "step_00000001"
    config = json.loads((step / "hf" / "config.json").read_text())
    (step / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / "hf" / "config.json").read_bytes()
    manifest["files"]["hf/config.json"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (step / "manifest.json").write_text(json.dumps(manifest))
    done = run_export(["--checkpoint-dir", ck, "--out", x])
    assert done.returncode == 2, done.stderr
    assert "holds model.layers.1." in done.stderr and "no place for" in done.stderr
    shard = next((tmp_path / "ck" / "step_00000001").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    done = run_export(["--checkpoint-dir", ck, "--step", "1", "--out", x])
    assert done.returncode == 2 and "is damaged" in done.stderr, done.stderr
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.partial-*"))


def test_a_model_trained_from_a_preset_exports_as_its_architecture(tmp_path):
    """From scratch (``--model tiny``, one process): the export's config is built from the preset
    and transformers computes the loss hdp trains on next."""
    import transformers

    from hdp.testing.hf_models import reference

    ck, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    run = ["--steps", "2", "--save-every", "1", "--lr", "1e-2", "--checkpoint-dir", ck]
    docs = _tiny(tmp_path, *run, "--metrics", str(metrics))
    step2 = json.loads(metrics.read_text().splitlines()[1])
    # A checkpoint saved before checkpoints carried hf/: the config comes from the preset named
    # in its fingerprint.
    old = Path(shutil.copytree(tmp_path / "ck", tmp_path / "old"))
    shutil.rmtree(old / "step_00000001" / "hf")
    manifest = json.loads((old / "step_00000001" / "manifest.json").read_text())
    manifest["files"] = {n: v for n, v in manifest["files"].items() if not n.startswith("hf/")}
    (old / "step_00000001" / "manifest.json").write_text(json.dumps(manifest))
    for folder in (ck, str(old)):
        out = tmp_path / f"hf-{Path(folder).name}"
        done = run_export(
            ["--checkpoint-dir", folder, "--step", "1", "--dtype", "fp32", "--out", str(out)]
        )
        assert done.returncode == 0, done.stderr
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["max_position_embeddings"] == 128
        _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info.values()), info
        expected = reference(out, docs)
        assert abs(step2["loss"] - expected) <= 1e-5 * expected, (step2["loss"], expected)
