"""The numba kernels a training step runs, made ready before the first step, with a log line.

On a machine's first run numba compiles the lookups' unique rows, the sparse optimizers, the
gradient coalescing (of contiguous arrays and of a gathered push's strided views), the
parameter-server client's routing, the reduction kernels and the shared window's copy-in,
the all-to-all's passes and copies (and its store's placement and packing), the frequency
sketch, the hot-set planner's passes, the hot tier's re-tiering copy, and the hot
gradients' segment writing and records' sum (``cache=True``: later runs load them from
``__pycache__``); compiling inside the first step left the progress bar at step 1 for
seconds with no word why. :func:`prepare_kernels` runs each kernel once on a few elements,
through the same entry points and argument types as the step, and says on rank 0 how long
that took and whether the kernels were compiled or loaded from numba's cache; one rank per
machine compiles, and the others load its kernels from the cache after it. It prepares
the job's kernels only (the parameter server's, the all-to-all's and the tiered store's when
the job uses them, the group's single-copy probe always): a loaded kernel stays resident.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from embeddings import alltoall as sharded
from embeddings import collection, freq, hotcold, hotsum, hottier, tiered, worker_sharding
from embeddings.optim import SparseOptimizer, coalesce
from embeddings.sharding import Placement, plan_sharding
from embeddings.tables import pack_rows, unpack_rows
from embeddings.types import TableSpec
from hpctrain.comm import alltoall, cma, kernels, window
from hpctrain.runtime.waits import Wait, wait_all
from ps import kernels as ps_kernels

__all__ = ["prepare_kernels"]

log = logging.getLogger(__name__)


def prepare_kernels(optimizers: Sequence[SparseOptimizer], tiering: bool,
                    parameter_server: bool = False, all_to_all: bool = False,
                    node: MPI.Intracomm | None = None) -> tuple[float, int]:
    """Compile or load the kernels of a step with the row ``optimizers`` (and the tiered
    store's frequency sketch when ``tiering``, the client's routing of rows to servers when
    ``parameter_server``, the exchanges of the all-to-all store when ``all_to_all``);
    returns (seconds, kernels this rank compiled). Only the job's: each loaded kernel stays
    resident (the all-to-all's took 5 MiB of every rank).

    With ``node`` (collective over it: the ranks sharing this machine), its first rank
    prepares them while the others wait, sleeping, and then load what it compiled from
    numba's cache: a machine's first run compiles each kernel once, not once per rank on the
    same cores, and the compiler's memory stays on that one rank. (Where the cache cannot be
    written, the others compile after it.)"""
    dispatchers = _dispatchers(tiering, parameter_server, all_to_all)
    misses = sum(sum(d.stats.cache_misses.values()) for d in dispatchers)
    log.info("preparing the numba kernels (compiled on a machine's first run, then loaded "
             "from numba's cache)")
    start = time.perf_counter()
    first = node is None or node.Get_rank() == 0
    if first:
        _run_kernels(optimizers, tiering, parameter_server, all_to_all)
    if node is not None and node.Get_size() > 1:
        wait_all([node.Ibarrier()], Wait("barrier", node))
        if not first:
            _run_kernels(optimizers, tiering, parameter_server, all_to_all)
    seconds = time.perf_counter() - start
    compiled = sum(sum(d.stats.cache_misses.values()) for d in dispatchers) - misses
    if compiled:
        log.info("compiled %d numba kernels in %.1f s (cached for later runs)", compiled,
                 seconds)
    else:
        log.info("numba kernels ready in %.2f s (nothing to compile)", seconds)
    return seconds, compiled


def _run_kernels(optimizers: Sequence[SparseOptimizer], tiering: bool, parameter_server: bool,
                 all_to_all: bool) -> None:
    """Each kernel of :func:`prepare_kernels` once, on a few elements, through the step's
    entry points and argument types."""
    rows, grads = np.array([2, 0, 2], np.int64), np.ones((3, 4), np.float32)
    collection.unique_rows(rows)
    unique, summed = coalesce(rows, grads)
    coalesce(*unpack_rows(pack_rows(rows, grads)))  # strided views of gathered lines
    for sparse in optimizers:
        weight = np.zeros((3, 4), np.float32)
        sparse.apply(weight, sparse.new_state(3, 4), unique, summed, 0.1)
    for dtype in (np.float32, np.float64):
        flat, own = np.zeros(8, dtype), np.zeros(4, dtype)
        kernels.reduce_pair(own, flat[:4], kernels.SUM, kernels.ARITH)
        for mode in (0, 1, 2):
            kernels.reduce_slice(flat, 4, 2, 0, own, 0, 4, mode, kernels.SUM, kernels.ARITH)
    window.compile_kernels()
    cma.compile_kernels()
    if all_to_all:
        alltoall.compile_kernels()
        sharded.compile_kernels()
    if parameter_server:  # as the client routes a pull: tables and ids of sorted rows
        placement = Placement(plan_sharding([TableSpec("t", 4, 2)], 1))
        ps_kernels.route(np.zeros(2, np.int64), np.arange(2, dtype=np.int64),
                         np.zeros(1, np.int64), 1, *placement.arrays)
    if tiering:
        sketch = freq.CountMinSketch(64, 2, seed=0)
        sketch.add(rows, np.ones(3, np.float32))
        planner = hotcold.HotSetPlanner(freq.FrequencyTracker([4], 8, 4, 1), 1)
        seen = hotcold.merge_seen(rows, np.ones(3, np.float32), np.zeros(3, np.int64))
        planner.record(*seen)
        planner.record(*seen)  # a second observation: the candidates' merge
        planner.plan()
        hottier._reslot(unique, np.arange(2), unique, 2)
        freq.LookupTotals(4, 16).add(unique, np.ones(2, np.float32))
        records = np.array([1, 0, 1, 2], np.float32)  # one worker's region: 1 record
        spills = np.empty((0, 3), np.float32)  # none beyond the region
        hotsum._sum_records(records, 1, 4, 3, 1, spills, np.zeros(1, np.int64),
                            np.full(2, -1, np.int32), np.float32(1))
        hot, slots = hottier._locate(unique, np.arange(2), unique)
        hot.flags.writeable = slots.flags.writeable = False  # as the hot tier hands them
        hottier._read(np.zeros((2, 2), np.float32), hot, slots, np.empty((2, 2), np.float32))
        tiered._count_lookups(np.zeros(1, np.int64), unique, np.ones(2, np.int64), hot,
                              np.zeros((2, 1), np.int64))
        hotsum._write(records, 0, 1, hot, slots, np.ones((2, 2), np.float32), True,
                      np.empty((1, 3), np.float32))  # two hot rows: one spills


def _dispatchers(tiering: bool, parameter_server: bool, all_to_all: bool) -> list:
    """The numba dispatchers :func:`prepare_kernels` reaches (for their cache counters)."""
    from embeddings import optim

    found = [getattr(module, name)
             for module in (optim, kernels, window, cma, collection,
                            *((alltoall, sharded, worker_sharding) if all_to_all else ()),
                            *((ps_kernels,) if parameter_server else ()),
                            *((freq, hotcold, hotsum, hottier, tiered) if tiering else ()))
             for name in dir(module)]
    return [d for d in found if hasattr(d, "stats") and hasattr(d.stats, "cache_misses")]
