"""Argument types shared by every command line (``hdp-sim``, ``hdp-plan``, ``hdp-data``,
``hdp-calibrate``, ``launch/pretrain.py``): each checks one flag's value before any work starts.

A value out of range raises ``argparse.ArgumentTypeError``, which argparse prints as one line
naming the flag (``argument --seed: must be >= 0, got -1``) and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import select
import sys
from collections.abc import Callable
from pathlib import Path

from .specs import format_size, parse_size

_Error = argparse.ArgumentTypeError

# Every count a flag or a file gives has a range. These bounds are far above any real run and far
# below where numpy arrays or C integers overflow, so a typo is one line, not a traceback.
MAX_TOKENS = 1 << 36  # tokens in a step or a sequence (64G)
MAX_RANKS = 1 << 20  # GPUs of a cluster
MAX_DOCUMENTS = 10**8  # documents of a synthetic corpus
MAX_INT = (1 << 63) - 1  # any other whole number: what an int64 holds


def size(min_value: int = 1, max_value: int = MAX_TOKENS) -> Callable[[str], int]:
    """A token count with an optional K/M/G suffix (``2M``) in ``[min_value, max_value]``."""

    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as e:
            raise _Error(str(e)) from None
        if value < min_value:
            raise _Error(f"must be >= {min_value}, got {text!r}")
        if value > max_value:
            raise _Error(f"must be <= {format_size(max_value)} tokens, got {text!r}")
        return value

    parse.__name__ = "size"
    return parse


_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def byte_size(text: str) -> int:
    """A byte count as Hugging Face writes it: ``5GB`` (5 * 10**9), ``500MB``, ``2GiB``."""
    s = text.strip().upper()
    digits = s.rstrip("BKMGTI")
    unit = s[len(digits) :]
    try:
        value = float(digits)
    except ValueError:
        raise _Error(f"{text!r} is not a size such as 5GB, 500MB or 2GiB") from None
    if unit not in _BYTE_UNITS:
        raise _Error(f"{text!r}: unknown unit {unit!r} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    result = value * _BYTE_UNITS[unit]
    if not math.isfinite(result) or result < 1:
        raise _Error(f"{text!r}: must be at least 1 byte")
    return int(result)


def integer(min_value: int | None = None, max_value: int = MAX_INT) -> Callable[[str], int]:
    """A whole number in ``[min_value, max_value]`` (no lower bound when ``None``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _Error(f"{text!r} is not an integer") from None
        if min_value is not None and value < min_value:
            raise _Error(f"must be >= {min_value}, got {value}")
        if value > max_value:
            raise _Error(f"must be <= {max_value}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number(
    min_value: float = 0.0, *, exclusive: bool = False, max_value: float = math.inf
) -> Callable[[str], float]:
    """A finite real number at least (or, ``exclusive``, above) ``min_value`` and at most
    ``max_value``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise _Error(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise _Error(f"must be a finite number, got {text!r}")
        if value < min_value or (exclusive and value == min_value):
            raise _Error(f"must be {'>' if exclusive else '>='} {min_value:g}, got {text}")
        if value > max_value:
            raise _Error(f"must be at most {max_value:g}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def number_list(text: str) -> list[float]:
    """Comma-separated finite non-negative numbers (``0.7,0.3``), at least one above zero."""
    values = []
    for i, part in enumerate(text.split(","), start=1):
        try:
            values.append(number(0.0)(part.strip()))
        except _Error as e:
            raise _Error(f"item {i} of {text!r}: {e}") from None
    if sum(values) <= 0:
        raise _Error(f"at least one weight must be above 0, got {text!r}")
    return values


def _writable_ancestor(path: Path) -> str | None:
    """Why ``path`` cannot be created (its nearest existing ancestor is not a writable folder),
    or ``None``."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None


def output_file(text: str) -> Path:
    """A file to write: not a directory; an existing file writable, else its folder writable
    (missing folders are created by the command that writes it)."""
    path = Path(text)
    if path.is_dir():
        raise _Error(f"{path} is a directory, expected a file name")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise _Error(f"{path} is not writable")
        return path
    why = _writable_ancestor(path)
    if why:
        raise _Error(f"cannot create {path}: {why}")
    return path


def output_dir(text: str) -> Path:
    """A directory to write into: an existing writable one, or one that can be created."""
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise _Error(f"{path} exists and is not a directory")
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            raise _Error(f"directory {path} is not readable and writable")
        return path
    why = _writable_ancestor(path / "x")
    if why:
        raise _Error(f"cannot create {path}: {why}")
    return path


def input_file(text: str) -> Path:
    """A file to read: exists, is a file, is readable."""
    path = Path(text)
    if not path.exists():
        raise _Error(f"{path}: no such file")
    if not path.is_file():
        raise _Error(f"{path} is not a file")
    if not os.access(path, os.R_OK):
        raise _Error(f"{path} is not readable")
    return path


def input_dir(text: str) -> Path:
    """A directory to read: exists, is a directory, is readable."""
    path = Path(text)
    if not path.exists():
        raise _Error(f"{path}: no such directory")
    if not path.is_dir():
        raise _Error(f"{path} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise _Error(f"directory {path} is not readable")
    return path


def input_file_or_dir(text: str) -> Path:
    """A file or a directory to read (``--tokenizer``: tokenizer.json or the folder holding it)."""
    return input_dir(text) if Path(text).is_dir() else input_file(text)


def model(text: str) -> str:
    """A model preset's name, or a transformers ``config.json`` (or its directory), whose
    architecture :func:`hdp.model_spec` reads."""
    from .models import model_spec

    try:
        model_spec(text)
    except ValueError as e:
        raise _Error(str(e)) from None
    return text


def rope_scaling(text: str) -> dict:
    """``--rope-scaling``: a JSON object of transformers' RoPE scaling keys."""
    from .hf_config import parse_rope_scaling

    try:
        return parse_rope_scaling(text)
    except ValueError as e:
        raise _Error(str(e)) from None


def choice(names: list[str] | tuple[str, ...], what: str) -> Callable[[str], str]:
    """One of ``names`` (a registry's keys), named in the error as ``what``."""

    def parse(text: str) -> str:
        if text not in names:
            raise _Error(f"unknown {what} {text!r}: choose from {', '.join(names)}")
        return text

    parse.__name__ = what
    return parse


__all__ = [
    "byte_size",
    "choice",
    "input_dir",
    "input_file",
    "input_file_or_dir",
    "model",
    "integer",
    "number",
    "number_list",
    "output_dir",
    "output_file",
    "rope_scaling",
    "size",
]


def _reader_gone(stream) -> bool:
    """Whether the pipe behind ``stream`` has lost its reader (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return True


def command(main: Callable[..., int]) -> Callable[..., int]:
    """A console script's ``main`` that ends quietly when its reader goes away (``hdp-data stats
    X | head``): exit status 1 as ``head``'s writers get, no traceback."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            if not _reader_gone(sys.stdout):
                raise  # another pipe broke: that is a real error
            # Python would flush stdout again at exit and fail once more: point it at /dev/null.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    return run
