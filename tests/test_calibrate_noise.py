"""Calibration that knows its noise: rows repeat until their fastest repeats agree (or time is up),
the profile records their spread and the host's load, ``measure`` warns when either is high and
reports progress with an ETA, and a profile whose rows disagree is refused for planning unless
forced. Times come from injected fake timers and clocks: nothing here sleeps or reads the wall
clock."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

import hdp
from hdp.launch import calibrate
from hdp.launch import calibrate_tables as tables
from hdp.profile import ProfileError, read_profile_json
from hdp.profile_quality import RepeatRule

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted((ROOT / "hdp" / "data" / "profiles").glob("*.json"))
CPU = ROOT / "hdp" / "data" / "profiles" / "cpu.json"


@pytest.fixture(autouse=True)
def _not_forced(monkeypatch):
    monkeypatch.delenv("HDP_FORCE_PROFILE", raising=False)


# ----------------------------------------------------------------------------- the repeat rule


def _timed(times_ms: list[float], rule: RepeatRule) -> tuple[tables.Timing, int]:
    """The Timing a Bench gives a row whose calls take ``times_ms`` in turn (the first is the
    warm-up: long enough that no second one runs), and how many calls it made."""
    grids = replace(tables.grids_for("cpu", True), repeats=rule)
    bench = tables.Bench(tables.torch.device("cpu"), tables.torch.float32, grids, 1e9)
    calls = iter([rule.limit_s] + [t / 1e3 for t in times_ms])
    made = []

    def once(fn):
        made.append(fn)
        return next(calls)

    bench.once = once
    return bench.timing(lambda: None), len(made) - 1


def test_a_quiet_row_stops_after_three_repeats():
    timing, repeats = _timed([10.0, 10.01, 10.02, 99.0], RepeatRule(limit_s=1.0))
    assert repeats == 3 and timing.repeats == 3
    assert timing.seconds == pytest.approx(10.01e-3)
    assert timing.spread == pytest.approx(0.002)


def test_a_noisy_row_repeats_until_its_three_fastest_agree():
    # The worked example of Note [Repeating a row until its spread is small].
    timing, repeats = _timed([10.0, 15.0, 12.0, 10.1, 10.2, 99.0], RepeatRule(limit_s=1.0))
    assert repeats == 5
    assert timing.seconds == pytest.approx(10.1e-3)
    assert timing.spread == pytest.approx(0.02)


def test_a_row_that_never_settles_stops_at_its_time_limit():
    # Each repeat 30% slower than the last: the fastest three always span 1.3^2 - 1 = 69%.
    times = [10.0 * 1.3**i for i in range(20)]  # cumulative: 10, 23, 39.9, 61.87, 90.43, ...
    timing, repeats = _timed(times, RepeatRule(limit_s=0.2))
    assert repeats == 8  # 175.83 ms after seven, 238.58 ms after eight
    assert timing.seconds == pytest.approx(13e-3) and timing.spread == pytest.approx(0.69)
    # A slow row reaches its limit early, yet gets five repeats to drop two disturbed ones.
    timing, repeats = _timed(times, RepeatRule(limit_s=0.001))
    assert repeats == 5 and timing.spread == pytest.approx(0.69)
    _, repeats = _timed(times, RepeatRule(limit_s=10.0, max_repeats=6))
    assert repeats == 6


# ----------------------------------------------------------------------------- progress


def test_progress_lines_come_every_fifteen_seconds_with_an_eta():
    now = [100.0]
    lines: list[str] = []
    progress = calibrate._Progress({"gemm": 4, "scalars": 1}, lambda: now[0], lines.append)
    progress.begin("gemm")
    now[0] = 105.0
    progress.repeat()
    assert lines == []  # 5 s: too soon
    now[0] = 115.0
    progress.repeat()
    assert lines == ["gemm: 0 of 4 rows done; elapsed 15.0 s, ETA unknown until a row is done"]
    now[0] = 120.0
    progress.row()  # 5 s after the last line: quiet
    now[0] = 130.0
    progress.repeat()  # one row of five in 30 s: four more take about 120 s
    assert lines[-1] == "gemm: 1 of 4 rows done; elapsed 30.0 s, ETA ~2 min 0 s"
    now[0] = 140.0
    progress.done("gemm", "4 rows")  # four of five rows in 40 s: one more takes about 10 s
    assert lines[-1] == "gemm: 4 rows in 40.0 s (elapsed 40.0 s, ETA ~10.0 s)"


# ----------------------------------------------------------------------------- a whole measure


class FakeHost:
    """Stands in for the device and the clock: each call of a row takes ``1 ms x growth^i`` for
    its ``i``-th call (warm-up included), and the clock advances ``step_s`` per call."""

    def __init__(self, growth: float, step_s: float = 0.0) -> None:
        self.growth, self.step_s, self.now = growth, step_s, 0.0
        self.calls: Counter = Counter()  # by the callable timed: one per row

    def once(self, fn) -> float:
        self.now += self.step_s
        self.calls[fn] += 1
        return 1e-3 * self.growth ** (self.calls[fn] - 1)

    def clock(self) -> float:
        return self.now


def _measure(tmp_path, monkeypatch, host: FakeHost, load: float, name: str) -> Path:
    monkeypatch.setattr(tables.Bench, "once", lambda bench, fn: host.once(fn))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    out = tmp_path / f"{name}.json"
    argv = ["measure", "--device", "cpu", "--quick", "--no-collectives", "--out", str(out)]
    setup = calibrate.resolve(calibrate.build_parser().parse_args(argv))
    profile = calibrate.measure(setup, quick=True, collectives=False, argv=argv, clock=host.clock)
    hdp.profile.write_profile(profile, out)
    for line in calibrate.noise_warnings(profile, str(out)):
        tables.note(f"warning: {line}")
    return out


def test_a_quiet_measure_records_small_spreads_and_warns_of_nothing(tmp_path, monkeypatch, capsys):
    host = FakeHost(growth=1.0)
    out = _measure(tmp_path, monkeypatch, host, load=0.5, name="quiet")
    err = capsys.readouterr().err
    assert "warning" not in err, err
    m = json.loads(out.read_text())["measurement"]
    assert m["cpus"] == os.cpu_count() and m["load_before"] == m["load_after"] == [0.5] * 3
    assert m["spread_target"] == 0.05 and m["spread_k"] == 3
    assert all(s == 0 for v in m["spread"].values() for s in v)
    # Two warm-up calls (the first was quick) and three repeats; the decoder layer's points ten.
    assert set(host.calls.values()) == {2 + 3, 2 + 10}
    assert hdp.GPUProfile.load(out).name == "cpu"


def test_a_noisy_measure_repeats_more_records_the_spread_and_warns(tmp_path, monkeypatch, capsys):
    host = FakeHost(growth=1.3)  # the fastest three repeats of every row span 69%
    out = _measure(tmp_path, monkeypatch, host, load=2 * os.cpu_count() + 1, name="noisy")
    err = capsys.readouterr().err
    assert min(host.calls.values()) >= 2 + 5
    data = json.loads(out.read_text())
    spreads = [s for v in data["measurement"]["spread"].values() for s in v]
    assert len(spreads) == sum(len(t["rows"]) for t in data["tables"].values())
    assert spreads and all(s == pytest.approx(0.69, abs=1e-4) for s in spreads)
    warnings = [line for line in err.splitlines() if line.startswith("hdp-calibrate: warning: ")]
    assert any("the host was busy" in line for line in warnings), err
    assert any("kept a spread above 5%" in line for line in warnings), err
    assert "HDP_FORCE_PROFILE=1" in warnings[-1] and "idle machine" in warnings[-1]
    with pytest.raises(ProfileError, match="spread 69%"):
        hdp.GPUProfile.load(out)
    monkeypatch.setenv("HDP_FORCE_PROFILE", "1")
    assert hdp.GPUProfile.load(out).name == "cpu"


def _elapsed(line: str) -> float:
    """The ``elapsed`` time a progress line gives, in seconds."""
    text = re.search(r"elapsed ([^,)]+)", line).group(1)
    parts = dict((unit, float(n)) for n, unit in re.findall(r"([\d.]+) (h|min|s)", text))
    return parts.get("h", 0) * 3600 + parts.get("min", 0) * 60 + parts.get("s", 0)


def test_a_slow_measure_is_never_silent_for_thirty_seconds(tmp_path, monkeypatch, capsys):
    host = FakeHost(growth=1.0, step_s=4.0)  # every call 4 s by the injected clock
    _measure(tmp_path, monkeypatch, host, load=0.5, name="slow")
    lines = [line for line in capsys.readouterr().err.splitlines() if "elapsed" in line]
    times = [0.0, *map(_elapsed, lines)]
    assert max(b - a for a, b in zip(times, times[1:])) <= 30, lines
    assert sum(1 for line in lines if "rows done" in line and "ETA ~" in line) >= 10, lines


# ----------------------------------------------------------------------------- the check


def _profile(tmp_path, edit, name: str = "p.json") -> Path:
    """The cpu preset's JSON, changed by ``edit``, written to a file."""
    data = json.loads(CPU.read_text())
    edit(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _set_gemm(data: dict, tokens: int, n_in: int, n_out: int, seconds: float) -> None:
    rows = data["tables"]["gemm"]["rows"]
    (row,) = [r for r in rows if r[:3] == [tokens, n_in, n_out]]
    row[3] = seconds


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_the_shipped_profiles_pass_the_check(path, capsys):
    assert hdp.GPUProfile.load(path).name == json.loads(path.read_text())["name"]
    assert calibrate.main(["check", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["disagreements"] == 0 and summary["max_spread"] is None


def test_a_gemm_far_slower_than_its_neighbours_is_refused_unless_forced(tmp_path, monkeypatch):
    # The worked example of Note [Rows that disagree]: 2,048 tokens of the 64 x 512 GEMM in 19.8
    # ms run at 0.30x the rate of 1,024 tokens in 2.93 ms.
    path = _profile(tmp_path, lambda d: _set_gemm(d, 2048, 64, 512, 0.0198))
    with pytest.raises(ProfileError) as e:
        hdp.GPUProfile.load(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    assert "gemm 2048x64x512 against gemm 1024x64x512: 0.3x the rate" in message
    assert "HDP_FORCE_PROFILE=1" in message and "hdp-calibrate check" in message
    assert read_profile_json(path, force=True)["name"] == "cpu"
    monkeypatch.setenv("HDP_FORCE_PROFILE", "1")
    assert hdp.GPUProfile.load(path).name == "cpu"


@pytest.mark.parametrize(
    "edit, words",
    [
        (  # 8 documents of 1,024 tokens in less time per document than 16 of 512
            lambda d: d["tables"]["attention"]["rows"][4].__setitem__(7, 0.05),
            "attention reference causal 4/2x16 a=1024 b=8 against attention reference causal "
            "4/2x16 a=512 b=16: more work in 0.31x the time",
        ),
        (
            lambda d: d.__setitem__("peak_flops", 1e13),
            "gemm 2048x64x176 (the fastest) against peak_flops 1e+13: 0.0075x the peak",
        ),
        (
            lambda d: d.__setitem__(
                "measurement",
                {"cpus": 2, "spread": {"optimizer": [0.01, 0.4, 0.02, 0.01]}},
            ),
            "optimizer 4194304 params: spread 40%",
        ),
    ],
    ids=["attention", "peak", "spread"],
)
def test_rows_that_disagree_are_named(tmp_path, edit, words):
    with pytest.raises(ProfileError, match=re.escape(words)):
        hdp.GPUProfile.load(_profile(tmp_path, edit))


def test_a_measurement_record_that_does_not_fit_the_rows_is_an_error(tmp_path):
    path = _profile(tmp_path, lambda d: d.__setitem__("measurement", {"spread": {"gemm": [0.1]}}))
    with pytest.raises(ProfileError, match="measurement.spread.gemm has 1 values for 35 rows"):
        hdp.GPUProfile.load(path)


def test_check_reports_disagreements_and_refuses_unless_forced(tmp_path, capsys):
    path = _profile(tmp_path, lambda d: _set_gemm(d, 2048, 64, 512, 0.0198))
    assert calibrate.main(["check", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "disagree: gemm 2048x64x512 against gemm 1024x64x512" in out
    assert err.count("\n") == 1 and "--force" in err and "1 disagreement (listed above)" in err
    assert calibrate.main(["check", str(path), "--force"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary == {"disagreements": 1, "table_rows": 118, "max_spread": None}
    table = tmp_path / "t.csv"
    table.write_text("kind,heads,kv_heads,head_dim,a,b,c,ms\ngemm,0,0,0,4096,64,64,1.5\n")
    assert calibrate.main(["check", str(path), "--table", str(table)]) == 1
    capsys.readouterr()
    assert calibrate.main(["check", str(path), "--table", str(table), "--force"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["disagreements"] == 1
