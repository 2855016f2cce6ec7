"""Run Megatron-LM's own training code at its release tags on what ``HDPDataLoaderWrapper`` yields.

For each tag: the tag's ``parse_args`` / ``validate_args`` read every flag line of docs/megatron.md
exactly as written (``--flags-only``: only this); then, on gloo CPU ranks, they read a hybrid-CP
flag line like the documented one, the tag's ``parallel_state`` builds the groups, hdp's wrapper
(with the layout ``hdp.dataloader.megatron.versions`` picks for the tag's megatron-core version)
feeds the tag's ``hybrid_context_parallel_forward_backward``, which calls the tag's
``pretrain_gpt.forward_step`` and so its ``get_batch``. The model is a recorder: it keeps what
``forward_step`` hands it. The parent process then compares every record with an expectation
computed here from the batch alone (which document each sub-sample is, its CP size and partners from
the schedule, zigzag chunks, padding to a multiple of 2 x CP).

Not part of CI: it needs Megatron-LM's sources, which are not in the megatron-core wheel, and a
few packages they import that hdp's venv lacks. Prepare them once:

    fetch github:NVIDIA/Megatron-LM  (or git clone it), then for each tag
    git -C MIRROR archive core_v0.19.0 megatron pretrain_gpt.py gpt_builders.py model_provider.py \\
        | tar -x -C /tmp/megatron-core_v0.19.0
    .venv/bin/python -m pip install --target /tmp/megatron-extra six regex pydantic
    .venv/bin/python -m pip install --no-deps --target /tmp/megatron-extra triton

    .venv/bin/python scripts/check_megatron_tags.py --megatron-dir '/tmp/megatron-{tag}' \\
        --extra /tmp/megatron-extra

Prints one line per tag and case: PASS, or FAIL with what differed (or where Megatron raised).
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import re
import shlex
import socket
import sys
import tempfile
import traceback
import types
import typing
import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
TAGS = ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0")
# (ranks, tensor parallel, static context parallel, forward only): DPxCP groups of 2 and 4, and a
# TP pair so the broadcast to the other tensor-parallel rank runs too. Forward-only runs check the
# data path of tags whose hybrid-CP schedule cannot run a backward step.
CASES = ((2, 1, 1, False), (4, 1, 2, False), (4, 2, 1, False), (4, 1, 2, True), (4, 2, 1, True))
CAP = 48  # --max-seqlen-per-dp-cp-rank: small, so short documents still land on CP > 1
DOC = 100_000  # token = doc * DOC + position: a record says which document it holds
# Imported at module load by the trees (triton by GPU kernels this check never runs).
NEEDED = ("six", "regex", "pydantic", "triton")


def flag_line(tp: int, cp: int) -> list[str]:
    """The hybrid-CP flags of docs/megatron.md plus a tiny model, as the tag's parser reads them."""
    return [
        "--hybrid-context-parallel",
        f"--max-seqlen-per-dp-cp-rank={CAP}",
        "--calculate-per-token-loss",
        "--dataloader-type=single",
        "--no-create-attention-mask-in-dataloader",
        f"--tensor-model-parallel-size={tp}",
        f"--context-parallel-size={cp}",
        "--pipeline-model-parallel-size=1",
        "--num-layers=1",
        "--hidden-size=32",
        "--num-attention-heads=4",
        f"--seq-length={4 * CAP}",
        f"--max-position-embeddings={4 * CAP}",
        "--micro-batch-size=1",
        "--tokenizer-type=NullTokenizer",
        "--vocab-size=128",
        "--no-gradient-accumulation-fusion",
        "--transformer-impl=local",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-rope-fusion",
    ]


# What the flag lines in docs/megatron.md leave to the user: a model, a micro-batch size (which
# every run must give), and the parallel sizes.
MODEL_FLAGS = [
    f for f in flag_line(1, 1) if f.startswith(("--num-", "--hidden", "--seq", "--max-p"))
]
MODEL_FLAGS += ["--tokenizer-type=NullTokenizer", "--vocab-size=128", "--transformer-impl=local"]
MODEL_FLAGS += ["--micro-batch-size=1"]
# (ranks, extra flags, minor versions) under which each documented line is parsed: CP 2, TP 2,
# and for the PackedBatchIterator line (--dataloader-type external) on 0.18 / 0.19 with TP,
# --sft as docs/megatron.md says.
FLAG_VARIANTS = (
    (4, ["--context-parallel-size=2"], None),
    (4, ["--tensor-model-parallel-size=2"], None),
    (4, ["--tensor-model-parallel-size=2", "--sft"], ((0, 18), (0, 19))),
)


def documented_flag_lines(doc: Path = REPO / "docs/megatron.md") -> list[list[str]]:
    """Every fenced block of docs/megatron.md that is a flag line (starts with ``--``), exactly as
    written there, split as a shell would."""
    blocks = re.findall(r"^[ \t]*```[a-z]*\n(.*?)^[ \t]*```", doc.read_text(), re.M | re.S)
    blocks = [b.replace("\\\n", " ") for b in blocks if b.strip().startswith("--")]
    return [shlex.split(b) for b in blocks]


def flags_main(case: dict, out: str) -> None:
    """One documented flag line through the tag's own ``parse_args`` and ``validate_args``."""
    os.environ.update(RANK="0", WORLD_SIZE=str(case["world"]), LOCAL_RANK="0")
    os.environ.update(CUDA_DEVICE_MAX_CONNECTIONS="1")
    sys.path[:0] = [case["tree"], case["extra"]]  # the tag's Megatron-LM sources
    warnings.simplefilter("ignore")
    _shim_imports()
    _cuda_on_cpu()
    try:
        from megatron.training import arguments

        sys.argv = ["pretrain_gpt.py", *case["argv"]]
        arguments.validate_args(arguments.parse_args())
        result = "PASS"
    except BaseException as e:  # SystemExit from argparse included
        where = traceback.extract_tb(e.__traceback__)[-1]
        result = f"FAIL {type(e).__name__}: {str(e)[:300]} at {where.filename}:{where.lineno}"
    Path(out).write_text(result)


def check_flag_lines(tree: Path, extra: str, timeout: float) -> list[tuple[str, str]]:
    """(flag line, PASS or FAIL ...) for each documented line and variant, in the tag's tree."""
    version = (tree / "megatron/core/package_info.py").read_text()
    minor = tuple(int(re.search(rf"^{k} = (\d+)", version, re.M)[1]) for k in ("MAJOR", "MINOR"))
    results = []
    for line in documented_flag_lines():
        for world, more, minors in FLAG_VARIANTS:
            if minors is not None and (minor not in minors or "external" not in line):
                continue
            argv = [*line, *MODEL_FLAGS, *more]
            with tempfile.TemporaryDirectory() as tmp:
                case = dict(tree=str(tree), extra=extra, world=world, argv=argv)
                proc = mp.get_context("spawn").Process(target=flags_main, args=(case, f"{tmp}/out"))
                proc.start()
                proc.join(timeout)
                if proc.is_alive():
                    proc.kill()
                out = Path(tmp, "out")
                got = out.read_text() if out.exists() else "FAIL: wrote nothing"
            results.append((f"{' '.join(line)} [+ {' '.join(more)}, {world} ranks]", got))
    return results


def replica_batch(seed: int, replica: int, n_hdp: int) -> list[dict[str, torch.Tensor]]:
    """The packed samples DP replica ``replica`` reads: documents with odd and tiny lengths (so
    padding to 2 x CP is needed), each document's tokens saying which document it is."""
    rng = np.random.default_rng([seed, replica])
    samples, doc = [], replica * 1000 + 1  # 0 stays the padding token
    for _ in range(2):
        lens = rng.integers(1, min(2 * CAP, n_hdp * CAP), size=int(rng.integers(1, 4))).tolist()
        if replica == 0 and not samples:
            lens[0] = 1  # on CP k > 1 all but one of its 2k tokens are padding
        tokens = torch.cat([(doc + i) * DOC + torch.arange(n) for i, n in enumerate(lens)])
        pos = torch.cat([torch.arange(n) for n in lens])
        samples.append(
            {
                "tokens": tokens,
                "labels": tokens + 1,
                "loss_mask": torch.ones(tokens.numel()),
                "position_ids": pos,
                "cu_seqlens": torch.tensor(np.r_[0, np.cumsum(lens)], dtype=torch.int32),
            }
        )
        doc += len(lens)
    return samples


def documents(seed: int, n_dp: int, n_hdp: int) -> list[tuple[int, int]]:
    """(first token, length) of every sub-sample in global id order: DP replicas in rank order,
    samples and documents in reading order (the numbering Megatron's wrapper uses)."""
    out = []
    for replica in range(n_dp):
        for sample in replica_batch(seed, replica, n_hdp):
            cu = sample["cu_seqlens"].tolist()
            out += [(int(sample["tokens"][a]), b - a) for a, b in zip(cu[:-1], cu[1:])]
    return out


def _shim_imports() -> None:
    """Python 3.12's ``typing.override``, which the tagged trees import, on Python 3.11."""
    if not hasattr(typing, "override"):  # the trees only use it as a marker decorator
        typing.override = lambda f: f


def _cuda_on_cpu() -> None:
    """Megatron's CUDA calls (``.cuda()``, ``device='cuda'``, pinned memory) on the CPU."""
    real_tensor, real_empty = torch.tensor, torch.empty

    def on_cpu(fn):
        def call(*args, **kwargs):
            if str(kwargs.get("device", "cpu")).startswith("cuda"):
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return call

    torch.tensor, torch.empty = on_cpu(real_tensor), on_cpu(real_empty)
    torch.Tensor.cuda = lambda t, *a, **k: t
    torch.cuda.current_device = lambda: "cpu"
    # validate_args reads the GPU generation under TP or CP > 1: answer as an H100 would.
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0)


class Recorder(torch.nn.Module):
    """Stands in for ``GPTModel``: keeps what ``forward_step`` passes and returns a per-token
    loss that backward can run through."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.vp_stage = None
        self.records: list[dict] = []

    def set_input_tensor(self, _tensor) -> None:
        pass

    def forward(self, tokens, position_ids, attention_mask, **kwargs):
        params = kwargs.get("packed_seq_params")
        rec = {
            "tokens": tokens,
            "position_ids": position_ids,
            "labels": kwargs.get("labels"),
            "loss_mask": kwargs.get("loss_mask"),
            "attention_mask": attention_mask,
            "params": None,
        }
        if params is not None:
            group = getattr(params, "cp_group", None)
            rec["params"] = {
                "qkv_format": params.qkv_format,
                "cu_seqlens_q": params.cu_seqlens_q,
                "cu_seqlens_kv": params.cu_seqlens_kv,
                "max_seqlen_q": _int(params.max_seqlen_q),
                "local_cp_size": _int(params.local_cp_size),
                "cp_group": None if group is None else dist.get_process_group_ranks(group),
            }
        self.records.append({k: _plain(v) for k, v in rec.items()})
        return (self.weight * kwargs["loss_mask"].float()).reshape(1, -1)


def _int(value):
    return None if value is None else int(value)


def _plain(value):
    # numpy, not tensors: the tags register their own pickling for torch objects, which the
    # parent (without the tag on its path) could not load.
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _init_megatron(tp: int, cp: int):
    """The tag's own argument parsing and validation, globals and parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.training import arguments, global_vars

    sys.argv = ["pretrain_gpt.py", *flag_line(tp, cp)]
    args = arguments.parse_args()
    arguments.validate_args(args)
    global_vars.set_global_variables(args, build_tokenizer=False)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, hybrid_context_parallel=True
    )
    return arguments.core_transformer_config_from_args(args)


def _forward_backward(config, wrapper, model, forward_only: bool) -> None:
    """One global batch through the tag's hybrid-CP schedule with its ``pretrain_gpt``."""
    import inspect

    import pretrain_gpt
    from megatron.core.pipeline_parallel import hybrid_cp_schedule

    config.timers = None
    config.variable_seq_lengths = True
    config.deallocate_pipeline_outputs = False
    kwargs = dict(
        forward_step_func=pretrain_gpt.forward_step,
        data_iterator=wrapper,
        model=model,
        num_microbatches=1,
        input_tensor=None,
        output_tensor_grad=None,
        forward_data_store=[],
        config=config,
        collect_non_loss_data=False,
        first_val_step=None,
        forward_only=forward_only,
        no_sync_func=nullcontext,
        total_num_tokens=torch.zeros((), dtype=torch.int),
        check_first_val_step=lambda first, only, cond: cond,
        model_type=None,
    )
    fb = hybrid_cp_schedule.hybrid_context_parallel_forward_backward
    names = inspect.signature(fb).parameters
    fb(**{k: v for k, v in kwargs.items() if k in names})


def rank_main(rank: int, world: int, port: int, case: dict, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        OMP_NUM_THREADS="1",
        CUDA_DEVICE_MAX_CONNECTIONS="1",  # what validate_args asks for under TP or CP on H100
    )
    sys.path[:0] = [case["tree"], case["extra"]]  # the tag's Megatron-LM sources
    warnings.simplefilter("ignore")
    _shim_imports()
    _cuda_on_cpu()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    result: dict = {"rank": rank}
    try:
        config = _init_megatron(case["tp"], case["cp"])
        from megatron.core import parallel_state as ps

        from hdp.dataloader.megatron import HDPDataLoaderWrapper, installed_version

        hdp = ps.get_data_parallel_group(with_context_parallel=True)
        result.update(
            version=installed_version().text,
            contract=installed_version().contract,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            hdp_rank=hdp.rank(),
            hdp_ranks=dist.get_process_group_ranks(hdp),
        )
        first_tp = result["tp_rank"] == 0
        batch = replica_batch(case["seed"], ps.get_data_parallel_rank(), hdp.size())
        wrapper = HDPDataLoaderWrapper(iter([batch]) if first_tp else None, config)
        seen: list = []

        def tap():  # keeps the schedule the wrapper handed Megatron
            item = next(wrapper)
            seen.append(item[1])
            yield item

        model = Recorder()
        try:
            _forward_backward(config, tap() if first_tp else None, model, case["forward_only"])
        finally:
            result.update(records=model.records, schedule=seen[0] if seen else None)
    except BaseException:  # reported per rank, so the parent says where Megatron raised
        result["error"] = traceback.format_exc(limit=-3)
    with open(f"{out}/rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def expected_runs(schedule, hdp_rank: int, hdp_ranks: list[int], rank: int, docs) -> list[dict]:
    """What each forward step on this rank must receive, in order, from the schedule alone."""
    runs = []
    for group in schedule:
        for sid in group[hdp_rank]:
            partners = sorted(hdp_ranks[d] for d, ids in enumerate(group) if sid in ids)
            k = len(partners)
            first, length = docs[sid]
            padded = length if k == 1 else math.ceil(length / (2 * k)) * 2 * k
            pad = padded - length
            full = {
                "tokens": torch.cat(
                    [first + torch.arange(length), torch.zeros(pad, dtype=torch.long)]
                ),
                "labels": torch.cat(
                    [first + 1 + torch.arange(length), torch.zeros(pad, dtype=torch.long)]
                ),
                "loss_mask": torch.cat([torch.ones(length), torch.zeros(pad)]),
                "position_ids": torch.arange(padded),
            }
            r, chunk = partners.index(rank), padded // (2 * k)
            if k > 1:  # chunks r and 2k-1-r of 2k: the zigzag split that balances causal work
                full = {
                    key: torch.cat(
                        [v[r * chunk : (r + 1) * chunk], v[(2 * k - 1 - r) * chunk :][:chunk]]
                    )
                    for key, v in full.items()
                }
            runs.append(
                {
                    "sid": sid,
                    "k": k,
                    "partners": partners,
                    "padded": padded,
                    "length": length,
                    **full,
                }
            )
    return runs


def compare(record: dict, want: dict, contract: str) -> list[str]:
    """What differs between one recorded forward step and its expectation."""
    bad = []
    tag = f"sub-sample {want['sid']} (L={want['length']}, CP {want['k']})"
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        got = None if record[key] is None else torch.from_numpy(record[key])
        if got is None or tuple(got.shape) != (1, want[key].numel()):
            bad.append(f"{tag}: {key} shape {None if got is None else tuple(got.shape)}")
        elif not torch.equal(got.reshape(-1).to(want[key].dtype), want[key]):
            bad.append(f"{tag}: {key} values differ")
    if record["attention_mask"] is not None:
        bad.append(f"{tag}: an attention_mask reached the model")
    params = record["params"]
    if params is None:
        return bad + [f"{tag}: no packed_seq_params (no hybrid split was made)"]
    if params["local_cp_size"] != want["k"]:
        bad.append(f"{tag}: local_cp_size {params['local_cp_size']}")
    group = params["cp_group"]
    if (group if want["k"] > 1 else None) != (want["partners"] if want["k"] > 1 else None):
        bad.append(f"{tag}: cp_group {group} != partners {want['partners']}")
    if params["max_seqlen_q"] != want["padded"]:
        bad.append(f"{tag}: max_seqlen_q {params['max_seqlen_q']} != {want['padded']}")
    cu = params["cu_seqlens_q"]
    cu = None if cu is None else torch.as_tensor(cu)
    if cu is None or cu.reshape(-1).tolist() != [0, want["padded"]]:
        bad.append(f"{tag}: cu_seqlens_q {None if cu is None else cu.tolist()}")
    fmt = {"flat": "sbhd", "packed": "thd"}[contract]
    if params["qkv_format"] != fmt:
        bad.append(f"{tag}: qkv_format {params['qkv_format']} (expected {fmt})")
    return bad


def check(results: list[dict], case: dict) -> list[str]:
    """Every rank's records against the expectation; the schedule is the one TP rank 0 ran."""
    errors = {}
    for r in results:
        if "error" in r:
            lines = r["error"].strip().splitlines()
            where = [x.strip() for x in lines if x.strip().startswith("File ")]
            where_s = f" at {where[-1]}" if where else ""
            errors.setdefault(f"{lines[-1][:200]}{where_s}", []).append(r["rank"])
    if errors:
        return [f"ranks {ranks}: {msg}" for msg, ranks in errors.items()]
    schedule = next(r["schedule"] for r in results if r["schedule"] is not None)
    n_hdp = len(results[0]["hdp_ranks"])
    n_dp = n_hdp // case["cp"]
    docs = documents(case["seed"], n_dp, n_hdp)
    ran = sorted(s for g in schedule for ids in g for s in ids)
    bad = [] if set(ran) == set(range(len(docs))) else [f"schedule runs {ran}, not all {len(docs)}"]
    for res in results:
        want = expected_runs(schedule, res["hdp_rank"], res["hdp_ranks"], res["rank"], docs)
        if len(res["records"]) != len(want):
            bad.append(
                f"rank {res['rank']}: {len(res['records'])} forward steps, expected {len(want)}"
            )
            continue
        for rec, w in zip(res["records"], want):
            bad += [f"rank {res['rank']}: {m}" for m in compare(rec, w, res["contract"])]
    return bad


def run_case(case: dict, timeout: float) -> tuple[bool, str]:
    world = case["world"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(target=rank_main, args=(r, world, port, case, out)) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            path = Path(out, f"rank{r}.pkl")
            if path.exists():
                results.append(pickle.loads(path.read_bytes()))
            else:
                results.append({"rank": r, "error": f"rank {r} wrote nothing (hung: {r in hung})"})
    bad = check(results, case)
    contract = next((r["contract"] for r in results if "contract" in r), "?")
    sizes = [
        (rec["params"] or {}).get("local_cp_size") for r in results for rec in r.get("records", [])
    ]
    head = f"layout {contract}, {len(sizes)} forward steps, CP sizes {sorted(set(sizes))}"
    return not bad, head + ("" if not bad else "; " + "; ".join(bad[:6]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--megatron-dir",
        required=True,
        help="a Megatron-LM tree per tag, '{tag}' standing for the tag (e.g. /tmp/megatron-{tag})",
    )
    parser.add_argument(
        "--extra", required=True, help=f"pip --target folder holding {', '.join(NEEDED)}"
    )
    parser.add_argument("--tags", nargs="+", default=list(TAGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument(
        "--flags-only", action="store_true", help="only parse the documented flag lines"
    )
    opts = parser.parse_args(argv)
    missing = [n for n in NEEDED if not any(Path(opts.extra).glob(f"{n}*"))]
    if missing:
        parser.error(
            f"{opts.extra} lacks {', '.join(missing)}: "
            f"python -m pip install --target {opts.extra} {' '.join(NEEDED)}"
        )
    failed = 0
    for tag in opts.tags:
        tree = Path(opts.megatron_dir.format(tag=tag))
        if not (tree / "pretrain_gpt.py").exists() or not (tree / "megatron/training").is_dir():
            print(
                f"{tag}: MISSING {tree} (needs pretrain_gpt.py, gpt_builders.py, "
                f"model_provider.py and megatron/ of the tag: git archive {tag} | tar -x)"
            )
            failed += 1
            continue
        for line, got in check_flag_lines(tree, opts.extra, opts.timeout):
            failed += not got.startswith("PASS")
            print(f"{tag} flags {line}: {got}", flush=True)
        if opts.flags_only:
            continue
        for world, tp, cp, forward_only in CASES:
            case = dict(tree=str(tree), extra=opts.extra, world=world, tp=tp, cp=cp)
            case.update(seed=opts.seed, forward_only=forward_only)
            ok, detail = run_case(case, opts.timeout)
            mode = "forward-only" if forward_only else "train"
            failed += not ok
            print(
                f"{tag} ranks={world} tp={tp} cp={cp} {mode}: {'PASS' if ok else 'FAIL'} {detail}",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
