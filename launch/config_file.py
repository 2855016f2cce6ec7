"""``pretrain.py --config run.toml``: a run's flags in a file, as torchtitan's users keep them.

Every key is a flag of ``pretrain.py`` without its dashes (``max-seq`` or ``max_seq``), at the top
level or in one level of tables whose names are free (``[model]``, ``[data]``, ``[training]``):

    [model]
    model = "tiny"

    [data]
    workload = "wlb-128k"
    max-seq = "4K"
    tokens-per-step = "16K"

    [training]
    steps = 20
    activation-checkpointing = false

The file becomes command-line flags placed before the real ones, so argparse checks each value as
it checks the flag, and a flag given on the command line replaces the file's. Switches take
``true``/``false``; ``data`` (repeatable) takes a list.
"""

from __future__ import annotations

import argparse
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None


class ConfigFileError(ValueError):
    """A config file that cannot be used: one line naming the file and the key."""


def config_argv(path: Path, parser: argparse.ArgumentParser, given: list[str]) -> list[str]:
    """The flags ``path`` sets, as arguments for ``parser``, leaving out those ``given`` on the
    command line. Raises ConfigFileError naming the file and key."""
    if tomllib is None:
        raise ConfigFileError("--config needs Python 3.11 or later, or: pip install tomli")
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot read it: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigFileError(f"--config {path}: not a text file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"--config {path}: not TOML ({e})") from None
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    argv = []
    for where, key, value in _entries(path, data):
        action = actions.get(key.replace("-", "_"))
        if action is None or action.dest == "config":
            raise ConfigFileError(f"{path}: {where}{key} is not a flag of {parser.prog}")
        flag = next(f for f in action.option_strings if not f.startswith("--no-"))
        if any(a == flag or a.startswith(flag + "=") or a == f"--no-{flag[2:]}" for a in given):
            continue
        argv += _arguments(path, f"{where}{key}", flag, action, value)
    return argv


def _entries(path: Path, data: dict):
    for key, value in data.items():
        if isinstance(value, dict):
            for inner, v in value.items():
                if isinstance(v, dict):
                    raise ConfigFileError(f"{path}: [{key}.{inner}]: tables nest one level deep")
                yield f"[{key}] ", inner, v
        else:
            yield "", key, value


def _arguments(path: Path, key: str, flag: str, action: argparse.Action, value) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigFileError(f"{path}: {key} must be true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else f"--no-{flag[2:]}"]
        return [flag] if value else []
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and not isinstance(action, argparse._AppendAction):
        raise ConfigFileError(f"{path}: {key} takes one value, got a list")
    out = []
    for v in values:
        if isinstance(v, (dict, list, bool)) or v is None:
            raise ConfigFileError(f"{path}: {key} must be a number or a string, got {v!r}")
        out += [flag, str(v)]
    return out


__all__ = ["ConfigFileError", "config_argv"]
