"""Training: N gloo ranks equal one process on the same global batches; resume is bit-identical;
a killed run resumes losing only the steps since its checkpoint; bad flags fail clearly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hdp.testing.ranks import patient, run_ranks

ROOT = Path(__file__).resolve().parents[1]

# The CPU suite stays on CPU where a GPU is present: one-rank and gloo runs are compared.
COMMON = [
    "--device",
    "cpu",
    "--model",
    "tiny",
    "--workload",
    "wlb-128k",
    "--tokens-per-step",
    "3K",
    "--max-seq",
    "1K",
    "--synthetic-docs",
    "400",
    "--lr",
    "1e-2",
    "--warmup",
    "2",
    "--capacity",
    "1024",
]


def _train(rank, world, argv, out):
    """One rank of a training run (the process group is already up). Rank 0 saves the full
    weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import hdp.launch.train as lt
    from hdp.launch.cli import parse_config

    args = parse_config(argv)
    captured = {}
    orig = lt.build_model

    def keep(*a, **k):
        captured["model"] = model = orig(*a, **k)
        return model

    lt.build_model = keep
    assert lt.train(args, rank=rank, world=world, per_node=world, device=torch.device("cpu")) == 0
    sd = get_model_state_dict(
        captured["model"], options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save(sd, out)


def run_single(argv, out, tmp_path):
    """The same run on one process, no process group, no FSDP."""
    from hdp.launch.cli import parse_config
    from hdp.launch.model import Llama
    from hdp.launch.train import train

    args = parse_config(argv)
    captured = {}
    orig_init = Llama.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        captured["model"] = self

    Llama.__init__ = init
    try:
        assert train(args, rank=0, world=1, per_node=1, device=torch.device("cpu")) == 0
    finally:
        Llama.__init__ = orig_init
    torch.save({k: v.detach().clone() for k, v in captured["model"].state_dict().items()}, out)


def losses(path):
    return [json.loads(line)["loss"] for line in Path(path).read_text().splitlines()]


@pytest.mark.parametrize(
    "strategy, sync", [("hdp", "peer"), ("hdp", "wave"), ("static", "peer"), ("static", "wave")]
)
def test_four_ranks_equal_one_process(tmp_path, strategy, sync):
    # lr 1e-3: weights move ~10% in 3 steps; AdamW turns fp32 summation-order noise into parameter
    # differences proportional to the learning rate.
    argv = COMMON + ["--steps", "3", "--strategy", strategy, "--sync", sync, "--lr", "1e-3"]
    run_single(argv + ["--metrics", str(tmp_path / "one.jsonl")], tmp_path / "one.pt", tmp_path)
    run_ranks(
        _train, 4, argv + ["--metrics", str(tmp_path / "four.jsonl")], str(tmp_path / "four.pt")
    )
    one, four = losses(tmp_path / "one.jsonl"), losses(tmp_path / "four.jsonl")
    assert len(one) == len(four) == 3
    for a, b in zip(one, four):
        assert abs(a - b) <= 1e-5 * abs(a), (one, four)
    w1, w4 = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "four.pt")
    assert set(w1) == set(w4)
    for k in w1:
        # Relative error of each tensor (norm-wise): AdamW divides by sqrt(v), which magnifies the
        # summation-order noise of near-zero gradients element by element, not tensor by tensor.
        assert (w1[k] - w4[k]).norm().item() <= 1e-5 * w1[k].norm().item(), k


def test_a_sequence_spread_over_all_ranks(tmp_path):
    # One global batch holding a 3K-token document on 4 ranks of capacity 1K: it spans >= 3 ranks.
    from hdp.dataloader import BatchStream, SyntheticSource

    argv = [
        "--model",
        "tiny",
        "--workload",
        "wlb-128k",
        "--tokens-per-step",
        "4K",
        "--max-seq",
        "4K",
        "--synthetic-docs",
        "50",
        "--steps",
        "3",
        "--lr",
        "1e-3",
    ]
    stream = BatchStream([SyntheticSource("wlb-128k", 50, 512, 0).lengths], 4096, 4096)
    assert (
        max(stream.next_batch().lengths.max() for _ in range(3)) > 3 * 1024
    )  # needs all 4 ranks at capacity 1K
    run_single(argv + ["--metrics", str(tmp_path / "one.jsonl")], tmp_path / "one.pt", tmp_path)
    run_ranks(
        _train,
        4,
        argv + ["--capacity", "1024", "--metrics", str(tmp_path / "four.jsonl")],
        str(tmp_path / "four.pt"),
    )
    for a, b in zip(losses(tmp_path / "one.jsonl"), losses(tmp_path / "four.jsonl"), strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)


def test_resume_is_bit_identical(tmp_path):
    argv = COMMON + ["--steps", "4"]
    run_ranks(
        _train,
        2,
        argv + ["--metrics", str(tmp_path / "straight.jsonl")],
        str(tmp_path / "straight.pt"),
    )
    ck = tmp_path / "ck"
    run_ranks(
        _train,
        2,
        COMMON
        + [
            "--steps",
            "4",
            "--checkpoint-dir",
            str(ck),
            "--save-every",
            "2",
            "--metrics",
            str(tmp_path / "a.jsonl"),
        ],
        str(tmp_path / "a.pt"),
    )
    # Pretend the run died saving step 4: a shard of it is missing. Resuming passes over it to
    # step 2 and, saving step 4 again, keeps the damaged one aside.
    shard = next((ck / "step_00000004").glob("*.distcp"))
    shard.unlink()
    run_ranks(
        _train,
        2,
        COMMON
        + [
            "--steps",
            "4",
            "--checkpoint-dir",
            str(ck),
            "--resume",
            "--metrics",
            str(tmp_path / "b.jsonl"),
        ],
        str(tmp_path / "b.pt"),
    )
    straight = losses(tmp_path / "straight.jsonl")
    assert losses(tmp_path / "b.jsonl") == straight[2:]
    w1, w2 = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "b.pt")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not (ck / "step_00000004.damaged" / shard.name).exists()
    assert (ck / "step_00000004.damaged" / "train_state.json").exists()
    assert (ck / "step_00000004" / "manifest.json").exists()


def test_kill_a_rank_and_resume(tmp_path):
    """kill -9 one rank mid-step; --resume loses only the steps since the last checkpoint and
    repeats no data (the resumed steps train on exactly the batches of an uninterrupted run).
    The metrics file, shared by both runs, ends with each step once, the redone step 5 replaced,
    and its token count continues as the uninterrupted run's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ck = tmp_path / "ck"
    base = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "launch" / "pretrain.py"),
        *COMMON,
        "--steps",
        "6",
        "--checkpoint-dir",
        str(ck),
        "--save-every",
        "2",
    ]
    metrics = tmp_path / "run.jsonl"
    killed = subprocess.run(
        base + ["--metrics", str(metrics)],
        env=dict(env, HDP_KILL_AT="1:6"),
        capture_output=True,
        text=True,
        timeout=patient(300),
    )
    assert killed.returncode != 0  # torchrun reports the lost worker
    assert (ck / "latest").read_text().strip() == "step_00000004"
    killed_losses = losses(metrics)
    assert len(killed_losses) == 5
    resumed = subprocess.run(
        base + ["--resume", "--metrics", str(metrics)],
        env=env,
        capture_output=True,
        text=True,
        timeout=patient(300),
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout
    assert "replaced 1 rows of steps after 4" in resumed.stdout
    straight = subprocess.run(
        base[:-4] + ["--metrics", str(tmp_path / "straight.jsonl")],
        env=env,
        capture_output=True,
        text=True,
        timeout=patient(300),
    )
    assert straight.returncode == 0, straight.stdout + straight.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    ref = [json.loads(line) for line in (tmp_path / "straight.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]
    assert killed_losses == [r["loss"] for r in ref][:5]
    assert [r["trained_tokens"] for r in rows] == [r["trained_tokens"] for r in ref]
    assert ref[-1]["trained_tokens"] == sum(r["tokens"] for r in ref)
    assert f"tokens trained {ref[-1]['trained_tokens']:,}" in resumed.stdout


def train_here(argv, capsys) -> tuple[int, str]:
    """A run in this process (one rank, no process group): (exit code, what it printed)."""
    from hdp.launch.cli import parse_config
    from hdp.launch.train import train

    rc = train(parse_config(argv), rank=0, world=1, per_node=1, device=torch.device("cpu"))
    return rc, capsys.readouterr().out


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_accounting_continues_across_a_resume(tmp_path, capsys):
    """Trained and truncated tokens continue from the checkpoint; the truncated tokens are what
    the trained documents lost, the same per step in the metrics and in total on the last line."""
    from hdp.dataloader import BatchStream, SyntheticSource

    argv = COMMON + ["--max-seq", "512", "--truncate", "--steps", "4"]
    ck, run = ["--checkpoint-dir", str(tmp_path / "ck")], ["--metrics", str(tmp_path / "run.jsonl")]
    assert train_here(argv + ["--metrics", str(tmp_path / "straight.jsonl")], capsys)[0] == 0
    # The first 2 steps of the 4-step schedule, which the checkpoint saves and the resume keeps.
    assert train_here(argv[:-1] + ["2", "--lr-decay-steps", "4"] + ck + run, capsys)[0] == 0
    rc, out = train_here(argv + ck + run + ["--resume"], capsys)
    assert rc == 0, out
    ref, got = rows(tmp_path / "straight.jsonl"), rows(tmp_path / "run.jsonl")
    keys = ("step", "loss", "tokens", "trained_tokens", "truncated_tokens")
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in ref]
    # Independently: each batch's documents, full length minus what was trained of them.
    lens = SyntheticSource("wlb-128k", 400, 512, 0).lengths
    stream = BatchStream([lens], 3 << 10, 512, seed=0, truncate=True)
    lost = [sum(int(lens[s.doc]) - s.length for s in stream.next_batch().seqs) for _ in range(4)]
    assert [r["truncated_tokens"] for r in got] == lost and sum(lost) > 0
    assert f"tokens trained {ref[-1]['trained_tokens']:,} (all steps)" in out
    assert f"truncated {sum(lost):,}" in out.splitlines()[-1]
    # What the resume must refuse, each one line before the model is built.
    (tmp_path / "x.jsonl").write_text('{"input_ids": [1, 2, 3]}\n' * 600)
    other_data = [a for a in argv if a not in ("--workload", "wlb-128k")]
    for case, message in [
        (argv + ["--steps", "3"], "--steps 3 is not above step 4, where "),
        (argv + ["--steps", "5", "--tokens-per-step", "4K"], "data.tokens_per_step: 3072 -> 4096"),
        (
            other_data + ["--steps", "5", "--data", str(tmp_path / "x.jsonl")],
            "data.sources.1.name: 'synthetic:wlb-128k' -> 'x.jsonl'",
        ),
        (argv + ["--steps", "5", "--lr", "1e-3"], "optimizer.lr: 0.01 -> 0.001"),
    ]:
        rc, out = train_here(case + ck + ["--resume"], capsys)
        assert rc == 2 and out.strip().splitlines()[-1].startswith("pretrain.py: error: ")
        assert message in out.strip().splitlines()[-1]
    # Allowed, a changed learning rate takes effect: the extended run keeps its saved 4-step
    # schedule, so step 5 trains at 10% of the new 1e-3 (the checkpoint saved 1e-2).
    allowed = ["--steps", "5", "--lr", "1e-3", "--allow-changed-setup"]
    rc, out = train_here(argv + allowed + ck + run + ["--resume"], capsys)
    assert rc == 0, out
    assert "continuing the saved schedule: its decay ends at step 4" in out
    assert rows(tmp_path / "run.jsonl")[-1]["lr"] == pytest.approx(1e-4)
    assert "step 5: " in out and " by the cost model (cpu profile)" in out
    rc, out = train_here(argv + ck, capsys)
    assert rc == 2 and "already holds checkpoints (step_00000005 and 2 more)" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-seq", "8K", "--tokens-per-step", "4K"], "exceeds --tokens-per-step"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (
            ["--max-seq", "4K", "--tokens-per-step", "8K", "--capacity", "1K"],
            "cannot hold a 4096-token sequence",
        ),
        (["--data", "/no/such/file.jsonl"], "file.jsonl: cannot open"),
    ],
)
def test_bad_flags(argv, message):
    res = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "pretrain.py"), *argv],
        capture_output=True,
        text=True,
        timeout=patient(120),
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stdout + res.stderr


def test_selective_offload_keeps_the_math(tmp_path):
    """A plan that offloads half the layers' activations trains exactly as one that does not."""
    from hdp import ClusterSpec, Plan, model_preset
    from hdp.dataloader import BatchStream, HDPDataLoader, SyntheticSource
    from hdp.launch.model import Llama
    from hdp.launch.runtime import run_waves

    src = SyntheticSource("wlb-128k", 30, 512, 0)
    loader = HDPDataLoader(
        [src],
        BatchStream([src.lengths], 2048, 512),
        ClusterSpec.preset("cpu", 1),
        model_preset("tiny"),
    )
    step = next(loader)
    loader.close()
    grads = []
    for frac in (0.0, 0.5):
        torch.manual_seed(0)
        model = Llama(model_preset("tiny"), activation_checkpointing=True)
        p = step.plan
        step.plan = Plan(
            p.seq_lens,
            1,
            p.rank,
            p.wave,
            p.seq,
            p.start,
            p.end,
            sync=p.sync,
            offload=[[frac]] * p.num_waves,
        )
        run_waves(model, step)
        grads.append([q.grad.clone() for q in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_chunked_loss_matches_full_logits():
    """The chunked loss path (LM head and cross-entropy recomputed per chunk) gives the loss and
    gradients of ``F.cross_entropy`` over the full logits."""
    import torch.nn.functional as F

    from hdp import Plan, model_preset
    from hdp.launch.model import AttentionContext, Llama

    T = 300
    plan = Plan(
        np.array([T]), 1, np.array([0]), np.array([0]), np.array([0]), np.array([0]), np.array([T])
    )
    ctx = AttentionContext(plan, 0)
    ids = torch.randint(0, 512, (T,))
    pos = torch.arange(T)
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    labels[::7] = -100
    results = []
    for chunk in (64, None):
        torch.manual_seed(0)
        model = Llama(model_preset("tiny"), loss_chunk_tokens=chunk or T).double()
        loss = (
            model(ids, pos, ctx, labels)
            if chunk
            else F.cross_entropy(model(ids, pos, ctx).double(), labels, reduction="sum")
        )
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l_chunked, g_chunked), (l_full, g_full) = results
    # The model hands fp32 logits to the loss (as it does on GPU), hence fp32 tolerances.
    torch.testing.assert_close(l_chunked.double(), l_full, rtol=1e-5, atol=0)
    for a, b in zip(g_chunked, g_full):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("exchange", ["node", "ulysses"])
def test_exchanges_on_virtual_nodes_equal_one_process(tmp_path, exchange):
    """4 ranks as 2 virtual nodes of 2, K/V fetched once per node or split sequences attending
    head-parallel (tiny's 4 heads, one a rank): the same losses and weights. Documents over 3K
    tokens on ranks of capacity 1K span both nodes."""
    argv = [
        *("--model", "tiny", "--workload", "wlb-128k", "--tokens-per-step", "4K"),
        *("--max-seq", "4K", "--synthetic-docs", "50", "--steps", "3", "--lr", "1e-3"),
        *("--kv-exchange", exchange, "--gpus-per-node", "2"),
    ]
    run_single(argv + ["--metrics", str(tmp_path / "one.jsonl")], tmp_path / "one.pt", tmp_path)
    four = argv + ["--capacity", "1024", "--metrics", str(tmp_path / "four.jsonl")]
    run_ranks(_train, 4, four, str(tmp_path / "four.pt"))
    rows = [json.loads(line) for line in (tmp_path / "four.jsonl").read_text().splitlines()]
    assert all(r["kv_exchange"] == exchange for r in rows)
    assert any(r["predicted_nic_bytes"] > 0 for r in rows)  # K/V crossed the virtual nodes
    one, four = losses(tmp_path / "one.jsonl"), losses(tmp_path / "four.jsonl")
    assert len(one) == len(four) == 3
    for a, b in zip(one, four):
        assert abs(a - b) <= 1e-5 * abs(a), (one, four)
    w1, w4 = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "four.pt")
    for k in w1:
        assert (w1[k] - w4[k]).norm().item() <= 1e-5 * w1[k].norm().item(), k


def test_plans_are_priced_by_the_model_training_prices_its_steps_with(tmp_path):
    """A profile whose own attention rows (``torch_flash``, 10x slower) are not those of the backend
    that runs on a CPU (``reference``): the plan's prediction must come from the training's cost
    model, which prices the reference rows, not from the profile's default."""
    from hdp.launch.cli import parse_config
    from hdp.launch.model_source import model_source
    from hdp.launch.setup import build_data, build_loader, build_pricing, resolve_auto

    profile = json.loads((ROOT / "hdp" / "data" / "profiles" / "cpu.json").read_text())
    rows = profile["tables"]["attention"]["rows"]
    rows += [["torch_flash", *row[1:-1], row[-1] * 10] for row in rows]
    profile["attention_backend"] = "torch_flash"
    (tmp_path / "p.json").write_text(json.dumps(profile))
    argv = COMMON + ["--steps", "1", "--gpu-profile", str(tmp_path / "p.json")]
    args = parse_config(argv)
    source = model_source(args.model)
    cpu = torch.device("cpu")
    args = resolve_auto(args, spec=source.spec, world=1, per_node=1, device=cpu, log=print)
    pricing = build_pricing(args, spec=source.spec, world=1, per_node=1, device=cpu)
    cost = pricing.cost
    assert cost.attention_backend == "reference"
    assert args.training.compile is False and cost.compiled is False  # eager on CPU by default
    sources, stream = build_data(args, source, vocab=cost.model.vocab)
    loader = build_loader(args, sources=sources, stream=stream, pricing=pricing)
    try:
        plan = next(loader).plan
    finally:
        loader.close()
    assert plan.predicted["step_time_s"] == pytest.approx(cost.evaluate(plan).step_time_s)
    default = type(cost)(cost.model, cost.cluster, activation_checkpointing=False)
    assert default.evaluate(plan).step_time_s > 2 * plan.predicted["step_time_s"]


def test_the_loader_plans_with_the_hdp_search_flags():
    """``--plan-budget`` and ``--max-ranks-per-seq`` reach the plans the loader makes."""
    from hdp.launch.cli import parse_config
    from hdp.launch.model_source import model_source
    from hdp.launch.setup import build_data, build_loader, build_pricing, resolve_auto
    from hdp.planner.dynamic import DynamicOptions

    argv = COMMON + ["--steps", "1", "--plan-budget", "0", "--max-ranks-per-seq", "1"]
    args = parse_config(argv)
    source = model_source(args.model)
    cpu = torch.device("cpu")
    args = resolve_auto(args, spec=source.spec, world=1, per_node=1, device=cpu, log=print)
    pricing = build_pricing(args, spec=source.spec, world=1, per_node=1, device=cpu)
    sources, stream = build_data(args, source, vocab=pricing.cost.model.vocab)
    loader = build_loader(args, sources=sources, stream=stream, pricing=pricing)
    try:
        plan = next(loader).plan
    finally:
        loader.close()
    wanted = DynamicOptions(plan_budget_s=0.0, max_ranks_per_seq=1)
    assert loader.plan_options == {"hdp_options": wanted}
    assert plan.predicted["budget_s"] == 0.0


def test_the_synthetic_data_is_learnt_within_20_steps(tmp_path, capsys):
    """A newcomer's first run on the default data shows a falling loss, not one stuck at
    ln(vocab)."""
    metrics = tmp_path / "m.jsonl"
    argv = ["--model", "tiny", "--tokens-per-step", "4K", "--max-seq", "1K", "--steps", "20"]
    assert train_here(argv + ["--metrics", str(metrics)], capsys)[0] == 0
    loss = [r["loss"] for r in rows(metrics)]
    assert abs(loss[0] - np.log(rows(metrics)[0]["vocab"])) < 0.1
    assert loss[-1] < loss[0] - 0.2
