"""The hang watchdog: a stalled wait names the ranks it waits for, then ends the job.

Every rank publishes, in a one-sided MPI window over the world (the *board*), what it is
waiting in: the operation, the communicator (by name), that communicator's call number, and
since when, plus its pid and host. A wait that passes ``runtime.watchdog_warn_s`` reads every
entry with ``MPI_Get`` (one-sided: the answer comes even from a rank that is stopped) and logs
which members have not arrived: those not waiting in the same call, with what they are doing
instead, and "stopped" when ``/proc`` shows a peer on this node stopped by a signal. After
``runtime.watchdog_abort_s`` it aborts the job with that message. Horovod's stall inspector
does this for its allreduces; here every wait of the toolkit reports, point-to-point pulls
and pushes included.

The board is the one process-wide object of the runtime (like a signal handler): waits deep
in the collectives or the parameter-server client consult it through :func:`current`.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
import zlib
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

__all__ = ["Board", "Wait", "watch", "uninstall", "current"]

log = logging.getLogger(__name__)

_FIELDS = 7  # waiting, op, comm id, call number, since (ms), pid, host id
_OPS = ("allreduce", "reduce_scatter", "allgather", "alltoallv", "bcast", "gather", "barrier",
        "pull", "push", "write", "save", "send", "recv", "other")


@dataclass
class Wait:
    """What a rank is blocked in: ``op`` on ``comm``, waiting for ``peers`` (world ranks;
    empty for a collective: all members of ``comm``)."""

    op: str
    comm: MPI.Comm
    peers: tuple[int, ...] = ()


class Board:
    """The world's board of waits and the limits that act on it (collective to create)."""

    def __init__(self, world: MPI.Intracomm, warn_s: float, abort_s: float) -> None:
        self.world = world.Dup()
        self.world.Set_name(world.Get_name())
        self.warn_s = warn_s
        self.abort_s = abort_s
        self.window = MPI.Win.Allocate(_FIELDS * 8, 8, comm=self.world)
        self.entry = np.frombuffer(self.window.tomemory(), dtype=np.int64)
        self.entry[:] = 0
        self.entry[5] = os.getpid()
        self.entry[6] = _host_id()
        self.window.Lock_all()
        self.calls: dict[int, int] = {}
        self.world.Barrier()

    def free(self) -> None:
        self.window.Unlock_all()
        self.window.Free()
        self.world.Free()

    # -- publishing ------------------------------------------------------------------------

    def enter(self, wait: Wait) -> int:
        """Publish that this rank now waits in ``wait``; returns the call number."""
        cid = _comm_id(wait.comm)
        call = self.calls.get(cid, 0) + 1
        self.calls[cid] = call
        op = _OPS.index(wait.op) if wait.op in _OPS else len(_OPS) - 1
        self.entry[1:5] = (op, cid, call, int(time.time() * 1000))
        self.entry[0] = 1
        return call

    def leave(self) -> None:
        self.entry[4] = int(time.time() * 1000)
        self.entry[0] = 0

    # -- inspecting ------------------------------------------------------------------------

    def read(self) -> np.ndarray:
        """Every rank's entry, ``[world size, fields]`` (one-sided reads)."""
        size = self.world.Get_size()
        out = np.empty((size, _FIELDS), dtype=np.int64)
        for rank in range(size):
            self.window.Get(out[rank], rank)
        self.window.Flush_all()
        return out

    def stalled(self, wait: Wait, call: int, waited_s: float) -> str:
        """The message naming the members of ``wait`` that have not arrived."""
        entries = self.read()
        me = self.world.Get_rank()
        cid = _comm_id(wait.comm)
        members = wait.peers or _world_ranks(wait.comm, self.world)
        missing = []
        now_ms = int(time.time() * 1000)
        for rank in members:
            if rank == me:
                continue
            waiting, op, other_cid, other_call, since, pid, host = entries[rank]
            if not wait.peers and waiting and other_cid == cid and other_call == call:
                continue  # arrived
            if host == entries[me][6] and _stopped(int(pid)):
                doing = "stopped by a signal"
            elif waiting:
                doing = f"waiting in {_OPS[op]} for {(now_ms - since) / 1000:.0f} s"
            else:
                doing = f"not waiting for {(now_ms - since) / 1000:.0f} s (computing, or hung)"
            missing.append(f"rank {rank} ({doing})")
        name = wait.comm.Get_name() or "a communicator"
        who = "; ".join(missing) if missing else "none (a message may be lost)"
        return (f"rank {me} has waited {waited_s:.0f} s in {wait.op} #{call} on {name}; "
                f"not arrived: {who}")


_current: Board | None = None


def watch(world: MPI.Intracomm, warn_s: float, abort_s: float) -> None:
    """Watch waits over ``world`` with these limits. The first call creates the process's
    board (collective over ``world``), later ones only change its limits; the board is
    freed at exit, before MPI finalises."""
    global _current
    if _current is None:
        _current = Board(world, warn_s, abort_s)
        atexit.register(uninstall)
    _current.warn_s, _current.abort_s = warn_s, abort_s


def uninstall() -> None:
    global _current
    if _current is not None:
        _current.free()
    _current = None


def current() -> Board | None:
    return _current


def _comm_id(comm: MPI.Comm) -> int:
    return zlib.crc32(comm.Get_name().encode()) & 0x7FFFFFFF


def _world_ranks(comm: MPI.Comm, world: MPI.Intracomm) -> list[int]:
    group, world_group = comm.Get_group(), world.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                          world_group)]
    finally:
        group.Free()
        world_group.Free()


def _host_id() -> int:
    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` on this host is stopped (state T in ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
