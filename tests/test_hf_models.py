"""Hugging Face models in and out: ``--init-from`` training on 1, 2 and 4 gloo ranks computes
transformers' loss and gradients; ``hdp-export`` round-trips; RoPE frequencies equal
transformers'. The reference is always transformers itself, on checkpoints it wrote."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hdp.testing.hf_models import (
    CAPACITY,
    STEP,
    first_steps,
    hf_name_of,
    reference,
    run_export,
    train_in_process,
    write_checkpoint,
    write_checkpoints,
    write_corpus,
    write_tokenizer,
)
from hdp.testing.ranks import patient, run_ranks

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One checkpoint per architecture (:func:`hf_models.write_checkpoints`) and the corpus."""
    root = tmp_path_factory.mktemp("hf")
    dirs = write_checkpoints(root)
    docs = write_corpus(root / "corpus.jsonl")
    return dirs, root / "corpus.jsonl", docs


@pytest.mark.parametrize("world", [1, 2, 4])
def test_init_from_computes_transformers_loss_and_gradients(models, tmp_path, world):
    """Step 1 of every architecture, on ``world`` ranks under plans that split documents: the
    loss within 1e-5 and every gradient within 1e-4 (relative) of transformers' on the same
    documents."""
    dirs, corpus, docs = models
    out = tmp_path / "results.pt"
    run_ranks(first_steps, world, dirs, corpus, CAPACITY[world], str(out))
    results = torch.load(out)
    for kind, directory in dirs.items():
        ref_loss, ref_grads = reference(directory, docs, grads=True)
        got = results[kind]
        assert got["split"] == world, (kind, got["split"])  # a document over every rank
        assert abs(got["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (kind, got["loss"], ref_loss)
        assert {hf_name_of(n) for n in got["grads"]} == set(ref_grads), kind
        for name, grad in got["grads"].items():
            ref = ref_grads[hf_name_of(name)].float()
            err = (grad - ref).norm() / ref.norm()
            assert err <= 1e-4, (kind, name, float(err))


def test_a_wrong_rope_would_be_caught(models, tmp_path):
    """The checkpoints are sensitive: transformers' own loss moves by far more than the tests'
    tolerance when only RoPE's theta changes."""
    dirs, _, docs = models
    right = reference(dirs["llama"], docs)
    wrong = reference(
        dirs["llama"], docs, rope_parameters={**_rope(dirs["llama"]), "rope_theta": 1e4}
    )
    assert abs(right - wrong) > 1e-3 * abs(right)


def _rope(directory: Path) -> dict:
    import transformers

    return dict(transformers.AutoConfig.from_pretrained(directory).rope_parameters)


def _torchrun(argv: list[str], tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(ROOT / "launch" / "pretrain.py"), *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=patient(600),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)


@pytest.mark.parametrize(
    "kind, rope_flags, rope_check",
    [
        # 4.x spelling kept; the new theta written, the llama3 scaling kept.
        (
            "llama",
            ["--rope-theta", "2e6"],
            lambda c: c["rope_theta"] == 2e6 and c["rope_scaling"]["rope_type"] == "llama3",
        ),
        # 5.x spelling kept; tied embeddings; the yarn scaling replaced.
        (
            "qwen2",
            [
                "--rope-scaling",
                '{"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 32}',
            ],
            lambda c: (
                c["rope_parameters"]["factor"] == 2
                and c["rope_parameters"]["original_max_position_embeddings"] == 32
            ),
        ),
    ],
)
def test_export_round_trip(tmp_path, kind, rope_flags, rope_check):
    """``--init-from`` -> 3 steps on 2 ranks with a checkpoint at step 2 -> ``hdp-export`` of
    step 2 -> transformers loads it without a missing or unexpected weight, its loss on step 3's
    documents equals hdp's step-3 loss, its config keeps the source's shape and tying and carries
    the run's RoPE; the tokenizer files travel along."""
    import transformers

    source = write_checkpoint(kind, tmp_path / "source")
    write_tokenizer(source)
    docs = write_corpus(tmp_path / "corpus.jsonl")
    _torchrun(
        [
            *("--init-from", str(source), "--data", str(tmp_path / "corpus.jsonl"), *STEP),
            *("--steps", "3", "--save-every", "2", "--checkpoint-dir", str(tmp_path / "ck")),
            *("--metrics", str(tmp_path / "m.jsonl"), "--capacity", "64", "--lr", "1e-2"),
            *("--warmup", "1", *rope_flags),
        ],
        tmp_path,
    )
    out = tmp_path / "export"
    done = run_export(
        [
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--step",
            "2",
            "--out",
            str(out),
            "--dtype",
            "fp32",
            "--max-shard-size",
            "40KB",
        ]
    )
    assert done.returncode == 0, done.stderr
    assert (out / "model.safetensors.index.json").exists()  # sharded at 40KB
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    transformers.AutoTokenizer.from_pretrained(out)

    exported, src = (json.loads((d / "config.json").read_text()) for d in (out, source))
    assert {f: exported[f] for f in SHAPE_FIELDS} == {f: src[f] for f in SHAPE_FIELDS}
    assert rope_check(exported), exported
    transformers.logging.set_verbosity_warning()
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    step3 = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()][2]
    assert step3["step"] == 3
    expected = reference(out, docs)
    assert abs(step3["loss"] - expected) <= 1e-5 * abs(expected), (step3["loss"], expected)


def test_resuming_an_init_from_run_continues_it(models, tmp_path, capsys):
    """A resumed ``--init-from`` run takes its weights from its own checkpoint (the model is built
    on the meta device either way) and trains the losses of the uninterrupted run; a RoPE
    changed on resume is another model, refused."""
    dirs, corpus, _ = models
    base = ["--init-from", str(dirs["qwen2"]), "--data", str(corpus), *STEP]
    base += ["--lr", "1e-2", "--warmup", "1", "--lr-decay-steps", "3"]
    train_in_process([*base, "--steps", "3", "--metrics", str(tmp_path / "straight.jsonl")])
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "split.jsonl")]
    train_in_process([*base, *ck, "--steps", "1"])
    train_in_process([*base, *ck, "--steps", "3", "--resume"])
    straight, split = (
        [json.loads(x)["loss"] for x in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
        for n in ("straight", "split")
    )
    assert split == straight
    import hdp.launch.train as lt
    from hdp.launch.cli import parse_config

    args = parse_config([*base, *ck, "--steps", "4", "--resume", "--rope-theta", "2e6"])
    assert lt.train(args, rank=0, world=1, per_node=1, device=torch.device("cpu")) == 2
    assert (
        "holds another model (rope.rope_theta: 1000000.0 -> 2000000.0)" in capsys.readouterr().out
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_weights_load_in_pieces_converted_to_the_model_dtype(models, monkeypatch, dtype):
    """Every tensor as safetensors' own reader gives it, converted to the model's dtype, when the
    loader reads through its staging buffer in pieces of a few rows (and straight into the
    parameters where the dtypes agree)."""
    from safetensors.torch import load_file

    import hdp.launch.hf_weights as hw
    from hdp.launch.model import Llama

    dirs, _, _ = models
    monkeypatch.setattr(hw, "_READ_BYTES", 300)
    for kind in ("qwen3", "mistral"):  # bf16 in one file; fp32 in shards
        checkpoint = hw.open_checkpoint(dirs[kind])
        with torch.device("meta"):
            model = Llama(checkpoint.spec).to(dtype)
        model.materialize(torch.device("cpu"))
        checkpoint.load_into(model)
        stored = {}
        for file in sorted(dirs[kind].glob("*.safetensors")):
            stored.update(load_file(file))
        for name, p in model.named_parameters():
            assert torch.equal(p, stored[hf_name_of(name)].to(dtype)), (kind, name)


def test_a_tied_checkpoint_with_its_own_head_trains_as_transformers_loads_it(
    models, tmp_path, capsys
):
    """config.json ties the head, the weights file holds a different lm_head.weight: transformers
    5 keeps the two apart, and so does hdp (with one warning), so the loss is transformers'."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    dirs, corpus, docs = models
    ck = tmp_path / "qwen2"
    shutil.copytree(dirs["qwen2"], ck)
    weights = load_file(ck / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied as written by transformers
    head = torch.randn_like(weights["model.embed_tokens.weight"]) * 0.2
    save_file({**weights, "lm_head.weight": head}, ck / "model.safetensors", {"format": "pt"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(ck)
    assert torch.equal(theirs.lm_head.weight, head)  # transformers' own reading
    metrics = tmp_path / "m.jsonl"
    train_in_process(
        [
            "--init-from",
            str(ck),
            "--data",
            str(corpus),
            *STEP,
            "--steps",
            "1",
            "--metrics",
            str(metrics),
        ]
    )
    assert "training them apart, as transformers loads it" in capsys.readouterr().out
    loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    expected = reference(ck, docs)
    assert abs(loss - expected) <= 1e-5 * abs(expected), (loss, expected)
