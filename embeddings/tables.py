"""Table layout (global row ids), seeded row initialisation, and rows held in local memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from embeddings.optim import SparseOptimizer, coalesce
from embeddings.types import BackingStore, RowSink, RowSource, TableSpec
from hpctrain.errors import EmbeddingError
from hpctrain.runtime import rng

__all__ = ["TableLayout", "init_rows", "LocalTables", "pack_rows", "unpack_rows"]

_INIT_BLOCK = 1 << 14


class TableLayout:
    """Tables stacked into one row space: row ``offsets[t] + id`` is row ``id`` of table ``t``.

    All tables share one width, as DLRM's dot interaction requires.
    """

    def __init__(self, specs: Sequence[TableSpec]) -> None:
        if not specs or len({s.dim for s in specs}) != 1:
            raise ValueError("a layout needs at least one table and one shared dim")
        self.specs = tuple(specs)
        self.dim = specs[0].dim
        self.sizes = np.array([s.rows for s in specs], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.total_rows = int(self.sizes.sum())

    @classmethod
    def from_sizes(cls, sizes: Sequence[int], dim: int) -> TableLayout:
        return cls([TableSpec(f"t{t}", int(n), dim) for t, n in enumerate(sizes)])

    def global_rows(self, ids: np.ndarray) -> np.ndarray:
        """Global rows of ``ids`` (int [B, T], column t indexes table t); checks the range."""
        if ids.ndim != 2 or ids.shape[1] != len(self.specs):
            raise EmbeddingError(f"expected ids of shape [batch, {len(self.specs)}], "
                                 f"got {list(ids.shape)}")
        bad = (ids < 0) | (ids >= self.sizes)
        if bad.any():
            b, t = np.argwhere(bad)[0]
            raise EmbeddingError(f"id {int(ids[b, t])} is outside table "
                                 f"{self.specs[t].name!r} of {self.specs[t].rows} rows "
                                 f"(sample {b} of the batch)")
        return ids.astype(np.int64, copy=False) + self.offsets

    def table_of(self, rows: np.ndarray) -> np.ndarray:
        """Table index of each global row."""
        return np.searchsorted(self.offsets, rows, side="right") - 1


def init_rows(layout: TableLayout, rows: np.ndarray, seed: int) -> np.ndarray:
    """Initial values of global ``rows``: uniform in +-1/sqrt(table rows), as DLRM does.

    Each value depends only on (seed, row, column), never on which rank or shard makes it.
    """
    rows = np.asarray(rows, dtype=np.int64)
    scale = 1.0 / np.sqrt(layout.sizes[layout.table_of(rows)].astype(np.float64))
    keys = rows.astype(np.uint64)[:, None] * np.uint64(layout.dim) + np.arange(
        layout.dim, dtype=np.uint64)
    values = (2.0 * rng.uniform(keys, seed) - 1.0) * scale[:, None]
    return values.astype(np.float32)


def pack_rows(rows: np.ndarray, grads: np.ndarray) -> np.ndarray:
    """Each row id (int64) and its float32 gradient as one line of ``dim + 2`` int32 words,
    so rows and gradients travel in one message."""
    packed = np.empty((len(rows), grads.shape[1] + 2), dtype=np.int32)
    packed[:, :2] = np.ascontiguousarray(rows, dtype=np.int64).view(np.int32).reshape(-1, 2)
    packed[:, 2:] = np.ascontiguousarray(grads, dtype=np.float32).view(np.int32)
    return packed


def unpack_rows(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row ids and gradients of lines made by :func:`pack_rows`, as strided views into
    ``packed`` (:func:`~embeddings.optim.coalesce` reads them in place: copying them out
    cost numpy's strided loops more than the coalescing itself)."""
    return packed[:, :2].view(np.int64)[:, 0], packed[:, 2:].view(np.float32)


class LocalTables(BackingStore):
    """Rows in one contiguous array with their optimizer state, addressed by slot.

    Slot ``i`` holds global row ``rows_of(i, i + 1)[0]``: by default every row of the layout
    in order (a replica); a server shard passes its plan's inverse placement. Initial values
    come from :func:`init_rows`, block by block, so no full-size temporary is ever made.
    """

    def __init__(self, layout: TableLayout, optimizer: SparseOptimizer, seed: int,
                 count: int | None = None,
                 rows_of: Callable[[int, int], np.ndarray] | None = None) -> None:
        self.layout = layout
        self.dim = layout.dim
        count = layout.total_rows if count is None else count
        rows_of = rows_of or (lambda lo, hi: np.arange(lo, hi, dtype=np.int64))
        self.weight = np.empty((count, self.dim), dtype=np.float32)
        for lo in range(0, count, _INIT_BLOCK):
            hi = min(count, lo + _INIT_BLOCK)
            self.weight[lo:hi] = init_rows(layout, rows_of(lo, hi), seed)
        self.optimizer = optimizer
        self.state = optimizer.new_state(count, self.dim)
        self.state_width = self.state.shape[1]

    def pull(self, rows: np.ndarray) -> np.ndarray:
        """Values at slots ``rows``."""
        return np.take(self.weight, rows, axis=0)

    def push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        """Apply gradients at slots ``rows`` (repeats summed first)."""
        rows, grads = coalesce(rows, grads)
        self.optimizer.apply(self.weight, self.state, rows, grads, lr)

    def read(self, rows: np.ndarray) -> np.ndarray:
        """Values then optimizer state at slots ``rows``."""
        return np.concatenate([np.take(self.weight, rows, axis=0),
                               np.take(self.state, rows, axis=0)], axis=1)

    def save(self, out: RowSink) -> None:
        """Every slot as the row of the same number (the replica layout), as part
        ``tables.h5``."""
        out.write("tables.h5", np.arange(len(self.weight), dtype=np.int64), self.weight,
                  self.state)

    def restore(self, source: RowSource) -> None:
        """The saved rows into the slots of the same number (the replica layout)."""
        if len(self.weight) != self.layout.total_rows:
            raise ValueError("LocalTables.restore needs every row of the layout in order")
        for rows, weight, state in source.rows(self.dim, self.state_width):
            self.weight[rows] = weight
            self.state[rows] = state

    def write(self, rows: np.ndarray, block: np.ndarray) -> None:
        """Store values then optimizer state ``block`` at slots ``rows``."""
        if block.shape != (len(rows), self.dim + self.state_width):
            raise ValueError(f"a write of {len(rows)} rows needs a block of "
                             f"[{len(rows)}, {self.dim + self.state_width}], "
                             f"got {list(block.shape)}")
        self.weight[rows] = block[:, : self.dim]
        self.state[rows] = block[:, self.dim:]
