"""Personalised all-to-all exchange (``alltoallv``): three algorithms and their costs.

Every rank sends ``counts[j]`` rows to rank ``j``. The counts are first made known to every
rank (one ``MPI_Allgather`` of each rank's counts, giving the whole ``p x p`` matrix), so all
ranks predict the same costs and choose the same algorithm, and a caller can account the
bytes of the whole exchange:

- ``pairwise``: ``p - 1`` rounds of MPI point-to-point; in round ``k`` rank ``r`` sends to
  ``(r + k) % p`` and receives from ``(r - k) % p`` (any ``p``, not only powers of two), so
  each rank has one message in flight each way and the waits yield the core
  (:func:`~hpctrain.runtime.waits.wait_all`) under the watchdog;
- ``shm`` (one node only): every rank copies what it sends into its row of the node's
  shared scratch window, one flag synchronisation, then every rank copies its segments out
  of the others' rows: two copies per byte and no MPI message (:mod:`hpctrain.comm.shm`);
- ``native``: ``MPI_Alltoallv`` itself, the baseline.

Under ``comm.emulate`` the pairwise messages go through the group's
:class:`~hpctrain.comm.emulate.Channel`; after ``MPI_Alltoallv`` (and the counts'
``MPI_Allgather``) each rank waits the emulated time of the busiest node's bytes across nodes.

Each cost is the dearer of two alpha-beta lines: one fitted on whole small and mid-size
exchanges (``exchange_*`` in :class:`~hpctrain.comm.types.CostParams`, Python's share
included) and one from the memory-bound links; ``auto``'s choice is remembered per size
class.

A second module beside the in-place :class:`~hpctrain.comm.types.Algorithm` families
because an exchange has a different shape: its input and output differ in length and its
cost depends on the count matrix, not on one buffer size.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar

import numba
import numpy as np
from mpi4py import MPI

from hpctrain.comm.types import Cost, CostParams, Layout, Link
from hpctrain.errors import CommError
from hpctrain.runtime.waits import Wait

if TYPE_CHECKING:
    from hpctrain.comm.group import Group

__all__ = ["Exchange", "EXCHANGES", "EXCHANGE_NAMES", "Matrix", "alltoallv", "choose_exchange",
           "exchange_counts"]


@dataclass(frozen=True)
class Matrix:
    """Bytes each rank sends each rank (``bytes[i, j]``: from ``i`` to ``j``), with the few
    maxima the costs read, computed once in one pass (a selection runs on every exchange,
    so it must cost a microsecond or two, not tens of them)."""

    bytes: np.ndarray
    rank: int = 0  # whose segments :attr:`segments` gives

    @property
    def size(self) -> int:
        return self.bytes.shape[0]

    def off_diagonal(self) -> np.ndarray:
        out = self.bytes.copy()
        np.fill_diagonal(out, 0)
        return out

    def moved(self) -> int:
        """Bytes that leave their rank, over all ranks."""
        return int(self.off_diagonal().sum())

    @cached_property
    def maxima(self) -> tuple[int, int, int, int, int]:
        """(bytes the busiest rank sends plus receives, its own segment counted both ways;
        bytes the busiest rank sends or receives to or from other ranks; the largest segment
        a rank sends itself; the sum over pairwise rounds ``k = 1 .. p-1`` of the round's
        largest message, rank ``r`` to ``(r + k) % p``; the most one rank sends)."""
        return _maxima(np.ascontiguousarray(self.bytes, dtype=np.int64))

    @cached_property
    def segments(self) -> tuple[np.ndarray, ...]:
        """For :attr:`rank`: the offsets of its send and receive segments (``p + 1`` each,
        in bytes, rank order), their lengths (``p`` each), and where its segment starts
        inside each sender's row (``p``)."""
        return _segments(np.ascontiguousarray(self.bytes, dtype=np.int64), self.rank)


@numba.njit(cache=True)
def _maxima(m):  # one pass in numba: numpy's reductions cost microseconds each at p = 2-8
    p = m.shape[0]
    through = across = kept = rounds = most = 0
    for r in range(p):
        sent = received = 0
        for j in range(p):
            sent += m[r, j]
            received += m[j, r]
        most = max(most, sent)
        through = max(through, sent + received)
        across = max(across, sent - m[r, r], received - m[r, r])
        kept = max(kept, m[r, r])
    for k in range(1, p):
        largest = 0
        for r in range(p):
            largest = max(largest, m[r, (r + k) % p])
        rounds += largest
    return through, across, kept, rounds, most


@numba.njit(cache=True)
def _segments(m, rank):  # one numba call instead of a handful of numpy ones per exchange
    p = m.shape[0]
    sent, received = np.zeros(p + 1, np.int64), np.zeros(p + 1, np.int64)
    starts = np.zeros(p, np.int64)
    for j in range(p):
        sent[j + 1] = sent[j] + m[rank, j]
        received[j + 1] = received[j] + m[j, rank]
        for k in range(rank):
            starts[j] += m[j, k]
    return sent, received, m[rank].copy(), m[:, rank].copy(), starts


class Exchange(ABC):
    """One alltoallv algorithm; ``run`` is collective over ``group.comm``."""

    name: ClassVar[str]

    def enabled(self, layout: Layout) -> bool:
        return True

    @abstractmethod
    def cost(self, matrix: Matrix, layout: Layout, params: CostParams) -> Cost:
        """Predicted seconds of the exchange described by ``matrix``."""

    @abstractmethod
    def run(self, send: np.ndarray, out: np.ndarray, matrix: Matrix, group: Group) -> None:
        """Move the bytes: ``send`` and ``out`` are flat ``uint8`` views, segments in rank
        order with lengths ``matrix.bytes[rank, :]`` and ``matrix.bytes[:, rank]``."""


def _latency(alpha: float, layout: Layout, params: CostParams) -> float:
    return alpha * (params.oversubscribed if layout.oversubscribed else 1.0)


def _dearer(a: Cost, b: Cost) -> Cost:
    """The larger of two predictions. Each exchange has two lines: one fitted on small and
    mid-size exchanges timed whole (``exchange_*``: Python's share, cache-resident copies)
    and one from the links' memory-bound rates (large exchanges); the larger holds at every
    size, so a line need not fit both ends."""
    return a if a.seconds >= b.seconds else b


class Pairwise(Exchange):
    """``p - 1`` rounds of ``Isend``/``Irecv`` pairs; round ``k`` pairs ``r`` with
    ``r +- k``. A round takes as long as its largest message."""

    name = "pairwise"

    def cost(self, matrix: Matrix, layout: Layout, params: CostParams) -> Cost:
        _, _, kept, rounds, _ = matrix.maxima
        peers = matrix.size - 1
        link = params.net if layout.nodes > 1 else params.p2p
        far = Cost(latency_s=_latency(link.alpha, layout, params) * peers,
                   transfer_s=link.beta * rounds + params.shm.beta * kept)
        if layout.nodes > 1:
            return far
        near = params.exchange_p2p
        return _dearer(far, Cost(latency_s=_latency(near.alpha, layout, params) * peers,
                                 transfer_s=near.beta * (rounds + kept)))

    def run(self, send: np.ndarray, out: np.ndarray, matrix: Matrix, group: Group) -> None:
        comm, p, r = group.link, group.size, group.rank
        so, ro, *_ = matrix.segments
        out[ro[r]:ro[r + 1]] = send[so[r]:so[r + 1]]
        for k in range(1, p):
            dst, src = (r + k) % p, (r - k) % p
            requests = []
            if ro[src + 1] > ro[src]:
                requests.append(comm.Irecv(out[ro[src]:ro[src + 1]], source=src, tag=k))
            if so[dst + 1] > so[dst]:
                requests.append(comm.Isend(send[so[dst]:so[dst + 1]], dest=dst, tag=k))
            if requests:
                comm.wait_all(requests, Wait("alltoallv", group.comm, (dst, src)))


class SharedMemory(Exchange):
    """Copy in to this rank's row of the node's scratch window, synchronise, copy out."""

    name = "shm"

    def enabled(self, layout: Layout) -> bool:
        return layout.nodes == 1

    def cost(self, matrix: Matrix, layout: Layout, params: CostParams) -> Cost:
        near, through = params.exchange_shm, matrix.maxima[0]
        return _dearer(Cost(latency_s=_latency(params.shm.alpha, layout, params),
                            transfer_s=params.shm.beta * through),
                       Cost(latency_s=_latency(near.alpha, layout, params),
                            transfer_s=near.beta * through))

    def run(self, send: np.ndarray, out: np.ndarray, matrix: Matrix, group: Group) -> None:
        r, p = group.rank, group.size
        so, ro, _, _, starts = matrix.segments
        arena = group.arena(matrix.maxima[4])
        half = arena.next_half()
        arena.row(r, half, np.dtype(np.uint8), send.size)[:] = send
        arena.sync()
        for k in range(p):
            n = ro[k + 1] - ro[k]
            if n:
                out[ro[k]:ro[k + 1]] = arena.row(k, half, np.dtype(np.uint8),
                                                 starts[k] + n)[starts[k]:]


class NativeAlltoallv(Exchange):
    """``MPI_Alltoallv`` over ``group.comm``: ``alpha`` per peer plus ``beta`` per byte to or
    from the busiest rank (the dearer of its fitted line and the library allreduce's)."""

    name = "native"

    def cost(self, matrix: Matrix, layout: Layout, params: CostParams) -> Cost:
        peers, across = matrix.size - 1, matrix.maxima[1]
        far, near = params.native, params.exchange_native
        if layout.nodes > 1:
            far = Link(max(far.alpha, params.net.alpha), max(far.beta, params.net.beta))
        return _dearer(Cost(latency_s=_latency(far.alpha, layout, params) * peers,
                            transfer_s=far.beta * across),
                       Cost(latency_s=_latency(near.alpha, layout, params) * peers,
                            transfer_s=near.beta * across))

    def run(self, send: np.ndarray, out: np.ndarray, matrix: Matrix, group: Group) -> None:
        so, ro, sc, rc, _ = matrix.segments
        started = time.perf_counter()
        group.comm.Alltoallv([send, sc, so[:-1], MPI.BYTE], [out, rc, ro[:-1], MPI.BYTE])
        if group.link.emulating:
            group.link.library(started, _busiest_across(matrix, group.link.nodes),
                               matrix.size - 1)


def _busiest_across(matrix: Matrix, nodes: list[int]) -> float:
    """Bytes the busiest emulated node sends or receives across nodes."""
    labels = np.asarray(nodes)
    across = np.where(labels[:, None] != labels[None, :], matrix.bytes, 0)
    sent = np.bincount(labels, across.sum(axis=1))
    received = np.bincount(labels, across.sum(axis=0))
    return float(max(sent.max(), received.max()))


EXCHANGES: tuple[Exchange, ...] = (SharedMemory(), Pairwise(), NativeAlltoallv())
EXCHANGE_NAMES = ("auto", *(e.name for e in EXCHANGES))
_BY_NAME = {e.name: e for e in EXCHANGES}


def choose_exchange(matrix: Matrix, layout: Layout, params: CostParams,
                    algorithm: str = "auto") -> Exchange:
    """The cheapest enabled exchange (the earlier on a tie), or the one named."""
    if algorithm != "auto":
        algo = _BY_NAME.get(algorithm)
        if algo is None:
            raise CommError(f"alltoallv: unknown algorithm {algorithm!r}; algorithms are: "
                            f"{', '.join(EXCHANGE_NAMES)}")
        if not algo.enabled(layout):
            raise CommError(f"alltoallv: algorithm {algorithm!r} needs all ranks on one node")
        return algo
    options = [e for e in EXCHANGES if e.enabled(layout)]
    return min(options, key=lambda e: e.cost(matrix, layout, params).seconds)


def _chosen(matrix: Matrix, group: Group, algorithm: str) -> Exchange:
    """:func:`choose_exchange`, for ``auto`` remembered per size class (each maximum's power
    of two) in ``group.plans``: pricing the exchanges costs about as much as a small exchange
    itself. Every rank sees the same matrices in the same order, so all remember alike."""
    if algorithm != "auto":
        return choose_exchange(matrix, group.layout, group.params, algorithm)
    key = ("alltoallv", *(v.bit_length() for v in matrix.maxima[:4]))
    chosen = group.plans.get(key)
    if chosen is None:
        chosen = group.plans[key] = choose_exchange(matrix, group.layout, group.params)
    return chosen


def exchange_counts(counts: np.ndarray, group: Group, extra: int = 0
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's ``counts`` (``MPI_Allgather``): the ``p x len(counts)`` row-count matrix
    (``p x p`` for one exchange; a caller may send the counts of two), and each rank's
    ``extra`` (a small non-negative integer that rides along, e.g. flags)."""
    mine = np.empty(len(counts) + 1, np.int64)
    mine[:-1] = counts
    mine[-1] = extra
    every = np.empty((group.size, len(mine)), np.int64)
    started = time.perf_counter()
    group.comm.Allgather(mine, every)
    group.link.library(started, mine.nbytes * group.size)
    return every[:, :-1], every[:, -1]


def alltoallv(send: np.ndarray, counts: np.ndarray, *, comm: Group, algorithm: str = "auto",
              matrix: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Send ``counts[j]`` rows of ``send`` (in rank order) to rank ``j``; returns the rows
    received, in source order, and the count from each source. ``matrix`` is the row-count
    matrix when the caller already exchanged it (:func:`exchange_counts`)."""
    group = comm
    send = np.ascontiguousarray(send)
    counts = np.asarray(counts, dtype=np.int64)
    listed = counts.tolist()  # a Python list: faster than numpy's reductions for p values
    if len(listed) != group.size or min(listed, default=0) < 0 or sum(listed) != len(send):
        raise CommError(f"alltoallv: rank {group.rank} passed {len(counts)} counts summing "
                        f"to {int(counts.sum())} for {len(send)} rows; need {group.size} "
                        f"non-negative counts summing to the rows")
    if matrix is None:
        matrix = exchange_counts(counts, group)[0]
    recv = matrix[:, group.rank].copy()
    row = send.itemsize * math.prod(send.shape[1:])
    m = Matrix(matrix * row, group.rank)
    out = np.empty((int(recv.sum()), *send.shape[1:]), dtype=send.dtype)
    if group.size == 1:
        out[:] = send
        return out, recv
    algo = _chosen(m, group, algorithm)
    algo.run(send.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8), m, group)
    return out, recv
