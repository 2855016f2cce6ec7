"""Shared test setup: the single-process tests compare float64 results too (see ``warm_up_exp``),
and a line per test file as it finishes, so a person can watch the suite (:class:`FileProgress`).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import pytest

from hdp.testing.ranks import warm_up_exp

warm_up_exp()


class FileProgress:
    """Prints ``tests/test_x.py: 12 passed in 34.5 s  [3/44 files, 120/823 tests, 0:02:10]``
    when a file's last test ends. Works with pytest-xdist: the totals come from a worker's
    collection, the reports reach the controller."""

    def __init__(self, reporter) -> None:
        self.reporter = reporter
        self.total: Counter[str] = Counter()
        self.ended: Counter[str] = Counter()
        self.outcomes: dict[str, Counter[str]] = defaultdict(Counter)
        self.seconds: Counter[str] = Counter()
        self.state: dict[str, str] = {}  # a running test's outcome so far: failed, skipped
        self.start = time.monotonic()

    def expect(self, nodeids: list[str]) -> None:
        if not self.total:
            self.total.update(nodeid.split("::")[0] for nodeid in nodeids)

    def pytest_collection_finish(self, session) -> None:
        self.expect([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self.expect(ids)

    def pytest_runtest_logreport(self, report) -> None:
        file = report.nodeid.split("::")[0]
        self.seconds[file] += report.duration
        if report.failed:
            self.state[report.nodeid] = "failed"
        elif report.skipped and self.state.get(report.nodeid) != "failed":
            self.state[report.nodeid] = "skipped"
        if report.when != "teardown":
            return
        self.outcomes[file][self.state.pop(report.nodeid, "passed")] += 1
        self.ended[file] += 1
        if self.ended[file] == self.total.get(file):
            self._line(file)

    def _line(self, file: str) -> None:
        counts = ", ".join(f"{n} {what}" for what, n in sorted(self.outcomes[file].items()) if n)
        files_done = sum(1 for f, n in self.total.items() if self.ended[f] == n)
        elapsed = time.strftime("%H:%M:%S", time.gmtime(time.monotonic() - self.start))
        if self.reporter._tw.width_of_current_line:  # after the progress dots
            self.reporter.write("\n")
        self.reporter.write_line(
            f"{file}: {counts or 'nothing run'} in {self.seconds[file]:.1f} s  "
            f"[{files_done}/{len(self.total)} files, {sum(self.ended.values())}/"
            f"{sum(self.total.values())} tests, {elapsed}]"
        )


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    worker = hasattr(config, "workerinput")  # an xdist worker: the controller reports
    if reporter is not None and not worker:
        config.pluginmanager.register(FileProgress(reporter), "hdp-file-progress")
