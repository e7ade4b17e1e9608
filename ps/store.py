"""One server's shard: its rows of every table in one array, with optimizer state.

Slots follow the plan's :class:`~embeddings.sharding.Placement`; initial values depend only
on (seed, table, row), so a row starts the same however the tables are sharded.

In full mode the last table holds the dense parameters, which get an optimizer of their own
(``dense_optimizer``, per value: :meth:`~embeddings.optim.SparseOptimizer.per_value`). A
table's slots on a server are contiguous and the last table's come last, so the dense rows
are the slots from :attr:`ShardStore.dense_from` on, and their state is a separate array.
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
                 optimizer: SparseOptimizer, seed: int,
                 dense_optimizer: SparseOptimizer | None = None) -> None:
        self.layout = layout
        self.placement = placement
        self.server = server
        self.tables = LocalTables(layout, optimizer, seed, placement.server_rows(server),
                                  rows_of=self.global_rows)
        count = len(self.tables.weight)
        self.dense_from = count - int(placement.counts[server][-1]) if dense_optimizer else count
        self.dense_optimizer = dense_optimizer
        self.dense_state = (dense_optimizer.new_state(count - self.dense_from, layout.dim)
                            if dense_optimizer else None)

    def apply(self, slots: np.ndarray, grads: np.ndarray, lr: float) -> None:
        """Update unique ``slots`` with their gradient rows: the tables' optimizer, and the
        dense optimizer on the dense rows."""
        t, lo = self.tables, self.dense_from
        if self.dense_optimizer is None:
            t.optimizer.apply(t.weight, t.state, slots, grads, lr)
            return
        dense = slots >= lo
        t.optimizer.apply(t.weight, t.state, slots[~dense], grads[~dense], lr)
        self.dense_optimizer.apply(t.weight[lo:], self.dense_state, slots[dense] - lo,
                                   grads[dense], lr)

    def end_round(self) -> None:
        """Every running worker has pushed since the last round ended (the slowest clock
        moved): the dense optimizer folds the round's parts in
        (:meth:`~embeddings.optim.SparseOptimizer.end_round`)."""
        if self.dense_optimizer is not None:
            self.dense_optimizer.end_round(self.dense_state)

    def write_values(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Overwrite rows, their optimizer state reset (workers place the dense values so)."""
        self.tables.weight[slots] = values
        self.tables.state[slots] = 0.0
        if self.dense_state is not None:
            dense = slots[slots >= self.dense_from] - self.dense_from
            self.dense_state[dense] = 0.0

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
        dense = 0 if self.dense_state is None else self.dense_state.nbytes
        return self.tables.weight.nbytes + self.tables.state.nbytes + dense
