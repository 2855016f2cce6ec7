"""The multi-rank test helper names where stuck ranks wait instead of hanging the suite."""

import pytest
import torch
import torch.distributed as dist

from hdp.testing.ranks import run_ranks


def _rank0_waits_for_a_message_never_sent(rank: int, world: int) -> None:
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)


def test_stuck_ranks_are_reported_with_where_they_wait():
    with pytest.raises(TimeoutError) as caught:
        run_ranks(_rank0_waits_for_a_message_never_sent, 2, timeout=15.0)
    message = str(caught.value)
    assert "-- rank 0 waits in:" in message
    assert "_rank0_waits_for_a_message_never_sent" in message
