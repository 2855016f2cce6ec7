"""Document sources: each knows its documents' token counts before reading their tokens.

* :class:`JsonlSource`: one JSON object per line with ``input_ids`` (a list of ints) or ``text``
  (tokenized with a local HF ``tokenizer.json`` or the built-in byte tokenizer). Lengths come from
  an index pass (byte offset and token count of every line), cached beside the file as
  ``FILE.hdpidx.npz`` and rebuilt when the file's size or mtime, or the tokenizer, changes.
* :class:`ParquetSource`: a parquet/arrow file with an ``input_ids`` (list of ints) or ``text``
  column (``pyarrow``, the ``parquet`` extra).
* :class:`MegatronSource`: a Megatron-LM indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``), read
  directly (memory-mapped); each sequence of the index is a document.
* :class:`SyntheticSource`: lengths drawn from a standard workload, tokens from a seeded generator.

A bad record (malformed JSON, a missing or mistyped field, a token id outside the vocabulary, a
document past the end of a truncated ``.bin``) raises :class:`DataError` naming the file, the line
or document and the problem. With ``skip_bad=True`` it is skipped and counted instead
(``skipped_documents``, ``skipped_tokens``; tokens of records that cannot be parsed are unknown
and not counted). Token ids are int64 numpy arrays.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from hdp.argtypes import MAX_DOCUMENTS

from .tokenizer import Tokenizer, load_tokenizer


class DataError(ValueError):
    """Bad input data: the message names the file, the line or document, and the problem."""


class Source(Protocol):
    name: str
    lengths: np.ndarray  # int64 [documents]: tokens of each usable document (0 = skipped)
    skipped_documents: int
    skipped_tokens: int

    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray: ...

    def fingerprint(self) -> dict:
        """What identifies the source's tokens without reading them (a resumed run checks it)."""
        ...


def fingerprint(name: str, lengths: np.ndarray, files: Sequence[Path], **extra: int) -> dict:
    """A source's :meth:`Source.fingerprint`: its name (a file's, without its folder), the size of
    its files, its documents and tokens, a hash of its lengths, and ``extra``."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    return {
        "name": name if name.startswith("synthetic:") else Path(name).name,
        "bytes": sum(os.stat(p).st_size for p in files),
        "documents": int(np.count_nonzero(lengths)),
        "tokens": int(lengths.sum()),
        "lengths_sha256": hashlib.sha256(lengths.tobytes()).hexdigest()[:16],
        **extra,
    }


@dataclass
class _Skips:
    documents: int = 0
    tokens: int = 0


def _check_ids(ids: object, vocab_size: int | None) -> tuple[np.ndarray | None, str | None, int]:
    """(ids, problem, known token count) for an ``input_ids`` value."""
    if not isinstance(ids, list):
        return None, f"field 'input_ids' must be a list of integers, got {type(ids).__name__}", 0
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        bad = next(x for x in ids if not isinstance(x, int) or isinstance(x, bool))
        return None, f"field 'input_ids' must hold integers, found {bad!r}", len(ids)
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # an id beyond int64 (2**70): no vocabulary holds it
        bad = next(x for x in ids if not -(2**63) <= x < 2**63)
        limit = vocab_size if vocab_size is not None else "2**63"
        return None, f"token id {bad} is outside the vocabulary [0, {limit})", len(ids)
    if arr.size and (arr.min() < 0 or (vocab_size is not None and arr.max() >= vocab_size)):
        bad = int(arr[(arr < 0) | ((arr >= vocab_size) if vocab_size is not None else False)][0])
        limit = vocab_size if vocab_size is not None else "2**63"
        return None, f"token id {bad} is outside the vocabulary [0, {limit})", int(arr.size)
    return arr, None, int(arr.size)


def _encode_text(
    tokenizer: Tokenizer, text: str, vocab_size: int | None
) -> tuple[np.ndarray | None, str | None, int]:
    """(ids, problem, known token count) for a ``text`` value."""
    try:
        ids = tokenizer.encode(text)
    except UnicodeEncodeError as e:  # valid JSON ("\ud800") but not Unicode text
        bad = text[e.start : e.end].encode("unicode_escape").decode("ascii")
        return None, f"field 'text' holds a lone surrogate ({bad}) at character {e.start}", 0
    if vocab_size is None:
        return ids, None, int(ids.size)
    return _check_ids(ids.tolist(), vocab_size)


class JsonlSource:
    """JSON lines with ``input_ids`` or ``text``; see the module docstring."""

    INDEX_VERSION = 1

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer | None = None,
        vocab_size: int | None = None,
        skip_bad: bool = False,
        cache_index: bool = True,
    ) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        self.tokenizer = tokenizer or load_tokenizer(None)
        # input_ids are bounded by the vocabulary given (the model's in training, --vocab-size in
        # hdp-data), never by the text tokenizer's: a tokenized corpus need not be bytes.
        self.vocab_size = vocab_size
        self.skip_bad = skip_bad
        try:
            st = self.path.stat()
        except OSError as e:
            raise DataError(f"{self.path}: cannot open: {e.strerror}") from None
        key = np.array(
            [st.st_size, st.st_mtime_ns, self.INDEX_VERSION, self.vocab_size or -1], dtype=np.int64
        )
        cache = self.path.with_name(self.path.name + ".hdpidx.npz")
        loaded = self._load_cache(cache, key) if cache_index else None
        if loaded is None:
            self.offsets, self.lengths, skips = self._index()
            if cache_index:
                # Written under a private name, then renamed: ranks that index the same file at once
                # never read a half-written cache (one read it as an empty zip: EOFError in CI).
                partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial.npz")
                try:
                    np.savez(
                        partial,
                        key=key,
                        offsets=self.offsets,
                        lengths=self.lengths,
                        skips=np.array([skips.documents, skips.tokens]),
                        tokenizer=np.array(self.tokenizer.id),
                    )
                    os.replace(partial, cache)
                except OSError:  # read-only data folder: keep the index in memory only
                    with contextlib.suppress(OSError):
                        partial.unlink(missing_ok=True)
        else:
            self.offsets, self.lengths, skips = loaded
        self.skipped_documents, self.skipped_tokens = skips.documents, skips.tokens
        self._fh = None  # opened on first read, kept for the next ones

    def _load_cache(self, cache: Path, key: np.ndarray):
        try:
            with np.load(cache) as z:
                if not np.array_equal(z["key"], key) or str(z["tokenizer"]) != self.tokenizer.id:
                    return None
                if not self.skip_bad and int(z["skips"][0]) > 0:
                    return None  # re-scan so that the first bad record is reported
                s = z["skips"]
                return z["offsets"], z["lengths"], _Skips(int(s[0]), int(s[1]))
        except (OSError, KeyError, ValueError):
            return None

    def _parse(self, raw: bytes, line_no: int) -> tuple[np.ndarray | None, str | None, int]:
        try:
            obj = json.loads(raw)
        except RecursionError:
            return None, "JSON nested too deeply to read", 0
        except (ValueError, UnicodeDecodeError) as e:  # an integer past Python's digit limit too
            return None, f"malformed JSON ({e.msg if hasattr(e, 'msg') else e})", 0
        if not isinstance(obj, dict):
            return None, f"expected a JSON object, got {type(obj).__name__}", 0
        if "input_ids" in obj:
            return _check_ids(obj["input_ids"], self.vocab_size)
        if "text" in obj:
            if not isinstance(obj["text"], str):
                return None, f"field 'text' must be a string, got {type(obj['text']).__name__}", 0
            return _encode_text(self.tokenizer, obj["text"], self.vocab_size)
        return None, "has neither 'input_ids' nor 'text'", 0

    def _index(self) -> tuple[np.ndarray, np.ndarray, _Skips]:
        offsets, lengths, skips = [], [], _Skips()
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise DataError(f"{self.path}: cannot open: {e.strerror}") from None
        with f:
            pos = 0
            for line_no, raw in enumerate(f, start=1):
                start, pos = pos, pos + len(raw)
                if not raw.strip():
                    continue
                ids, problem, known = self._parse(raw, line_no)
                if problem is not None:
                    if not self.skip_bad:
                        raise DataError(
                            f"{self.path}, line {line_no}: {problem} "
                            "(use --skip-bad-records to skip such records)"
                        )
                    skips.documents += 1
                    skips.tokens += known
                    continue
                if ids.size == 0:
                    skips.documents += 1  # empty documents are skipped and counted
                    continue
                offsets.append(start)
                lengths.append(ids.size)
        return np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64), skips

    def fingerprint(self) -> dict:
        return fingerprint(self.name, self.lengths, [self.path])

    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        if self._fh is None:
            self._fh = open(self.path, "rb")
        self._fh.seek(int(self.offsets[doc]))
        raw = self._fh.readline()
        ids, problem, _ = self._parse(raw, -1)
        if problem is not None or ids.size != self.lengths[doc]:
            raise DataError(
                f"{self.path}: document {doc} changed since it was indexed; delete "
                f"{self.path.name}.hdpidx.npz or restore the file"
            )
        return ids[start:end]


class ParquetSource:
    """A parquet file with an ``input_ids`` (list of ints) or ``text`` column."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer | None = None,
        vocab_size: int | None = None,
        skip_bad: bool = False,
    ) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(
                f"{path}: reading parquet needs pyarrow (pip install 'hdp-llm[parquet]')"
            ) from None
        self.path = Path(path)
        self.name = str(self.path)
        self.tokenizer = tokenizer or load_tokenizer(None)
        self.vocab_size = vocab_size  # as JsonlSource's: the tokenizer's bounds only its own ids
        try:
            self.file = pq.ParquetFile(self.path)
        except (
            OSError,
            Exception,
        ) as e:  # pyarrow raises its own ArrowInvalid for non-parquet files
            raise DataError(f"{self.path}: cannot read parquet: {e}") from None
        names = self.file.schema_arrow.names
        if "input_ids" in names:
            self.column = "input_ids"
        elif "text" in names:
            self.column = "text"
        else:
            raise DataError(
                f"{self.path}: has neither an 'input_ids' nor a 'text' column "
                f"(columns: {', '.join(names)})"
            )
        self.row_group_starts = np.cumsum(
            [0]
            + [self.file.metadata.row_group(i).num_rows for i in range(self.file.num_row_groups)]
        )
        lengths, skips = [], _Skips()
        self._valid = []
        for g in range(self.file.num_row_groups):
            col = self.file.read_row_group(g, columns=[self.column]).column(0).to_pylist()
            for i, val in enumerate(col):
                row = int(self.row_group_starts[g]) + i
                ids, problem, known = self._convert(val)
                if problem is not None:
                    if not skip_bad:
                        raise DataError(
                            f"{self.path}, row {row}: {problem} "
                            "(use --skip-bad-records to skip such records)"
                        )
                    skips.documents += 1
                    skips.tokens += known
                    continue
                if ids.size == 0:
                    skips.documents += 1
                    continue
                self._valid.append(row)
                lengths.append(ids.size)
        self.rows = np.asarray(self._valid, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.skipped_documents, self.skipped_tokens = skips.documents, skips.tokens

    def _convert(self, val) -> tuple[np.ndarray | None, str | None, int]:
        if self.column == "input_ids":
            return _check_ids(val, self.vocab_size)
        if not isinstance(val, str):
            return None, f"column 'text' must hold strings, got {type(val).__name__}", 0
        return _encode_text(self.tokenizer, val, self.vocab_size)

    def fingerprint(self) -> dict:
        return fingerprint(self.name, self.lengths, [self.path])

    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        row = int(self.rows[doc])
        g = int(np.searchsorted(self.row_group_starts, row, side="right") - 1)
        val = (
            self.file.read_row_group(g, columns=[self.column])
            .column(0)[row - int(self.row_group_starts[g])]
            .as_py()
        )
        ids, _, _ = self._convert(val)
        return ids[start:end]


_MEGATRON_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_MEGATRON_HEADER = b"MMIDIDX\x00\x00"


def _token_dtype(idx: Path, version: int, code: int) -> np.dtype:
    """The token dtype an index's header names, or :class:`DataError` saying why not."""
    if version != 1 or code not in _MEGATRON_DTYPES:
        raise DataError(f"{idx}: unsupported index version {version} or dtype code {code}")
    dtype = np.dtype(_MEGATRON_DTYPES[code])
    if dtype.kind == "f":  # Megatron's codes 6 and 7: token ids cannot be floats
        raise DataError(
            f"{idx}: dtype code {code} ({dtype.name}) holds no token ids; "
            "re-tokenize with an integer dtype (Megatron picks uint16 or int32)"
        )
    return dtype


def _read_index(idx: Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, document lengths int64 [n], byte pointers int64 [n]) of a Megatron index
    file; DataError naming the file where it is not one."""
    try:
        raw = idx.read_bytes()
    except OSError as e:
        raise DataError(f"{idx}: cannot read: {e.strerror}") from None
    head = 9 + 8 + 1 + 8 + 8
    if len(raw) < head or raw[:9] != _MEGATRON_HEADER:
        raise DataError(f"{idx}: not a Megatron index file (bad header)")
    (version,) = struct.unpack("<Q", raw[9:17])
    dtype = _token_dtype(idx, version, raw[17])
    n_seq, n_doc = struct.unpack("<QQ", raw[18:34])
    need = head + n_seq * 4 + n_seq * 8 + n_doc * 8
    if len(raw) < need:
        raise DataError(
            f"{idx}: truncated index ({len(raw)} bytes, {need} expected for {n_seq} sequences)"
        )
    lengths = np.frombuffer(raw, dtype=np.int32, count=n_seq, offset=head).astype(np.int64)
    pointers = np.frombuffer(raw, dtype=np.int64, count=n_seq, offset=head + 4 * n_seq)
    return dtype, lengths, pointers


def _negative_entries(
    idx: Path, lengths: np.ndarray, pointers: np.ndarray, skip_bad: bool
) -> np.ndarray:
    """The documents of an index with a negative length or pointer: a DataError naming the first,
    or with ``skip_bad`` their indices, to skip."""
    negative = np.flatnonzero((lengths < 0) | (pointers < 0))
    if negative.size and not skip_bad:
        first = int(negative[0])
        field = "length" if lengths[first] < 0 else "pointer"
        value = int(lengths[first] if field == "length" else pointers[first])
        raise DataError(
            f"{idx}: document {first}: negative {field} {value} (use --skip-bad-records to skip "
            "such documents)"
        )
    return negative


class MegatronSource:
    """A Megatron-LM ``.bin``/``.idx`` indexed dataset, read directly; a sequence is a document."""

    def __init__(
        self, prefix: str | Path, vocab_size: int | None = None, skip_bad: bool = False
    ) -> None:
        prefix = str(prefix)
        for ext in (".bin", ".idx"):
            if prefix.endswith(ext):
                prefix = prefix[: -len(ext)]
        self.name = prefix
        idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
        if not idx.exists():
            raise DataError(
                f"{idx}: missing index file (a Megatron dataset is a PREFIX.bin / PREFIX.idx pair)"
            )
        if not bin_.exists():
            raise DataError(
                f"{bin_}: missing data file (a Megatron dataset is a PREFIX.bin / PREFIX.idx pair)"
            )
        self.dtype, lengths, self.pointers = _read_index(idx)
        size = bin_.stat().st_size
        self.skipped_tokens = 0
        negative = _negative_entries(idx, lengths, self.pointers, skip_bad)
        self.skipped_documents = int(negative.size)  # their token counts are unknown
        lengths[negative] = 0
        n_empty = int(np.count_nonzero(lengths == 0)) - int(negative.size)
        ends = np.where(lengths > 0, self.pointers + lengths * self.dtype.itemsize, 0)
        over = np.flatnonzero(ends > size)

        def skip(docs: np.ndarray) -> None:
            self.skipped_documents += int(docs.size)
            self.skipped_tokens += int(lengths[docs].sum())
            lengths[docs] = 0

        if over.size:
            first = int(over[0])
            if not skip_bad:
                raise DataError(
                    f"{bin_}: truncated: document {first} needs bytes up to {int(ends[first])} "
                    f"but the file has {size} (use --skip-bad-records to skip the documents past "
                    "its end)"
                )
            skip(over)
        self.vocab_size = vocab_size
        self.bin_path = bin_
        self._data = (
            np.memmap(bin_, dtype=self.dtype, mode="r") if size else np.zeros(0, dtype=self.dtype)
        )
        if vocab_size is not None and self._data.size:
            bad = np.flatnonzero((self._data < 0) | (self._data >= vocab_size))
            if bad.size:
                docs = np.unique(
                    np.searchsorted(self.pointers // self.dtype.itemsize, bad, side="right") - 1
                )
                docs = docs[lengths[docs] > 0]
                if docs.size and not skip_bad:
                    pos = int(bad[0])
                    raise DataError(
                        f"{bin_}: document {int(docs[0])}: token id {int(self._data[pos])} is "
                        f"outside the vocabulary [0, {vocab_size}) (use --skip-bad-records to skip "
                        "such documents)"
                    )
                skip(docs)
        self.skipped_documents += n_empty
        self.lengths = lengths

    def fingerprint(self) -> dict:
        return fingerprint(self.name, self.lengths, [self.bin_path])

    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        base = int(self.pointers[doc]) // self.dtype.itemsize
        n = int(self.lengths[doc])
        stop = n if end is None else min(end, n)
        return np.asarray(self._data[base + start : base + stop], dtype=np.int64)


STRIDES = np.array([1, 2, 3, 5], dtype=np.int64)
STRIDE_ODDS = (0.7, 0.1, 0.1, 0.1)


class SyntheticSource:
    """``documents`` documents, lengths drawn from a standard workload, and tokens a model can
    learn: each document starts at a random token and walks up the vocabulary by a seeded random
    stride (1 with probability 0.7, else 2, 3 or 5), wrapping around. The next token's entropy is
    0.94 nats where uniform tokens have ln(vocab) (6.2 for 512), so a model's falling loss shows
    that it learns."""

    def __init__(
        self,
        workload: str = "wlb-128k",
        documents: int = 10000,
        vocab_size: int = 512,
        seed: int = 0,
    ) -> None:
        from hdp.workloads import get_workload

        self.name = f"synthetic:{workload}"
        self.vocab_size = vocab_size
        self.seed = seed
        self.lengths = (
            get_workload(workload)
            .sample_lengths(documents, np.random.default_rng(seed))
            .astype(np.int64)
        )
        self.skipped_documents = self.skipped_tokens = 0

    def fingerprint(self) -> dict:
        return fingerprint(self.name, self.lengths, [], seed=int(self.seed))  # tokens from the seed

    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        n = int(self.lengths[doc])
        stop = n if end is None else min(end, n)
        rng = np.random.default_rng([self.seed, doc])
        strides = rng.choice(STRIDES, size=n, p=STRIDE_ODDS)
        strides[0] = rng.integers(0, self.vocab_size)
        return (np.cumsum(strides) % self.vocab_size)[start:stop]


def _synthetic(path: str, vocab_size: int | None) -> SyntheticSource:
    """``synthetic:WORKLOAD[:DOCUMENTS]``, each part checked."""
    from hdp.workloads import workload_names

    parts = path.split(":")
    form = "expected synthetic:WORKLOAD[:DOCUMENTS]"
    if len(parts) > 3 or not parts[1]:
        raise DataError(f"{path}: {form}, e.g. synthetic:wlb-128k:1000")
    if parts[1] not in workload_names():
        raise DataError(
            f"{path}: unknown workload {parts[1]!r}: choose from {', '.join(workload_names())}"
        )
    docs = 10000
    if len(parts) == 3:
        try:
            docs = int(parts[2])
        except ValueError:
            docs = 0
        if not 1 <= docs <= MAX_DOCUMENTS:
            raise DataError(
                f"{path}: DOCUMENTS must be a whole number from 1 to {MAX_DOCUMENTS:,}, "
                f"got {parts[2]!r}"
            )
    return SyntheticSource(parts[1], docs, vocab_size or 512)


# What open_source reads, as its errors name it.
_FORMATS = ".jsonl, .parquet, a Megatron .bin/.idx prefix, or synthetic:NAME"


def open_source(
    path: str,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
    skip_bad: bool = False,
) -> Source:
    """A source for ``path``: ``*.jsonl``/``*.json``, ``*.parquet``/``*.arrow``, a Megatron prefix
    (or its ``.bin``/``.idx``), or ``synthetic:WORKLOAD[:DOCUMENTS]``."""
    if path.startswith("synthetic:"):
        return _synthetic(path, vocab_size)
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return JsonlSource(p, tokenizer, vocab_size, skip_bad)
    if suffix in (".parquet", ".arrow", ".pq"):
        return ParquetSource(p, tokenizer, vocab_size, skip_bad)
    if suffix in (".bin", ".idx") or Path(path + ".idx").exists() or Path(path + ".bin").exists():
        return MegatronSource(path, vocab_size, skip_bad)
    if not p.exists():
        raise DataError(f"{path}: no such file (expected {_FORMATS})")
    raise DataError(f"{path}: unknown format (expected {_FORMATS})")
