"""The clock rule every synchronization model is an instance of.

Each worker's clock counts its completed steps (a step is complete once its updates have
been applied where the parameters live). A read made at clock ``c`` may be served once the
slowest worker's clock is at least ``c - bound``: it then lacks at most ``bound`` steps of
anyone's updates. ``slack`` widens the bound for reads that knowingly run ahead, such as a
prefetch issued one step early (see :mod:`ps.client`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncModel"]


@dataclass(frozen=True)
class SyncModel:
    name: str
    bound: int | None
    """Staleness bound in clocks; ``None`` is unbounded (never wait)."""

    def ready(self, read_clock: int, slowest_clock: int, slack: int = 0) -> bool:
        """Whether a read at ``read_clock`` may be served now."""
        return self.bound is None or slowest_clock >= read_clock - self.bound - slack

    def staleness(self, read_clock: int, slowest_clock: int) -> int:
        """Steps of updates a read served now may lack (0 when everyone has caught up)."""
        return max(0, read_clock - slowest_clock)
