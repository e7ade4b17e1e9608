"""Asynchronous parallel.

Guarantee: none on staleness — a read is served at once with whatever updates have arrived;
no worker ever waits for another. Staleness is unbounded but measured (the gap between the
reader's clock and the slowest worker's is recorded for every read).
"""

from __future__ import annotations

from hpctrain.sync.types import SyncModel

__all__ = ["ASP"]

ASP = SyncModel("asp", bound=None)
