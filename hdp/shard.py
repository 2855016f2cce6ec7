"""The unit of placement: a contiguous run of one sequence's tokens (no imports of the rest of
the package, so plans, exchanges and their rounds can all name it)."""

from __future__ import annotations

from typing import NamedTuple


class Shard(NamedTuple):
    """Tokens ``[start, end)`` of sequence ``seq`` of the global batch."""

    seq: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start
