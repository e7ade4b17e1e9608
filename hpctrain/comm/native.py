"""Collectives served by the MPI library itself (the baseline every other algorithm beats).

Each function states the collective it issues; all are collective over ``comm``.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

__all__ = ["allreduce_sum", "allgatherv", "gatherv"]


def allreduce_sum(buf: np.ndarray, comm: MPI.Intracomm) -> np.ndarray:
    """In-place ``MPI_Allreduce`` (sum) of a contiguous buffer; returns ``buf``."""
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return buf


def allgatherv(part: np.ndarray, comm: MPI.Intracomm) -> np.ndarray:
    """Concatenation, in rank order, of every rank's ``part`` (same dtype and trailing
    shape on all ranks, any leading length): ``MPI_Allgather`` of the lengths, then
    ``MPI_Allgatherv``."""
    if comm.Get_size() == 1:
        return part
    part = np.ascontiguousarray(part)
    row = int(np.prod(part.shape[1:], dtype=np.int64))
    counts = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([part.shape[0]], dtype=np.int64), counts)
    out = np.empty((int(counts.sum()), *part.shape[1:]), dtype=part.dtype)
    comm.Allgatherv(part, [out, counts * row])
    return out


def gatherv(part: np.ndarray, comm: MPI.Intracomm, root: int = 0) -> np.ndarray | None:
    """Concatenation of every rank's 1-D ``part`` on ``root`` (``None`` elsewhere):
    ``MPI_Gather`` of the lengths, then ``MPI_Gatherv``."""
    part = np.ascontiguousarray(part)
    if comm.Get_size() == 1:
        return part
    counts = np.empty(comm.Get_size(), dtype=np.int64) if comm.Get_rank() == root else None
    comm.Gather(np.array([part.shape[0]], dtype=np.int64), counts, root=root)
    if comm.Get_rank() != root:
        comm.Gatherv(part, None, root=root)
        return None
    out = np.empty(int(counts.sum()), dtype=part.dtype)
    comm.Gatherv(part, [out, counts], root=root)
    return out
