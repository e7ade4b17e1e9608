"""Which rows are hot: the budget, the re-tiering schedule, and hot-set selection (pure).

Click-log ids follow a power law, so a few percent of the rows take most lookups; those are
kept replicated on the workers (:mod:`embeddings.tiered`). Every ``interval`` steps the
workers merge the counts they saw and each runs :meth:`HotSetPlanner.plan` on the same
input, so they agree on the hot set without sending it.

- **Budget**: :func:`hot_capacity` turns a budget in rows, bytes (values and optimizer state,
  the row id and its slot) or a fraction of all rows into a row count, at most every row.
- **LFU** (default): the rows with the highest decayed lookup counts
  (:class:`~embeddings.freq.FrequencyTracker`); ties go to the most recently seen, then the
  lower row.
- **LRU** (for comparison): the rows seen most recently, ties to the higher count.
- **Admission**: a row may enter only once its decayed count reaches ``admission``, so a
  row seen once in the long tail does not displace a hot one; under LFU a row also needs
  ``admission`` more lookups than the hot row it displaces, so rows at the edge of the hot
  set, whose counts differ by noise, do not swap back and forth (each swap moves two rows
  with their optimizer state over the network).

Only rows that can matter are scored: the hot set, a reserve of as many runners-up, and the
rows seen since the last plan. A row outside all three was outranked by ``2 * capacity``
rows at the last plan and has not been seen since.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from embeddings.collection import radix_sort
from embeddings.freq import FrequencyTracker

__all__ = ["POLICIES", "BUDGET_UNITS", "hot_row_bytes", "hot_capacity", "retier_due",
           "merge_seen", "best", "Retier", "HotSetPlanner"]

POLICIES = ("lfu", "lru")
BUDGET_UNITS = ("fraction", "rows", "bytes")

_NO_ROWS = np.empty(0, dtype=np.int64)
_NO_STEPS = np.empty(0, dtype=np.int32)  # steps are kept as int32: a pool row costs 12 bytes


def hot_row_bytes(dim: int, state_width: int, delayed: bool = False) -> int:
    """Bytes one hot row costs on each worker: its id and its slot (int64 each), values and
    optimizer state (float32); ``delayed`` (a staleness bound above 0) adds the shared base
    copy, the accumulated gradient and a touched flag (see :mod:`embeddings.tiered`)."""
    row = 16 + 4 * (dim + state_width)
    return row + 4 * (dim + state_width) + 4 * dim + 1 if delayed else row


def hot_capacity(budget: float, unit: str, total_rows: int, row_bytes: int) -> int:
    """Hot rows that ``budget`` allows: ``budget`` is a share of ``total_rows``, a row count,
    or bytes at ``row_bytes`` per hot row. A budget above the table makes every row hot."""
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"a hot-tier budget must be a finite number >= 0, got {budget!r}")
    if unit not in BUDGET_UNITS:
        raise ValueError(f"unknown budget unit {unit!r}; expected one of {BUDGET_UNITS}")
    if unit == "fraction":
        rows = budget * total_rows
    elif unit == "rows":
        rows = budget
    else:
        rows = budget / row_bytes
    return int(min(total_rows, math.floor(rows)))


def retier_due(step: int, interval: int, warm_up: bool = True) -> bool:
    """Whether the hot set is recomputed after 0-based step ``step``: with ``warm_up``
    after steps 1, 2, 4, 8, ... while under ``interval`` (the first batches already reveal
    most of the head), and after every ``interval``-th step."""
    done = step + 1
    return done % interval == 0 or (warm_up and done < interval and done & (done - 1) == 0)


def merge_seen(rows: np.ndarray, counts: np.ndarray,
               last: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Observations of several workers merged: sorted unique rows (non-negative), summed
    counts (whole numbers, so the order of the sums does not matter), and the latest step
    each row was seen; one radix sort and one pass in numba (numpy's stable argsort and
    segment reductions took 2.7x as long on a re-tiering's 200k observations)."""
    return _merge_seen(np.ascontiguousarray(rows, dtype=np.int64),
                       np.ascontiguousarray(counts, dtype=np.float32),
                       np.ascontiguousarray(last, dtype=np.int64))


@numba.njit(cache=True, nogil=True)  # runs on the re-tiering thread beside the step
def _merge_seen(rows, counts, last):  # pragma: no cover - compiled
    out_rows, order = radix_sort(rows)
    out_counts = np.empty(rows.size, np.float32)
    out_last = np.empty(rows.size, np.int64)
    m = -1
    for k in range(rows.size):
        i = order[k]
        if m < 0 or out_rows[k] != out_rows[m]:
            m += 1
            out_rows[m], out_counts[m], out_last[m] = out_rows[k], counts[i], last[i]
        else:
            out_counts[m] += counts[i]
            out_last[m] = max(out_last[m], last[i])
    return out_rows[:m + 1], out_counts[:m + 1], out_last[:m + 1]


def best(first: np.ndarray, second: np.ndarray, count: int) -> np.ndarray:
    """Positions (in no order) of the ``count`` best entries by ``first`` then ``second``
    (both higher first), ties to the lower position: a partition, and a sort of the ties."""
    if count >= len(first):
        return np.arange(len(first))
    if count <= 0:
        return np.empty(0, dtype=np.int64)
    kth = np.partition(first, len(first) - count)[len(first) - count]
    above = np.flatnonzero(first > kth)
    tied = np.flatnonzero(first == kth)
    tied = tied[np.lexsort((-second[tied], ))][: count - len(above)]
    return np.concatenate([above, tied])


@dataclass(frozen=True)
class Retier:
    """A re-tiering: the new hot set, and the rows entering and leaving it (all sorted)."""

    hot: np.ndarray
    promoted: np.ndarray
    demoted: np.ndarray


class HotSetPlanner:
    """Chooses the hot set from the counts every worker has merged."""

    def __init__(self, tracker: FrequencyTracker, capacity: int, policy: str = "lfu",
                 admission: float = 0.0, decay: float = 1.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        self.tracker = tracker
        self.capacity = capacity
        self.policy = policy
        self.admission = admission
        self.decay = decay
        self.hot = _NO_ROWS
        self._pool, self._pool_last = _NO_ROWS, _NO_STEPS  # hot set and reserve, sorted
        self._seen: list[tuple[np.ndarray, np.ndarray]] = []

    def record(self, rows: np.ndarray, counts: np.ndarray, last: np.ndarray) -> None:
        """Count merged observations (:func:`merge_seen`): unique rows, their lookups, and
        the step each was last seen."""
        self.tracker.add(rows, counts)
        self.consider(rows, last)

    def consider(self, rows: np.ndarray, last: np.ndarray) -> None:
        """Make ``rows`` (sorted, unique; ``last`` the step each was last seen) candidates of
        the next plan without counting them: their counts are in the tracker already."""
        self._seen.append((rows, np.asarray(last, dtype=np.int32)))

    def plan(self) -> Retier:
        """The next hot set; then every count decays by ``decay``.

        Memory: besides the candidates and their counts, a few flags and one partition's
        copy per candidate; the last pool is let go once merged, the counts before the new
        pool is copied out."""
        candidates, latest = self._pool, self._pool_last
        self._pool, self._pool_last = _NO_ROWS, _NO_STEPS
        for rows, last in self._seen:
            candidates, latest = _union(candidates, latest, rows, last) if len(candidates) \
                else (rows, last)
        self._seen = []
        freq = self.tracker.estimate(candidates)
        hot = _within(candidates, self.hot)
        eligible = freq >= self.admission
        eligible |= hot
        if self.policy == "lfu":
            first, second = freq, latest  # freq is not needed as such any more
            if self.admission:
                np.add(first, np.float32(self.admission), out=first, where=hot)
            first[~eligible] = -1.0  # below every count: the ineligible come last
        else:
            first, second = np.where(eligible, latest, -2), freq  # steps start at -1
        del freq, hot
        eligible = int(np.count_nonzero(eligible))
        pool = best(first, second, min(2 * self.capacity, eligible))
        pool.sort()
        # the best `capacity` of all, which lie in the pool: ranked without copying its counts
        hot = candidates[best(first, second, min(self.capacity, eligible))]
        del first, second  # before the copies below
        hot.sort()
        self._pool, self._pool_last = candidates[pool], latest[pool]
        self.tracker.decay(self.decay)
        retier = Retier(hot, hot[~_within(hot, self.hot)], self.hot[~_within(self.hot, hot)])
        self.hot = hot
        return retier


@numba.njit(cache=True, nogil=True)
def _union(a, a_last, b, b_last):  # pragma: no cover - compiled
    """Sorted unique ``a`` and ``b`` merged, each row with the later of its steps: one pass
    (the hot set's candidates are a few times its capacity, too many to sort each time)."""
    rows = np.empty(len(a) + len(b), np.int64)
    last = np.empty(len(a) + len(b), np.int32)
    i = j = n = 0
    while i < len(a) or j < len(b):
        if j == len(b) or (i < len(a) and a[i] < b[j]):
            rows[n], last[n] = a[i], a_last[i]
            i += 1
        elif i == len(a) or b[j] < a[i]:
            rows[n], last[n] = b[j], b_last[j]
            j += 1
        else:
            rows[n], last[n] = a[i], max(a_last[i], b_last[j])
            i += 1
            j += 1
        n += 1
    return rows[:n], last[:n]


@numba.njit(cache=True, nogil=True)
def _within(values, sorted_set):  # pragma: no cover - compiled
    """Which of the sorted ``values`` are in ``sorted_set`` (sorted, unique): one pass over
    both."""
    found = np.zeros(len(values), np.bool_)
    j = 0
    for i in range(len(values)):
        while j < len(sorted_set) and sorted_set[j] < values[i]:
            j += 1
        found[i] = j < len(sorted_set) and sorted_set[j] == values[i]
    return found
