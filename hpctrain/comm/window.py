"""The node's shared memory: MPI-3 shared windows (``Win.Allocate_shared``), their flag
synchronisation and the allreduce paths over them.

Every rank of the node communicator maps the same memory, so a collective is loads and
stores plus flag synchronisation; no message passes through MPI.

Window layout: rank ``k`` owns the chunk at ``k * chunk`` bytes: ``slots`` flag lines of
64 bytes, then ``rows`` rows of ``row_bytes``. Synchronisation protocol, per slot:

1. a rank finishes its stores, issues ``MPI_Win_sync`` (a memory barrier in the unified
   model) and stores the slot's next value into its own flag line;
2. it waits until every rank's flag in that slot has reached the value (polling a while,
   then yielding the core), then ``MPI_Win_sync`` again before it loads what the others
   stored. When ranks outnumber cores it does not poll, and yields only for the first
   2 ms, then sleeps (pauses doubling up to 1 ms), so that the late rank gets to run:
   Linux keeps a yielding process runnable, so ranks that only yielded while they waited
   for a peer still computing took their share of the cores from it.

Flags only grow and every rank passes the same values in the same order, so no reset is
needed. The scratch arena keeps two halves and alternates them between calls: a rank
writes a half again only after every rank has announced the call in between, that is,
after every rank finished reading that half (:meth:`Window.next_half` says when a call
may keep the same half). Resident buffers (:meth:`Window.buffer`) are
rows the caller fills in place (the trainer's fused gradients), so an allreduce of one
needs no copy in or out.

:class:`~hpctrain.comm.group.Group` owns the windows it makes; the collective family that
uses them is :mod:`hpctrain.comm.shm`. ``open_windows()`` counts the windows this process
holds (tests check that repeated trainings free theirs).

The protocol also exists inside numba code (:func:`publish_flag`, :func:`flags_reached`,
with an LLVM fence in place of ``MPI_Win_sync``), so a kernel can copy, synchronise and copy
again in one call: the all-to-all's shared-memory exchange does.

Allreduce has two paths: latency-bound buffers are copied in and every rank reduces the
whole buffer (one synchronisation); larger ones are split in ``p`` slices, rank ``r``
reduces slice ``r`` over all rows and publishes it, and every rank copies the others'
slices out (two synchronisations, ``2 (p-1)/p`` copies, the reduction spread over all
cores). For numeric dtypes the slices path is one numba call
(:func:`allreduce_pipelined`, flags 1 and 2 per piece), piece by piece once the buffers
outgrow the last-level cache (:func:`piece_bytes`). Every copy into the window is a
streaming store (:func:`~hpctrain.comm.bytecopy.stream_bytes`); resident buffers' results
keep plain stores (streamed, they measured 1.3-1.7x slower). Where the node's ranks may read
each other's memory, :func:`allreduce_single_copy` runs the slices without the window's
rows: the window carries only the flags and where each rank's buffer lies.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
from mpi4py import MPI
from numba.core import types
from numba.extending import intrinsic

from hpctrain.comm import cma, kernels
from hpctrain.comm.bytecopy import copy_bytes, stream_bytes
from hpctrain.comm.kernels import _accumulate
from hpctrain.comm.types import chunk_bounds
from hpctrain.errors import CommError
from hpctrain.runtime.waiting import watching
from hpctrain.runtime.waits import Backoff

__all__ = ["Window", "Resident", "ResidentAllreduce", "allreduce_small", "allreduce_slices",
           "allreduce_resident", "allreduce_pipelined", "allreduce_single_copy", "piece_bytes",
           "complete", "compile_kernels", "open_windows", "publish_flag", "flags_reached"]

_LINE = 64
# A numba kernel's flag poll costs a few nanoseconds, a poll of :meth:`Window.wait` a few
# hundred: a kernel polls this many times as often before it hands the wait to Python (whose
# own return costs microseconds).
_KERNEL_POLLS = 64
# Where ranks outnumber cores, a flag wait yields this long before it sleeps: a collective
# whose ranks are all inside it completes while they yield (`bench allreduce`, 4 ranks on 2
# cores, 64 KiB-16 MiB: no slower than yielding throughout), a wait for a peer that is
# still computing sleeps and leaves it the core (module doc).
_SHARED_CORES_YIELD_S = 2e-3
Between = Callable[[np.ndarray], None]


_open = 0  # windows this process has allocated and not freed


def open_windows() -> int:
    """Shared windows this process holds now (allocated, not yet freed)."""
    return _open


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@intrinsic
def _fence(typingctx):  # noqa: ARG001 - numba's signature
    """A sequentially consistent memory fence: ``MPI_Win_sync``'s barrier in numba code (it
    also keeps the compiler from moving loads and stores across it)."""
    def codegen(context, builder, signature, args):  # noqa: ARG001
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@numba.njit(cache=True, nogil=True)
def _fill(mem, at, arr, start, n):  # :meth:`Window.fill` in one numba call
    stream_bytes(mem, at, arr, start, n)


@numba.njit(cache=True, nogil=True, inline="always")
def publish_flag(words, stride, rank, value, slot):
    """:meth:`Window.publish`: fence, then store ``value`` in ``rank``'s flag ``slot``
    (``words`` is the window as int64, ``stride`` its chunk in words)."""
    _fence()
    words[rank * stride + slot * (_LINE // 8)] = value


@numba.njit(cache=True, nogil=True, inline="always")
def flags_reached(words, stride, ranks, value, polls, slot):
    """Whether every rank's flag ``slot`` reached ``value`` within ``polls + 1`` polls
    (then fenced, so the others' stores are visible); ``False`` leaves the waiting, which
    may yield the core, to :meth:`Window.wait`."""
    for _ in range(polls + 1):
        _fence()
        behind = False
        for k in range(ranks):
            if words[k * stride + slot * (_LINE // 8)] < value:
                behind = True
                break
        if not behind:
            _fence()
            return True
    return False


def compile_kernels() -> None:
    """Run :meth:`Window.fill`'s numba call once for the dtypes a step's small allreduces
    copy in (float32 and float64), so that the first allreduce of a run does not compile it."""
    for dtype in (np.float32, np.float64):
        _fill(np.zeros(64, np.uint8), 0, np.zeros(8, dtype), 0, 8)


class Window:
    """A shared window over the node communicator ``comm`` (collective to create/free)."""

    def __init__(self, comm: MPI.Intracomm, row_bytes: int, rows: int = 1,
                 slots: int = 1, spin: int = 0) -> None:
        self.comm = comm
        self.spin = spin  # polls before yielding the core (0 when ranks outnumber cores)
        self.polls = spin * _KERNEL_POLLS  # a numba kernel's polls before Python waits
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.row_bytes = _round_up(max(row_bytes, _LINE), _LINE)
        self.slots, self.rows = slots, rows
        self.head = slots * _LINE
        self.chunk = self.head + rows * self.row_bytes
        total = self.size * self.chunk
        # One allocation on local rank 0 keeps the rows contiguous with a fixed stride;
        # pages land on the NUMA node of the rank that first touches them (its own row).
        global _open
        with watching("create", comm):
            self.win = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=comm)
        _open += 1
        buf, _ = self.win.Shared_query(0)
        self.mem = np.frombuffer(buf, dtype=np.uint8, count=total)
        self.words = words = self.mem.view(np.int64)
        self._flags = [words[s * 8:: self.chunk // 8][: self.size] for s in range(slots)]
        self._values = [0] * slots
        self._views: dict[tuple[int, int, int], np.ndarray] = {}
        self._last: tuple[int, ...] | None = None
        self.calls = 0
        self.win.Lock_all(MPI.MODE_NOCHECK)
        for flags in self._flags:
            flags[self.rank] = 0
        comm.Barrier()

    # -- memory ----------------------------------------------------------------------------

    def row(self, k: int, half: int, dtype: np.dtype, count: int) -> np.ndarray:
        key = (k, half, dtype.num)
        full = self._views.get(key)
        if full is None:
            start = k * self.chunk + self.head + half * self.row_bytes
            full = self._views[key] = self.mem[start: start + self.row_bytes].view(dtype)
        return full[:count]

    def fill(self, half: int, arr: np.ndarray, lo: int, hi: int) -> None:
        """Copy ``arr[lo:hi]`` (1-D, contiguous) to the same elements of this rank's row
        ``half``, by streaming stores: the other ranks read it next."""
        size = arr.itemsize
        _fill(self.mem, self.rank * self.chunk + self.head + half * self.row_bytes + lo * size,
              arr, lo * size, (hi - lo) * size)

    def flat(self, half: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
        """All rows ``half`` as one array and the row stride in elements (for kernels)."""
        key = (-1, half, dtype.num)
        full = self._views.get(key)
        if full is None:
            full = self._views[key] = self.mem[self.head + half * self.row_bytes:].view(dtype)
        return full, self.chunk // dtype.itemsize

    def contains(self, arr: np.ndarray) -> int | None:
        """Element offset of ``arr`` in this rank's row 0, or ``None`` if it lies elsewhere."""
        address = arr.__array_interface__["data"][0]
        start = self.mem.__array_interface__["data"][0] + self.rank * self.chunk + self.head
        offset = address - start
        if offset >= 0 and offset + arr.nbytes <= self.row_bytes and \
                offset % arr.itemsize == 0:
            return offset // arr.itemsize
        return None

    # -- synchronisation -------------------------------------------------------------------

    def next_value(self, slot: int = 0) -> int:
        self._values[slot] += 1
        return self._values[slot]

    def publish(self, value: int, slot: int = 0) -> None:
        self.win.Sync()
        self._flags[slot][self.rank] = value

    def reached(self, value: int, slot: int = 0) -> bool:
        if min(self._flags[slot].tolist()) >= value:  # tolist: far cheaper than .min()
            self.win.Sync()
            return True
        return False

    def wait(self, value: int, slot: int = 0) -> None:
        flags = self._flags[slot]
        if min(flags.tolist()) < value:  # tolist: far cheaper than .min()
            backoff = self.backoff()
            while min(flags.tolist()) < value:
                backoff.idle()
        self.win.Sync()

    def backoff(self) -> Backoff:
        """How a wait on the flags passes its time (module doc, step 2)."""
        if self.spin:
            return Backoff(math.inf, spins=self.spin)
        return Backoff(_SHARED_CORES_YIELD_S, spins=0)

    def sync(self, slot: int = 0) -> None:
        """Every rank of the node has finished its stores before this point."""
        value = self.next_value(slot)
        self.publish(value, slot)
        self.wait(value, slot)

    def reserve(self, count: int, *slots: int) -> int:
        """The first of ``count`` consecutive values of flag ``slots`` (a call that
        publishes several in a row)."""
        first = self._values[slots[0]] + 1
        for slot in slots:
            self._values[slot] += count
        return first

    def next_half(self, repeat: tuple[int, ...] | None = None) -> int:
        """The half this call uses: the other one than last time, unless the call is a
        two-synchronisation slice allreduce with the same slicing as the previous call
        (``repeat``). That one may reuse the half: while it copies in, others can still
        be copying out only its own slice, which it does not write before the first
        synchronisation. Keeping one half halves the memory a loop of equal calls runs
        through."""
        if repeat is None or repeat != self._last:
            self.calls += 1
        self._last = repeat
        return self.calls % self.rows

    def free(self) -> None:
        global _open
        self.win.Unlock_all()
        self.win.Free()
        _open -= 1


class Resident:
    """A buffer of ``count`` elements living in this rank's row of a shared window.

    ``array`` is the caller's buffer; an allreduce of it (or of a slice of it) through
    :class:`Shm` or the hierarchical algorithm reduces in place with no copies. Slot 0
    serves blocking calls; slots ``1..slots`` serve nonblocking ones (one per bucket).
    """

    def __init__(self, comm: MPI.Intracomm, count: int, dtype: np.dtype, slots: int = 0,
                 spin: int = 0) -> None:
        self.window = Window(comm, count * dtype.itemsize, rows=1, slots=1 + slots, spin=spin)
        self.array = self.window.row(self.window.rank, 0, dtype, count)
        self.array[:] = 0

    def free(self) -> None:
        self.window.free()


def allreduce_small(arr: np.ndarray, arena: Window, op: int, kind: int) -> None:
    """Copy in, one synchronisation, every rank reduces the whole buffer."""
    half = arena.next_half()
    arena.fill(half, arr, 0, arr.size)
    arena.sync()
    flat, stride = arena.flat(half, arr.dtype)
    kernels.reduce_slice(flat, stride, arena.size, arena.rank, arr, 0, arr.size, 0, op, kind)


def allreduce_slices(arr: np.ndarray, arena: Window, op: int, kind: int,
                     between: Between | None = None) -> None:
    """Slice path through the scratch arena; ``between`` (the hierarchical algorithm's
    inter-node step) runs on this rank's reduced slice before it is published."""
    p, r = arena.size, arena.rank
    b = chunk_bounds(arr.size, p)
    lo, hi = b[r], b[r + 1]
    half = arena.next_half(repeat=(arr.size, arr.itemsize))
    arena.fill(half, arr, 0, lo)
    arena.fill(half, arr, hi, arr.size)
    arena.sync()
    flat, stride = arena.flat(half, arr.dtype)
    if between is None:
        kernels.reduce_slice(flat, stride, p, r, arr, lo, hi, 1, op, kind)
    else:
        kernels.reduce_slice(flat, stride, p, r, arr, lo, hi, 0, op, kind)
        between(arr[lo:hi])
        arena.fill(half, arr, lo, hi)
    arena.sync()
    for k in range(p):
        if k != r:
            arr[b[k]:b[k + 1]] = flat[k * stride + b[k]: k * stride + b[k + 1]]


@numba.njit(cache=True, nogil=True, inline="always")
def _bound(m, p, k):
    """Start of balanced part ``k`` of ``range(m)`` over ``p`` parts (:func:`chunk_bounds`)."""
    return k * (m // p) + min(k, m % p)


@numba.njit(cache=True, nogil=True)
def _pipeline(arr, flat, mem, at, stride, words, wstride, rank, p, piece, slots, value,
              state, polls, op):
    """The slices allreduce piece by piece through ``slots`` cache-sized slots of each
    rank's row, from where ``state`` (piece, stage) says; ``False`` when a flag was not
    reached within ``polls`` polls (``state`` then says where to go on).

    Per piece: copy the others' slices in, publish flag 1, wait for every rank's; reduce
    this rank's slice and write it to the row, publish flag 2, wait; copy the others'
    results out. A slot is written again ``slots >= 2`` pieces later, after every rank
    published flag 2 of a later piece, so after it copied this piece out."""
    n, size = arr.size, arr.itemsize
    c, stage = state[0], state[1]
    while c * piece < n:
        lo = c * piece
        m = min(n, lo + piece) - lo
        mine = rank * stride + (c % slots) * piece
        a, b = lo + _bound(m, p, rank), lo + _bound(m, p, rank + 1)
        if stage == 0:
            stream_bytes(mem, at + mine * size, arr, lo * size, (a - lo) * size)
            stream_bytes(mem, at + (mine + b - lo) * size, arr, b * size, (lo + m - b) * size)
            publish_flag(words, wstride, rank, value + c, 1)
            stage = 1
        if stage == 1:
            if not flags_reached(words, wstride, p, value + c, polls, 1):
                state[0], state[1] = c, stage
                return False
            for k in range(p):
                if k != rank:
                    _accumulate(arr[a:b], flat[k * stride + mine - rank * stride + a - lo:
                                               k * stride + mine - rank * stride + b - lo], op)
            stream_bytes(mem, at + (mine + a - lo) * size, arr, a * size, (b - a) * size)
            publish_flag(words, wstride, rank, value + c, 2)
            stage = 2
        if not flags_reached(words, wstride, p, value + c, polls, 2):
            state[0], state[1] = c, stage
            return False
        for k in range(p):
            if k != rank:
                ka, kb = lo + _bound(m, p, k), lo + _bound(m, p, k + 1)
                copy_bytes(arr, ka * size, mem,
                           at + (k * stride + mine - rank * stride + ka - lo) * size,
                           (kb - ka) * size)
        c, stage = c + 1, 0
    state[0], state[1] = c, 0
    return True


_PIECE_BYTES = 256 << 10
_SLOTS = 4


def _last_level_cache() -> int:
    """Bytes of the largest CPU cache (Linux sysfs; 32 MiB where it cannot be read)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        digits = text.rstrip("KM")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 << 20)


_CACHE_BYTES = _last_level_cache()


def piece_bytes(nbytes: int, ranks: int) -> int:
    """How :func:`allreduce_pipelined` cuts ``nbytes`` over ``ranks`` ranks of a node: in
    ``_PIECE_BYTES`` pieces once the ranks' buffers and both halves of the window
    (``3 x ranks`` buffers) outgrow the last-level cache (with streaming stores into the
    window, pieces still measured 1-15% faster than whole buffers at 8-64 MiB, 2 and 4
    ranks); below that whole, the slices path's two synchronisations in one call, as a
    piece's pair of flags costs more than it saves."""
    if 3 * ranks * nbytes <= _CACHE_BYTES:
        return max(nbytes, 1)
    return _PIECE_BYTES


def allreduce_pipelined(arr: np.ndarray, arena: Window, op: int, piece: int) -> None:
    """The slices path in one numba call, ``piece`` bytes at a time (:func:`piece_bytes`)
    with a pair of flags per piece. Arithmetic dtypes; the arena's rows hold ``arr``."""
    half = arena.next_half()
    flat, stride = arena.flat(half, arr.dtype)
    piece = max(1, piece // arr.itemsize)
    pieces = -(-arr.size // piece)
    value = arena.reserve(pieces, 1, 2)
    state = np.zeros(2, np.int64)
    at = arena.head + half * arena.row_bytes
    while not _pipeline(arr, flat, arena.mem, at, stride, arena.words,
                        arena.chunk // 8, arena.rank, arena.size, piece, _SLOTS, value, state,
                        arena.polls, op):
        arena.wait(value + state[0], slot=int(state[1]))


@numba.njit(cache=True, nogil=True)
def _single_copy(arr, tmp, words, stride, rank, p, value, pid, stage, polls, op):
    """:func:`allreduce_single_copy` from ``stage`` on: 0, publish ``arr``'s address and
    this process's pid beside flag ``value`` (words 1 and 2 of the slot-0 line); 1, once
    every rank did, fold the others' parts of slice ``rank`` into it, read through ``tmp``
    a piece at a time, and publish ``value + 1``; 2, once every slice is reduced, read the
    others' slices straight into ``arr`` and publish ``value + 2``; 3, wait until every
    rank has read (a buffer must outlive its readers). Returns 0 when done, the stage to
    wait in and go on from when a flag was not reached within ``polls`` polls, and
    ``-(k + 1)`` when reading rank ``k`` failed (this rank's last flag then published, so
    no rank waits for this one)."""
    n, size = arr.size, arr.itemsize
    a, b = _bound(n, p, rank), _bound(n, p, rank + 1)
    iov = np.empty(4, np.int64)
    if stage == 0:
        cma.publish(words, stride, rank, arr, pid)
        publish_flag(words, stride, rank, value, 0)
        stage = 1
    if stage == 1:
        if not flags_reached(words, stride, p, value, polls, 0):
            return 1
        for k in range(p):
            if k != rank:
                for lo in range(a, b, tmp.size):
                    m = min(tmp.size, b - lo)
                    if not cma.read_published(words, stride, k, lo * size, tmp, 0, m * size,
                                              iov):
                        publish_flag(words, stride, rank, value + 2, 0)
                        return -(k + 1)
                    _accumulate(arr[lo:lo + m], tmp[:m], op)
        publish_flag(words, stride, rank, value + 1, 0)
        stage = 2
    if stage == 2:
        if not flags_reached(words, stride, p, value + 1, polls, 0):
            return 2
        for k in range(p):
            ka, kb = _bound(n, p, k), _bound(n, p, k + 1)
            if k != rank and kb > ka and not cma.read_published(
                    words, stride, k, ka * size, arr, ka * size, (kb - ka) * size, iov):
                publish_flag(words, stride, rank, value + 2, 0)
                return -(k + 1)
        publish_flag(words, stride, rank, value + 2, 0)
    if not flags_reached(words, stride, p, value + 2, polls, 0):
        return 3
    return 0


def allreduce_single_copy(arr: np.ndarray, arena: Window, op: int) -> None:
    """The slices path without the window's rows (where the node's ranks may read each
    other's memory, :mod:`hpctrain.comm.cma`): rank ``r`` reads the others' parts of slice
    ``r`` straight out of their buffers, a cache-sized piece at a time, and folds them
    in; then every rank reads the reduced slices straight into its buffer. One copy per
    byte that crosses ranks where the slices path makes two, for a third synchronisation.
    Arithmetic dtypes."""
    tmp = np.empty(max(1, _PIECE_BYTES // arr.itemsize), arr.dtype)
    value = arena.reserve(3, 0)
    stage = 0
    while True:
        stage = _single_copy(arr, tmp, arena.words, arena.chunk // 8, arena.rank,
                             arena.size, value, os.getpid(), stage, arena.polls, op)
        if stage <= 0:
            break
        arena.wait(value + stage - 1)  # the others are late: wait yielding the core
    if stage < 0:
        raise CommError(f"allreduce: rank {arena.rank} of the node could not read rank "
                        f"{-stage - 1}'s buffer (process_vm_readv failed: has it ended?)")


class ResidentAllreduce:
    """A nonblocking allreduce of ``arr``, a slice of a :class:`Resident` row, on ``slot``.

    :meth:`start` announces the slice; :meth:`test` advances without blocking (reduce this
    rank's part once every rank has announced, then announce the result) and tells whether
    the whole slice is final; :meth:`wait` blocks until it is. The fused-gradient buckets
    call ``test`` from later gradient hooks, so the reduction overlaps backward, and start
    the same object again every step.
    """

    def __init__(self, arr: np.ndarray, resident: Resident, slot: int, op: int, kind: int,
                 between: Between | None = None) -> None:
        win = resident.window
        offset = win.contains(arr)
        if offset is None:
            raise ValueError("buffer is not in this rank's resident row")
        self.win, self.slot, self.op, self.kind, self.between = win, slot, op, kind, between
        b = chunk_bounds(arr.size, win.size)
        self.lo, self.hi = offset + b[win.rank], offset + b[win.rank + 1]
        self.row = win.row(win.rank, 0, arr.dtype, win.row_bytes // arr.itemsize)
        self.dtype = arr.dtype
        self.stage = 0

    def start(self) -> ResidentAllreduce:
        self.announced = self.win.next_value(self.slot)
        self.win.publish(self.announced, self.slot)
        self.stage = 1
        return self

    def _reduce(self) -> None:
        win, lo, hi = self.win, self.lo, self.hi
        flat, stride = win.flat(0, self.dtype)
        if self.between is None:
            kernels.reduce_slice(flat, stride, win.size, win.rank, self.row, lo, hi, 2,
                                 self.op, self.kind)
        else:
            kernels.reduce_slice(flat, stride, win.size, win.rank, self.row, lo, hi, 0,
                                 self.op, self.kind)
            self.between(self.row[lo:hi])
            for k in range(win.size):
                if k != win.rank:
                    flat[k * stride + lo: k * stride + hi] = self.row[lo:hi]
        self.done_value = win.next_value(self.slot)
        win.publish(self.done_value, self.slot)
        self.stage = 2

    def test(self) -> bool:
        if self.stage == 1 and self.win.reached(self.announced, self.slot):
            self._reduce()
        if self.stage == 2 and self.win.reached(self.done_value, self.slot):
            self.stage = 3
        return self.stage == 3

    def wait(self) -> None:
        if self.stage == 1:
            self.win.wait(self.announced, self.slot)
            self._reduce()
        if self.stage == 2:
            self.win.wait(self.done_value, self.slot)
            self.stage = 3


def complete(ops: list[ResidentAllreduce]) -> None:
    """Advance all ``ops`` together until every one is final, so their synchronisations
    overlap instead of adding up (only for ops without an inter-node step, whose messages
    must keep their order)."""
    if not ops:
        return
    backoff = ops[0].win.backoff()
    while ops:
        left = [op for op in ops if not op.test()]
        if len(left) == len(ops):
            backoff.idle()
        ops = left


def allreduce_resident(arr: np.ndarray, resident: Resident, op: int, kind: int,
                       between: Between | None = None) -> None:
    """Blocking zero-copy allreduce of a slice of a resident row (slot 0)."""
    ResidentAllreduce(arr, resident, 0, op, kind, between).start().wait()


