"""Ring collectives (Patarasuk & Yuan 2009): bandwidth-optimal, ``p - 1`` steps per phase.

The buffer is cut into ``p`` balanced chunks. Reduce-scatter: at step ``s`` rank ``r``
sends chunk ``r-s-1`` to its right neighbour and receives chunk ``r-s-2`` from its left
one, reducing it into its own copy; after ``p-1`` steps rank ``r`` holds the total of
chunk ``r``. Allgather then circulates the finished chunks the same way. Each rank sends
``(p-1)/p`` of the buffer per phase, so allreduce moves ``2 (p-1)/p * n`` bytes per rank
whatever ``p`` is. All messages are ``MPI_Sendrecv`` on the given communicator, through its
:class:`~hpctrain.comm.emulate.Channel` (which delays those between emulated nodes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hpctrain.comm import kernels
from hpctrain.comm.algorithm import Algorithm
from hpctrain.comm.types import OP_KERNEL, Cost, CostParams, Layout, Request, chunk_bounds

if TYPE_CHECKING:
    from hpctrain.comm.emulate import Channel
    from hpctrain.comm.group import Group

__all__ = ["Ring", "RING", "reduce_scatter", "allgather", "allreduce", "ring_cost"]

_TAG = 71


def reduce_scatter(arr: np.ndarray, comm: Channel, op: int, kind: int,
                   scratch: np.ndarray) -> None:
    """Ring reduce-scatter: afterwards chunk ``rank`` of ``arr`` holds the total over
    ``comm``; ``scratch`` holds at least one chunk."""
    p, r = comm.Get_size(), comm.Get_rank()
    b = chunk_bounds(arr.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        out, inc = (r - s - 1) % p, (r - s - 2) % p
        tmp = scratch[: b[inc + 1] - b[inc]]
        comm.Sendrecv(arr[b[out]:b[out + 1]], right, _TAG, tmp, left, _TAG)
        kernels.reduce_pair(arr[b[inc]:b[inc + 1]], tmp, op, kind)


def allgather(arr: np.ndarray, comm: Channel) -> None:
    """Ring allgather: chunk ``k`` of every rank's ``arr`` becomes rank ``k``'s chunk."""
    p, r = comm.Get_size(), comm.Get_rank()
    b = chunk_bounds(arr.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        out, inc = (r - s) % p, (r - s - 1) % p
        comm.Sendrecv(arr[b[out]:b[out + 1]], right, _TAG, arr[b[inc]:b[inc + 1]], left, _TAG)


def allreduce(arr: np.ndarray, comm: Channel, op: int, kind: int,
              scratch: np.ndarray) -> None:
    """Ring reduce-scatter then ring allgather over ``comm``."""
    if comm.Get_size() > 1:
        reduce_scatter(arr, comm, op, kind, scratch)
        allgather(arr, comm)


def ring_cost(primitive: str, nbytes: float, p: int, link_alpha: float, link_beta: float,
              gamma: float) -> Cost:
    steps, chunk = p - 1, nbytes / p
    scatter = Cost(latency_s=link_alpha * steps, transfer_s=link_beta * chunk * steps,
                   compute_s=gamma * chunk * steps)
    gather = Cost(latency_s=link_alpha * steps, transfer_s=link_beta * chunk * steps)
    return {"allreduce": scatter + gather, "reduce_scatter": scatter,
            "allgather": gather}[primitive]


class Ring(Algorithm):
    """Ring allreduce, reduce-scatter and allgather over ``group.comm`` (``group.link``)."""

    name = "ring"
    primitives = frozenset({"allreduce", "reduce_scatter", "allgather"})

    def cost(self, req: Request, layout: Layout, params: CostParams) -> Cost:
        link = params.net if layout.nodes > 1 else params.p2p
        return ring_cost(req.primitive, req.nbytes, layout.size, params.latency(link.alpha, layout),
                         link.beta, params.gamma)

    def run(self, req: Request, arr: np.ndarray, group: Group) -> None:
        op, kind = OP_KERNEL[req.op], req.dtype.kind
        scratch = group.scratch(-(-arr.size // group.layout.size), arr.dtype)
        if req.primitive in ("allreduce", "reduce_scatter"):
            reduce_scatter(arr, group.link, op, kind, scratch)
        if req.primitive in ("allreduce", "allgather"):
            allgather(arr, group.link)


RING = Ring()
