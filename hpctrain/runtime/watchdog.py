"""The hang watchdog: a stalled wait names the ranks it waits for, then ends the job.

Every rank publishes, in a one-sided MPI window over the world (the *board*), a heartbeat,
its pid and host, and what each of its threads waits in (:mod:`hpctrain.runtime.waiting`:
the operation, the communicator by name, that communicator's call number, since when).
A thread of the watchdog on every rank (the *timer*) beats the heartbeat and looks at this
rank's own waits, so a wait in a blocking MPI call, a shared-memory spin loop or the comm
thread is watched like any other, and the decision never depends on a peer:

1. a wait that passes ``runtime.watchdog_warn_s`` reads the board (``MPI_Rget`` of every
   entry, completed by polling until a deadline: a read that does not complete, as across
   nodes on a transport without asynchronous progress to a stopped rank, becomes "did not
   answer") and logs which members have not arrived: those not in the same call, with what
   they are doing instead, "stopped by a signal" when ``/proc`` shows a peer on this node
   stopped, "no heartbeat" when its heartbeat is old;
2. after ``runtime.watchdog_abort_s`` it aborts the job with that message (``MPI_Abort``;
   if even that does not return, the process exits and the launcher ends the others),
   unless every missing member is alive and computing (heartbeat fresh, in no wait: a
   first step's compilation, a slow file system), or all have arrived and are alive (a
   kernel compiling inside the call): those get :data:`COMPUTING_FACTOR` times as long.
   A stopped rank (even one inside the same call), one whose heartbeat is old, one that
   does not answer and one waiting in another call end the wait at ``watchdog_abort_s``;
3. an *idle* wait (a server waiting for requests, which may last while workers compute)
   is ended only when, past ``watchdog_abort_s``, one of its peers has stopped, lost its
   heartbeat or does not answer.

Horovod's stall inspector does this for its allreduces; here every wait of the toolkit is
watched. The board and its timer are the one process-wide object of the runtime (like a
signal handler).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import zlib

import numpy as np
from mpi4py import MPI

from hpctrain.runtime import waiting
from hpctrain.runtime.abort import abort_job
from hpctrain.runtime.waiting import FIELDS, HEAD, OPS, SLOT_FIELDS, SLOTS, watching

__all__ = ["Board", "watch", "uninstall"]

log = logging.getLogger(__name__)

_READ_S = 1.0  # deadline of one board read
_EXIT_AFTER_S = 10.0  # if MPI_Abort has not ended this process by then, exit
_STALE_S = 2.0  # a heartbeat older than this (and several ticks) means stopped or hung
COMPUTING_FACTOR = 4  # how much longer a wait on alive, computing ranks may last


class Board:
    """The world's board of waits and the limits that act on it (collective to create)."""

    def __init__(self, world: MPI.Intracomm, warn_s: float, abort_s: float) -> None:
        self.world = world.Dup()
        self.world.Set_name(world.Get_name())
        self.warn_s, self.abort_s = warn_s, abort_s
        self.window = MPI.Win.Allocate(FIELDS * 8, 8, comm=self.world)
        self.entry = np.frombuffer(self.window.tomemory(), dtype=np.int64)
        self.entry[:] = 0
        self.entry[:HEAD] = (_now_ms(), os.getpid(), _host_id())
        self.threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._unanswered: list[tuple[MPI.Request, np.ndarray]] = []  # kept alive
        self.window.Lock_all()
        self.world.Barrier()

    def free(self) -> None:
        self.window.Unlock_all()
        self.window.Free()
        self.world.Free()

    @property
    def tick_s(self) -> float:
        limits = [s for s in (self.warn_s, self.abort_s) if s > 0]
        return min(1.0, max(0.05, min(limits) / 10)) if limits else 1.0

    def beat(self) -> None:
        self.entry[0] = _now_ms()

    # -- inspecting ------------------------------------------------------------------------

    def read(self) -> tuple[np.ndarray, list[bool]]:
        """Every rank's entry, ``[world size, fields]``, and whether each answered within
        :data:`_READ_S` (one-sided ``MPI_Rget``, polled; never waits longer)."""
        size, me = self.world.Get_size(), self.world.Get_rank()
        out = np.zeros((size, FIELDS), dtype=np.int64)
        answered = [False] * size
        out[me] = self.entry
        answered[me] = True
        if not self.threaded:  # the timer thread may not call MPI
            return out, answered
        pending = {r: self.window.Rget(out[r], r) for r in range(size) if r != me}
        deadline = time.monotonic() + _READ_S
        while pending and time.monotonic() < deadline:
            for rank in [r for r, req in pending.items() if req.Test()]:
                answered[rank] = True
                del pending[rank]
            if pending:
                time.sleep(0.005)
        self._unanswered += [(req, out) for req in pending.values()]
        return out, answered

    def stalled(self, wait: watching, waited_s: float) -> tuple[str, bool, bool]:
        """The message naming the members of ``wait`` that have not arrived, whether one
        of them has stopped, lost its heartbeat or did not answer, and whether all of them
        are alive and computing."""
        entries, answered = self.read()
        me = self.world.Get_rank()
        cid = waiting.comm_id(wait.comm)
        members = _world_ranks(wait.comm, self.world, wait.peers)
        now_ms = _now_ms()
        stale_ms = 1000 * max(_STALE_S, 4 * self.tick_s)
        missing, dead, computing = [], False, True
        for rank in members:
            if rank == me:
                continue
            if not answered[rank]:
                missing.append(f"rank {rank} (did not answer)")
                dead = True
                continue
            beat, pid, host = entries[rank][:HEAD]
            slots = [entries[rank][HEAD + s * SLOT_FIELDS: HEAD + (s + 1) * SLOT_FIELDS]
                     for s in range(SLOTS)]
            arrived = not wait.peers and any(
                s[0] and s[2] == cid and s[3] == wait.call for s in slots)
            busy = [s for s in slots if s[0]]
            if host == entries[me][2] and _stopped(int(pid)):
                doing, dead = "stopped by a signal", True
            elif now_ms - beat > stale_ms:
                doing, dead = f"no heartbeat for {(now_ms - beat) / 1000:.0f} s: stopped " \
                              f"or hung", True
            elif arrived:
                continue
            elif busy:
                computing = False
                doing = f"waiting in {OPS[busy[0][1]]} for {(now_ms - busy[0][4]) / 1000:.0f} s"
            else:
                since = max(s[4] for s in slots)
                doing = f"not waiting for {(now_ms - since) / 1000:.0f} s (computing, or hung)"
            missing.append(f"rank {rank} ({doing})")
        name = wait.comm.Get_name() or "a communicator"
        who = "; ".join(missing) if missing else "none (a message may be lost)"
        return (f"rank {me} has waited {waited_s:.0f} s in {wait.op} #{wait.call} on {name}; "
                f"not arrived: {who}"), dead, computing and not dead

    # -- the timer -------------------------------------------------------------------------

    def check(self) -> None:
        """One look at this rank's waits: warn, abort (see the module doc)."""
        now = time.monotonic()
        for wait in waiting.active():
            if wait is None:
                continue
            waited = now - wait.start
            if self.abort_s and waited > self.abort_s and now - wait.looked > self.look_s:
                wait.looked = now
                message, dead, computing = self.stalled(wait, waited)
                if dead or not (wait.idle or computing) or (
                        not wait.idle and waited > COMPUTING_FACTOR * self.abort_s):
                    self.abort(message)
            if self.warn_s and not wait.warned and waited > self.warn_s and not wait.idle:
                wait.warned = True
                log.warning("watchdog: %s", self.stalled(wait, waited)[0])

    @property
    def look_s(self) -> float:
        """Least time between two reads of the board for one wait past the abort limit."""
        return max(self.tick_s, self.abort_s / 10)

    def abort(self, message: str) -> None:
        exit_anyway = threading.Timer(_EXIT_AFTER_S, os._exit, (1,))
        exit_anyway.daemon = True
        exit_anyway.start()
        abort_job(f"hpctrain: watchdog: {message}; aborting the job", 1)


class _Timer(threading.Thread):
    def __init__(self, board: Board) -> None:
        super().__init__(name="hpctrain-watchdog", daemon=True)
        self.board = board
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.board.tick_s):
            self.board.beat()
            try:
                self.board.check()
            except Exception:  # noqa: BLE001 - the watchdog must outlive a failed look
                log.exception("watchdog: a check failed")


_current: Board | None = None
_timer: _Timer | None = None


def watch(world: MPI.Intracomm, warn_s: float, abort_s: float) -> None:
    """Watch waits over ``world`` with these limits. The first call creates the process's
    board (collective over ``world``) and starts the timer thread, later ones only change
    the limits; both are released at exit, before MPI finalises."""
    global _current, _timer
    if _current is None:
        _current = Board(world, warn_s, abort_s)
        if not _current.threaded:
            log.warning("watchdog: MPI gives less than MPI_THREAD_MULTIPLE: a stalled wait "
                        "is ended but its missing ranks cannot be named")
        waiting.attach(_current.entry)
        _timer = _Timer(_current)
        _timer.start()
        atexit.register(uninstall)
    _current.warn_s, _current.abort_s = warn_s, abort_s


def uninstall() -> None:
    global _current, _timer
    if _timer is not None:
        _timer.stop.set()
        _timer.join()
    waiting.attach(None)
    if _current is not None:
        _current.free()
    _current = _timer = None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _world_ranks(comm: MPI.Comm, world: MPI.Intracomm, peers: tuple[int, ...]) -> list[int]:
    """World ranks of ``peers`` (ranks of ``comm``; all its ranks when empty)."""
    try:
        group, world_group = comm.Get_group(), world.Get_group()
    except MPI.Exception:  # freed meanwhile
        return list(peers)
    try:
        ranks = list(peers) or list(range(group.Get_size()))
        return [int(r) for r in MPI.Group.Translate_ranks(group, ranks, world_group)
                if r != MPI.UNDEFINED]
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
