"""Collectives served by the MPI library itself: the baseline every other algorithm is
measured against, and the implementation of the rarely hot primitives (gather, scatter,
variable-length allgather; ``MPI_Alltoallv`` is the baseline exchange in
:mod:`hpctrain.comm.alltoall`).

Each function states the collective it issues; all are collective over ``comm``.
MPI has no 16-bit float reduction, so reductions of float16/bfloat16 widen to float32,
reduce, and round back (float32 accumulation, one rounding).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from hpctrain.comm import kernels
from hpctrain.comm.algorithm import Algorithm
from hpctrain.comm.types import Cost, CostParams, Layout, Link, Request, chunk_bounds
from hpctrain.runtime.waiting import watching
from hpctrain.runtime.waits import Wait, wait_all

if TYPE_CHECKING:
    from hpctrain.comm.emulate import Channel
    from hpctrain.comm.group import Group

__all__ = ["Native", "NATIVE", "allgatherv", "gatherv", "scatterv", "library_cost",
           "emulated_wait"]

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def allgatherv(part: np.ndarray, comm: MPI.Intracomm, yielding: bool = False,
               link: Channel | None = None, counts: np.ndarray | None = None) -> np.ndarray:
    """Concatenation, in rank order, of every rank's ``part`` (same dtype and trailing
    shape on all ranks, any leading length): ``MPI_Allgather`` of the lengths, then
    ``MPI_Allgatherv``. (The in-place ``allgather`` of :mod:`hpctrain.comm` fills equal
    chunks of one buffer instead; this one serves variable-length sparse rows.) ``counts``:
    every rank's length, when the caller already has them (no ``MPI_Allgather`` then).

    ``yielding``: their non-blocking forms completed by
    :func:`~hpctrain.runtime.waits.wait_all`, which sleeps between polls: for a background
    thread, whose spinning wait would take the core its own main thread computes on.
    ``link`` (a :class:`~hpctrain.comm.emulate.Channel` over ``comm``): under
    ``comm.emulate``, the call then waits out the emulated network
    (:meth:`~hpctrain.comm.emulate.Channel.library`)."""
    if comm.Get_size() == 1:
        return part
    started = time.perf_counter()
    out = _allgatherv(np.ascontiguousarray(part), comm, yielding, counts)
    if link is not None:
        emulated_wait(link, started, "allgather", out.nbytes)
    return out


def _allgatherv(part: np.ndarray, comm: MPI.Intracomm, yielding: bool,
                counts: np.ndarray | None) -> np.ndarray:
    if counts is None:
        counts = np.empty(comm.Get_size(), dtype=np.int64)
        length = np.array([part.shape[0]], dtype=np.int64)
        if yielding:
            wait_all([comm.Iallgather(length, counts)], Wait("allgather", comm))
        else:
            with watching("allgather", comm):
                comm.Allgather(length, counts)
    out = np.empty((int(counts.sum()), *part.shape[1:]), dtype=part.dtype)
    sizes = counts * int(np.prod(part.shape[1:], dtype=np.int64))
    if yielding:
        wait_all([comm.Iallgatherv(part, [out, sizes])], Wait("allgather", comm))
    else:
        with watching("allgather", comm):
            comm.Allgatherv(part, [out, sizes])
    return out


def gatherv(part: np.ndarray, comm: MPI.Intracomm, root: int = 0) -> np.ndarray | None:
    """Concatenation of every rank's 1-D ``part`` on ``root`` (``None`` elsewhere):
    ``MPI_Gather`` of the lengths, then ``MPI_Gatherv``."""
    part = np.ascontiguousarray(part)
    if comm.Get_size() == 1:
        return part
    counts = np.empty(comm.Get_size(), dtype=np.int64) if comm.Get_rank() == root else None
    with watching("gather", comm):
        comm.Gather(np.array([part.shape[0]], dtype=np.int64), counts, root=root)
        if comm.Get_rank() != root:
            comm.Gatherv(part, None, root=root)
            return None
        out = np.empty(int(counts.sum()), dtype=part.dtype)
        comm.Gatherv(part, [out, counts], root=root)
    return out


def scatterv(whole: np.ndarray | None, count: int, dtype: np.dtype, comm: MPI.Intracomm,
             root: int = 0) -> np.ndarray:
    """This rank's balanced chunk of ``root``'s 1-D ``whole`` (``count`` elements of
    ``dtype``, known on every rank): ``MPI_Scatterv``."""
    b = chunk_bounds(count, comm.Get_size())
    rank = comm.Get_rank()
    out = np.empty(b[rank + 1] - b[rank], dtype=dtype)
    counts = np.diff(b)
    with watching("scatter", comm):
        comm.Scatterv([whole, counts, b[:-1], None] if rank == root else None, out, root=root)
    return out


def library_cost(link: Link, req: Request, layout: Layout, params: CostParams) -> Cost:
    """A library collective fitted as ``alpha * ceil(log2 p)`` plus ``beta`` per byte each
    rank sends in a bandwidth-optimal schedule (native MPI and torch.distributed); across
    nodes no faster than the network."""
    p, n = layout.size, req.nbytes
    alpha, beta = link.alpha, link.beta
    if layout.nodes > 1:
        alpha, beta = max(alpha, params.net.alpha), max(beta, params.net.beta)
    if layout.oversubscribed:
        alpha *= params.oversubscribed
    return Cost(latency_s=alpha * layout.log2, transfer_s=beta * n * _VOLUME[req.primitive](p))


_VOLUME = {"allreduce": lambda p: 2.0 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
           "allgather": lambda p: (p - 1) / p, "broadcast": lambda p: 2.0,
           "reduce": lambda p: 2.0}
"""Bytes each of ``p`` members sends in a bandwidth-optimal schedule, per buffer byte."""


def emulated_wait(link: Channel, started: float, primitive: str, nbytes: int) -> None:
    """After an MPI library ``primitive`` over ``link``'s ranks entered at ``started``, of
    ``nbytes`` (the whole buffer: an all-gather's output): under ``comm.emulate`` wait for
    a bandwidth-optimal schedule over the emulated nodes (:meth:`Channel.library`). Off,
    it returns at once: every native collective and store push calls it."""
    if link.emulating:
        link.library(started, _VOLUME[primitive](link.node_count) * nbytes)


class Native(Algorithm):
    """``MPI_Allreduce``, ``MPI_Reduce_scatter``, ``MPI_Allgatherv``, ``MPI_Bcast`` and
    ``MPI_Reduce`` over ``group.comm``."""

    name = "native"
    primitives = frozenset({"allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"})

    def cost(self, req: Request, layout: Layout, params: CostParams) -> Cost:
        return library_cost(params.native, req, layout, params)

    def run(self, req: Request, arr: np.ndarray, group: Group) -> None:
        """The MPI call, then (``comm.emulate``) the emulated time of a bandwidth-optimal
        schedule over the group's emulated nodes (:meth:`Channel.library`)."""
        started = time.perf_counter()
        self._run(req, arr, group)
        emulated_wait(group.link, started, req.primitive, req.nbytes)

    @staticmethod
    def _run(req: Request, arr: np.ndarray, group: Group) -> None:
        comm, prim = group.comm, req.primitive
        if prim == "broadcast":
            comm.Bcast(arr, root=req.root)
            return
        p, r = comm.Get_size(), comm.Get_rank()
        b = chunk_bounds(arr.size, p)
        if prim == "allgather":
            comm.Allgatherv(MPI.IN_PLACE, [arr, np.diff(b), b[:-1], None])
            return
        wide = arr if req.dtype.kind == kernels.ARITH else np.empty(arr.size, np.float32)
        if wide is not arr:
            kernels.widen(arr, wide, req.dtype.kind)
        op = MPI_OPS[req.op]
        if prim == "allreduce":
            comm.Allreduce(MPI.IN_PLACE, wide, op=op)
        elif prim == "reduce":
            comm.Reduce(MPI.IN_PLACE if r == req.root else wide, wide if r == req.root else None,
                        op=op, root=req.root)
            if r != req.root:
                return
        else:  # reduce_scatter: this rank's chunk, written back in place
            out = np.empty(b[r + 1] - b[r], wide.dtype)
            comm.Reduce_scatter(wide, out, np.diff(b), op=op)
            wide[b[r]:b[r + 1]] = out
        if wide is not arr:
            kernels.narrow(wide, arr, req.dtype.kind)


NATIVE = Native()
