"""Collectives inside a node through the node's shared window (:mod:`hpctrain.comm.window`).

Every rank of the node communicator maps the same memory, so a collective is loads and
stores plus flag synchronisation; no message passes through MPI. Allreduce takes the
one-synchronisation path below :func:`small_limit` bytes and above it the sliced path (in
one numba call for numeric dtypes, piece by piece once the buffers outgrow the cache,
:func:`~hpctrain.comm.window.piece_bytes`), the in-place path for resident buffers, or,
where the ranks may read each other's memory and it costs less, the single-copy path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from hpctrain.comm import kernels
from hpctrain.comm.algorithm import Algorithm
from hpctrain.comm.types import OP_KERNEL, Cost, CostParams, Layout, Request, chunk_bounds
from hpctrain.comm.window import (
    allreduce_pipelined,
    allreduce_resident,
    allreduce_single_copy,
    allreduce_slices,
    allreduce_small,
    piece_bytes,
)

if TYPE_CHECKING:
    from hpctrain.comm.group import Group

__all__ = ["Shm", "SHM", "sync_cost", "small_limit"]


def small_limit(layout: Layout, params: CostParams) -> float:
    """Bytes below which the one-synchronisation path is cheaper: it costs
    ``bytes * (beta / p + gamma (p-1)^2 / p)`` more than the slices (it copies every
    byte out of the first row and reduces the whole buffer on every rank) and one
    synchronisation less."""
    p = layout.size
    extra = (params.shm.beta + params.gamma * (p - 1) ** 2) / p
    return sync_cost(layout, params) / extra


def sync_cost(layout: Layout, params: CostParams) -> float:
    """Seconds of one flag synchronisation (longer when a peer may be descheduled)."""
    return params.latency(params.shm.alpha, layout)


class Shm(Algorithm):
    """Shared-window collectives over ``group.node`` (the whole group must be one node)."""

    name = "shm"
    primitives = frozenset({"allreduce", "reduce_scatter", "allgather", "broadcast"})

    def enabled(self, req: Request, layout: Layout) -> bool:
        return super().enabled(req, layout) and layout.nodes == 1

    @staticmethod
    def small_cost(nbytes: int, p: int, params: CostParams, sync: float) -> Cost:
        """Copy in, one synchronisation, every rank starts from the first row (a copy) and
        folds the other ``p - 1`` rows into it."""
        return Cost(latency_s=sync, transfer_s=2.0 * params.shm.beta * nbytes,
                    compute_s=params.gamma * (p - 1) * nbytes)

    @staticmethod
    def slices_cost(nbytes: int, p: int, params: CostParams, sync: float,
                    resident: bool) -> Cost:
        """Two synchronisations; rank ``r`` folds ``p - 1`` rows into slice ``r`` and writes
        it to its row (resident: to every row), and a private buffer is copied in and out
        except for its own slice."""
        copies = 0.0 if resident else 2.0 * (p - 1) / p * nbytes
        writes = (p - 1) / p * nbytes if resident else nbytes / p
        return Cost(latency_s=2 * sync, transfer_s=params.shm.beta * (copies + writes),
                    compute_s=params.gamma * (p - 1) / p * nbytes)

    @staticmethod
    def single_copy_cost(nbytes: int, p: int, params: CostParams, layout: Layout) -> Cost:
        """Rank ``r`` reads the others' parts of slice ``r`` and folds them in, then reads
        the others' reduced slices: ``2 (p-1)/p`` copies, none into the window, priced by
        the ``single_copy`` line fitted to whole calls (``CostParams``)."""
        line = params.single_copy
        return Cost(latency_s=params.latency(line.alpha, layout),
                    transfer_s=line.beta * 2.0 * (p - 1) / p * nbytes)

    def _large(self, req: Request, layout: Layout, params: CostParams) -> tuple[Cost, bool]:
        """The cost of an allreduce above :func:`small_limit` and whether the single-copy
        path (:func:`~hpctrain.comm.window.allreduce_single_copy`) is the cheaper one:
        where the ranks may read each other's memory, for private buffers of arithmetic
        dtypes."""
        p, n, sync = layout.size, req.nbytes, sync_cost(layout, params)
        slices = self.slices_cost(n, p, params, sync, req.resident)
        if not (layout.single_copy and not req.resident and req.dtype.kind == kernels.ARITH):
            return slices, False
        single = self.single_copy_cost(n, p, params, layout)
        return (single, True) if single.seconds < slices.seconds else (slices, False)

    def cost(self, req: Request, layout: Layout, params: CostParams) -> Cost:
        """The cost of the path :meth:`bind` takes."""
        p, n = layout.size, req.nbytes
        sync = sync_cost(layout, params)
        if req.primitive == "allreduce":
            if n < small_limit(layout, params):
                return self.small_cost(n, p, params, sync)
            return self._large(req, layout, params)[0]
        moved = {"reduce_scatter": 2.0 * (p - 1) / p * n, "allgather": 2.0 * (p - 1) / p * n,
                 "broadcast": 2.0 * n}[req.primitive]
        reduced = n if req.primitive == "reduce_scatter" else 0.0
        return Cost(latency_s=sync, transfer_s=params.shm.beta * moved,
                    compute_s=params.gamma * reduced)

    def bind(self, req: Request, group: Group) -> Callable[[np.ndarray], None]:
        """Allreduce's path is fixed per request: latency-bound buffers (resident ones
        too: copying them is cheaper than a second synchronisation) take the small path,
        larger ones the single-copy path or the slices, whichever costs less, or the
        in-place path when resident."""
        if req.primitive != "allreduce":
            return super().bind(req, group)
        op, kind, nbytes = OP_KERNEL[req.op], req.dtype.kind, req.nbytes
        if nbytes < small_limit(group.layout, group.params):
            return lambda arr: allreduce_small(arr, group.arena(nbytes), op, kind)
        if req.resident:
            return super().bind(req, group)
        if self._large(req, group.layout, group.params)[1]:
            return lambda arr: allreduce_single_copy(arr, group.arena(0), op)
        if kind == kernels.ARITH:
            piece = piece_bytes(nbytes, group.layout.local_size)
            return lambda arr: allreduce_pipelined(arr, group.arena(nbytes), op, piece)
        return lambda arr: allreduce_slices(arr, group.arena(nbytes), op, kind)

    def run(self, req: Request, arr: np.ndarray, group: Group) -> None:
        op, kind = OP_KERNEL[req.op], req.dtype.kind
        if req.primitive == "allreduce":
            resident = group.resident_of(arr) if req.resident else None
            if resident is not None and req.nbytes >= small_limit(group.layout, group.params):
                allreduce_resident(arr, resident, op, kind)
            else:
                self.bind(dataclasses.replace(req, resident=False), group)(arr)
            return
        arena = group.arena(req.nbytes)
        p, r = arena.size, arena.rank
        b = chunk_bounds(arr.size, p)
        half = arena.next_half()
        if req.primitive == "reduce_scatter":
            arena.fill(half, arr, 0, b[r])
            arena.fill(half, arr, b[r + 1], arr.size)
            arena.sync()
            flat, stride = arena.flat(half, arr.dtype)
            kernels.reduce_slice(flat, stride, p, r, arr, b[r], b[r + 1], 0, op, kind)
        elif req.primitive == "allgather":
            arena.fill(half, arr, b[r], b[r + 1])
            arena.sync()
            flat, stride = arena.flat(half, arr.dtype)
            for k in range(p):
                if k != r:
                    arr[b[k]:b[k + 1]] = flat[k * stride + b[k]: k * stride + b[k + 1]]
        else:  # broadcast
            if r == req.root:
                arena.fill(half, arr, 0, arr.size)
            arena.sync()
            if r != req.root:
                arr[:] = arena.row(req.root, half, arr.dtype, arr.size)


SHM = Shm()
