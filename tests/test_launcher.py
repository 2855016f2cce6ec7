"""``hdp-train --nproc-per-node N`` starts and watches its ranks; ``srun`` tasks are ranks without
torchrun; an error every rank meets alike is printed once (Note [Who starts the ranks])."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hdp.launch import checkpoint
from hdp.launch.cli import parse_config
from hdp.launch.config import LauncherConfig
from hdp.launch.launcher import (
    HEADER,
    error_line,
    first_host,
    node_layout,
    reports_errors,
    role,
    slurm_rank_environment,
    thread_count,
)
from hdp.testing.ranks import patient

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "HDP_"))}
ENV.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
COMMON = [
    "--device",
    "cpu",
    *("--model", "tiny", "--workload", "wlb-128k", "--tokens-per-step", "3K", "--max-seq", "1K"),
    *("--synthetic-docs", "400", "--lr", "1e-2", "--warmup", "2", "--lr-decay-steps", "10"),
]
TRAIN = [str(Path(sys.executable).with_name("hdp-train"))]  # the installed command


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=patient(300))


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


# --- what a process is, from its environment -------------------------------------------------


def slurm_task(rank: int, tasks: int = 2, **extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % 8),
        "SLURM_NODEID": str(rank // 8),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_TASKS_PER_NODE": "8(x2)" if tasks == 16 else str(tasks),
        "SLURM_STEP_NODELIST": "gpu[07-08]" if tasks == 16 else "localhost",
        **extra,
    }


@pytest.mark.parametrize(
    "nodelist, host",
    [("gpu[07-08,11],cpu3", "gpu07"), ("node12", "node12"), ("a1,b2", "a1"), ("x[3]", "x3")],
)
def test_the_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_an_srun_task_becomes_the_rank_torchrun_would_have_made():
    env = slurm_rank_environment(slurm_task(11, tasks=16))
    assert env == {
        "RANK": "11",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 4242),
    }
    assert (
        slurm_rank_environment({**slurm_task(11, tasks=16), "MASTER_PORT": "1234"})["MASTER_PORT"]
        == "1234"
    )


def test_a_batch_script_or_a_single_task_is_not_an_srun_rank():
    batch = {k: v for k, v in slurm_task(0).items() if k != "SLURM_STEP_ID"}
    assert slurm_rank_environment(batch) is None
    assert slurm_rank_environment(slurm_task(0, tasks=1)) is None
    assert role(LauncherConfig(), batch) == "lone"
    assert role(LauncherConfig(), slurm_task(1)) == "srun"


def test_roles_and_who_prints_an_error_every_rank_meets():
    starts = LauncherConfig(nproc_per_node=2)
    assert role(starts, {}) == "launcher"
    assert role(LauncherConfig(), {"RANK": "1"}) == "rank"
    assert role(starts, {"RANK": "1", "HDP_LAUNCHER": "1"}) == "rank"  # one this launcher started
    with pytest.raises(ValueError, match="torchrun already started this one"):
        role(starts, {"RANK": "1"})
    assert reports_errors({}) and reports_errors({"RANK": "0"})
    assert not reports_errors({"RANK": "1"})
    assert reports_errors({"RANK": "1", "HDP_LAUNCHER": "1"})  # into its own log
    assert not reports_errors(slurm_task(1)) and reports_errors(slurm_task(0))


def test_a_node_layout_from_the_flags_or_from_slurm():
    layout = node_layout(LauncherConfig(nproc_per_node=8, rdzv_endpoint="gpu07"), {})
    assert (layout.nnodes, layout.node_rank, layout.host, layout.port) == (1, 0, "gpu07", 29500)
    under_srun = slurm_task(8, tasks=2, SLURM_NNODES="2", SLURM_NODEID="1")
    under_srun["SLURM_STEP_NODELIST"] = "gpu[07-08]"
    layout = node_layout(LauncherConfig(nproc_per_node=8), under_srun)
    assert (layout.nnodes, layout.node_rank, layout.host, layout.port) == (2, 1, "gpu07", 24242)
    assert list(layout.ranks()) == list(range(8, 16))
    assert layout.environment(11)["LOCAL_RANK"] == "3"
    with pytest.raises(ValueError, match="--nnodes 2 needs --rdzv-endpoint"):
        node_layout(LauncherConfig(nproc_per_node=8, nnodes=2), {})
    with pytest.raises(ValueError, match="srun started 16 tasks on 2 nodes"):
        node_layout(LauncherConfig(nproc_per_node=8), {**under_srun, "SLURM_STEP_NUM_TASKS": "16"})
    with pytest.raises(ValueError, match="expected HOST or HOST:PORT"):
        node_layout(LauncherConfig(nproc_per_node=8, rdzv_endpoint="gpu07:http"), {})


@pytest.mark.parametrize(
    "cpus, load, ranks, threads", [(2, 0.0, 1, 2), (2, 3.5, 1, 1), (16, 0.2, 4, 4), (16, 8.0, 2, 4)]
)
def test_threads_are_the_idle_cores_shared_by_the_ranks(cpus, load, ranks, threads):
    assert thread_count(ranks, cpus=cpus, load=load) == threads


def test_a_ranks_error_line_is_hdps_own_else_its_tracebacks_last(tmp_path):
    log = tmp_path / "rank1.log"
    log.write_text(
        f"{HEADER} earlier run\nhdp-train: error: from an earlier run\n"
        f"{HEADER} this run\nstep 1 ...\n"
        "[rank1]: Traceback (most recent call last):\n[rank1]:   File 'x', line 1\n"
        "[rank1]: RuntimeError: Connection closed by peer\n"
    )
    assert error_line(log) == "RuntimeError: Connection closed by peer"
    log.write_text(log.read_text() + "hdp-train: error: cannot read x.jsonl\n")
    assert error_line(log) == "hdp-train: error: cannot read x.jsonl"
    log.write_text(f"{HEADER} a run\nhdp-train: error: old\n{HEADER} the next\nstep 1\n")
    assert error_line(log) is None


# --- errors once -------------------------------------------------------------------------------


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_a_bad_setting_is_one_line_without_usage_on_rank_0_only(monkeypatch, capsys, rank, printed):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("HDP_LAUNCHER", raising=False)
    with pytest.raises(SystemExit) as stop:
        parse_config(["--max-seq", "1M", "--tokens-per-step", "3K"], prog="hdp-train")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    expected = (
        "hdp-train: error: --max-seq (1M) exceeds --tokens-per-step (3K): a sequence must fit in "
        "one global batch; raise --tokens-per-step or leave it out\n"
    )
    assert err == (expected if printed else "")


def test_a_malformed_command_line_is_a_one_line_usage_and_the_error(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        parse_config(["--stepz", "3"], prog="hdp-train")
    assert capsys.readouterr().err.splitlines() == [
        "usage: hdp-train [--config RUN.toml] [FLAG ...]  (--help lists every flag)",
        "hdp-train: error: unrecognized arguments: --stepz 3",
    ]


def test_the_launcher_refuses_a_bad_setting_before_starting_any_rank(tmp_path):
    done = run([*TRAIN, "--nproc-per-node", "2", *COMMON, "--nnodes", "2", "--steps", "2"])
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "hdp-train: error: --nnodes 2 needs --rdzv-endpoint HOST:PORT, node 0's address that "
        "every node can reach (under srun it is the job's first node)"
    ]


def test_an_error_of_every_rank_is_one_line_and_the_launchers(tmp_path):
    logs = tmp_path / "logs"
    flags = ("--checkpoint-dir", str(tmp_path / "ck"), "--resume-step", "5", "--log-dir", str(logs))
    done = run([*TRAIN, "--nproc-per-node", "2", *COMMON, *flags])
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith("hdp-train: error: "), out
    assert (
        out.splitlines()[-1] == f"hdp-train: rank 0 exited with code 2 (full log: {logs}/rank0.log)"
    )
    assert "usage" not in out and "Traceback" not in out


# --- the launcher's ranks ----------------------------------------------------------------------


def test_two_ranks_of_the_launcher_and_of_srun_train_what_torchrun_trains(tmp_path):
    """torchrun is the independent reference: the same ranks, started by another program."""
    steps = ["--steps", "3"]
    ref = tmp_path / "torchrun.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    done = run([*torchrun, "2", "-m", "hdp.launch.cli", *COMMON, *steps, "--metrics", str(ref)])
    assert done.returncode == 0, done.stdout + done.stderr

    ours, logs = tmp_path / "launcher.jsonl", tmp_path / "logs"
    launcher = ["--nproc-per-node", "2", "--log-dir", str(logs)]
    done = run([*TRAIN, *COMMON, *steps, *launcher, "--metrics", str(ours)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert losses(ours) == losses(ref)
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log"]
    assert "done: steps 1-3" in (logs / "rank0.log").read_text()
    assert done.stdout.count("done: steps 1-3") == 1  # rank 0's lines on the screen, once

    srun = tmp_path / "srun.jsonl"
    tasks = [
        subprocess.Popen(
            [*TRAIN, *COMMON, *steps, "--metrics", str(srun)],
            env={**ENV, **slurm_task(r, MASTER_PORT=str(29000 + os.getpid() % 1000))},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [task.communicate(timeout=patient(300))[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    assert losses(srun) == losses(ref)


def start(flags: list[str], out) -> subprocess.Popen:
    return subprocess.Popen(
        [*TRAIN, *COMMON, *flags], env=ENV, stdout=out, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.parametrize("ranks", [1, 2])
def test_sigterm_to_the_launcher_saves_the_step_and_exits_0(tmp_path, ranks):
    ck, metrics, screen = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "screen.txt"
    flags = ["--nproc-per-node", str(ranks), "--steps", "200", "--checkpoint-dir", str(ck)]
    with open(screen, "w") as out:
        job = start([*flags, "--metrics", str(metrics)], out)
        deadline = time.monotonic() + patient(300)
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert job.poll() is None and time.monotonic() < deadline, screen.read_text()
            time.sleep(0.1)
        job.send_signal(signal.SIGTERM)  # the launcher only: it forwards to its ranks
        code = job.wait(timeout=patient(300))
    text = screen.read_text()
    assert code == 0, text
    stopped = re.findall(r"stopped by SIGTERM after step (\d+); checkpoint (\S+) ", text)
    assert len(stopped) == 1, text
    step = int(stopped[0][0])
    assert checkpoint.select(ck).path == ck / f"step_{step:08d}"
    assert "Traceback" not in text
    (logs,) = (ck / "logs").iterdir()  # beside the checkpoints by default
    assert sorted(p.name for p in logs.iterdir()) == [f"rank{r}.log" for r in range(ranks)]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_failed_rank_is_one_line_naming_its_log(tmp_path, ranks):
    dead = ranks - 1
    logs = tmp_path / "logs"
    env = {**ENV, "HDP_KILL_AT": f"{dead}:2"}
    flags = [*COMMON, "--nproc-per-node", str(ranks), "--steps", "6", "--log-dir", str(logs)]
    done = subprocess.run(
        [*TRAIN, *flags], env=env, capture_output=True, text=True, timeout=patient(300)
    )
    assert done.returncode == 128 + signal.SIGKILL, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"hdp-train: rank {dead} was killed by SIGKILL (full log: {logs}/rank{dead}.log)"
    )
    assert "Traceback" not in done.stdout + done.stderr  # in the logs, not on the screen
    assert sorted(p.name for p in logs.iterdir()) == [f"rank{r}.log" for r in range(ranks)]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while listed
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_launcher_killed_outright_leaves_no_ranks(tmp_path):
    metrics = tmp_path / "m.jsonl"
    with open(tmp_path / "screen.txt", "w") as out:
        job = start(["--nproc-per-node", "2", "--steps", "500", "--metrics", str(metrics)], out)
        deadline = time.monotonic() + patient(300)
        while not (metrics.exists() and metrics.read_text().strip()):
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        ranks = children(job.pid)
        assert len(ranks) == 2
        job.kill()
        job.wait()
    deadline = time.monotonic() + patient(30)
    while any(running(pid) for pid in ranks):
        assert time.monotonic() < deadline, "ranks outlived their launcher"
        time.sleep(0.1)


def test_under_nohup_a_hangup_reaches_no_rank(tmp_path):
    """A launcher started with SIGHUP ignored (``nohup``) leaves it ignored in its ranks: a
    hangup to all of them changes nothing, and SIGTERM still saves and exits 0."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    flags = ["--nproc-per-node", "2", "--steps", "200", "--checkpoint-dir", str(ck)]
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with open(tmp_path / "screen.txt", "w") as out:
            job = start([*flags, "--metrics", str(metrics)], out)
    finally:
        signal.signal(signal.SIGHUP, previous)
    deadline = time.monotonic() + patient(300)
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    for pid in [job.pid, *children(job.pid)]:
        os.kill(pid, signal.SIGHUP)
    time.sleep(1.5)
    assert job.poll() is None and len(children(job.pid)) == 2
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=patient(300)) == 0
    assert checkpoint.select(ck) is not None
