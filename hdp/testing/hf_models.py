"""Tiny random Hugging Face checkpoints written by transformers itself, and transformers' loss and
gradients on documents, for the tests of real models (nothing is downloaded)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import torch

from .ranks import patient

VOCAB = 101  # not a multiple of 2 or 4: FSDP2 shards the embedding unevenly
# Large enough that a wrong RoPE, norm or bias changes the loss (at 0.02 every model scores
# log(vocab)).
INIT_RANGE = 0.2
SMALL = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "initializer_range": INIT_RANGE,
    "max_position_embeddings": 64,
}
DOC_LENGTHS = [97, 64, 120, 45, 88, 71, 33, 90]  # 608 tokens, none past --max-seq 128
CORPUS_TOKENS = sum(DOC_LENGTHS)
# One global batch is the whole corpus, every step: the step's documents are known exactly.
STEP = ["--tokens-per-step", str(CORPUS_TOKENS), "--max-seq", "128", "--grad-clip", "0"]
# Per world size, a capacity that splits the longest documents across ranks.
CAPACITY = {1: None, 2: "64", 4: "32"}

# The architectures of the tests: transformers' config class, its arguments, and whether the
# config.json is rewritten in the transformers 4.x spelling (rope_theta + rope_scaling).
KINDS = {
    "llama": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
        True,
    ),
    "qwen2": (
        "Qwen2Config",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
        False,
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 24, "pad_token_id": 0}, False),
    "mistral": (
        "MistralConfig",
        {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        False,
    ),
}

# transformers' names of hdp's parameters, written out here rather than taken from the code
# under test.
_HF_OF_HDP = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    (".attn_norm.", ".input_layernorm."),
    (".mlp_norm.", ".post_attention_layernorm."),
    (".attn.", ".self_attn."),
]


def hf_name_of(hdp_name: str) -> str:
    for a, b in _HF_OF_HDP:
        if hdp_name == a:
            return b
    name = "model." + hdp_name
    for a, b in _HF_OF_HDP[3:]:
        name = name.replace(a, b)
    return name


def write_checkpoint(
    kind: str, directory: Path, *, seed: int = 0, max_shard_size=None, dtype=torch.float32
) -> Path:
    """A random ``kind`` model saved by transformers in ``directory`` in ``dtype``: norms and
    biases are perturbed too, so that a norm or bias read into the wrong place changes the
    loss."""
    import transformers

    cls_name, extra, old_spelling = KINDS[kind]
    config = getattr(transformers, cls_name)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, INIT_RANGE).add_(1.0 if "norm" in name else 0.0)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(directory, **kw)
    if old_spelling:
        to_old_spelling(directory / "config.json")
    return directory


def write_checkpoints(root: Path) -> dict[str, Path]:
    """One checkpoint of each of ``KINDS`` under ``root``: mistral's in shards with an index,
    qwen3's in bf16 (fp32 in training: the loader converts), the others in one fp32 file."""
    return {
        kind: write_checkpoint(
            kind,
            root / kind,
            max_shard_size="40KB" if kind == "mistral" else None,
            dtype=torch.bfloat16 if kind == "qwen3" else torch.float32,
        )
        for kind in KINDS
    }


def to_old_spelling(path: Path) -> None:
    """Rewrite a config.json's RoPE as transformers 4.x wrote it: rope_theta + rope_scaling."""
    config = json.loads(path.read_text())
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    config["torch_dtype"] = config.pop("dtype", "float32")
    path.write_text(json.dumps(config, indent=2))


def write_corpus(path: Path, *, seed: int = 0) -> list[list[int]]:
    """``DOC_LENGTHS`` documents of random token ids as a jsonl of ``input_ids``."""
    rng = random.Random(seed)
    docs = [[rng.randrange(VOCAB) for _ in range(n)] for n in DOC_LENGTHS]
    path.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    return docs


def reference(model_dir: Path, docs: list[list[int]], *, grads: bool = False, **overrides):
    """transformers' loss on ``docs`` (each document alone; cross-entropy summed over the tokens
    that have a next token, divided by their count), and its gradients by parameter name."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, attn_implementation="eager", dtype=torch.float64
    )
    count = sum(len(d) - 1 for d in docs)
    total = torch.zeros((), dtype=torch.float64)
    for doc in docs:
        ids = torch.tensor(doc)[None]
        logits = model(ids).logits[0, :-1].double()
        total = total + torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
    loss = total / count
    if not grads:
        return float(loss.detach())
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def write_tokenizer(directory: Path) -> None:
    """A byte-pair tokenizer of fewer tokens than ``VOCAB`` (``tokenizer.json`` and its config),
    as a Hugging Face model directory holds them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "long context training needs every step balanced and every byte necessary".split()
    tok.train_from_iterator(
        words * 20, trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"])
    )
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def run_export(argv: list[str]) -> subprocess.CompletedProcess:
    """``hdp-export`` in a fresh process, in this one's directory (``python -m`` puts it first on
    the path: inside the hdp folder, hdp/profile.py would shadow the standard library's)."""
    cmd = [sys.executable, "-m", "hdp.launch.export", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=patient(300))


def train_in_process(argv: list[str]) -> None:
    """``pretrain.py`` with ``argv`` as one rank without a process group."""
    import hdp.launch.train as lt
    from hdp.launch.cli import parse_config

    args = parse_config(argv)
    assert lt.train(args, rank=0, world=1, per_node=1, device=torch.device("cpu")) == 0


def first_steps(rank, world, dirs, corpus, capacity, out):
    """Step 1 of ``--init-from`` training of every checkpoint: rank 0 saves the loss, the widest
    split of a document, and the full gradients (taken just before the optimizer steps)."""
    import hdp.launch.train as lt
    from hdp.launch.cli import parse_config

    orig_optimizer, orig_step = lt.build_optimizer, lt.train_step
    seen = {}

    def build_optimizer(args, *, model, schedule):
        optimizer, scheduler = orig_optimizer(args, model=model, schedule=schedule)

        def keep(opt, a, k):
            for name, p in model.named_parameters():
                g = p.grad
                seen["grads"][name] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()

        optimizer.register_step_pre_hook(keep)
        return optimizer, scheduler

    def train_step(data, **kw):
        seen["split"] = widest_split(data.plan)
        return orig_step(data, **kw)

    lt.build_optimizer, lt.train_step = build_optimizer, train_step
    results = {}
    for kind, directory in dirs.items():
        argv = ["--init-from", str(directory), "--data", str(corpus), "--steps", "1", *STEP]
        argv += ["--metrics", f"{out}.{kind}.jsonl"]
        if capacity:
            argv += ["--capacity", capacity]
        seen["grads"] = {}
        args = parse_config(argv)
        assert (
            lt.train(args, rank=rank, world=world, per_node=world, device=torch.device("cpu")) == 0
        )
        if rank == 0:
            row = json.loads(Path(f"{out}.{kind}.jsonl").read_text().splitlines()[0])
            results[kind] = {"loss": row["loss"], "split": seen["split"], "grads": seen["grads"]}
    if rank == 0:
        torch.save(results, out)


def widest_split(plan) -> int:
    """The most ranks any one document of the plan is spread over."""
    ranks = {}
    for w in range(plan.num_waves):
        for r in range(plan.num_ranks):
            for shard in plan.shards(r, w):
                ranks.setdefault(shard.seq, set()).add(r)
    return max(len(v) for v in ranks.values())
