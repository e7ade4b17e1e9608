"""One server's shard: its rows of every table in one array, with optimizer state.

Slots follow the plan's :class:`~embeddings.sharding.Placement`; initial values depend only
on (seed, table, row), so a row starts the same however the tables are sharded.
"""

from __future__ import annotations

import numpy as np

from embeddings.optim import SparseOptimizer
from embeddings.sharding import Placement
from embeddings.tables import LocalTables, TableLayout
from hpctrain.errors import EmbeddingError

__all__ = ["ShardStore"]


class ShardStore:
    def __init__(self, layout: TableLayout, placement: Placement, server: int,
                 optimizer: SparseOptimizer, seed: int) -> None:
        self.layout = layout
        self.placement = placement
        self.server = server
        self.tables = LocalTables(layout, optimizer, seed, placement.server_rows(server),
                                  rows_of=self.global_rows)

    def global_rows(self, lo: int, hi: int) -> np.ndarray:
        """Global rows held in slots ``[lo, hi)`` (they may span several tables)."""
        base, counts = self.placement.base[self.server], self.placement.counts[self.server]
        parts = []
        for t in range(len(counts)):
            a, z = max(lo, int(base[t])), min(hi, int(base[t] + counts[t]))
            if a < z:
                ids = self.placement.ids_at(self.server, t, a - int(base[t]), z - int(base[t]))
                parts.append(self.layout.offsets[t] + ids)
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def slots(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Slots of ``ids`` of ``table`` on this server; names the table and id when an id
        is out of range, the table unknown, or the row held by another server."""
        if not 0 <= table < len(self.layout.specs):
            raise EmbeddingError(f"unknown table index {table} "
                                 f"(the job has {len(self.layout.specs)} tables)")
        spec = self.layout.specs[table]
        bad = (ids < 0) | (ids >= spec.rows)
        if bad.any():
            raise EmbeddingError(f"id {int(ids[bad][0])} is outside table {spec.name!r} of "
                                 f"{spec.rows} rows")
        server, slots = self.placement.locate(table, ids)
        if (server != self.server).any():
            wrong = int(ids[server != self.server][0])
            raise EmbeddingError(f"row {wrong} of table {spec.name!r} belongs to server "
                                 f"{int(server[server != self.server][0])}, not {self.server}")
        return slots

    def resident_bytes(self) -> int:
        return self.tables.weight.nbytes + self.tables.state.nbytes
