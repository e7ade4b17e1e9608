"""Binomial trees: reduce to a root, broadcast from it, and allreduce as the two in turn.

Ranks are renumbered relative to the root (``v = (rank - root) mod p``). Reduce: for
``mask = 1, 2, 4, ...`` a rank with bit ``mask`` set sends its partial result to
``v - mask`` and stops; the others receive from ``v + mask`` (when it exists) and reduce.
Broadcast runs the same tree downwards. ``ceil(log2 p)`` rounds each, whole buffers, any
``p``: a latency-bound choice for small messages. Messages are ``MPI_Send``/``MPI_Recv``
on the given communicator, through its :class:`~hpctrain.comm.emulate.Channel`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hpctrain.comm import kernels
from hpctrain.comm.algorithm import Algorithm
from hpctrain.comm.types import OP_KERNEL, Cost, CostParams, Layout, Request

if TYPE_CHECKING:
    from hpctrain.comm.emulate import Channel
    from hpctrain.comm.group import Group

__all__ = ["Tree", "TREE", "reduce", "broadcast"]

_TAG = 73


def reduce(arr: np.ndarray, comm: Channel, root: int, op: int, kind: int,
           scratch: np.ndarray) -> None:
    """Binomial-tree reduce of ``arr`` onto ``root`` (other ranks' ``arr`` is clobbered)."""
    p, r = comm.Get_size(), comm.Get_rank()
    v = (r - root) % p
    tmp = scratch[: arr.size]
    mask = 1
    while mask < p:
        if v & mask:
            comm.Send(arr, (v - mask + root) % p, _TAG)
            return
        if v + mask < p:
            comm.Recv(tmp, (v + mask + root) % p, _TAG)
            kernels.reduce_pair(arr, tmp, op, kind)
        mask <<= 1


def broadcast(arr: np.ndarray, comm: Channel, root: int) -> None:
    """Binomial-tree broadcast of ``root``'s ``arr``."""
    p, r = comm.Get_size(), comm.Get_rank()
    v = (r - root) % p
    mask = 1
    while mask < p:
        if v & mask:
            comm.Recv(arr, (v - mask + root) % p, _TAG)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if v + mask < p:
            comm.Send(arr, (v + mask + root) % p, _TAG)
        mask >>= 1


class Tree(Algorithm):
    """Binomial reduce, broadcast and allreduce (reduce to rank 0, then broadcast) over
    ``group.comm``."""

    name = "tree"
    primitives = frozenset({"allreduce", "reduce", "broadcast"})

    def cost(self, req: Request, layout: Layout, params: CostParams) -> Cost:
        link = params.net if layout.nodes > 1 else params.p2p
        rounds, n = layout.log2, req.nbytes
        down = Cost(latency_s=params.latency(link.alpha, layout) * rounds,
                    transfer_s=link.beta * n * rounds)
        up = down + Cost(compute_s=params.gamma * n * rounds)
        return {"allreduce": up + down, "reduce": up, "broadcast": down}[req.primitive]

    def run(self, req: Request, arr: np.ndarray, group: Group) -> None:
        if req.primitive in ("allreduce", "reduce"):
            root = 0 if req.primitive == "allreduce" else req.root
            reduce(arr, group.link, root, OP_KERNEL[req.op], req.dtype.kind,
                   group.scratch(arr.size, arr.dtype))
        if req.primitive in ("allreduce", "broadcast"):
            broadcast(arr, group.link, req.root if req.primitive == "broadcast" else 0)


TREE = Tree()
