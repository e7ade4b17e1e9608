"""Recursive doubling and recursive halving-doubling (Thakur, Rabenseifner & Gropp 2005).

Both first fold a non-power-of-two group onto ``q = 2^floor(log2 p)`` ranks: each of the
first ``2 (p - q)`` ranks pairs up, the even one sends its buffer to the odd one and waits.
The ``q`` active ranks then run a power-of-two schedule and finally send the result back
to the folded ranks. All messages are ``MPI_Sendrecv``/``MPI_Send``/``MPI_Recv`` on the
given communicator, through its :class:`~hpctrain.comm.emulate.Channel`.

- Recursive doubling: ``log2 q`` steps, each exchanging the whole buffer with the partner
  ``rank ^ mask`` and reducing. Latency-optimal, for small messages. Both partners
  compute ``a (op) b`` with a commutative kernel, so every rank ends with the same bits.
- Halving-doubling: reduce-scatter by recursive halving (each step exchanges half of the
  current range and keeps the other half), then allgather by recursive doubling in reverse
  order. ``2 log2 q`` messages and ``2 (q-1)/q * n`` bytes: for medium and large messages.
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

__all__ = ["RecursiveDoubling", "HalvingDoubling", "RECURSIVE_DOUBLING", "HALVING_DOUBLING",
           "recursive_doubling", "halving_doubling"]

_TAG = 72


def _fold(arr: np.ndarray, comm: Channel, op: int, kind: int,
          scratch: np.ndarray) -> tuple[int, int]:
    """Fold onto a power of two; returns (rank among the active ranks or -1, active size)."""
    p, r = comm.Get_size(), comm.Get_rank()
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    if r < 2 * extra:
        if r % 2 == 0:
            comm.Send(arr, r + 1, _TAG)
            return -1, q
        tmp = scratch[: arr.size]
        comm.Recv(tmp, r - 1, _TAG)
        # Same operand order as the partner would use: lower rank's data first.
        kernels.reduce_pair(arr, tmp, op, kind)
        return r // 2, q
    return r - extra, q


def _unfold(arr: np.ndarray, comm: Channel) -> None:
    p, r = comm.Get_size(), comm.Get_rank()
    extra = p - (1 << (p.bit_length() - 1))
    if r < 2 * extra:
        if r % 2 == 0:
            comm.Recv(arr, r + 1, _TAG)
        else:
            comm.Send(arr, r - 1, _TAG)


def _world_rank(active: int, extra: int) -> int:
    return 2 * active + 1 if active < extra else active + extra


def recursive_doubling(arr: np.ndarray, comm: Channel, op: int, kind: int,
                       scratch: np.ndarray) -> None:
    """Allreduce of the whole ``arr`` by recursive doubling over ``comm``."""
    p = comm.Get_size()
    me, q = _fold(arr, comm, op, kind, scratch)
    if me >= 0:
        tmp = scratch[: arr.size]
        mask = 1
        while mask < q:
            partner = _world_rank(me ^ mask, p - q)
            comm.Sendrecv(arr, partner, _TAG, tmp, partner, _TAG)
            kernels.reduce_pair(arr, tmp, op, kind)
            mask <<= 1
    _unfold(arr, comm)


def halving_doubling(arr: np.ndarray, comm: Channel, op: int, kind: int,
                     scratch: np.ndarray) -> None:
    """Allreduce by recursive halving (reduce-scatter) then doubling (allgather)."""
    p = comm.Get_size()
    me, q = _fold(arr, comm, op, kind, scratch)
    if me >= 0:
        lo, hi = 0, arr.size
        splits: list[tuple[int, int, int, int]] = []
        mask = q >> 1
        while mask:
            partner = _world_rank(me ^ mask, p - q)
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if me & mask == 0 else ((mid, hi), (lo, mid))
            tmp = scratch[: keep[1] - keep[0]]
            comm.Sendrecv(arr[give[0]:give[1]], partner, _TAG, tmp, partner, _TAG)
            kernels.reduce_pair(arr[keep[0]:keep[1]], tmp, op, kind)
            splits.append((partner, *give))
            lo, hi = keep
            mask >>= 1
        for partner, glo, ghi in reversed(splits):
            comm.Sendrecv(arr[lo:hi], partner, _TAG, arr[glo:ghi], partner, _TAG)
            lo, hi = min(lo, glo), max(hi, ghi)
    _unfold(arr, comm)


def _fold_cost(layout: Layout, nbytes: int, alpha: float, beta: float,
               gamma: float) -> Cost:
    if layout.size & (layout.size - 1) == 0:
        return Cost()
    return Cost(latency_s=2 * alpha, transfer_s=2 * beta * nbytes, compute_s=gamma * nbytes)


class _Recursive(Algorithm):
    primitives = frozenset({"allreduce"})

    @staticmethod
    def _link(layout: Layout, params: CostParams) -> tuple[float, float]:
        link = params.net if layout.nodes > 1 else params.p2p
        return params.latency(link.alpha, layout), link.beta


class RecursiveDoubling(_Recursive):
    """Recursive-doubling allreduce over ``group.comm``."""

    name = "recursive_doubling"

    def cost(self, req: Request, layout: Layout, params: CostParams) -> Cost:
        alpha, beta = self._link(layout, params)
        n, steps = req.nbytes, (layout.size.bit_length() - 1)
        return Cost(latency_s=alpha * steps, transfer_s=beta * n * steps,
                    compute_s=params.gamma * n * steps) + _fold_cost(layout, n, alpha, beta,
                                                                     params.gamma)

    def run(self, req: Request, arr: np.ndarray, group: Group) -> None:
        recursive_doubling(arr, group.link, OP_KERNEL[req.op], req.dtype.kind,
                           group.scratch(arr.size, arr.dtype))


class HalvingDoubling(_Recursive):
    """Recursive halving-doubling (Rabenseifner) allreduce over ``group.comm``."""

    name = "halving_doubling"

    def cost(self, req: Request, layout: Layout, params: CostParams) -> Cost:
        alpha, beta = self._link(layout, params)
        n, steps = req.nbytes, (layout.size.bit_length() - 1)
        q = 1 << steps
        return Cost(latency_s=2 * alpha * steps, transfer_s=2 * beta * n * (q - 1) / q,
                    compute_s=params.gamma * n * (q - 1) / q) + _fold_cost(
            layout, n, alpha, beta, params.gamma)

    def run(self, req: Request, arr: np.ndarray, group: Group) -> None:
        halving_doubling(arr, group.link, OP_KERNEL[req.op], req.dtype.kind,
                         group.scratch(arr.size, arr.dtype))


RECURSIVE_DOUBLING = RecursiveDoubling()
HALVING_DOUBLING = HalvingDoubling()
