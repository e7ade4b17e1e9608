"""numba kernels of the parameter server's hot paths: one pass per request, no per-table or
per-row Python.

- :func:`route` (client): sorted global rows to (server, sync-model group) parts, each with
  its table runs, ids and batch positions, by one counting sort;
- :func:`shard_slots` (server): a request's (table, id) groups to slots of the shard, with
  the checks that name a bad id, and whether the ids are strictly increasing per table (then
  the slots are unique and a push needs no coalescing);
- :func:`gather_rows` / :func:`scatter_rows`: row copies between the shard, message buffers
  and the batch.

Placement follows :func:`embeddings.sharding.locate_run`, the rule :class:`Placement` uses.
"""

from __future__ import annotations

import numba
import numpy as np

from embeddings.sharding import locate_run

__all__ = ["route", "shard_slots", "gather_rows", "scatter_rows",
           "OK", "UNKNOWN_TABLE", "OUT_OF_RANGE", "WRONG_SERVER"]

OK, UNKNOWN_TABLE, OUT_OF_RANGE, WRONG_SERVER = 0, 1, 2, 3


@numba.njit(cache=True, nogil=True)
def route(table, ids, groups, ngroups, code, owner, mult, shift, rows, base, k):
    """Parts of rows (``table``/``ids`` per row, in row order) keyed ``server * ngroups +
    group``. Returns ``order`` (row positions, by key, stable), ``ids[order]``, ``start``
    (``[keys + 1]`` offsets into ``order``), and the table runs of each part: ``run_table``,
    ``run_count`` and ``run_start`` (``[keys + 1]`` offsets into the runs)."""
    n = table.shape[0]
    keys = k * ngroups
    key = np.empty(n, dtype=np.int64)
    local = np.empty(n, dtype=np.int64)
    start = np.zeros(keys + 1, dtype=np.int64)
    lo = 0
    while lo < n:  # one run of equal tables at a time
        t, hi = table[lo], lo + 1
        while hi < n and table[hi] == t:
            hi += 1
        locate_run(code, owner, mult, shift, rows, k, t, ids, lo, hi, key, local)
        for j in range(lo, hi):
            key[j] = key[j] * ngroups + groups[t]
            start[key[j] + 1] += 1
        lo = hi
    for c in range(keys):
        start[c + 1] += start[c]
    fill = start[:keys].copy()
    order = np.empty(n, dtype=np.int64)
    for j in range(n):
        order[fill[key[j]]] = j
        fill[key[j]] += 1
    sorted_ids = np.empty(n, dtype=np.int64)
    run_table = np.empty(n, dtype=np.int64)
    run_count = np.zeros(n, dtype=np.int64)
    run_start = np.zeros(keys + 1, dtype=np.int64)
    runs = 0
    for c in range(keys):
        for p in range(start[c], start[c + 1]):
            j = order[p]
            sorted_ids[p] = ids[j]
            if p == start[c] or table[j] != run_table[runs - 1]:
                run_table[runs] = table[j]
                runs += 1
            run_count[runs - 1] += 1
        run_start[c + 1] = runs
    return order, sorted_ids, start, run_table[:runs], run_count[:runs], run_start


@numba.njit(cache=True, nogil=True)
def shard_slots(tables, counts, ids, me, code, owner, mult, shift, rows, base, k, slots):
    """Fill ``slots`` with the slots of server ``me`` for a request's groups. Returns
    ``(status, where, unique)``: on a bad group or id, its status and index (of the group for
    ``UNKNOWN_TABLE``, of the id otherwise); ``unique`` when tables and the ids within each
    are strictly increasing."""
    unique = True
    at = 0
    server = np.empty(ids.shape[0], dtype=np.int64)
    for g in range(tables.shape[0]):
        t = tables[g]
        if t < 0 or t >= rows.shape[0]:
            return UNKNOWN_TABLE, g, False
        if g > 0 and t <= tables[g - 1]:
            unique = False
        end = at + counts[g]
        locate_run(code, owner, mult, shift, rows, k, t, ids, at, end, server, slots)
        for j in range(at, end):
            i = ids[j]
            if i < 0 or i >= rows[t]:
                return OUT_OF_RANGE, j, False
            if server[j] != me:
                return WRONG_SERVER, j, False
            slots[j] += base[me, t]
            if j > at and i <= ids[j - 1]:
                unique = False
        at = end
    return OK, 0, unique


@numba.njit(cache=True, nogil=True)
def gather_rows(out, source, index):
    """``out[i, :w] = source[index[i]]`` (``w`` = source's width; ``out`` may be wider)."""
    for i in range(index.shape[0]):
        r = index[i]
        for j in range(source.shape[1]):
            out[i, j] = source[r, j]


@numba.njit(cache=True, nogil=True)
def scatter_rows(out, index, source):
    """``out[index[i]] = source[i]``."""
    for i in range(index.shape[0]):
        r = index[i]
        for j in range(source.shape[1]):
            out[r, j] = source[i, j]
