"""The commands in README.md and docs/user_guide.md are true to the code: every flag they name is
one the program's ``--help`` lists, every file they read from the repository is in it, and the
cheap ones run on a fresh clone."""

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from hdp.testing.ranks import patient

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/user_guide.md", "docs/reliability.md")
# How each documented program runs here, by the first words of its commands: a console script's
# entry point (module:function, then subcommand words), or a file of the repository.
HELP = {
    "hdp-sim": ["hdp.planner.cli:sim_main"],
    "hdp-plan": ["hdp.planner.cli:plan_main"],
    "hdp-data stats": ["hdp.dataloader.cli:main", "stats"],
    "hdp-calibrate measure": ["hdp.launch.calibrate:main", "measure"],
    "hdp-calibrate check": ["hdp.launch.calibrate:main", "check"],
    "hdp-export": ["hdp.launch.export:main"],
    "launch/pretrain.py": ["launch/pretrain.py"],
    "scripts/plot_metrics.py": ["scripts/plot_metrics.py"],
}


def python_args(name: str) -> list[str]:
    """The arguments of ``python`` that run program ``name`` (before its own flags)."""
    entry, *words = HELP[name]
    if ":" not in entry:
        return [entry, *words]
    module, function = entry.split(":")
    code = f"import sys; from {module} import {function} as f; sys.exit(f(sys.argv[1:]))"
    return ["-c", code, *words]


# Commands that finish in seconds on a fresh clone: they run as documented.
CHEAP = ("hdp-calibrate check h100 --table hdp/data/measured/h100_measured.csv",)


def commands() -> list[tuple[str, str]]:
    """(document, command) for each command or synopsis in a shell block of the documents, its
    continuation lines joined."""
    found = []
    for doc in DOCS:
        fence, in_block, current = False, False, None
        for line in (ROOT / doc).read_text().splitlines():
            if line.startswith("```"):
                fence = not fence  # an opening fence names its language, a closing one nothing
                in_block = fence and line.strip() in ("```", "```bash", "```sh")
                if current:
                    found.append((doc, current))
                current = None
                continue
            if not in_block:
                continue
            text = line.strip().removeprefix("$ ")
            if current and (current.endswith("\\") or text.startswith(("[", "--"))):
                current = current.rstrip("\\ ") + " " + text
            elif any(program(text) == p for p in HELP):
                if current:
                    found.append((doc, current))
                current = text
            elif current:
                found.append((doc, current))
                current = None
    return found


def program(command: str) -> str | None:
    """Which of HELP's programs ``command`` runs."""
    for name in sorted(HELP, key=len, reverse=True):
        if name.startswith(("launch/", "scripts/")) and name in command.split():
            return name
        if command.startswith(name):
            return name
    return None


@cache
def flags_of(name: str) -> frozenset[str]:
    """The flags ``name --help`` lists."""
    cmd = [sys.executable, *python_args(name), "--help"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=patient(120))
    assert done.returncode == 0, done.stderr
    return frozenset(re.findall(r"--[a-z][a-z0-9-]*", done.stdout))


def test_the_documents_show_commands():
    assert len(commands()) >= 15


@pytest.mark.parametrize("doc, command", commands(), ids=lambda x: x[:60])
def test_every_flag_a_document_names_is_one_the_program_has(doc, command):
    name = program(command)
    if name == "launch/pretrain.py":  # torchrun's own flags come first
        command = command[command.index(name) :]
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command))
    unknown = named - flags_of(name)
    assert not unknown, f"{doc}: {command}\nflags {name} --help does not list: {sorted(unknown)}"


@pytest.mark.parametrize("doc, command", commands(), ids=lambda x: x[:60])
def test_the_repository_files_a_command_reads_are_there(doc, command):
    for word in shlex.split(command.replace("|", " ").replace("[", " ").replace("]", " ")):
        if word.startswith(("hdp/", "examples/", "scripts/", "launch/", "docs/")):
            assert (ROOT / word).exists(), f"{doc}: {command} names {word}, not in the repository"


@pytest.mark.parametrize("command", CHEAP)
def test_the_cheap_commands_run_on_a_fresh_clone(command):
    assert any(command == c for _, c in commands()), f"{command} is no longer documented"
    name = program(command)
    args = python_args(name) + shlex.split(command)[len(name.split()) :]
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=patient(300)
    )
    assert done.returncode == 0, done.stderr
