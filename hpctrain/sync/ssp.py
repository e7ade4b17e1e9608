"""Stale synchronous parallel, SSP(s) (Ho et al., NIPS 2013).

Guarantee: a read at clock ``c`` is served only once the slowest worker has completed
``c - s`` steps, so it lacks at most ``s`` steps of anyone's updates; a worker always sees
its own updates (its pushes reach a server before its later reads, and the server applies
them on arrival). A worker may therefore run up to ``s`` steps ahead of the slowest before it
blocks. SSP(0) is BSP.
"""

from __future__ import annotations

from hpctrain.sync.types import SyncModel

__all__ = ["ssp"]


def ssp(staleness: int) -> SyncModel:
    if staleness < 0:
        raise ValueError(f"SSP needs a staleness bound >= 0, got {staleness}")
    return SyncModel(f"ssp:{staleness}", bound=staleness)
