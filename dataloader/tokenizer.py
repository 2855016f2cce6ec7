"""Tokenizers for ``text`` records: the built-in byte-level tokenizer (offline default: UTF-8
bytes are the ids 0-255) or a local Hugging Face ``tokenizer.json`` (the ``tokenizers`` package)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


class Tokenizer:
    """``encode(text) -> int64 ids``; ``vocab_size``; ``id`` names it for index caches."""

    vocab_size: int
    id: str

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    vocab_size = 256
    id = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


class HFTokenizer(Tokenizer):
    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _T
        except ImportError:
            raise ValueError(
                f"{path}: loading a tokenizer.json needs the 'tokenizers' package "
                "(pip install tokenizers)"
            ) from None
        path = Path(path)
        try:
            self._tok = _T.from_file(str(path))
        except Exception as e:  # the tokenizers package raises its own exception types
            raise ValueError(f"{path}: cannot load tokenizer: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.id = "hf:" + hashlib.sha1(path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> np.ndarray:
        try:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:
            # tokenizers says only "TextInputSequence must be str" for a lone surrogate; the
            # UnicodeEncodeError raised here says where it is, and sources report it per line.
            text.encode("utf-8")
            raise
        return np.asarray(ids, dtype=np.int64)


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer at ``path`` (a ``tokenizer.json``), or the byte tokenizer when ``None``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
