"""A self-describing binary message: named scalar fields in a JSON header, arrays as raw bytes.

Layout of a message (one flat ``uint8`` array, so it crosses ranks as one tensor):

* 8 bytes: ``H``, the header's length in bytes (little-endian uint64);
* ``H`` bytes: UTF-8 JSON ``{"fields": {...}, "arrays": {name: {"dtype", "shape", "offset"}}}``,
  padded with spaces to a multiple of 8;
* the arrays' bytes, each at its ``offset`` from the end of the header, 8-byte aligned.

Every value is found by its name, never by a position. Arrays travel as raw little-endian bytes,
so a plan of millions of shards costs one copy to pack and none to unpack (views into the buffer).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

_ALIGN = 8
_LENGTH = np.dtype("<u8")


class WireError(ValueError):
    """A buffer that is not a well-formed message."""


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack(fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> np.ndarray:
    """One ``uint8`` message holding ``fields`` (JSON-serialisable) and ``arrays`` (any shape)."""
    metas: dict[str, dict[str, Any]] = {}
    parts: list[tuple[int, np.ndarray]] = []
    offset = 0
    for name, a in arrays.items():
        a = np.asarray(a)
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        metas[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset}
        parts.append((offset, a.reshape(-1).view(np.uint8)))
        offset += _pad(a.nbytes)
    header = json.dumps({"fields": fields, "arrays": metas}, separators=(",", ":")).encode()
    header += b" " * (_pad(len(header)) - len(header))
    base = _LENGTH.itemsize + len(header)
    out = np.zeros(base + offset, dtype=np.uint8)
    out[: _LENGTH.itemsize] = np.array([len(header)], dtype=_LENGTH).view(np.uint8)
    out[_LENGTH.itemsize : base] = np.frombuffer(header, dtype=np.uint8)
    for at, raw in parts:
        out[base + at : base + at + raw.size] = raw
    return out


def unpack(buf: np.ndarray | bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The ``(fields, arrays)`` of a message from :func:`pack`; arrays are views into ``buf``."""
    if isinstance(buf, (bytes, bytearray, memoryview)):
        buf = np.frombuffer(buf, dtype=np.uint8)
    buf = np.asarray(buf).reshape(-1)
    if buf.dtype != np.uint8:
        raise WireError(f"a message is a uint8 array, got dtype {buf.dtype}")
    if buf.size < _LENGTH.itemsize:
        raise WireError(f"a message has at least {_LENGTH.itemsize} bytes, got {buf.size}")
    size = int(buf[: _LENGTH.itemsize].view(_LENGTH)[0])
    base = _LENGTH.itemsize + size
    if base > buf.size:
        raise WireError(f"the header needs {base} bytes but the message has {buf.size}")
    try:
        header = json.loads(buf[_LENGTH.itemsize : base].tobytes())
        fields, metas = header["fields"], header["arrays"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise WireError(f"unreadable header: {e}") from None
    arrays: dict[str, np.ndarray] = {}
    for name, m in metas.items():
        dtype, shape = np.dtype(m["dtype"]), tuple(m["shape"])
        lo = base + int(m["offset"])
        hi = lo + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if hi > buf.size:
            raise WireError(f"array {name!r} needs bytes up to {hi} but the message has {buf.size}")
        arrays[name] = buf[lo:hi].view(dtype).reshape(shape)
    return fields, arrays
