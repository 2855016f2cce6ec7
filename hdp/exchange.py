"""Who sends which keys/values to whom in one wave: the ``rank`` and ``node`` K/V exchanges.

A rank holding queries of sequence ``s`` up to position ``E`` needs the keys/values of every token
of ``s`` before ``E``; the parts other ranks hold are *pieces* (:func:`kv_needs`).

``rank`` exchange: every rank fetches every piece it needs from its owner itself. Eight ranks of a
node holding shards of one long sequence each pull the same earlier K/V through eight NICs.

``node`` exchange, Note [Node exchange]: pieces from an owner on another node cross the network
once per node. The node's holders of those pieces split the fetching between them (each block
goes to one *relay*, so the node's NICs share the load) and the relay forwards each block over
NVLink to the node's other ranks that need part of it. Backward, those ranks return their dK/dV
partials of the block to the relay, which adds them to its own and sends one message to the owner.
Pieces between ranks of one node travel directly, as in ``rank`` exchange.

``ulysses`` marks a plan whose split sequences attend head-parallel, by all-to-alls
(:mod:`hdp.ulysses` prices them, :mod:`hdp.attention.ulysses` runs them); it has no P2P rounds.

Note [Node exchange rounds]: the messages run in rounds in which each rank sends at most one
message and receives at most one (:mod:`hdp.rounds`). Each relay's fetches are numbered
``0, 1, 2, ...``; superstep ``g`` holds the relays' fetch number ``g``, the forwards of their fetch
number ``g - 1`` and the ``g``-th block of each direct pair, coloured into rounds on its own. A
forward thus always runs after its fetch, and a relay holds at most two fetched blocks: the one it
forwards and the one arriving. Its dK/dV sum goes back to the owner in the *return phase* after
the block's last forward (the phase after round ``r`` is ``r + 1``; the last phase follows the
last round).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .rounds import edge_colour_rounds
from .shard import Shard

if TYPE_CHECKING:
    from .plan import Plan

KV_EXCHANGES = ("rank", "node", "ulysses")
RELAY_SLOTS = 2  # fetched blocks a relay holds at once (Note [Node exchange rounds])


@dataclass(frozen=True)
class KVTransfer:
    """One P2P message: keys/values of ``pieces`` (``Shard``s) from ``src`` to ``dst``.

    ``hop`` numbers the wave's messages. In ``node`` exchange a *fetch* (``relay``) is kept by
    ``dst`` to forward, and a *forward* sends a part of fetch ``via``'s block on.
    """

    src: int
    dst: int
    pieces: tuple[Shard, ...]
    hop: int = -1
    relay: bool = False
    via: int = -1

    @property
    def tokens(self) -> int:
        return sum(p.end - p.start for p in self.pieces)


@dataclass
class WaveExchange:
    """The messages of one wave in rounds, and when each relay returns a fetch's dK/dV sum."""

    rounds: list[list[KVTransfer]]
    returns: dict[int, int] = field(default_factory=dict)  # fetch hop -> return phase

    @property
    def transfers(self) -> list[KVTransfer]:
        return [m for rnd in self.rounds for m in rnd]


def kv_needs(plan: Plan, wave: int) -> dict[tuple[int, int], list[Shard]]:
    """What each rank receives from each other rank in ``wave``: ``(src, dst) -> pieces``.

    Each part of another rank's shard before the end of the last shard ``dst`` holds of that
    sequence is a piece. Pieces are in (sequence, start) order; pairs in (src, dst) order.
    """
    rank, seq, start, end = plan.cell_columns(wave)
    need_end: dict[tuple[int, int], int] = {}
    holders: dict[int, list[int]] = {}
    for r, s, b in zip(rank, seq, end):
        key = (s, r)
        if key not in need_end:
            holders.setdefault(s, []).append(r)
            need_end[key] = b
        elif b > need_end[key]:
            need_end[key] = b
    pairs: dict[tuple[int, int], list[Shard]] = {}
    for i in sorted(range(len(seq)), key=lambda i: (seq[i], start[i])):
        s, src, a, b = seq[i], rank[i], start[i], end[i]
        if len(holders[s]) == 1:
            continue
        for dst in holders[s]:
            if dst != src:
                stop = min(b, need_end[(s, dst)])
                if stop > a:
                    pairs.setdefault((src, dst), []).append(Shard(s, a, stop))
    return dict(sorted(pairs.items()))


def cut_blocks(pieces: list[Shard], block_tokens: int) -> list[tuple[Shard, ...]]:
    """``pieces`` cut into consecutive messages of at most ``block_tokens`` tokens."""
    out: list[tuple[Shard, ...]] = []
    msg: list[Shard] = []
    room = block_tokens
    for p in pieces:
        a = p.start
        while a < p.end:
            take = min(room, p.end - a)
            msg.append(Shard(p.seq, a, a + take))
            a += take
            room -= take
            if room == 0:
                out.append(tuple(msg))
                msg, room = [], block_tokens
    if msg:
        out.append(tuple(msg))
    return out


def rank_transfers(plan: Plan, wave: int) -> list[KVTransfer]:
    """``rank`` exchange: each (src, dst) pair's pieces cut into messages, in (src, dst) order."""
    out: list[KVTransfer] = []
    for (src, dst), pieces in kv_needs(plan, wave).items():
        for block in cut_blocks(pieces, plan.kv_block_tokens):
            out.append(KVTransfer(src, dst, block, hop=len(out)))
    return out


def wave_exchange(plan: Plan, wave: int) -> WaveExchange:
    """The rounds of ``wave`` in the plan's K/V exchange (deterministic for a given plan)."""
    if plan.kv_exchange == "rank":
        return WaveExchange(edge_colour_rounds(rank_transfers(plan, wave)))
    if plan.kv_exchange == "ulysses":
        raise ValueError(
            "a ulysses plan exchanges by all-to-alls over heads, not P2P rounds; for its "
            "placement's rounds use plan.with_exchange('rank')"
        )
    return _node_exchange(plan, wave)


def _clip(pieces: tuple[Shard, ...], wanted: dict[int, int]) -> tuple[Shard, ...]:
    """The parts of ``pieces`` before ``wanted[seq]`` (sequences not in ``wanted``: none)."""
    out = []
    for p in pieces:
        stop = min(p.end, wanted.get(p.seq, p.start))
        if stop > p.start:
            out.append(Shard(p.seq, p.start, stop))
    return tuple(out)


class _NodeRoutes:
    """Fetches, forwards and direct messages of one wave's ``node`` exchange, by superstep."""

    def __init__(self, plan: Plan, wave: int) -> None:
        self.rpn = int(plan.ranks_per_node or 1)
        self.block = plan.kv_block_tokens
        self.steps: dict[int, list[KVTransfer]] = defaultdict(list)
        self.fetched: dict[int, int] = defaultdict(int)  # relay -> tokens fetched so far
        self.fetches: dict[int, int] = defaultdict(int)  # relay -> fetches so far
        self.hops = 0
        needs = kv_needs(plan, wave)
        remote: dict[tuple[int, int], dict[int, dict[int, int]]] = defaultdict(dict)
        for (src, dst), pieces in needs.items():
            if src // self.rpn == dst // self.rpn:
                for k, block in enumerate(cut_blocks(pieces, self.block)):
                    self._add(k, KVTransfer(src, dst, block))
                continue
            ends: dict[int, int] = {}
            for p in pieces:  # what dst needs of src, per sequence: a prefix of src's shards
                ends[p.seq] = max(ends.get(p.seq, 0), p.end)
            remote[(src, dst // self.rpn)][dst] = ends
        for (src, _node), consumers in sorted(remote.items()):
            self._route(src, consumers, needs)

    def _add(self, step: int, m: KVTransfer) -> KVTransfer:
        m = KVTransfer(m.src, m.dst, m.pieces, self.hops, m.relay, m.via)
        self.hops += 1
        self.steps[step].append(m)
        return m

    def _route(self, src: int, consumers: dict[int, dict[int, int]], needs) -> None:
        """Fetch what ``consumers`` (one node's ranks: dst -> sequence -> end) need of ``src``
        once, block by block, and forward each block's parts to the consumers that need them."""
        union: dict[tuple[int, int], int] = {}
        for dst in consumers:
            for p in needs[(src, dst)]:
                key = (p.seq, p.start)
                union[key] = max(union.get(key, 0), p.end)
        pieces = [Shard(s, a, b) for (s, a), b in sorted(union.items())]
        for block in cut_blocks(pieces, self.block):
            parts = {dst: _clip(block, ends) for dst, ends in consumers.items()}
            wanting = [dst for dst, part in parts.items() if part]
            relay = min(wanting, key=lambda d: (self.fetched[d], d))
            g = self.fetches[relay]
            self.fetches[relay] += 1
            self.fetched[relay] += sum(p.end - p.start for p in block)
            fetch = self._add(g, KVTransfer(src, relay, block, relay=True))
            for dst in wanting:
                if dst != relay:
                    self._add(g + 1, KVTransfer(relay, dst, parts[dst], via=fetch.hop))


def _node_exchange(plan: Plan, wave: int) -> WaveExchange:
    routes = _NodeRoutes(plan, wave)
    rounds: list[list[KVTransfer]] = []
    for step in sorted(routes.steps):
        rounds.extend(edge_colour_rounds(routes.steps[step]))
    last_use: dict[int, int] = {}
    for r, rnd in enumerate(rounds):
        for m in rnd:
            if m.relay:
                last_use.setdefault(m.hop, r)
            elif m.via >= 0:
                last_use[m.via] = max(last_use.get(m.via, r), r)
    return WaveExchange(rounds, {hop: r + 1 for hop, r in last_use.items()})
