"""Hugging Face models in and out: ``--init-from`` training on 1, 2 and 4 gloo ranks computes
transformers' loss and gradients; ``hdp-export`` round-trips; RoPE frequencies equal
transformers'. The reference is always transformers itself, on checkpoints it wrote."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    CORPUS_TOKENS,
    KINDS,
    hf_name_of,
    reference,
    write_checkpoint,
    write_corpus,
)

ROOT = Path(__file__).resolve().parents[1]
# One global batch is the whole corpus, every step: the step's documents are known exactly.
STEP = ["--tokens-per-step", str(CORPUS_TOKENS), "--max-seq", "128", "--grad-clip", "0"]
# Per world size, a capacity that splits the longest documents across ranks.
CAPACITY = {1: None, 2: "64", 4: "32"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One checkpoint per architecture (the mistral one in shards with an index) and the corpus."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {
        kind: write_checkpoint(
            kind, root / kind, max_shard_size="40KB" if kind == "mistral" else None
        )
        for kind in KINDS
    }
    docs = write_corpus(root / "corpus.jsonl")
    return dirs, root / "corpus.jsonl", docs


def _train_kinds(rank, world, dirs, corpus, capacity, out):
    """Step 1 of ``--init-from`` training of every checkpoint: rank 0 saves the loss and the full
    gradients (taken just before the optimizer steps)."""
    import launch.train as lt
    from launch.pretrain import parse_args

    results = {}
    for kind, directory in dirs.items():
        argv = ["--init-from", str(directory), "--data", str(corpus), "--steps", "1", *STEP]
        argv += ["--metrics", f"{out}.{kind}.jsonl"]
        if capacity:
            argv += ["--capacity", capacity]
        grads = {}

        def build_optimizer(args, *, model, _grads=grads):
            optimizer, scheduler = orig(args, model=model)

            def keep(opt, a, k):
                for name, p in model.named_parameters():
                    g = p.grad
                    _grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()

            optimizer.register_step_pre_hook(keep)
            return optimizer, scheduler

        spans = []

        def train_step(data, _spans=spans, **kw):
            _spans.append(_widest_split(data.plan))
            return orig_step(data, **kw)

        orig, orig_step = lt.build_optimizer, lt.train_step
        lt.build_optimizer, lt.train_step = build_optimizer, train_step
        try:
            code = lt.train(
                parse_args(argv), rank=rank, world=world, per_node=world, device=torch.device("cpu")
            )
        finally:
            lt.build_optimizer, lt.train_step = orig, orig_step
        assert code == 0
        if rank == 0:
            row = json.loads(Path(f"{out}.{kind}.jsonl").read_text().splitlines()[0])
            results[kind] = {"loss": row["loss"], "split": max(spans), "grads": grads}
    if rank == 0:
        torch.save(results, out)


def _widest_split(plan) -> int:
    """The most ranks any one document of the plan is spread over."""
    ranks = {}
    for w in range(plan.num_waves):
        for r in range(plan.num_ranks):
            for shard in plan.shards(r, w):
                ranks.setdefault(shard.seq, set()).add(r)
    return max(len(v) for v in ranks.values())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_init_from_computes_transformers_loss_and_gradients(models, tmp_path, world):
    """Step 1 of every architecture, on ``world`` ranks under plans that split documents: the
    loss within 1e-5 and every gradient within 1e-4 (relative) of transformers' on the same
    documents."""
    dirs, corpus, docs = models
    out = tmp_path / "results.pt"
    run_ranks(_train_kinds, world, dirs, corpus, CAPACITY[world], str(out))
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
