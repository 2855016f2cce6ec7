"""Document sources: each format, lengths without tokens, every bad-input case (fail and skip)."""

import json
import os

import numpy as np
import pytest

from hdp.dataloader import DataError, JsonlSource, MegatronSource, SyntheticSource, open_source
from hdp.dataloader.cli import main as data_main

DOCS = [[5, 6, 7], list(range(100, 140)), [1], list(range(200, 203)) * 50]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_input_ids_and_index_cache(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": d} for d in DOCS] + [{"input_ids": []}])
    src = JsonlSource(p, vocab_size=512)
    assert src.lengths.tolist() == [len(d) for d in DOCS]
    assert src.skipped_documents == 1 and src.skipped_tokens == 0  # the empty document
    for i, d in enumerate(DOCS):
        assert src.read(i).tolist() == d
    assert src.read(1, 5, 9).tolist() == DOCS[1][5:9]
    assert (tmp_path / "d.jsonl.hdpidx.npz").exists()
    again = JsonlSource(p, vocab_size=512)  # from the cache
    assert again.lengths.tolist() == src.lengths.tolist()
    # Changing the file invalidates the cache.
    write_jsonl(p, [{"input_ids": [1, 2]}])
    os.utime(p, ns=(1, 1))
    assert JsonlSource(p, vocab_size=512).lengths.tolist() == [2]


def test_jsonl_text_with_byte_tokenizer(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "héllo"}, {"text": "ab"}])
    src = JsonlSource(p)
    assert src.lengths.tolist() == [6, 2]  # é is two UTF-8 bytes
    assert src.read(0).tolist() == list("héllo".encode())


def test_jsonl_text_with_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    from hdp.dataloader import load_tokenizer

    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world hello"}, {"text": "what"}])
    src = JsonlSource(p, load_tokenizer(tmp_path / "tokenizer.json"))
    assert src.lengths.tolist() == [3, 1] and src.read(0).tolist() == [1, 2, 1]
    write_jsonl(p, [{"text": "hello"}, '{"text": "x\\udc00"}'])
    with pytest.raises(DataError, match=r"t.jsonl, line 2: field 'text' holds a lone surrogate"):
        JsonlSource(p, load_tokenizer(tmp_path / "tokenizer.json"))


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"input_ids": [1, 2', "line 2: malformed JSON"),
        ('{"input_ids": "1 2 3"}', "line 2: field 'input_ids' must be a list of integers, got str"),
        ('{"input_ids": [1, 2.5]}', "line 2: field 'input_ids' must hold integers, found 2.5"),
        ('{"input_ids": [1, 999]}', "line 2: token id 999 is outside the vocabulary [0, 512)"),
        ('{"text": 7}', "line 2: field 'text' must be a string, got int"),
        ('{"ids": [1]}', "line 2: has neither 'input_ids' nor 'text'"),
        ("[1, 2]", "line 2: expected a JSON object, got list"),
        ('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 2: JSON nested too deeply"),
        ('{"input_ids": [' + "7" * 5000 + "]}", "line 2: malformed JSON (Exceeds the limit"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else v,
)
def test_jsonl_bad_records_fail_or_are_counted(tmp_path, line, problem):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [1, 2, 3]}, line, {"input_ids": [4]}])
    with pytest.raises(DataError) as e:
        JsonlSource(p, vocab_size=512)
    assert f"bad.jsonl, {problem}" in str(e.value) and "--skip-bad-records" in str(e.value)
    src = JsonlSource(p, vocab_size=512, skip_bad=True)
    assert src.lengths.tolist() == [3, 1] and src.skipped_documents == 1
    assert src.read(1).tolist() == [4]


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: cannot open"):
        JsonlSource(tmp_path / "nope.jsonl")
    p = write_jsonl(tmp_path / "locked.jsonl", [{"input_ids": [1]}])
    p.chmod(0)
    if os.access(p, os.R_OK):  # root reads anything: check the message path another way
        p.chmod(0o644)
        d = tmp_path / "dir.jsonl"
        d.mkdir()
        with pytest.raises(DataError, match="dir.jsonl: cannot open"):
            JsonlSource(d)
    else:
        with pytest.raises(DataError, match="locked.jsonl: cannot open"):
            JsonlSource(p)
    with pytest.raises(DataError, match="no such file"):
        open_source(str(tmp_path / "nothing.jsonl.gz"))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": DOCS}), tmp_path / "d.parquet", row_group_size=2)
    src = open_source(str(tmp_path / "d.parquet"), vocab_size=512)
    assert src.lengths.tolist() == [len(d) for d in DOCS]
    assert [src.read(i).tolist() for i in range(4)] == DOCS
    pq.write_table(pa.table({"input_ids": [[1, 2], [1, 600], [3]]}), tmp_path / "bad.parquet")
    with pytest.raises(
        DataError, match=r"bad.parquet, row 1: token id 600 is outside the vocabulary"
    ):
        open_source(str(tmp_path / "bad.parquet"), vocab_size=512)
    src = open_source(str(tmp_path / "bad.parquet"), vocab_size=512, skip_bad=True)
    assert src.lengths.tolist() == [2, 1] and src.skipped_documents == 1 and src.skipped_tokens == 2
    pq.write_table(pa.table({"text": ["ab", "cde"]}), tmp_path / "t.parquet")
    assert open_source(str(tmp_path / "t.parquet")).read(1).tolist() == list(b"cde")


def write_megatron(prefix, docs, dtype=np.int32):
    """Write with megatron-core's own builder where installed, else by the format's definition."""
    try:
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
        for d in docs:
            b.add_item(torch.tensor(d))
            b.end_document()
        b.finalize(str(prefix) + ".idx")
        return True
    except ImportError:
        import struct

        codes = {np.int32: 4, np.uint16: 8, np.int64: 5}
        with open(str(prefix) + ".bin", "wb") as f:
            for d in docs:
                f.write(np.asarray(d, dtype=dtype).tobytes())
        lens = np.array([len(d) for d in docs], dtype=np.int32)
        ptr = (
            np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
        )
        with open(str(prefix) + ".idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", codes[dtype]))
            f.write(struct.pack("<QQ", len(docs), len(docs) + 1))
            f.write(
                lens.tobytes() + ptr.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes()
            )
        return False


@pytest.mark.parametrize("dtype", [np.int32, np.uint16])
def test_megatron_bin_idx(tmp_path, dtype):
    prefix = tmp_path / "corpus_text_document"
    by_megatron = write_megatron(prefix, DOCS, dtype)
    src = open_source(str(prefix), vocab_size=512)
    assert isinstance(src, MegatronSource)
    assert src.lengths.tolist() == [len(d) for d in DOCS]
    assert [src.read(i).tolist() for i in range(len(DOCS))] == DOCS
    assert src.read(3, 10, 13).tolist() == DOCS[3][10:13]
    assert open_source(str(prefix) + ".bin").lengths.tolist() == src.lengths.tolist()
    if by_megatron:  # megatron-core reads the same tokens
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(str(prefix), mmap=True)
        assert [ds[i].tolist() for i in range(len(DOCS))] == DOCS


def test_megatron_bad_inputs(tmp_path):
    prefix = tmp_path / "c"
    write_megatron(prefix, DOCS)
    os.remove(str(prefix) + ".idx")
    with pytest.raises(DataError, match=r"c.idx: missing index file"):
        open_source(str(prefix))
    write_megatron(prefix, DOCS)
    data = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(data[: len(data) - 40])  # truncate inside the last document
    with pytest.raises(DataError, match=r"c.bin: truncated: document 3 needs bytes"):
        open_source(str(prefix))
    src = open_source(str(prefix), skip_bad=True)
    assert (
        src.lengths.tolist() == [3, 40, 1, 0]
        and src.skipped_documents == 1
        and src.skipped_tokens == 150
    )
    write_megatron(prefix, [[1, 2], [3, 700], [4]])
    with pytest.raises(
        DataError, match=r"c.bin: document 1: token id 700 is outside the vocabulary"
    ):
        open_source(str(prefix), vocab_size=512)
    src = open_source(str(prefix), vocab_size=512, skip_bad=True)
    assert src.lengths.tolist() == [2, 0, 1] and src.skipped_documents == 1
    for field, offset, value in (("length", 0, -5), ("pointer", 4 * 3, -8)):
        write_megatron(prefix, [[1, 2], [3, 4, 5], [6]])
        idx = bytearray((tmp_path / "c.idx").read_bytes())
        at = 34 + offset + (4 if field == "length" else 8)  # document 1's field
        size = 4 if field == "length" else 8
        idx[at : at + size] = value.to_bytes(size, "little", signed=True)
        (tmp_path / "c.idx").write_bytes(bytes(idx))
        with pytest.raises(DataError, match=f"c.idx: document 1: negative {field} {value} "):
            open_source(str(prefix))
        src = open_source(str(prefix), skip_bad=True)
        assert src.lengths.tolist() == [2, 0, 1] and src.skipped_documents == 1
        assert [src.read(0).tolist(), src.read(2).tolist()] == [[1, 2], [6]]
    (tmp_path / "c.idx").write_bytes(b"garbage")
    with pytest.raises(DataError, match="not a Megatron index file"):
        open_source(str(prefix))
    for code, name in ((6, "float64"), (7, "float32")):  # float "token ids" were truncated
        write_megatron(prefix, DOCS)
        idx = bytearray((tmp_path / "c.idx").read_bytes())
        idx[17] = code
        (tmp_path / "c.idx").write_bytes(bytes(idx))
        with pytest.raises(DataError, match=f"c.idx: dtype code {code} \\({name}\\) holds no"):
            open_source(str(prefix))


def test_synthetic_is_deterministic():
    a, b = (
        SyntheticSource("byted-2m", 50, 512, seed=3),
        SyntheticSource("byted-2m", 50, 512, seed=3),
    )
    assert a.lengths.tolist() == b.lengths.tolist()
    assert a.read(7, 3, 20).tolist() == b.read(7)[3:20].tolist()
    assert (a.read(7) < 512).all()


def test_synthetic_tokens_walk_the_vocabulary_by_small_strides():
    # What makes them learnable: each token follows the one before it by 1, 2, 3 or 5 (mod the
    # vocabulary), by 1 most often.
    src = SyntheticSource("wlb-128k", 20, 512, seed=1)
    strides = np.concatenate([np.diff(src.read(d)) % 512 for d in range(20)])
    assert set(np.unique(strides).tolist()) == {1, 2, 3, 5}
    assert 0.65 < np.mean(strides == 1) < 0.75


def test_hdp_data_stats(tmp_path, capsys):
    p = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": d} for d in DOCS] + ["{oops"])
    assert data_main(["stats", str(p), "--json", "--skip-bad-records", "--max-seq", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["documents"] == 4 and out["tokens"] == 194 and out["skipped_documents"] == 1
    assert out["sequences"] == 6 and out["lengths"]["max"] == 64 and out["skipped_tokens"] == 0
    assert data_main(["stats", str(p)]) == 2
    assert "d.jsonl, line 5: malformed JSON" in capsys.readouterr().err
    assert data_main(["stats", str(p), "--skip-bad-records"]) == 0
    text = capsys.readouterr().out
    assert "documents 4" in text and "length histogram" in text


def test_input_ids_are_not_held_to_a_byte_vocabulary(tmp_path, capsys):
    """A tokenized corpus (ids above 255) is read as it is: hdp-data bounds ids only by
    --vocab-size or --model, as training bounds them by its model's vocabulary."""
    docs = [[5, 300, 7], [31999, 2], [40000]]
    p = write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": d} for d in docs])
    assert data_main(["stats", str(p), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["documents"] == 3 and out["tokens"] == 6 and out["skipped_documents"] == 0
    # llama-7b's vocabulary is 32000: the last document is out of it, for hdp-data and training.
    assert data_main(["stats", str(p), "--model", "llama-7b"]) == 2
    assert "tok.jsonl, line 3: token id 40000 is outside the vocabulary [0, 32000)" in (
        capsys.readouterr().err
    )
    with pytest.raises(DataError, match=r"line 3: token id 40000 is outside .*\[0, 32000\)"):
        open_source(str(p), vocab_size=32000)  # what pretrain.py --model llama-7b opens
    assert (
        data_main(["stats", str(p), "--vocab-size", "32000", "--skip-bad-records", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["documents"] == 2 and out["skipped_documents"] == 1 and out["skipped_tokens"] == 1


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"input_ids": [1, ' + str(2**70) + ", 2]}", "token id 1180591620717411303424 is outside"),
        ('{"input_ids": [-3]}', "token id -3 is outside"),
        ('{"text": "x\\ud800y"}', "field 'text' holds a lone surrogate (\\ud800) at character 1"),
    ],
)
def test_records_beyond_int64_or_unicode_are_named_and_skippable(tmp_path, capsys, line, problem):
    p = write_jsonl(tmp_path / "odd.jsonl", [{"text": "ok"}, line, {"input_ids": [4]}])
    assert data_main(["stats", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"odd.jsonl, line 2: {problem}" in err
    assert data_main(["stats", str(p), "--skip-bad-records", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["documents"] == 2 and out["tokens"] == 3 and out["skipped_documents"] == 1


def test_a_source_fingerprint_names_its_file_size_documents_and_lengths(tmp_path):
    """What a checkpoint records of each source, written out here independently: the same for
    runs made before sources computed it themselves, so their checkpoints still resume."""
    import hashlib

    p = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": d} for d in DOCS] + [{"input_ids": []}])
    lengths = np.array([len(d) for d in DOCS], dtype=np.int64)  # the empty one is skipped
    assert JsonlSource(p).fingerprint() == {
        "name": "d.jsonl",
        "bytes": os.path.getsize(p),
        "documents": len(DOCS),
        "tokens": int(lengths.sum()),
        "lengths_sha256": hashlib.sha256(lengths.tobytes()).hexdigest()[:16],
    }
    synthetic = SyntheticSource("wlb-128k", documents=5, seed=7).fingerprint()
    assert synthetic["name"] == "synthetic:wlb-128k" and synthetic["seed"] == 7
    assert synthetic["bytes"] == 0 and synthetic["documents"] == 5
