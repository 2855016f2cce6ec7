"""A loss or gradient norm that is not finite never reaches the weights: ``--nan-policy stop``
ends the run there with one line naming the step and the first rank whose tokens gave it, and no
checkpoint of it; ``--nan-policy skip`` drops that update, counts it and trains on."""

import json
import math
from pathlib import Path

import pytest
import torch

import hdp.launch.train as lt
from hdp.launch.cli import parse_config
from hdp.testing.hf_models import VOCAB, train_in_process, write_checkpoint, write_corpus
from hdp.testing.ranks import run_ranks

# --lr 1e6 makes tiny's loss overflow within a few steps.
DIVERGE = ["--model", "tiny", "--tokens-per-step", "608", "--max-seq", "128", "--lr", "1e6"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("clip", ["1.0", "0"])
def test_a_non_finite_step_stops_the_run_without_its_checkpoint(tmp_path, capsys, clip):
    write_corpus(tmp_path / "c.jsonl")
    argv = [*DIVERGE, "--data", str(tmp_path / "c.jsonl"), "--steps", "12", "--grad-clip", clip]
    argv += ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "1"]
    argv += ["--metrics", str(tmp_path / "m.jsonl")]
    code = lt.train(parse_config(argv), rank=0, world=1, per_node=1, device=torch.device("cpu"))
    assert code == 3
    errors = [x for x in capsys.readouterr().out.splitlines() if x.startswith("pretrain.py")]
    assert len(errors) == 1, errors
    rows = _rows(tmp_path / "m.jsonl")
    last = rows[-1]
    assert last["update_skipped"] and not math.isfinite(last["loss"])
    assert f"non-finite loss {last['loss']} at step {last['step']} (first on rank 0)" in errors[0]
    assert all(not r["update_skipped"] for r in rows[:-1])
    saved = sorted(p.name for p in (tmp_path / "ck").glob("step_*"))
    assert saved == [f"step_{s:08d}" for s in range(1, last["step"])]


def test_skip_drops_non_finite_updates_and_counts_them(tmp_path):
    write_corpus(tmp_path / "c.jsonl")
    argv = [*DIVERGE, "--data", str(tmp_path / "c.jsonl"), "--steps", "8", "--nan-policy", "skip"]
    argv += ["--metrics", str(tmp_path / "m.jsonl")]
    kept = {}
    orig = lt.build_model

    def build_model(*a, **k):
        kept["model"] = orig(*a, **k)
        return kept["model"]

    lt.build_model = build_model
    try:
        train_in_process(argv)
    finally:
        lt.build_model = orig
    rows = _rows(tmp_path / "m.jsonl")
    skipped = [r["step"] for r in rows if r["update_skipped"]]
    assert skipped and rows[-1]["skipped_updates"] == len(skipped)
    assert all(torch.isfinite(p).all() for p in kept["model"].parameters())


def _nan_token_run(rank, world, ck, corpus, out):
    """Train one step on 2 ranks; rank 0 saves which ranks hold the document that starts with
    the token whose embedding is NaN."""
    orig_step = lt.train_step
    seen = {}

    def train_step(data, **kw):
        doc = next(i for i, ref in enumerate(data.seqs) if ref.doc == 3)
        seen["holders"] = sorted(
            r
            for r in range(data.plan.num_ranks)
            for w in range(data.plan.num_waves)
            if any(s.seq == doc for s in data.plan.shards(r, w))
        )
        return orig_step(data, **kw)

    lt.train_step = train_step
    argv = ["--init-from", ck, "--data", corpus, "--tokens-per-step", "608", "--max-seq", "128"]
    args = parse_config([*argv, "--capacity", "64", "--steps", "1"])
    assert lt.train(args, rank=rank, world=world, per_node=world, device=torch.device("cpu")) == 3
    if rank == 0:
        Path(out).write_text(json.dumps(seen["holders"]))


def test_the_first_rank_whose_tokens_are_not_finite_is_named(tmp_path, capfd):
    """A NaN embedding row for a token that only document 3 holds, as its first token: the rank
    named is the lowest of those holding document 3."""
    from safetensors.torch import load_file, save_file

    ck = write_checkpoint("llama", tmp_path / "ck")
    weights = load_file(ck / "model.safetensors")
    weights["model.embed_tokens.weight"][VOCAB - 1] = float("nan")
    save_file(weights, ck / "model.safetensors", metadata={"format": "pt"})
    docs = write_corpus(tmp_path / "c.jsonl")
    docs = [[t % (VOCAB - 1) for t in d] for d in docs]
    docs[3][0] = VOCAB - 1
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    out = tmp_path / "holders.json"
    run_ranks(_nan_token_run, 2, str(ck), str(tmp_path / "c.jsonl"), str(out))
    first = json.loads(out.read_text())[0]
    assert f"non-finite loss nan at step 1 (first on rank {first})" in capfd.readouterr().out


def _overflowing_update_at(step: int):
    """A ``build_optimizer`` whose optimizer, at ``step``, leaves one weight infinite after an
    otherwise normal update: an update that overflows although the loss and the gradients are
    finite (Note [Non-finite updates])."""
    orig = lt.build_optimizer

    def build_optimizer(args, *, model, schedule):
        optimizer, scheduler = orig(args, model=model, schedule=schedule)
        calls = {"n": 0}

        def overflow(opt, a, k):
            calls["n"] += 1
            if calls["n"] == step:
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = float("inf")

        optimizer.register_step_post_hook(overflow)
        return optimizer, scheduler

    return build_optimizer


def _load_weights(path: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    names = [k for k in meta if k.startswith("model.")]
    out = {k: torch.empty(tuple(meta[k].size)) for k in names}
    dcp.load(out, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return out


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_an_update_that_overflows_the_weights_never_reaches_a_checkpoint(
    tmp_path, capsys, monkeypatch, policy
):
    write_corpus(tmp_path / "c.jsonl")
    argv = ["--model", "tiny", "--tokens-per-step", "608", "--max-seq", "128", "--steps", "3"]
    argv += ["--data", str(tmp_path / "c.jsonl"), "--nan-policy", policy, "--save-every", "1"]
    argv += ["--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl")]
    monkeypatch.setattr(lt, "build_optimizer", _overflowing_update_at(2))
    code = lt.train(parse_config(argv), rank=0, world=1, per_node=1, device=torch.device("cpu"))
    saved = sorted(p.name for p in (tmp_path / "ck").glob("step_*"))
    rows = _rows(tmp_path / "m.jsonl")
    if policy == "stop":
        assert code == 3 and saved == ["step_00000001"]
        errors = [x for x in capsys.readouterr().out.splitlines() if x.startswith("pretrain.py")]
        assert len(errors) == 1 and "the update of step 2 made weights non-finite" in errors[0]
        return
    assert code == 0 and saved == [f"step_{s:08d}" for s in (1, 2, 3)]
    assert [r["update_skipped"] for r in rows] == [False, True, False]
    after1, after2 = (_load_weights(tmp_path / "ck" / s) for s in saved[:2])
    assert all(torch.equal(after1[k], after2[k]) for k in after1)  # put back as before step 2
    assert all(torch.isfinite(t).all() for t in _load_weights(tmp_path / "ck" / saved[2]).values())


def test_no_checkpoint_holds_a_non_finite_weight_and_export_refuses_one(tmp_path, monkeypatch):
    from hdp import model_preset
    from hdp.launch import checkpoint
    from hdp.launch.export import ExportError, export
    from hdp.launch.model import Llama

    model = Llama(model_preset("tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    with pytest.raises(checkpoint.CheckpointError, match="model.norm.weight holds a non-finite"):
        checkpoint.save(tmp_path / "ck", 1, model, optimizer, scheduler, {})
    assert not list((tmp_path / "ck").glob("step_*"))
    # A checkpoint written before this check existed (simulated): export refuses it.
    monkeypatch.setattr(checkpoint, "first_non_finite", lambda tensors: None)
    state = {"fingerprint": {"model": {"model": "tiny"}}}
    checkpoint.save(tmp_path / "ck", 1, model, optimizer, scheduler, state)
    monkeypatch.undo()
    with pytest.raises(ExportError, match="model.norm.weight holds non-finite values"):
        export(tmp_path / "ck", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_weight_decay_that_overflows_stops_before_any_checkpoint(tmp_path, capsys, monkeypatch):
    """An AdamW decoupled decay far past the flag's range (as --weight-decay 1e42 ran before it
    had one) overflows the weights in the first update, with a finite loss and gradient."""
    orig = lt.build_optimizer

    def build_optimizer(args, *, model, schedule):
        optimizer, scheduler = orig(args, model=model, schedule=schedule)
        for group in optimizer.param_groups:
            group["weight_decay"] = 1e45  # x lr 3e-4: each weight times -3e41
        return optimizer, scheduler

    monkeypatch.setattr(lt, "build_optimizer", build_optimizer)
    write_corpus(tmp_path / "c.jsonl")
    argv = ["--model", "tiny", "--tokens-per-step", "608", "--max-seq", "128", "--steps", "3"]
    argv += ["--data", str(tmp_path / "c.jsonl"), "--checkpoint-dir", str(tmp_path / "ck")]
    argv += ["--save-every", "1", "--metrics", str(tmp_path / "m.jsonl"), "--warmup", "0"]
    code = lt.train(parse_config(argv), rank=0, world=1, per_node=1, device=torch.device("cpu"))
    assert code == 3 and not list((tmp_path / "ck").glob("step_*"))
    row = _rows(tmp_path / "m.jsonl")[0]
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    assert "the update of step 1 made weights non-finite" in capsys.readouterr().out
