"""The suite can be watched: a line per test file as its last test ends (tests/conftest.py), with
and without pytest-xdist's workers."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]])
def test_each_file_prints_its_outcome_and_the_suites_progress(workers):
    files = ["tests/test_schedule.py", "tests/test_lock.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {
        m[1]: m for m in re.finditer(r"^(tests/\S+): (\d+) passed in [\d.]+ s  \[(\d+)/2 files, "
        r"(\d+)/(\d+) tests, \d\d:\d\d:\d\d\]$", done.stdout, re.M)
    }  # fmt: skip
    assert sorted(lines) == sorted(files), done.stdout
    collected = int(re.search(r"(\d+) passed", done.stdout.splitlines()[-1])[1])
    assert sum(int(m[2]) for m in lines.values()) == collected
    assert sorted(int(m[3]) for m in lines.values()) == [1, 2]
    assert {int(m[5]) for m in lines.values()} == {collected}
