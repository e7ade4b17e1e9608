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
from ps import kernels

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
        """Slots of ``ids`` of ``table`` on this server (see :meth:`request_slots`)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        return self.request_slots(np.array([table], np.int64),
                                  np.array([len(ids)], np.int64), ids)[0]

    def request_slots(self, tables: np.ndarray, counts: np.ndarray,
                      ids: np.ndarray) -> tuple[np.ndarray, bool]:
        """Slots of a request's ids (``counts[g]`` ids of ``tables[g]`` per group, in order)
        and whether they are unique (ids strictly increasing per table, tables increasing);
        names the table and id when an id is out of range, the table unknown, or the row
        held by another server."""
        slots = np.empty(len(ids), dtype=np.int64)
        status, where, unique = kernels.shard_slots(tables, counts, ids, self.server,
                                                    *self.placement.arrays, slots)
        if status == kernels.OK:
            return slots, unique
        specs = self.layout.specs
        if status == kernels.UNKNOWN_TABLE:
            raise EmbeddingError(f"unknown table index {int(tables[where])} "
                                 f"(the job has {len(specs)} tables)")
        table = int(tables[np.searchsorted(np.cumsum(counts), where, side="right")])
        spec, bad = specs[table], int(ids[where])
        if status == kernels.OUT_OF_RANGE:
            raise EmbeddingError(f"id {bad} is outside table {spec.name!r} of "
                                 f"{spec.rows} rows")
        owner = int(self.placement.locate(table, np.array([bad]))[0][0])
        raise EmbeddingError(f"row {bad} of table {spec.name!r} belongs to server "
                             f"{owner}, not {self.server}")

    def resident_bytes(self) -> int:
        return self.tables.weight.nbytes + self.tables.state.nbytes
