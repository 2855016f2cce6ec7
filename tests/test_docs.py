"""The commands in README.md and docs/user_guide.md are true to the code: every flag they name is
one the program's ``--help`` lists, every file they read from the repository is in it, the
cheap ones run on a fresh clone, and what the documents show a command printing is what it
prints."""

import doctest
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
            text = line.strip().removeprefix("$ ").removeprefix(".venv/bin/")
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


# What the documents show a command printing is compared as doctest compares: runs of spaces are
# one space (tables pad their columns), and "..." stands for what a document leaves out, which
# must include every wall-clock time (the tables' plan s column).
SAME = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def fenced_blocks(doc: str) -> list[tuple[str, list[str]]]:
    """(opening fence, lines) of each fenced block of ``doc``."""
    blocks, fence, lines = [], None, []
    for line in (ROOT / doc).read_text().splitlines():
        if line.startswith("```"):
            if fence is None:
                fence, lines = line.strip(), []
            else:
                blocks.append((fence, lines))
                fence = None
        elif fence is not None:
            lines.append(line)
    return blocks


def shown_outputs() -> list[tuple[str, str, str]]:
    """(document, command, output) of each shell block that shows one command after ``$ `` and,
    below it, what it prints."""
    found = []
    for doc in DOCS:
        for fence, lines in fenced_blocks(doc):
            if fence == "```" and len(lines) > 1 and lines[0].startswith("$ "):
                command = lines[0].removeprefix("$ ").removeprefix(".venv/bin/")
                found.append((doc, command, "\n".join(lines[1:]) + "\n"))
    return found


def shown_prints() -> list[tuple[str, str, str]]:
    """(document, code, output) of each Python block whose ``print(...)`` lines are followed by
    what they print, as comment lines."""
    found = []
    for doc in DOCS:
        for fence, lines in fenced_blocks(doc):
            if fence != "```python":
                continue
            shown, after_print = [], False
            for line in lines:
                if after_print and line.startswith("# "):
                    shown.append(line.removeprefix("# "))
                    continue
                after_print = line.startswith("print(")
            if shown:
                found.append((doc, "\n".join(lines) + "\n", "\n".join(shown) + "\n"))
    return found


def differs(shown: str, printed: str) -> str | None:
    """None where ``printed`` is what ``shown`` shows, else the difference, as doctest says it."""
    checker = doctest.OutputChecker()
    if checker.check_output(shown, printed, SAME):
        return None
    return checker.output_difference(doctest.Example("", shown), printed, SAME)


def in_scratch_folder(tmp_path: Path) -> Path:
    """``tmp_path`` with the repository's folders a documented command reads linked in, so that
    what the command writes (``out/...``) stays out of the working tree."""
    for name in ("examples", "hdp", "scripts", "launch", "docs"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def test_the_documents_show_what_commands_print():
    assert {doc for doc, _, _ in shown_outputs()} >= {"README.md", "docs/user_guide.md"}
    assert any(doc == "README.md" for doc, _, _ in shown_prints())


def python_output(args: list[str], tmp_path, timeout: float) -> str:
    """What ``python ARGS`` prints in a scratch folder; it must exit 0."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=in_scratch_folder(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("doc, command, shown", shown_outputs(), ids=lambda x: x[:60])
def test_a_command_prints_what_the_documents_show(doc, command, shown, tmp_path):
    name = program(command)
    assert name is not None, f"{doc}: no known program runs {command}"
    args = python_args(name) + shlex.split(command)[len(name.split()) :]
    difference = differs(shown, python_output(args, tmp_path, patient(600)))
    assert difference is None, f"{doc}: {command}\n{difference}"


@pytest.mark.parametrize("doc, code, shown", shown_prints(), ids=lambda x: x[:60])
def test_python_examples_print_what_the_documents_show(doc, code, shown, tmp_path):
    difference = differs(shown, python_output(["-c", code], tmp_path, patient(300)))
    assert difference is None, f"{doc}: its Python example\n{difference}"


def test_the_demo_runs_the_command_whose_table_the_readme_shows():
    demo = (ROOT / "scripts" / "demo.sh").read_text().replace("\\\n", " ")
    runs = [shlex.split(line)[1:] for line in demo.splitlines() if ".venv/bin/hdp-sim" in line]
    shown = [shlex.split(c)[1:] for d, c, _ in shown_outputs() if d == "README.md"]
    shown = [args for args in shown if "--workload" in args]
    assert len(runs) == 1 and shown, "the README shows the table of the demo's one hdp-sim line"
    assert runs[0][: len(shown[0])] == shown[0], (runs[0], shown[0])
