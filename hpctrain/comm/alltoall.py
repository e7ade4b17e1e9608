"""Personalised all-to-all exchange (``alltoallv``): four algorithms and their costs.

Every rank sends ``counts[j]`` rows to rank ``j``. The counts are first made known to every
rank (one ``MPI_Allgather`` of each rank's counts, giving the whole ``p x p`` matrix), so all
ranks predict the same costs and choose the same algorithm, and a caller can account the
bytes of the whole exchange:

- ``pairwise``: ``p - 1`` rounds of MPI point-to-point; in round ``k`` rank ``r`` sends to
  ``(r + k) % p`` and receives from ``(r - k) % p`` (any ``p``, not only powers of two), so
  each rank has one message in flight each way and the waits yield the core
  (:func:`~hpctrain.runtime.waits.wait_all`) under the watchdog;
- ``shm`` (one node only): every rank copies what it sends the others into its row of the
  node's shared scratch window and its own segment straight to its output, one flag
  synchronisation, then every rank copies its segments out of the others' rows: two copies
  per byte that moves, no MPI message, and all of it in one numba call (fences,
  :func:`~hpctrain.comm.window.flags_reached`) unless a rank is late. The copies into the
  window are streaming stores (:func:`~hpctrain.comm.bytecopy.stream_bytes`), which need
  not take each line back from the core that read it last, and with them whole exchanges
  measured faster than piece by piece at every size to 16 MiB (2 and 4 ranks); a rank that
  sends more than 16 MiB goes piece by piece through four slots (a pair of flags per
  piece), so the window stays bounded;
- ``cma`` (one node, where a rank may read the others' memory: ``Layout.single_copy``):
  every rank publishes its send buffer's address beside its flag in the scratch window,
  one flag synchronisation, then every rank reads its segments straight out of the
  others' buffers with ``process_vm_readv`` (:mod:`hpctrain.comm.cma`) and a second
  synchronisation keeps each buffer until its readers are done: one copy per byte that
  moves, so from 16-64 KiB on it costs about half of ``shm``, and the two synchronisations
  make it dearer below;
- ``native``: ``MPI_Alltoallv`` itself, the baseline.

Under ``comm.emulate`` the pairwise messages go through the group's
:class:`~hpctrain.comm.emulate.Channel`; after ``MPI_Alltoallv`` (and the counts'
``MPI_Allgather``) each rank waits the emulated time of the busiest node's bytes across nodes.

Each cost is an alpha-beta line fitted on whole exchanges from 8 bytes to 4 MiB
(``exchange_*`` in :class:`~hpctrain.comm.types.CostParams`, Python's share included);
across nodes the network's link is a floor. ``auto``'s choice is remembered per size class.

A second module beside the in-place :class:`~hpctrain.comm.types.Algorithm` families
because an exchange has a different shape: its input and output differ in length and its
cost depends on the count matrix, not on one buffer size.
"""

from __future__ import annotations

import math
import os
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numba
import numpy as np
from mpi4py import MPI

from hpctrain.comm import cma
from hpctrain.comm.bytecopy import copy_bytes, stream_bytes
from hpctrain.comm.types import Cost, CostParams, Layout, Link
from hpctrain.comm.window import flags_reached, publish_flag
from hpctrain.errors import CommError
from hpctrain.runtime.waits import Wait

if TYPE_CHECKING:
    from hpctrain.comm.group import Group

__all__ = ["Exchange", "EXCHANGES", "EXCHANGE_NAMES", "Matrix", "alltoallv", "choose_exchange",
           "compile_kernels", "exchange_counts"]


class Matrix:
    """Bytes each rank sends each rank (``bytes[i, j]``: from ``i`` to ``j``), given as a
    row-count matrix and the bytes of a row, with everything the costs and the exchanges
    read computed once, in one numba pass (a selection and the segments' offsets run on
    every exchange, so they must cost a microsecond, not tens of them)."""

    __slots__ = ("counts", "row", "rank", "info", "fits")

    def __init__(self, counts: np.ndarray, rank: int = 0, row: int = 1,
                 sent_rows: int = -1) -> None:
        """With ``sent_rows`` (the rows ``rank`` sends in all), :attr:`fits` says whether
        ``rank``'s counts are non-negative and sum to them."""
        self.counts, self.rank, self.row = counts, rank, row
        # allocated here: a numba function's returned array costs 0.6 us to box, its
        # argument's 0.1
        self.info = np.empty(_HEAD + 6 * counts.shape[0] + 2, np.int64)
        self.fits = _describe(counts, row, rank, self.info, sent_rows)

    @property
    def size(self) -> int:
        return self.counts.shape[0]

    @property
    def bytes(self) -> np.ndarray:
        return self.counts * self.row

    def off_diagonal(self) -> np.ndarray:
        out = self.bytes
        np.fill_diagonal(out, 0)
        return out

    def moved(self) -> int:
        """Bytes that leave their rank, over all ranks."""
        return int(self.off_diagonal().sum())

    @property
    def maxima(self) -> tuple[int, int, int, int, int]:
        """(bytes the busiest rank sends plus receives, its own segment counted once;
        bytes the busiest rank sends or receives to or from other ranks; the largest segment
        a rank sends itself; the sum over pairwise rounds ``k = 1 .. p-1`` of the round's
        largest message, rank ``r`` to ``(r + k) % p``; the most one rank sends)."""
        return tuple(self.info[:5].tolist())  # type: ignore[return-value]

    @property
    def largest(self) -> int:
        """Bytes of the largest segment one rank sends another."""
        return int(self.info[6])

    @property
    def pipelined(self) -> bool:
        """Whether :class:`SharedMemory` goes piece by piece: when a rank sends more than
        ``_WHOLE_BYTES``."""
        return bool(self.info.item(7))

    @property
    def segments(self) -> tuple[np.ndarray, ...]:
        """For :attr:`rank`: the offsets of its send and receive segments (``p + 1`` each,
        in bytes, rank order), their lengths (``p`` each), and where its segment starts
        inside each sender's row (``p``)."""
        p, info = self.size, self.info
        return (info[_HEAD:_HEAD + p + 1], info[_HEAD + p + 1:_HEAD + 2 * p + 2],
                info[_HEAD + 2 * p + 2:_HEAD + 3 * p + 2],
                info[_HEAD + 3 * p + 2:_HEAD + 4 * p + 2],
                info[_HEAD + 4 * p + 2:_HEAD + 5 * p + 2])


# The five maxima, the size class (the first four maxima's bit lengths packed in one
# integer: auto's key), the largest segment and the piece-by-piece flag precede the
# segments; the received row counts follow them.
_HEAD = 8


_SLOT_BYTES = 512 << 10  # one slot of a rank's row: a piece of each of its p segments
_MIN_PIECE = 16 << 10
_SLOTS = 4
# A whole exchange holds all a rank sends in its row of the window (twice: two halves); a
# rank that sends more goes piece by piece through slots, so the window stays bounded.
_WHOLE_BYTES = 16 << 20


def _piece(ranks: int) -> int:
    """Bytes of one segment a rank copies in per step of the pipeline (128 KiB at 4 ranks),
    so that a rank's slots stay cache-sized however many ranks share the node."""
    return max(_MIN_PIECE, _SLOT_BYTES // ranks // 64 * 64)


@numba.njit(cache=True)
def _describe(counts, row, rank, info, sent_rows):  # one pass: numpy's take microseconds
    p = counts.shape[0]
    info[:] = 0
    through = across = kept = rounds = most = largest = 0
    for r in range(p):
        sent = received = 0
        for j in range(p):
            sent += counts[r, j]
            received += counts[j, r]
            if j != r:
                largest = max(largest, counts[r, j])
        own = counts[r, r]
        most = max(most, sent)
        through = max(through, sent + received - own)
        across = max(across, sent - own, received - own)
        kept = max(kept, own)
    for k in range(1, p):
        round_max = 0
        for r in range(p):
            round_max = max(round_max, counts[r, (r + k) % p])
        rounds += round_max
    maxima = (through, across, kept, rounds, most)
    key = 0
    for i in range(5):
        info[i] = maxima[i] * row
        if i < 4:
            bits = 0
            v = info[i]
            while v:
                bits += 1
                v >>= 1
            key |= bits << (7 * i)
    info[5] = key
    info[6] = largest * row
    info[7] = most * row > _WHOLE_BYTES
    sent_at, received_at, lengths, starts = _HEAD, _HEAD + p + 1, _HEAD + 2 * p + 2, \
        _HEAD + 4 * p + 2
    for j in range(p):
        info[sent_at + j + 1] = info[sent_at + j] + counts[rank, j] * row
        info[received_at + j + 1] = info[received_at + j] + counts[j, rank] * row
        info[lengths + j] = counts[rank, j] * row
        info[lengths + p + j] = counts[j, rank] * row
        info[_HEAD + 5 * p + 2 + j] = counts[j, rank]
        for k in range(rank):
            info[starts + j] += counts[j, k] * row
    return sent_rows < 0 or _counts_fit(counts[rank], p, sent_rows)


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
        """Move the bytes: ``send`` and ``out`` are C-contiguous arrays (any dtype and
        shape) whose bytes are the segments in rank order, with lengths
        ``matrix.bytes[rank, :]`` and ``matrix.bytes[:, rank]``."""


def _dearer(a: Cost, b: Cost) -> Cost:
    """The larger of two predictions: across nodes an exchange costs at least what it
    measured on one node (``exchange_*``) and at least what the network's link gives."""
    return a if a.seconds >= b.seconds else b


class Pairwise(Exchange):
    """``p - 1`` rounds of ``Isend``/``Irecv`` pairs; round ``k`` pairs ``r`` with
    ``r +- k``. A round takes as long as its largest message."""

    name = "pairwise"

    def cost(self, matrix: Matrix, layout: Layout, params: CostParams) -> Cost:
        _, _, kept, rounds, _ = matrix.maxima
        peers, near = matrix.size - 1, params.exchange_p2p
        measured = Cost(latency_s=params.latency(near.alpha, layout) * peers,
                        transfer_s=near.beta * (rounds + kept))
        if layout.nodes == 1:
            return measured
        net = params.net
        return _dearer(measured, Cost(latency_s=params.latency(net.alpha, layout) * peers,
                                      transfer_s=net.beta * rounds + params.shm.beta * kept))

    def run(self, send: np.ndarray, out: np.ndarray, matrix: Matrix, group: Group) -> None:
        comm, p, r = group.link, group.size, group.rank
        so, ro, *_ = matrix.segments
        send, out = _bytes(send), _bytes(out)
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
        near = params.exchange_shm
        return Cost(latency_s=params.latency(near.alpha, layout),
                    transfer_s=near.beta * matrix.maxima[0])

    def run(self, send: np.ndarray, out: np.ndarray, matrix: Matrix, group: Group) -> None:
        info = matrix.info
        if info.item(7):  # Matrix.pipelined, without a property's call
            _exchange_pipelined(send, out, matrix, group)
            return
        arena = group.arena(info.item(4))
        base = arena.head + arena.next_half() * arena.row_bytes
        value = arena.next_value()
        if not _shm_exchange(send, out, arena.mem, arena.words, info, group.rank, arena.chunk,
                             base, value, arena.polls):
            arena.wait(value)  # the others are late: wait yielding the core
            _copy_out(out, arena.mem, info, group.rank, arena.chunk, base)


@numba.njit(cache=True, nogil=True)
def _shm_exchange(send, out, mem, words, info, rank, chunk, base, value, polls):
    """Copy what ``send`` holds for the others into this rank's row (its own segment
    straight to ``out``), publish, poll the others' flags ``polls`` times and, if all
    arrived, copy this rank's segments out: ``True`` when done."""
    p = (info.size - _HEAD - 2) // 6
    lo, hi = info[_HEAD + rank], info[_HEAD + rank + 1]
    stream_bytes(mem, rank * chunk + base, send, 0, lo)
    stream_bytes(mem, rank * chunk + base + hi, send, hi, send.nbytes - hi)
    publish_flag(words, chunk // 8, rank, value, 0)
    copy_bytes(out, info[_HEAD + p + 1 + rank], send, lo, hi - lo)
    if not flags_reached(words, chunk // 8, p, value, polls, 0):
        return False
    _copy_out(out, mem, info, rank, chunk, base)
    return True


@numba.njit(cache=True, nogil=True)
def _copy_out(out, mem, info, rank, chunk, base):
    """Copy this rank's segments out of the other senders' rows (after the flags say all
    are in)."""
    p = (info.size - _HEAD - 2) // 6
    received, starts = _HEAD + p + 1, _HEAD + 4 * p + 2
    for k in range(p):
        lo, hi = info[received + k], info[received + k + 1]
        if hi > lo and k != rank:
            copy_bytes(out, lo, mem, k * chunk + base + info[starts + k], hi - lo)


def _exchange_pipelined(send: np.ndarray, out: np.ndarray, matrix: Matrix,
                        group: Group) -> None:
    """The shared-memory exchange a piece of every segment at a time through ``_SLOTS``
    slots of each rank's row, so that a rank sending more than ``_WHOLE_BYTES`` needs a
    window of only ``_SLOTS`` pieces a destination."""
    p = group.size
    piece = _piece(p)
    arena = group.arena(_SLOTS * p * piece)
    steps = -(-matrix.largest // piece)
    value = arena.reserve(steps, 1, 2)
    at = arena.head + arena.next_half() * arena.row_bytes
    state = np.zeros(2, np.int64)
    while not _pipeline(send, out, arena.mem, arena.words, matrix.info, group.rank,
                        arena.chunk, at, piece, steps, value, state, arena.polls):
        step, stage = int(state[0]), int(state[1])  # stage 0 waits on flag 2, 1 on flag 1
        arena.wait(value + step - (_SLOTS if stage == 0 else 0), slot=2 - stage)


@numba.njit(cache=True, nogil=True)
def _pipeline(send, out, mem, words, info, rank, chunk, at, piece, steps, value, state,
              polls):
    """Per step ``c``: copy piece ``c`` of every segment this rank sends into its slot
    ``c % _SLOTS`` (once every rank has read that slot's last use, flag 2), publish flag 1;
    when every rank's flag 1 says so, copy piece ``c`` of every segment sent to this rank out
    of the senders' slots and publish flag 2. ``False`` when a flag was not reached within
    ``polls`` polls: ``state`` holds the (step, stage) to wait in and go on from."""
    p = (info.size - _HEAD - 2) // 6
    sent_at, received_at = _HEAD, _HEAD + p + 1
    c, stage = state[0], state[1]
    if c == 0 and stage == 0:
        lo, hi = info[sent_at + rank], info[sent_at + rank + 1]
        copy_bytes(out, info[received_at + rank], send, lo, hi - lo)
    stride = chunk // 8
    while c < steps:
        slot = at + (c % _SLOTS) * p * piece
        if stage == 0:
            if c >= _SLOTS and not flags_reached(words, stride, p, value + c - _SLOTS,
                                                 polls, 2):
                state[0], state[1] = c, 0
                return False
            for j in range(p):
                lo = info[sent_at + j] + c * piece
                n = min(info[sent_at + j + 1] - lo, piece)
                if j != rank and n > 0:
                    stream_bytes(mem, rank * chunk + slot + j * piece, send, lo, n)
            publish_flag(words, stride, rank, value + c, 1)
            stage = 1
        if not flags_reached(words, stride, p, value + c, polls, 1):
            state[0], state[1] = c, 1
            return False
        for k in range(p):
            lo = info[received_at + k] + c * piece
            n = min(info[received_at + k + 1] - lo, piece)
            if k != rank and n > 0:
                copy_bytes(out, lo, mem, k * chunk + slot + rank * piece, n)
        publish_flag(words, stride, rank, value + c, 2)
        c, stage = c + 1, 0
    return True


class SingleCopy(Exchange):
    """Publish where the send buffer lies, synchronise, read this rank's segments straight
    out of the others' buffers (:func:`hpctrain.comm.cma.read`), synchronise again (a
    buffer must outlive its readers)."""

    name = "cma"

    def enabled(self, layout: Layout) -> bool:
        return layout.nodes == 1 and layout.single_copy

    def cost(self, matrix: Matrix, layout: Layout, params: CostParams) -> Cost:
        near = params.exchange_cma
        _, across, kept, _, _ = matrix.maxima
        return Cost(latency_s=params.latency(near.alpha, layout),
                    transfer_s=near.beta * (across + kept))

    def run(self, send: np.ndarray, out: np.ndarray, matrix: Matrix, group: Group) -> None:
        arena = group.arena(0)
        value = arena.reserve(2, 0)
        stage = 0
        while True:
            stage = _cma_exchange(send, out, arena.words, matrix.info, group.rank,
                                  arena.chunk // 8, value, os.getpid(), arena.polls,
                                  stage)
            if stage <= 0:
                break
            arena.wait(value + stage - 1)  # the others are late: wait yielding the core
        if stage < 0:
            raise CommError(f"alltoallv: rank {group.rank} could not read rank {-stage - 1}'s "
                            f"send buffer (process_vm_readv failed: has rank {-stage - 1} "
                            f"ended?)")


@numba.njit(cache=True, nogil=True)
def _cma_exchange(send, out, words, info, rank, stride, value, pid, polls, stage):
    """From ``stage`` on: 0, publish ``send``'s address and this process's pid beside flag
    ``value`` (words 1 and 2 of the flag line) and copy this rank's own segment; 1, once
    every flag reached ``value``, read the segments sent to this rank and publish
    ``value + 1``; 2, wait until every flag reached ``value + 1``. Returns 0 when done, the
    stage to wait in and go on from when a flag was not reached within ``polls`` polls, and
    ``-(k + 1)`` when reading rank ``k`` failed (its flag still published, so no rank waits
    for this one)."""
    p = (info.size - _HEAD - 2) // 6
    if stage == 0:
        cma.publish(words, stride, rank, send, pid)
        publish_flag(words, stride, rank, value, 0)
        lo, hi = info[_HEAD + rank], info[_HEAD + rank + 1]
        copy_bytes(out, info[_HEAD + p + 1 + rank], send, lo, hi - lo)
        stage = 1
    if stage == 1:
        if not flags_reached(words, stride, p, value, polls, 0):
            return 1
        received, starts = _HEAD + p + 1, _HEAD + 4 * p + 2
        iov = np.empty(4, np.int64)
        for k in range(p):
            lo, hi = info[received + k], info[received + k + 1]
            if hi > lo and k != rank and not cma.read_published(
                    words, stride, k, info[starts + k], out, lo, hi - lo, iov):
                publish_flag(words, stride, rank, value + 1, 0)
                return -(k + 1)
        publish_flag(words, stride, rank, value + 1, 0)
    if not flags_reached(words, stride, p, value + 1, polls, 0):
        return 2
    return 0


class NativeAlltoallv(Exchange):
    """``MPI_Alltoallv`` over ``group.comm``: ``alpha`` per peer plus ``beta`` per byte to or
    from the busiest rank (the dearer of its fitted line and the library allreduce's)."""

    name = "native"

    def cost(self, matrix: Matrix, layout: Layout, params: CostParams) -> Cost:
        peers, across, near = matrix.size - 1, matrix.maxima[1], params.exchange_native
        measured = Cost(latency_s=params.latency(near.alpha, layout) * peers,
                        transfer_s=near.beta * across)
        if layout.nodes == 1:
            return measured
        far = Link(max(params.native.alpha, params.net.alpha),
                   max(params.native.beta, params.net.beta))
        return _dearer(measured, Cost(latency_s=params.latency(far.alpha, layout) * peers,
                                      transfer_s=far.beta * across))

    def run(self, send: np.ndarray, out: np.ndarray, matrix: Matrix, group: Group) -> None:
        so, ro, sc, rc, _ = matrix.segments
        started = time.perf_counter()
        group.comm.Alltoallv([_bytes(send), sc, so[:-1], MPI.BYTE],
                             [_bytes(out), rc, ro[:-1], MPI.BYTE])
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


EXCHANGES: tuple[Exchange, ...] = (SharedMemory(), SingleCopy(), Pairwise(),
                                   NativeAlltoallv())
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
            needs = "all ranks on one node" if layout.nodes > 1 else \
                "ranks that may read each other's memory (process_vm_readv was refused)"
            raise CommError(f"alltoallv: algorithm {algorithm!r} needs {needs}")
        return algo
    options = [e for e in EXCHANGES if e.enabled(layout)]
    return min(options, key=lambda e: e.cost(matrix, layout, params).seconds)


def _chosen(matrix: Matrix, group: Group, algorithm: str) -> Exchange:
    """:func:`choose_exchange`; for ``auto`` remembered per size class (each maximum's power
    of two) in ``group.exchanges``, which :func:`alltoallv` reads first: pricing the
    exchanges costs about as much as a small exchange itself. Every rank sees the same
    matrices in the same order, so all remember alike."""
    if algorithm != "auto":
        return choose_exchange(matrix, group.layout, group.params, algorithm)
    chosen = group.exchanges[matrix.info.item(5)] = choose_exchange(matrix, group.layout,
                                                                   group.params)
    return chosen


def compile_kernels() -> None:
    """Run the exchange's numba passes once, on one rank's worth of dummy data with the
    argument types of a real exchange (matrices from :func:`exchange_counts` are strided
    views, their transposes, which the column-wise store describes, Fortran-ordered; the
    arrays the all-to-all store and the benchmarks exchange: bytes, ids, flat and
    row-shaped float32), so that the first exchange of a run does not compile them."""
    for counts in (np.ones((1, 1), np.int64), np.ones((2, 3), np.int64)[:, :-1]):
        Matrix(counts, 0, 8)
        _counts_fit(counts[0], 1, 1)
    Matrix(np.ones((2, 2), np.int64).T, 0, 8)
    info = Matrix(np.ones((1, 1), np.int64), 0, 8).info  # one rank, one row of 8 bytes
    mem = np.zeros(128, np.uint8)
    for send in (np.zeros(8, np.uint8), np.zeros(1, np.int64), np.zeros(2, np.float32),
                 np.zeros((1, 2), np.float32)):
        out = np.zeros_like(send)
        _shm_exchange(send, out, mem, mem.view(np.int64), info, 0, 128, 64, 1, 0)
        _copy_out(out, mem, info, 0, 128, 64)
        _pipeline(send, out, mem, mem.view(np.int64), info, 0, 128, 64, 8, 0, 1,
                  np.zeros(2, np.int64), 0)
        _cma_exchange(send, out, mem.view(np.int64), info, 0, 16, 1, os.getpid(), 0, 0)


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
    matrix when the caller already exchanged it (:func:`exchange_counts`).

    A small exchange is a few microseconds of work, so the Python around it is kept to a
    handful of calls (one numba pass over the matrix that checks this rank's counts and
    holds the received counts and sizes) and no attribute or view it can do without."""
    group = comm
    if not isinstance(send, np.ndarray) or not send.flags.c_contiguous:
        send = np.ascontiguousarray(send)
    p = group.size
    given = matrix is not None
    if not given:  # checked before any message; a given matrix's row in its pass below
        counts = np.asarray(counts, np.int64)
        if counts.ndim != 1 or not _counts_fit(counts, p, len(send)):
            _bad_counts(counts, len(send), group)
        matrix = exchange_counts(counts, group)[0]
    flat = send.ndim == 1
    row = send.itemsize if flat else send.itemsize * math.prod(send.shape[1:])
    m = Matrix(matrix, group.rank, row, len(send) if given else -1)
    if not m.fits:
        _bad_counts(counts, len(send), group)
    info = m.info
    recv = info[_HEAD + 5 * p + 2:]  # the rows from each rank
    rows = info.item(_HEAD + 2 * p + 1) // row if row else int(recv.sum())  # bytes received
    out = np.empty(rows if flat else (rows, *send.shape[1:]), send.dtype)
    if p == 1:
        out[:] = send
        return out, recv
    exchange = group.exchanges.get(info.item(5)) if algorithm == "auto" else None
    if exchange is None:
        exchange = _chosen(m, group, algorithm)
    exchange.run(send, out, m, group)
    return out, recv


def _bad_counts(counts: np.ndarray, rows: int, group: Group) -> None:
    counts = np.asarray(counts)
    raise CommError(f"alltoallv: rank {group.rank} passed {counts.size} counts summing to "
                    f"{counts.sum()} for {rows} rows; need {group.size} non-negative counts "
                    f"summing to the rows")


_BYTE = np.dtype(np.uint8)


def _bytes(a: np.ndarray) -> np.ndarray:
    """A contiguous array's bytes, flat."""
    return a.view(_BYTE) if a.ndim == 1 else a.reshape(-1).view(_BYTE)


@numba.njit(cache=True)
def _counts_fit(counts, ranks, rows):
    """Whether ``counts`` are ``ranks`` non-negative counts summing to ``rows``."""
    if counts.size != ranks:
        return False
    total = 0
    for c in counts:
        if c < 0:
            return False
        total += c
    return total == rows
