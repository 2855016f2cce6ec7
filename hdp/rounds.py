"""Congestion-free rounds of point-to-point messages: a minimum proper edge colouring.

The senders and receivers of a wave's K/V messages form a bipartite multigraph; colouring its
edges with as many colours as the largest degree (König) gives rounds in which every rank sends
at most one message and receives at most one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .exchange import KVTransfer


def edge_colour_rounds(transfers: Sequence[KVTransfer]) -> list[list[KVTransfer]]:
    """Proper edge colouring of the bipartite (sender, receiver) multigraph with max-degree colours.

    Classic alternating-path method: colour each edge with a colour free at both ends, swapping
    an alternating two-coloured path when no such colour exists. Deterministic for a given input
    order, so every rank derives the same rounds from the same plan.
    """
    send_at: dict[int, dict[int, int]] = {}  # sender -> colour -> edge index
    recv_at: dict[int, dict[int, int]] = {}  # receiver -> colour -> edge index
    colour = [-1] * len(transfers)

    def free(table: dict[int, int]) -> int:
        c = 0
        while c in table:
            c += 1
        return c

    for e, t in enumerate(transfers):
        su = send_at.setdefault(t.src, {})
        rv = recv_at.setdefault(t.dst, {})
        a = free(su)
        b = free(rv)
        if a not in rv:
            c = a
        elif b not in su:
            c = b
        else:
            # Colour a is free at the sender but used at the receiver; b the other way round.
            # Walk the a/b alternating path from the receiver and swap its colours, freeing a there.
            path: list[int] = []
            node, on_recv_side, want = t.dst, True, a
            while True:
                table = recv_at[node] if on_recv_side else send_at[node]
                if want not in table:
                    break
                edge = table[want]
                path.append(edge)
                node = transfers[edge].src if on_recv_side else transfers[edge].dst
                on_recv_side = not on_recv_side
                want = b if want == a else a
            for edge in path:
                old = colour[edge]
                tr = transfers[edge]
                del send_at[tr.src][old]
                del recv_at[tr.dst][old]
            for edge in path:
                new = b if colour[edge] == a else a
                colour[edge] = new
                tr = transfers[edge]
                send_at[tr.src][new] = edge
                recv_at[tr.dst][new] = edge
            c = a
        colour[e] = c
        su[c] = e
        rv[c] = e
    rounds: list[list[KVTransfer]] = [[] for _ in range(max(colour, default=-1) + 1)]
    for e, c in enumerate(colour):
        rounds[c].append(transfers[e])
    return rounds
