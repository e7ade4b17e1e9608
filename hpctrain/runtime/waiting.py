"""What this process is blocked in: the record every blocking wait of the toolkit keeps.

A wait is wrapped in ``with watching(op, comm):`` (collectives, point-to-point waits,
parameter-server pulls and pushes, the server loop, agreements). Entering costs a few
microseconds: it notes the wait in this thread's slot (the main thread has slot 0, the
tiered store's re-tiering thread slot 2, any other thread, such as the comm thread, slot 1:
threads that wait at the same time each publish their own wait) and, once the watchdog is
installed, copies
``(waiting, op, communicator id, call number, since)`` into this rank's entry of the
watchdog's board. Nothing here times out: the watchdog's own thread
(:mod:`hpctrain.runtime.watchdog`) looks at the slots, so a wait inside a blocking MPI call,
a shared-memory spin loop or a torch.distributed call is watched the same way.

Only the outermost wait of a thread is published (an allreduce, not the flag spins or the
``Sendrecv`` inside it); nested ones only count their calls, so that every member of a
communicator numbers its calls on it alike and the watchdog can tell who has arrived.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

__all__ = ["watching", "OPS", "HEAD", "SLOT_FIELDS", "SLOTS", "RETIER_THREAD", "FIELDS",
           "attach", "active", "comm_id"]

OPS = ("allreduce", "reduce_scatter", "allgather", "alltoallv", "bcast", "gather", "barrier",
       "pull", "push", "write", "save", "send", "recv", "agree", "serve", "scatter", "reduce",
       "create", "other")  # create: a communicator or window made (Dup, Split, Allocate)
_OP_INDEX = {op: i for i, op in enumerate(OPS)}
HEAD = 3  # heartbeat (ms), pid, host id
SLOT_FIELDS = 5  # waiting, op, communicator id, call number, since (ms)
SLOTS = 3  # the main thread; any other thread (the comm thread); the re-tiering thread
RETIER_THREAD = "hpctrain-retier"  # the name prefix of the thread that takes slot 2
FIELDS = HEAD + SLOTS * SLOT_FIELDS

_MAIN = threading.main_thread().ident
_active: list[watching | None] = [None] * SLOTS
_calls: dict[tuple[int, int], int] = {}
_ids: dict[str, int] = {}
_entry: memoryview | None = None  # the board entry's words: item stores cost ~40 ns, numpy's 200


class watching:  # noqa: N801 - used as a context manager, like contextlib's
    """``with watching("allreduce", comm):`` around a blocking wait on ``comm``.

    ``peers`` are the ranks of ``comm`` waited for (empty: a collective, all of them);
    ``idle`` marks a wait that may last while the peers compute (the server loop): the
    watchdog ends it only when a peer has stopped, not after a time alone.
    """

    __slots__ = ("op", "comm", "peers", "idle", "slot", "call", "start", "warned", "looked")

    def __init__(self, op: str, comm: MPI.Comm, peers: Sequence[int] = (),
                 idle: bool = False) -> None:
        self.op, self.comm, self.peers, self.idle = op, comm, tuple(peers), idle

    def __enter__(self) -> watching:
        entry = _entry
        if entry is None:
            self.slot = -1
            return self
        if threading.get_ident() == _MAIN:
            slot = self.slot = 0
        else:
            slot = self.slot = 2 if threading.current_thread().name.startswith(
                RETIER_THREAD) else 1
        cid = comm_id(self.comm)
        key = (slot, cid)
        call = _calls[key] = _calls.get(key, 0) + 1
        if _active[slot] is None:
            self.call, self.start, self.warned, self.looked = call, time.monotonic(), False, 0.0
            _active[slot] = self
            base = HEAD + slot * SLOT_FIELDS
            entry[base + 1] = _OP_INDEX.get(self.op, len(OPS) - 1)
            entry[base + 2] = cid
            entry[base + 3] = call
            entry[base + 4] = int(time.time() * 1000)
            entry[base] = 1
        return self

    def __exit__(self, *exc: object) -> None:
        slot = self.slot
        if slot >= 0 and _active[slot] is self:
            _active[slot] = None
            entry = _entry
            if entry is not None:
                base = HEAD + slot * SLOT_FIELDS
                entry[base + 4] = int(time.time() * 1000)
                entry[base] = 0


def attach(entry: np.ndarray | None) -> None:
    """Publish waits into ``entry`` (this rank's board entry; ``None`` stops watching)."""
    global _entry
    _entry = None if entry is None else memoryview(entry)
    if entry is None:
        _active[:] = [None] * SLOTS


def active() -> list[watching | None]:
    """The outermost wait of each slot now (``None``: not waiting)."""
    return list(_active)


def comm_id(comm: MPI.Comm) -> int:
    name = comm.Get_name()
    cid = _ids.get(name)
    if cid is None:
        cid = _ids[name] = zlib.crc32(name.encode()) & 0x7FFFFFFF
    return cid
