"""Every worker holds every row; the plain data-parallel store.

A push all-gathers the rows each worker touched with their gradients, in one message per
worker (never a dense table: only the rows the global batch touched travel), sums
duplicates, and applies the same update on every worker, so the replicas stay identical
without a broadcast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from embeddings.tables import LocalTables, pack_rows, unpack_rows
from embeddings.types import EmbeddingStore, RowSink, RowSource
from hpctrain.comm.native import allgatherv

if TYPE_CHECKING:
    from hpctrain.comm.emulate import Channel

__all__ = ["ReplicatedTables"]


class ReplicatedTables(EmbeddingStore):
    """All rows on each rank of ``comm``; ``push`` is collective over ``comm``. ``link``, a
    :class:`~hpctrain.comm.emulate.Channel` over ``comm``, delays the push's all-gather
    under ``comm.emulate``."""

    def __init__(self, tables: LocalTables, comm: MPI.Intracomm,
                 link: Channel | None = None) -> None:
        self.tables = tables
        self.dim = tables.dim
        self.comm = comm
        self.link = link
        self.bytes_sent = 0  # rows and gradients this worker sent to the others

    def pull(self, rows: np.ndarray) -> np.ndarray:
        return self.tables.pull(rows)

    def push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        """One ``Allgatherv`` over ``comm`` of every worker's rows with their gradients
        (packed in one message, after the ``Allgather`` of the lengths), then a local
        update. One worker pushes straight into its tables."""
        if self.comm.Get_size() == 1:
            self.tables.push(rows, grads, lr)
            return
        packed = pack_rows(rows, grads)
        self.bytes_sent += (self.comm.Get_size() - 1) * packed.nbytes
        self.tables.push(*unpack_rows(allgatherv(packed, self.comm, link=self.link)), lr)

    def save(self, out: RowSink) -> None:
        """Worker 0 writes every row (the replicas are identical)."""
        if out.lead:
            self.tables.save(out)

    def restore(self, source: RowSource) -> None:
        self.tables.restore(source)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
