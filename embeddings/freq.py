"""How often each embedding row is looked up: exact counts for small tables, count-min
sketches for large ones, both with decay.

The hot tier keeps the rows with the highest counts (:mod:`embeddings.hotcold`). Counting
every row exactly costs 4 bytes per row, as much as a quarter of a 16-wide row itself, so a
table of at least ``exact_below`` rows is counted in a count-min sketch of ``depth`` rows of
``width`` counters (Cormode & Muthukrishnan 2005) with conservative update (Estan & Varghese
2002): an estimate never undercounts, and it overcounts by more than ``e / width`` of the
table's total count with probability at most ``exp(-depth)``.

Ranking a table's share of the hot set needs more counters than it has hot rows, so a
sketch is at least :data:`COUNTERS_PER_HOT_ROW` times that share wide; where the sketch would
then be as large as exact counts, the table is counted exactly.

Decay: :meth:`FrequencyTracker.decay` multiplies every count by a factor in ``[0, 1]``, so
after ``k`` re-tierings a lookup weighs ``factor**k`` and the hot set follows a drifting id
distribution. Scaling keeps both sketch guarantees (every counter shrinks with the counts).

Pure numpy plus one numba kernel; no MPI. The tiered store feeds it counts already merged
over the workers, so every worker holds the same tracker.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from hpctrain.runtime import rng

__all__ = ["ExactCounts", "CountMinSketch", "FrequencyTracker", "LookupTotals", "oracle_hit_rate",
           "COUNTERS_PER_HOT_ROW"]

COUNTERS_PER_HOT_ROW = 4


class ExactCounts:
    """One float32 count per row of a table."""

    def __init__(self, rows: int) -> None:
        self.counts = np.zeros(rows, dtype=np.float32)

    def add(self, ids: np.ndarray, counts: np.ndarray) -> None:
        """Add ``counts`` to ``ids`` (unique local ids)."""
        self.counts[ids] += counts

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        return self.counts[ids]

    def decay(self, factor: float) -> None:
        self.counts *= np.float32(factor)

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes


@numba.njit(cache=True, nogil=True)
def _conservative_add(table, index, counts):  # pragma: no cover - compiled
    """Raise each key's counters to at least (its current estimate + its count)."""
    depth, n = index.shape
    for i in range(n):
        low = table[0, index[0, i]]
        for j in range(1, depth):
            low = min(low, table[j, index[j, i]])
        target = low + counts[i]
        for j in range(depth):
            if table[j, index[j, i]] < target:
                table[j, index[j, i]] = target


class CountMinSketch:
    """A count-min sketch with conservative update over int64 keys."""

    def __init__(self, width: int, depth: int, seed: int = 0) -> None:
        if width < 1 or depth < 1:
            raise ValueError(f"a sketch needs width and depth >= 1, got {width} x {depth}")
        self.width = int(width)
        self.depth = int(depth)
        self.seed = int(seed)
        self.table = np.zeros((self.depth, self.width), dtype=np.float32)

    def _index(self, keys: np.ndarray) -> np.ndarray:
        """Counter of each key in each sketch row: int64 [depth, n]."""
        keys = np.asarray(keys, dtype=np.uint64)
        return np.stack([(rng.mix64(keys, self.seed * 131 + j) % np.uint64(self.width))
                         .astype(np.int64) for j in range(self.depth)])

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        counts = np.ascontiguousarray(counts, dtype=np.float32)
        for part in _slices(len(keys)):
            _conservative_add(self.table, self._index(keys[part]), counts[part])

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Upper estimates of the keys' counts (exact when no key shares all its counters)."""
        out = np.empty(len(keys), dtype=np.float32)
        rows = np.arange(self.depth)[:, None]
        for part in _slices(len(keys)):
            out[part] = self.table[rows, self._index(keys[part])].min(axis=0)
        return out

    def decay(self, factor: float) -> None:
        self.table *= np.float32(factor)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes


def _slices(n: int, size: int = 1 << 15):
    """Consecutive slices of ``range(n)``: hashing a few keys at a time keeps the
    temporaries (a few uint64 arrays per sketch row) small whatever ``n`` is."""
    return (slice(lo, min(n, lo + size)) for lo in range(0, n, size))


class FrequencyTracker:
    """Lookup counts of every table of a layout (global rows: table offset + id)."""

    def __init__(self, sizes: Sequence[int], exact_below: int, width: int, depth: int,
                 hot_rows: int = 0, seed: int = 0) -> None:
        """Tables with fewer than ``exact_below`` rows count exactly, larger ones in a
        sketch of ``depth`` rows, ``width`` wide or wider for their share of ``hot_rows``
        (the hot tier's capacity, shared in proportion to the tables' rows)."""
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        total = int(self.sizes.sum())
        self.tables: list[ExactCounts | CountMinSketch] = []
        for t, n in enumerate(self.sizes.tolist()):
            wide = max(width, COUNTERS_PER_HOT_ROW * -(-hot_rows * n // total))
            exact = n < exact_below or wide * depth >= n
            self.tables.append(ExactCounts(n) if exact else CountMinSketch(wide, depth, seed + t))

    def _groups(self, rows: np.ndarray):
        """(table, positions) of each table's rows within sorted ``rows``."""
        bounds = np.searchsorted(rows, np.append(self.offsets, self.offsets[-1]
                                                 + self.sizes[-1]))
        for t in range(len(self.sizes)):
            if bounds[t] < bounds[t + 1]:
                yield t, slice(int(bounds[t]), int(bounds[t + 1]))

    def add(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Count ``counts`` lookups of global ``rows`` (sorted, unique)."""
        for t, part in self._groups(rows):
            self.tables[t].add(rows[part] - self.offsets[t], counts[part])

    def estimate(self, rows: np.ndarray) -> np.ndarray:
        """Estimated (decayed) counts of global ``rows`` (sorted, unique), float32."""
        out = np.zeros(len(rows), dtype=np.float32)
        for t, part in self._groups(rows):
            out[part] = self.tables[t].estimate(rows[part] - self.offsets[t])
        return out

    def decay(self, factor: float) -> None:
        for table in self.tables:
            table.decay(factor)

    def arrays(self) -> list[np.ndarray]:
        """The counters of every table (float32), for summing trackers over workers."""
        return [t.counts if isinstance(t, ExactCounts) else t.table for t in self.tables]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables)


class LookupTotals:
    """Exact lookup counts of every row seen (what the oracle hit rate ranks): sorted
    (row, count) pairs of the rows seen (int32 rows while the tables allow), merged as
    counts arrive, until one float32 per row of the tables takes less memory and at most
    ``dense_bytes``; then those."""

    def __init__(self, total_rows: int, dense_bytes: int) -> None:
        self.total_rows = total_rows
        self.dense_bytes = dense_bytes
        self.dense = False
        self.counts = np.empty(0, dtype=np.float32)
        self.rows = np.empty(0, dtype=np.int32 if total_rows <= np.iinfo(np.int32).max
                             else np.int64)

    def add(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Count ``counts`` more lookups of ``rows`` (sorted, unique)."""
        counts = np.asarray(counts, dtype=np.float32)
        if self.dense:
            self.counts[rows] += counts
            return
        if len(rows) == 0:
            return
        self.rows, self.counts = _merge_sum(self.rows, self.counts, rows, counts)
        dense = 4 * self.total_rows
        if dense <= min(self.rows.nbytes + self.counts.nbytes, self.dense_bytes):
            counts = np.zeros(self.total_rows, dtype=np.float32)
            counts[self.rows] = self.counts
            self.dense, self.counts = True, counts
            self.rows = np.empty(0, dtype=self.rows.dtype)

    def hit_rate(self, capacity: int) -> float:
        return oracle_hit_rate(self.counts, capacity)


@numba.njit(cache=True, nogil=True)
def _merge_sum(a, a_counts, b, b_counts):  # pragma: no cover - compiled
    """Sorted unique ``a`` and ``b`` merged (rows of ``a``'s type), the counts of a row in
    both summed: a pass that counts the union, so the result is allocated to size and
    never copied, then the merge."""
    i = j = n = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            j += a[i] == b[j]
            i += 1
        else:
            j += 1
        n += 1
    n += len(a) - i + len(b) - j
    rows = np.empty(n, a.dtype)
    counts = np.empty(n, np.float32)
    i = j = n = 0
    while i < len(a) or j < len(b):
        if j == len(b) or (i < len(a) and a[i] < b[j]):
            rows[n], counts[n] = a[i], a_counts[i]
            i += 1
        elif i == len(a) or b[j] < a[i]:
            rows[n], counts[n] = b[j], b_counts[j]
            j += 1
        else:
            rows[n], counts[n] = a[i], a_counts[i] + b_counts[j]
            i += 1
            j += 1
        n += 1
    return rows, counts


def oracle_hit_rate(counts: np.ndarray, capacity: int) -> float:
    """Share of the lookups counted in ``counts`` (exact, one per row) that the best static
    set of ``capacity`` rows would serve: the ``capacity`` largest counts over the total."""
    total = float(counts.sum())
    if total == 0.0 or capacity <= 0:
        return 0.0
    counts = counts[counts > 0]  # partitioning many equal zeros is slow, and they add nothing
    if capacity >= len(counts):
        return 1.0
    top = np.partition(counts, len(counts) - capacity)[len(counts) - capacity:]
    return float(top.sum(dtype=np.float64)) / total
