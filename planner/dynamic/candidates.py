"""What the placers share: candidates, the assignment of work to ranks, and how a job
picks its ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..common import Context


@dataclass(frozen=True)
class Candidate:
    """One way to plan a batch: each sequence's degree (1: whole on one rank) and its busy
    time there (s). ``stack_share`` (``wave`` sync): a multi-rank job joins a wave that already
    holds work only where that raises the wave by at most this share of the job's time.
    ``jobs_first`` (``wave`` sync): every multi-rank job is placed before any whole sequence,
    not in one list with them, tallest first."""

    degree: np.ndarray
    job_time: np.ndarray
    stack_share: float | None = None
    jobs_first: bool = False


@dataclass
class Assignment:
    """Where the placers put the work. Multi-rank jobs (in placement order): their members and
    keys; sequences placed whole (indexed by sequence, -1 where not placed): rank and key. Keys
    order the work: a wave index in ``wave`` sync, an order within each rank in ``peer`` sync."""

    job_members: list[np.ndarray]
    job_key: list[int]
    single_rank: np.ndarray
    single_key: np.ndarray


def num_waves_for(ctx: Context) -> int:
    """Waves a ``wave``-sync plan aims at (90% full, so sequences pack); 1 in ``peer`` sync."""
    if ctx.sync != "wave":
        return 1
    return max(1, math.ceil(int(ctx.seq_lens.sum()) / (0.9 * ctx.num_ranks * ctx.capacity)))


def jobs_and_singles(ctx: Context, degree: np.ndarray, job_time: np.ndarray) -> tuple:
    """(jobs placed as blocks, tallest first: split sequences and whole ones that need offload to
    fit a rank; sequences placed whole on one rank, slowest first)."""
    lens = ctx.seq_lens
    job = (degree > 1) | (lens > ctx.capacity)
    multi = np.flatnonzero(job)
    multi = multi[np.argsort(-job_time[multi], kind="stable")]
    single = np.flatnonzero(~job & (lens > 0))
    return multi, single[np.argsort(-ctx.packed_s[single], kind="stable")]


def pick_members(load_row: np.ndarray, d: int, rpn: int, eligible: np.ndarray) -> np.ndarray | None:
    """``d`` ranks for one job: the least-loaded ranks of one node if ``d <= rpn``, else whole
    nodes with the smallest maximum load plus the least-loaded ranks of one more node."""
    return NodeLoads(np.where(eligible, load_row, np.inf), rpn).pick(d)


class NodeLoads:
    """Ranks' loads as a ``[node, rank in node]`` grid with each node's ranks sorted by load,
    for :func:`pick_members`; :meth:`set` sorts again only the nodes whose loads changed."""

    def __init__(self, load: np.ndarray, rpn: int) -> None:
        nodes = -(-load.size // rpn)
        padded = np.full(nodes * rpn, np.inf)
        padded[: load.size] = load
        self.rpn, self.grid = rpn, padded.reshape(nodes, rpn)
        self.order = np.argsort(self.grid, axis=1, kind="stable")
        self.sorted = np.take_along_axis(self.grid, self.order, axis=1)

    def set(self, ranks: np.ndarray, load: float) -> None:
        """Ranks ``ranks`` (sorted) now carry ``load``."""
        self.grid.reshape(-1)[ranks] = load
        first, last = int(ranks[0]) // self.rpn, int(ranks[-1]) // self.rpn
        if first == last:  # (most jobs: one node, sorted without numpy's general machinery)
            row = self.grid[first]
            order = row.argsort(kind="stable")
            self.order[first], self.sorted[first] = order, row[order]
            return
        nodes = np.unique(ranks // self.rpn)
        order = np.argsort(self.grid[nodes], axis=1, kind="stable")
        self.order[nodes] = order
        self.sorted[nodes] = np.take_along_axis(self.grid[nodes], order, axis=1)

    def pick(self, d: int) -> np.ndarray | None:
        """:func:`pick_members`' ranks for a job of ``d`` (``None``: too few finite loads)."""
        rpn, order, sorted_loads = self.rpn, self.order, self.sorted
        if d <= rpn:
            score = sorted_loads[:, d - 1]
            k = int(np.argmin(score))
            if not np.isfinite(score[k]):
                return None
            return np.sort(k * rpn + order[k, :d])
        full, rem = divmod(d, rpn)
        node_max = sorted_loads[:, -1]
        by_max = np.argsort(node_max, kind="stable")
        chosen_nodes = by_max[:full]
        if not np.isfinite(node_max[chosen_nodes]).all():
            return None
        members = [np.arange(k * rpn, (k + 1) * rpn) for k in chosen_nodes]
        if rem:
            rest = by_max[full:]
            if rest.size == 0:
                return None
            score = sorted_loads[rest, rem - 1]
            k = int(rest[int(np.argmin(score))])
            if not np.isfinite(sorted_loads[k, rem - 1]):
                return None
            members.append(k * rpn + order[k, :rem])
        return np.sort(np.concatenate(members))
