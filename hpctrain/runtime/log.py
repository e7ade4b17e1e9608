"""Rank-prefixed logging through a :class:`logging.Filter` (never by patching ``print``)."""

from __future__ import annotations

import logging
import sys

__all__ = ["RankFilter", "setup_logging"]

_FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"


class RankFilter(logging.Filter):
    """Stamps every record with the world rank so that interleaved output stays readable."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int, level: str = "info") -> None:
    """Log ``level`` and up on rank 0, warnings and up elsewhere, to stderr with the rank."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RankFilter(rank))
    handler.setFormatter(logging.Formatter(_FORMAT, "%H:%M:%S"))
    root = logging.getLogger("hpctrain")
    root.handlers[:] = [handler]
    root.propagate = False
    root.setLevel(level.upper() if rank == 0 else logging.WARNING)
    for package in ("embeddings", "ps"):
        other = logging.getLogger(package)
        other.handlers[:] = [handler]
        other.propagate = False
        other.setLevel(root.level)
