"""Hierarchical allreduce: shared memory inside each node, a ring across nodes.

1. Shared-memory reduce-scatter over ``group.node``: local rank ``l`` reduces slice ``l``
   of the buffer over the node's ranks (:mod:`hpctrain.comm.shm`, first synchronisation).
2. Ring allreduce of that slice over ``group.cross``, the ranks that hold local rank ``l``
   on every node, so the nodes' links carry ``2 (N-1)/N`` of a slice per rank and all
   local ranks use them at once.
3. Shared-memory allgather: the finished slice is published in the node's window and the
   node's ranks copy it out (second synchronisation). A resident buffer skips the copies.

Every node must hold the same number of ranks (slices must line up across nodes). The
layout can be forced with ``comm.node_size`` so that one machine exercises step 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hpctrain.comm import ring, shm, window
from hpctrain.comm.algorithm import Algorithm
from hpctrain.comm.types import OP_KERNEL, Cost, CostParams, Layout, Request

if TYPE_CHECKING:
    from hpctrain.comm.group import Group

__all__ = ["Hierarchical", "HIERARCHICAL"]


class Hierarchical(Algorithm):
    """Allreduce over ``group.node`` (shared window) and ``group.cross`` (ring)."""

    name = "hierarchical"
    primitives = frozenset({"allreduce"})

    def enabled(self, req: Request, layout: Layout) -> bool:
        return super().enabled(req, layout) and layout.nodes > 1 and layout.uniform

    def cost(self, req: Request, layout: Layout, params: CostParams) -> Cost:
        local, n = layout.local_size, req.nbytes
        sync = shm.sync_cost(layout, params)
        inside = shm.Shm.slices_cost(n, local, params, sync, req.resident)
        across = ring.ring_cost("allreduce", n / local, layout.nodes, params.net.alpha,
                                params.net.beta, params.gamma)
        return inside + across

    def run(self, req: Request, arr: np.ndarray, group: Group) -> None:
        op, kind = OP_KERNEL[req.op], req.dtype.kind
        cross = group.cross_link
        scratch = group.scratch(-(-arr.size // (group.layout.local_size * cross.Get_size()))
                                + 1, arr.dtype)

        def across(part: np.ndarray) -> None:
            ring.allreduce(part, cross, op, kind, scratch)

        resident = group.resident_of(arr) if req.resident else None
        if resident is not None:
            window.allreduce_resident(arr, resident, op, kind, between=across)
        else:
            window.allreduce_slices(arr, group.arena(req.nbytes), op, kind, between=across)


HIERARCHICAL = Hierarchical()
