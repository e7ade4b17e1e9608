"""Bulk synchronous parallel (Valiant 1990).

Guarantee: a worker at clock ``c`` reads only values that include every worker's updates of
steps ``0 .. c-1`` (staleness 0). Every worker therefore computes on the same parameter
version, and the step time is the slowest worker's.
"""

from __future__ import annotations

from hpctrain.sync.types import SyncModel

__all__ = ["BSP"]

BSP = SyncModel("bsp", bound=0)
