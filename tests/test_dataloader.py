"""Global batches, per-rank dispatch (gloo), labels and positions, resume, background planning."""

import json
import time

import numpy as np
import pytest

from hdp import ClusterSpec, model_preset
from hdp.dataloader import IGNORE_INDEX, BatchStream, HDPDataLoader, JsonlSource, SyntheticSource
from hdp.testing.ranks import run_ranks


def corpus(seed=0, n=300):
    rng = np.random.default_rng(seed)
    lens = np.where(rng.random(n) < 0.05, rng.integers(3000, 9000, n), rng.integers(1, 400, n))
    lens[7] = 0  # an empty document
    return lens


def epoch_tokens(stream, lengths, source=0):
    """Run batches until epoch 0 of ``source`` is fully delivered; {doc: covered positions}."""
    seen = {}
    for _ in range(10_000):
        b = stream.next_batch()
        assert b.tokens <= stream.tokens_per_step
        for s in b.seqs:
            if s.source == source and s.epoch == 0:
                seen.setdefault(s.doc, []).append((s.offset, s.offset + s.length))
        done = sum(e - a for v in seen.values() for a, e in v)
        if done == int(lengths.sum()):
            return seen
    raise AssertionError("epoch never completed")


def test_every_token_exactly_once_per_epoch():
    lens = corpus()
    stream = BatchStream([lens], tokens_per_step=8192, max_seq=2048, seed=1)
    seen = epoch_tokens(stream, lens)
    assert set(seen) == set(np.flatnonzero(lens).tolist())
    for doc, spans in seen.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == lens[doc]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # chunks tile the document
        assert all(e - a <= 2048 for a, e in spans)


def test_outliers_are_spread_over_steps():
    lens = np.array([4096] * 8 + [100] * 2000)
    stream = BatchStream(
        [lens], tokens_per_step=16384, max_seq=4096, seed=0, lookahead_steps=8, outlier_tokens=2048
    )
    batches = [stream.next_batch().seqs for _ in range(12)]
    per_step = [sum(s.length >= 2048 for s in b) for b in batches]
    assert max(per_step) <= 2, per_step  # never all eight long documents in one step
    assert sum(s.length >= 2048 and s.epoch == 0 for b in batches for s in b) == 8


def test_shuffle_differs_by_epoch_and_seed_and_mixing_weights():
    lens = np.full(50, 10)
    stream = BatchStream([lens], 100, 10, seed=0)
    a = [s.doc for _ in range(10) for s in stream.next_batch().seqs]
    assert len(a) == 100 and sorted(a[:50]) == sorted(a[50:]) == list(range(50))
    assert a[:50] != a[50:]  # a new order every epoch
    b = [s.doc for s in BatchStream([lens], 100, 10, seed=1).next_batch().seqs]
    assert b != a[:10]
    mixed = BatchStream([np.full(1000, 10), np.full(1000, 10)], 1000, 10, weights=[3, 1])
    taken = [s.source for _ in range(20) for s in mixed.next_batch().seqs]
    assert abs(taken.count(0) / len(taken) - 0.75) < 0.02


def test_truncate_counts_what_it_drops():
    """A batch's truncated tokens are what its documents lost (full length - trained length),
    counted once, when the batch trains them; the stream's total is the batches' sum."""
    lens = np.array([5000, 10, 4100, 300])
    stream = BatchStream([lens], 8192, 4096, truncate=True)
    total = 0
    for _ in range(6):
        b = stream.next_batch()
        assert all(s.length <= 4096 and s.offset == 0 for s in b.seqs)
        assert b.truncated_tokens == sum(int(lens[s.doc]) - s.length for s in b.seqs)
        total += b.truncated_tokens
        st = stream.state_dict()
        assert st["truncated_tokens"] == total
        # read = trained + what the trained documents lost + the documents still waiting
        waiting = sum(int(lens[r[2]]) for r in st["pending"] + st["outliers"])
        assert sum(st["taken"]) == st["trained_tokens"] + st["truncated_tokens"] + waiting
    assert total > 0 and total % 904 != 0  # both long documents were cut (904 and 4)


def test_resume_gives_the_same_batches():
    lens = corpus(3)
    ref = BatchStream([lens], 8192, 2048, seed=5)
    ref_batches = [ref.next_batch().seqs for _ in range(12)]
    first = BatchStream([lens], 8192, 2048, seed=5)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = BatchStream([lens], 8192, 2048, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.next_batch().seqs for _ in range(7)] == ref_batches[5:]
    with pytest.raises(ValueError, match="data configuration changed.*max_seq: 2048 -> 1024"):
        BatchStream([lens], 8192, 1024, seed=5).load_state_dict(state)


def test_bad_configuration():
    with pytest.raises(ValueError, match="max_seq .* exceeds tokens_per_step"):
        BatchStream([np.array([10])], 100, 200)
    with pytest.raises(ValueError, match="no document with tokens"):
        BatchStream([np.array([0, 0])], 100, 10)


def make_loader(path, world, strategy="hdp", seed=0, plan_ahead=2, tokens=4096, state=None):
    src = JsonlSource(path, vocab_size=512)
    stream = BatchStream([src.lengths], tokens_per_step=tokens, max_seq=1024, seed=seed)
    loader = HDPDataLoader(
        [src],
        stream,
        ClusterSpec.preset("cpu", world, 2),
        model_preset("tiny"),
        strategy,
        plan_ahead=plan_ahead,
        plan_options={"capacity": 2048},
    )
    if state is not None:
        loader.load_state_dict(state)
    return loader, src


def write_corpus(tmp_path, seed=0, n=120):
    rng = np.random.default_rng(seed)
    lens = np.where(rng.random(n) < 0.1, rng.integers(900, 2500, n), rng.integers(1, 200, n))
    docs = [rng.integers(0, 512, int(L)).tolist() for L in lens]
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    return p, docs


def check_wave_data(step, src, world_rank):
    """Labels are the next token of the same sequence; positions restart at each sequence."""
    out = []
    for wd in step.waves:
        assert wd.input_ids.shape == wd.labels.shape == wd.position_ids.shape
        assert wd.cu_seqlens.tolist()[-1] == wd.input_ids.numel()
        for i, (s, a, b) in enumerate(wd.shards):
            ref = step.seqs[s]
            lo, hi = wd.cu_seqlens[i].item(), wd.cu_seqlens[i + 1].item()
            doc = src.read(ref.doc)
            assert wd.input_ids[lo:hi].tolist() == doc[ref.offset + a : ref.offset + b].tolist()
            assert wd.position_ids[lo:hi].tolist() == list(range(a, b))
            want = doc[ref.offset + a + 1 : ref.offset + min(b + 1, ref.length)].tolist()
            if b == ref.length:
                want.append(IGNORE_INDEX)
            assert wd.labels[lo:hi].tolist() == want
            out.append((ref.epoch, ref.doc, ref.offset + a, ref.offset + b))
    return out


def test_single_process_loader_labels_and_positions(tmp_path):
    p, docs = write_corpus(tmp_path)
    loader, src = make_loader(p, 1)
    for _ in range(4):
        step = next(loader)
        check_wave_data(step, src, 0)
        assert step.loss_tokens == sum(s.length - 1 for s in step.seqs)
        assert step.tokens == sum(s.length for s in step.seqs) <= 4096
    loader.close()


def _exactly_once_rank(rank, world, path, out_dir, steps):
    import torch.distributed as dist

    loader, src = make_loader(path, world)
    spans = []
    for _ in range(steps):
        spans += check_wave_data(next(loader), src, rank)
    state = loader.sync_state()
    loader.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, spans)
    if rank == 0:
        with open(f"{out_dir}/spans_{world}.json", "w") as f:
            json.dump({"spans": [s for g in gathered for s in g], "state": state}, f)


@pytest.mark.parametrize("world", [2, 4])
def test_every_token_once_across_ranks(tmp_path, world):
    p, docs = write_corpus(tmp_path)
    total = sum(len(d) for d in docs)
    steps = -(-total // 4096) + 8  # enough steps to finish epoch 0
    run_ranks(_exactly_once_rank, world, str(p), str(tmp_path), steps)
    spans = json.loads((tmp_path / f"spans_{world}.json").read_text())["spans"]
    covered = {}
    for epoch, doc, a, b in spans:
        if epoch == 0:
            for t in range(a, b):
                key = (doc, t)
                assert key not in covered, f"token {t} of document {doc} delivered twice"
                covered[key] = True
    assert len(covered) == total


def _resume_rank(rank, world, path, state, out_dir, steps):
    import torch.distributed as dist

    loader, src = make_loader(path, world, state=state)
    seqs = [list(map(list, next(loader).seqs)) for _ in range(steps)]
    loader.close()
    if rank == 0:
        with open(f"{out_dir}/resume_{world}.json", "w") as f:
            json.dump(seqs, f)
    dist.barrier()


def test_resume_with_a_different_rank_count(tmp_path):
    p, _ = write_corpus(tmp_path, seed=4)
    # Uninterrupted: 6 steps on one process.
    loader, _ = make_loader(p, 1)
    full = [list(map(list, next(loader).seqs)) for _ in range(6)]
    loader.close()
    # Interrupted after 2 steps (with planning ahead), resumed on 2 ranks.
    loader, _ = make_loader(p, 1)
    for _ in range(2):
        next(loader)
    time.sleep(0.2)  # the planner thread has run ahead; the state must not
    state = loader.state_dict()
    loader.close()
    run_ranks(_resume_rank, 2, str(p), state, str(tmp_path), 4)
    assert json.loads((tmp_path / "resume_2.json").read_text()) == full[2:]


def _wait_for(condition, limit_s: float = 120.0) -> bool:
    """Poll ``condition`` until it holds; False after ``limit_s`` (a stuck producer), so no
    assertion depends on how fast this machine plans."""
    end = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_background_planning_never_delays_a_slow_step(tmp_path):
    """While a step trains, the next ones are planned: before each request the loader already
    holds ``plan_ahead`` planned steps, so the step only reads its tokens."""
    p, _ = write_corpus(tmp_path, seed=2)
    loader, _ = make_loader(p, 1, plan_ahead=2)
    next(loader)
    for _ in range(4):
        # A training step slower than planning: the producer fills the queue meanwhile.
        assert _wait_for(lambda: loader.ready_plans() >= 2), "planning never got ahead"
        next(loader)
    loader.close()


def test_loader_rejects_a_cluster_of_the_wrong_size(tmp_path):
    p, _ = write_corpus(tmp_path)
    src = JsonlSource(p, vocab_size=512)
    with pytest.raises(ValueError, match="cluster spec has 4 ranks but the process group has 1"):
        HDPDataLoader(
            [src],
            BatchStream([src.lengths], 4096, 1024),
            ClusterSpec.preset("cpu", 4),
            model_preset("tiny"),
        )


def test_synthetic_source_through_the_loader():
    src = SyntheticSource("wlb-128k", 200, 512, seed=0)
    stream = BatchStream([src.lengths], 1 << 16, 1 << 14)
    loader = HDPDataLoader(
        [src],
        stream,
        ClusterSpec.preset("cpu", 1),
        model_preset("tiny"),
        "hdp",
        plan_options={"capacity": 1 << 16},
    )
    step = next(loader)
    assert sum(w.input_ids.numel() for w in step.waves) == step.tokens
    assert all(int(w.input_ids.max()) < 512 for w in step.waves if w.input_ids.numel())
    loader.close()


class Block16Loader(HDPDataLoader):
    """Plans with 16-token K/V messages (the planner keeps the default), and remembers them."""

    def _plan(self, batch):
        plan, dt = super()._plan(batch)
        plan.kv_block_tokens = 16
        self.planned = [*getattr(self, "planned", []), plan]
        return plan, dt


def make_block16_loader(path, world):
    src = JsonlSource(path, vocab_size=512)
    stream = BatchStream([src.lengths], tokens_per_step=4096, max_seq=2048, seed=1)
    cluster = ClusterSpec.preset("cpu", world, 2)
    return Block16Loader([src], stream, cluster, model_preset("tiny"), "hdp", plan_options={})


def plan_summary(step):
    p = step.plan
    return {
        "wire": p.to_wire().tolist(),
        "fields": [p.kv_block_tokens, p.strategy, p.capacity, p.predicted, p.sync, p.num_waves],
        "rounds": [repr(p.comm_rounds(w)) for w in range(p.num_waves)],
        "header": [
            step.step,
            step.truncated_tokens,
            step.plan_time_s,
            [list(s) for s in step.seqs],
        ],
    }


def _same_plan_rank(rank, world, path, out_dir, steps):
    import torch.distributed as dist

    loader = make_block16_loader(path, world)
    mine = [plan_summary(next(loader)) for _ in range(steps)]
    loader.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(f"{out_dir}/plans_{world}.json", "w") as f:
            json.dump(gathered, f)


def test_every_rank_runs_the_plan_rank0_planned(tmp_path):
    p, _ = write_corpus(tmp_path, seed=3)
    run_ranks(_same_plan_rank, 2, str(p), str(tmp_path), 3)
    ranks = json.loads((tmp_path / "plans_2.json").read_text())
    assert ranks[1] == ranks[0]
    for step in ranks[0]:
        block, strategy, capacity, predicted, _, _ = step["fields"]
        assert block == 16 and strategy == "hdp" and capacity is not None
        assert predicted["step_time_s"] > 0 and step["header"][2] > 0


def test_one_rank_takes_its_step_as_the_planning_thread_read_it(tmp_path):
    """With no other rank to tell, the plan is not encoded and decoded, and the tokens are read
    in the planning thread, off the training thread (several ranks: the test above)."""
    p, _ = write_corpus(tmp_path, seed=3)
    loader = make_block16_loader(p, 1)
    step = next(loader)
    loader.close()
    assert step.plan is loader.planned[0] and step.plan.kv_block_tokens == 16
    assert [w.input_ids.numel() for w in step.waves] == [step.tokens]


def test_weights_near_the_float_limit_mix_as_their_ratio():
    """--data-weights 1e308,1e308: their sum overflows, their ratio is 1:1."""
    lengths = [np.full(50, 10), np.full(50, 10)]
    huge = BatchStream(lengths, tokens_per_step=100, max_seq=10, weights=[1e308, 1e308], seed=0)
    even = BatchStream(lengths, tokens_per_step=100, max_seq=10, weights=[1, 1], seed=0)
    assert huge.weights.tolist() == even.weights.tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="finite non-negative"):
        BatchStream(lengths, tokens_per_step=100, max_seq=10, weights=[float("inf"), 1])
