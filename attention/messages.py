"""The P2P messages of ``dist_attn``: posting a batch of sends and receives, and counting bytes.

Both exchanges post through :func:`post`: the zigzag K/V rounds of :mod:`hdp.attention.dist` and the
head-parallel all-to-alls of :mod:`hdp.attention.ulysses`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommCounter:
    """Bytes this process sent and received through ``dist_attn`` (forward and backward)."""

    fwd_bytes_sent: int = 0
    fwd_bytes_received: int = 0
    bwd_bytes_sent: int = 0
    bwd_bytes_received: int = 0
    messages: int = 0
    bytes_to: dict[int, int] = field(default_factory=dict)  # global peer rank -> bytes sent

    def reset(self) -> None:
        self.__init__()

    def count(self, buf: torch.Tensor, peer: int, sent: bool, backward: bool) -> None:
        nbytes = buf.numel() * buf.element_size()
        if sent:
            self.messages += 1
            self.bytes_to[peer] = self.bytes_to.get(peer, 0) + nbytes
            if backward:
                self.bwd_bytes_sent += nbytes
            else:
                self.fwd_bytes_sent += nbytes
        elif backward:
            self.bwd_bytes_received += nbytes
        else:
            self.fwd_bytes_received += nbytes


COMM = CommCounter()


def global_rank(group, r: int) -> int:
    return r if group is None or group is dist.group.WORLD else dist.get_global_rank(group, r)


def wait_all(reqs: list) -> None:
    for r in reqs:
        r.wait()


def post(group, sends: list, recvs: list, tag: int, backward: bool, tag_step: int = 1) -> list:
    """Post ``sends`` and ``recvs`` (lists of (tensor, peer rank in ``group``)); returns the
    requests. The k-th message between two ranks in one call gets tag ``tag + 2 * k * tag_step``
    on both sides, so both must list their messages to one peer in the same order."""
    ops, count = [], {}
    for op, msgs in ((dist.isend, sends), (dist.irecv, recvs)):
        for buf, peer in msgs:
            k = count.get((op, peer), 0)
            count[(op, peer)] = k + 1
            where = global_rank(group, peer)
            ops.append(dist.P2POp(op, buf, where, group, tag + 2 * k * tag_step))
            COMM.count(buf, peer, sent=op is dist.isend, backward=backward)
    return dist.batch_isend_irecv(ops) if ops else []


_WARMED: set = set()


def warm_up(group, device: torch.device) -> None:
    """Before the first P2P call on a NCCL communicator: every rank must take part in the
    communicator's first call, which a barrier does."""
    if dist.is_initialized() and group not in _WARMED and device.type == "cuda":
        dist.barrier(group)
        _WARMED.add(group)
