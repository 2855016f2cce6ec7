"""Who starts a run's ranks, and the launcher ``hdp-train --nproc-per-node N`` that starts and
watches them itself: Note [Who starts the ranks].

Note [Who starts the ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A training process is one of three things (:func:`role`), decided from its environment and its
flags before anything is built:

* **a rank started by someone else**: torchrun or this launcher set ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; a task of ``srun``
  has ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` and ``SLURM_LOCALID`` instead, which
  :func:`slurm_rank_environment` turns into the same variables (node 0's address from the step's
  node list, a port from the job id), so ``srun`` needs no torchrun;
* **the launcher**, given ``--nproc-per-node N``: it starts N ranks of its own command line on
  this node (:class:`Ranks`), meeting at a store that node 0's launcher holds (as torchrun's
  agent does: bound before any rank starts, so no port is raced for), each with its output in
  ``rankR.log`` and rank 0's on the screen too; it forwards the signals the ranks stop on
  (``--exit-signal``: SIGTERM, SIGINT and SIGUSR1 by default; one the launcher was started
  ignoring, as ``nohup`` ignores SIGHUP, stays ignored) and waits as long as the ranks take to
  save (torchrun kills its ranks after a shutdown timeout); it exits 0 when every rank did, and
  otherwise reports the first rank that failed in one line and stops the others;
* **a lone process**: one rank without a process group.

A rank that sets no thread count of its own (``OMP_NUM_THREADS``) uses the cores not already
busy, shared by the node's ranks (:func:`thread_count`): torch's default of every core makes a
loaded machine's steps several times slower, as each rank's threads wait on the others'.

Worked example: ``srun --nodes 2 --ntasks-per-node 1 hdp-train --nproc-per-node 8 ...`` in job
4242 on ``gpu[07-08]``:

* each ``srun`` task is a launcher; ``SLURM_NNODES=2`` and ``SLURM_NODEID`` make them nodes 0
  and 1, meeting at ``gpu07:24242`` (port 20000 + 4242);
* node 1's launcher starts ranks 8-15 with ``LOCAL_RANK`` 0-7 and writes ``rank8.log`` to
  ``rank15.log``; node 0's shows rank 0's lines on the job's output;
* Slurm's SIGUSR1 before the time limit reaches the launchers, which forward it; every rank
  saves the step in hand (Note [Stopping on a signal]) and exits 0, and so do the launchers;
* had rank 11 died instead, node 1's launcher would print ``hdp-train: rank 11 exited with code
  1: RuntimeError: ... (full log: .../rank11.log)`` and stop ranks 8-15; node 0's ranks then fail
  on their lost peer and node 0's launcher reports the first of them.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import IO, Literal

from torch.distributed import TCPStore

from .config import LauncherConfig, RunConfig

Role = Literal["rank", "srun", "launcher", "lone"]
DEFAULT_PORT = 29500
# After a rank fails, the others get this long to fail or finish on their own, then SIGTERM,
# then SIGKILL after as long again: a rank blocked on its lost peer may never return.
FAILURE_GRACE_S = 10.0
POLL_S = 0.1
TEE_JOIN_S = 5.0
PR_SET_PDEATHSIG = 1  # prctl(2)
ERROR_LINE = re.compile(r"^\S+: error: ")
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")  # torch's on a rank's uncaught exception
HEADER = "=== hdp-train rank started"  # a log kept across runs: each run's part starts here
MARKER = "HDP_LAUNCHER"  # the launcher's pid, in the ranks it starts: their output goes to files


def role(launcher: LauncherConfig, environ: Mapping[str, str]) -> Role:
    """What this process is (Note [Who starts the ranks]). Raises ValueError when
    ``--nproc-per-node`` is given to a rank that torchrun or ``srun`` already started."""
    if "RANK" in environ:
        if launcher.nproc_per_node is not None and MARKER not in environ:
            raise ValueError(
                "--nproc-per-node starts the ranks itself, but torchrun already started this "
                "one: leave out --nproc-per-node, or run hdp-train without torchrun"
            )
        return "rank"
    if launcher.nproc_per_node is not None:
        return "launcher"
    if slurm_rank_environment(environ) is not None:
        return "srun"
    return "lone"


def reports_errors(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process prints an error every rank meets alike (a flag, a file's content):
    rank 0 only under torchrun or ``srun``, whose ranks share one screen; every rank this
    launcher started, as each writes its own log."""
    if MARKER in environ:
        return True
    if "RANK" in environ:
        return environ["RANK"] == "0"
    slurm = slurm_rank_environment(environ)
    return slurm is None or slurm["RANK"] == "0"


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[07-08,11],cpu3`` -> ``gpu07``."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if head is None or not (head[1] or head[2]):
        raise ValueError(f"cannot read a host from the Slurm node list {nodelist!r}")
    if head[2] is None:
        return head[1]
    return head[1] + head[2].split(",")[0].split("-")[0]


def _tasks_on_node(text: str, node: int) -> int:
    """Tasks on node ``node`` from ``SLURM_STEP_TASKS_PER_NODE``: ``8(x2),4`` -> 8, 8, 4."""
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"cannot read Slurm's tasks per node {text!r}")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts[min(node, len(counts) - 1)]


def slurm_port(environ: Mapping[str, str]) -> int:
    """``MASTER_PORT`` if set, else one per Slurm job step (two jobs sharing a node, or two steps
    of one job, do not meet), below Linux's ephemeral ports (32768 on)."""
    if "MASTER_PORT" in environ:
        return int(environ["MASTER_PORT"])
    job, step = (int(environ.get(k, "0") or 0) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID"))
    return 20000 + (job + step) % 10000


def slurm_rank_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's variables for a task of ``srun`` with several tasks, or ``None`` elsewhere
    (a batch script's own shell has ``SLURM_PROCID`` too, but no step id)."""
    if not all(k in environ for k in ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID")):
        return None
    world = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")))
    if world <= 1:
        return None
    node = int(environ.get("SLURM_NODEID", "0"))
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE"))
    nodelist = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": environ["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": str(_tasks_on_node(per_node, node) if per_node else world),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": str(slurm_port(environ)),
    }


def thread_count(ranks_here: int, *, cpus: int | None = None, load: float | None = None) -> int:
    """Threads per rank: the cores not already busy (by the 1-minute load average), shared by
    this node's ``ranks_here`` ranks, at least 1."""
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    load = os.getloadavg()[0] if load is None else load
    idle = max(1, int(cpus - load + 0.5))
    return max(1, idle // max(1, ranks_here))


@dataclass(frozen=True)
class NodeLayout:
    """This node's part of the job: ranks ``node_rank * nproc ...`` of ``nnodes * nproc``."""

    nnodes: int
    node_rank: int
    nproc: int
    host: str
    port: int

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc

    def ranks(self) -> range:
        return range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)

    def environment(self, rank: int) -> dict[str, str]:
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": str(rank - self.node_rank * self.nproc),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # the ranks meet at node 0's launcher
        }


def node_layout(launcher: LauncherConfig, environ: Mapping[str, str]) -> NodeLayout:
    """The layout from the flags, with Slurm's node count, node id and first node where a flag
    is left out under ``srun``. Raises ValueError naming the flag that is missing."""
    slurm = "SLURM_STEP_ID" in environ
    nnodes = launcher.nnodes or int(environ.get("SLURM_NNODES", "1") if slurm else 1)
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS", nnodes)) if slurm else nnodes
    if tasks > nnodes:
        raise ValueError(
            f"--nproc-per-node starts each node's ranks, but srun started {tasks} tasks on "
            f"{nnodes} nodes: run one task per node (srun --ntasks-per-node 1), or leave out "
            "--nproc-per-node and let srun start one task per rank"
        )
    node_rank = launcher.node_rank
    if node_rank is None:
        node_rank = int(environ.get("SLURM_NODEID", "0")) if slurm else 0
    if node_rank >= nnodes:
        raise ValueError(f"--node-rank {node_rank} is not below the {nnodes} nodes of the job")
    endpoint = launcher.rdzv_endpoint
    if endpoint is None and nnodes > 1:
        if not slurm:
            raise ValueError(
                f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, node 0's address that "
                "every node can reach (under srun it is the job's first node)"
            )
        nodelist = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))
        endpoint = f"{first_host(nodelist)}:{slurm_port(environ)}"
    if endpoint is None:
        return NodeLayout(1, 0, launcher.nproc_per_node or 1, "127.0.0.1", 0)  # port: any free
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected HOST or HOST:PORT")
    return NodeLayout(
        nnodes, node_rank, launcher.nproc_per_node or 1, host, int(port or DEFAULT_PORT)
    )


def log_folder(config: RunConfig) -> Path:
    """``--log-dir``; else a new folder under the checkpoint directory, else a temporary one."""
    if config.launcher.log_dir is not None:
        return config.launcher.log_dir
    if config.checkpointing.dir is not None:
        return config.checkpointing.dir / "logs" / datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.mkdtemp(prefix="hdp-train-logs-"))


def error_line(log: Path) -> str | None:
    """hdp's own error line in the last run's part of a rank's log (``prog: error: ...``), else
    the last line of its last traceback, else ``None``."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    text = text.rsplit(HEADER, 1)[-1]  # this run's part
    lines = [RANK_PREFIX.sub("", line) for line in text.splitlines()]
    ours = [line for line in lines if ERROR_LINE.match(line)]
    if ours:
        return ours[-1].strip()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return None
    unindented = [line for line in lines[starts[-1] + 1 :] if line and not line[0].isspace()]
    return unindented[-1].strip()[:500] if unindented else None


class _Tee(threading.Thread):
    """Copies one stream of a rank to its log and, up to its first traceback, to the screen: a
    traceback is the log's to keep, and the launcher's one line names it (``hid`` says one
    was held back)."""

    def __init__(self, source: IO[bytes], screen: IO[str], log: IO[bytes], lock: threading.Lock):
        super().__init__(daemon=True)
        self.source, self.screen, self.log, self.lock = source, screen, log, lock
        self.hid = False

    def run(self) -> None:
        for line in iter(self.source.readline, b""):
            with self.lock:
                self.log.write(line)
                self.log.flush()
            self.hid = self.hid or b"Traceback (most recent call last)" in line
            if self.hid:
                continue
            try:
                self.screen.write(line.decode(errors="replace"))
                self.screen.flush()
            except (OSError, ValueError):  # a closed screen must not stop the log
                pass


@dataclass
class Failure:
    rank: int
    code: int  # negative: killed by that signal

    def what(self) -> str:
        if self.code < 0:
            return f"rank {self.rank} was killed by {signal.Signals(-self.code).name}"
        return f"rank {self.rank} exited with code {self.code}"

    def exit_code(self) -> int:
        return 128 - self.code if self.code < 0 else self.code


def die_with_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """In a rank this launcher started: SIGKILL when the launcher dies (Linux), so a launcher
    killed outright (the OOM killer, ``kill -9``) leaves no ranks behind holding GPUs. Set by
    the rank itself, not between fork and exec, where the launcher's threads make it unsafe;
    a launcher already gone by then ends the rank here."""
    launcher = environ.get(MARKER, "")
    if not launcher.isdigit():
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):  # not Linux: ranks outlive a killed launcher
        return
    if os.getppid() != int(launcher):
        os._exit(128 + signal.SIGKILL)


class Ranks:
    """This node's ranks of one command line: started, signalled, waited for."""

    def __init__(self, layout: NodeLayout, argv: list[str], prog: str, folder: Path):
        self.layout, self.argv, self.prog, self.folder = layout, argv, prog, folder
        self.procs: dict[int, subprocess.Popen] = {}
        self.tees: list[_Tee] = []
        self.signalled: signal.Signals | None = None
        self.rank0_log: IO[bytes] | None = None

    def log(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.log"

    def start(self, environ: Mapping[str, str]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        threads = environ.get("OMP_NUM_THREADS") or str(thread_count(self.layout.nproc))
        command = [sys.executable, "-m", "hdp.launch.cli", *self.argv]
        for rank in self.layout.ranks():
            env = {
                **environ,
                **self.layout.environment(rank),
                "OMP_NUM_THREADS": threads,
                "PYTHONUNBUFFERED": "1",  # lines reach the log and the screen as written
                "HDP_PROG": self.prog,
                MARKER: str(os.getpid()),
            }
            log = open(self.log(rank), "ab")  # the rank's own: it writes there until it ends
            log.write(f"{HEADER} {datetime.now():%Y-%m-%d %H:%M:%S}: {command}\n".encode())
            log.flush()
            shown = rank == 0  # its output to the screen too, through two tees
            proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if shown else log,
                stderr=subprocess.PIPE if shown else subprocess.STDOUT,
            )
            self.procs[rank] = proc
            if not shown:
                log.close()  # the rank has its own copy
                continue
            self.rank0_log, lock = log, threading.Lock()
            self.tees = [
                _Tee(proc.stdout, sys.stdout, log, lock),
                _Tee(proc.stderr, sys.stderr, log, lock),
            ]
            for tee in self.tees:
                tee.start()

    def forward(self, signum: int, frame=None) -> None:
        """A signal handler: the signal to every rank still running."""
        self.signalled = self.signalled or signal.Signals(signum)
        self.send(signal.Signals(signum))

    def send(self, sig: signal.Signals) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _failed(self) -> Failure | None:
        """The first failure among the ranks that have ended: one killed by a signal before one
        that exited (its peers fail because it went), then the lowest rank."""
        codes = {r: p.returncode for r, p in self.procs.items() if p.returncode}
        failed = [(code > 0, r, code) for r, code in codes.items()]
        return Failure(*min(failed)[1:]) if failed else None

    def wait(self) -> Failure | None:
        """Until every rank has ended; the first that failed (:meth:`_failed`), after the
        others were given :data:`FAILURE_GRACE_S` to end on their own, then stopped."""
        failure: Failure | None = None
        stop_at = kill_at = float("inf")
        while [p.poll() for p in self.procs.values()].count(None):
            if failure is None and (failure := self._failed()) is not None:
                stop_at = time.monotonic() + FAILURE_GRACE_S
            now = time.monotonic()
            if now >= kill_at:
                self.send(signal.SIGKILL)
            elif now >= stop_at:
                self.send(signal.SIGTERM)
                stop_at, kill_at = float("inf"), now + FAILURE_GRACE_S
            time.sleep(POLL_S)
        for tee in self.tees:  # a process that inherited rank 0's pipes may hold them open
            tee.join(timeout=TEE_JOIN_S)
        if self.rank0_log is not None:
            self.rank0_log.close()
        return failure or self._failed()

    def report(self, failure: Failure) -> str:
        """One line: the rank, how it ended, its error line unless the screen showed it."""
        line = f"{self.prog}: {failure.what()}"
        shown = failure.rank == 0 and not any(tee.hid for tee in self.tees)
        why = None if shown else error_line(self.log(failure.rank))
        if why:
            line += f": {why}"
        return f"{line} (full log: {self.log(failure.rank)})"


def launch(config: RunConfig, argv: list[str], prog: str) -> int:
    """Start this node's ranks of ``argv``, forward signals to them, wait; the exit code: 0
    when every rank exited 0 (a signal's clean save included), else the first failure's."""
    layout = node_layout(config.launcher, os.environ)
    store = None
    if layout.node_rank == 0:  # the ranks' store, bound before any rank starts: no port race
        store = TCPStore(
            layout.host, layout.port, layout.world, is_master=True, wait_for_workers=False
        )
        layout = replace(layout, port=store.port)
    folder = log_folder(config)
    ranks = Ranks(layout, argv, prog, folder)
    first, last = layout.ranks()[0], layout.ranks()[-1]
    nodes = f" on node {layout.node_rank} of {layout.nnodes}" if layout.nnodes > 1 else ""
    print(
        f"{prog}: starting ranks {first}-{last} of {layout.world}{nodes}; each rank's output "
        f"in {folder}/rankR.log" + (" (rank 0's here too)" if first == 0 else ""),
        file=sys.stderr,
        flush=True,
    )
    previous = {
        sig: signal.signal(sig, ranks.forward)
        for sig in config.training.exit_signals
        if signal.getsignal(sig)
        is not signal.SIG_IGN  # nohup's SIGHUP stays ignored, in the ranks too
    }
    try:
        ranks.start(os.environ)
        if ranks.signalled is not None:  # it came before there were ranks to forward it to
            ranks.send(ranks.signalled)
        failure = ranks.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    del store  # kept open until every rank of this node has ended
    if failure is None:
        return 0
    print(ranks.report(failure), file=sys.stderr, flush=True)
    return failure.exit_code()


__all__ = [
    "NodeLayout",
    "Ranks",
    "error_line",
    "die_with_launcher",
    "first_host",
    "launch",
    "node_layout",
    "reports_errors",
    "role",
    "slurm_rank_environment",
    "thread_count",
]
