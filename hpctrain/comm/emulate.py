"""An emulated network between emulated nodes on one machine (``comm.emulate``).

Why: on one machine every link is shared memory, so the parameter server, tiering, prefetch
and SSP show their costs but not what they buy on a cluster. With
``comm.emulate = "LATENCY_US,GBPS"`` every message between ranks of different emulated
nodes (blocks of ``comm.node_size`` ranks; each parameter server a node of its own) arrives
``latency + bytes / bandwidth`` after it leaves.

How, and why so:

- **Delay at the receiver, against the sender's clock.** A message between nodes travels
  over MPI at once, with a companion (two float64: arrival time and bytes) sent first on a
  twin communicator to the same rank with the same tag; MPI's non-overtaking rule pairs the
  k-th companion with the k-th message of that (source, tag). The sender computes the arrival
  time; the receiver, once it holds the message, waits until then. ``time.perf_counter`` is
  CLOCK_MONOTONIC, one clock for every process of a Linux machine, so the sender's time is
  the receiver's (a job spanning real nodes is refused). Sends therefore never block (a NIC
  moves bytes while the CPU computes: pushes and prefetched pulls overlap compute as on a
  cluster), a non-blocking receive completed after its arrival time waits for nothing more,
  and a server holding several requests serves them in order of arrival.
- **A rank's link is serialised.** A message starts when the sender's link is free, so what
  one rank sends to all destinations shares its bandwidth (a parameter server's replies
  queue behind each other). Not modelled: ranks of one emulated node each have a link of
  their own, and a receiver takes messages from several senders at full rate each (no
  incast).
- **MPI's own collectives** (``native``, the all-to-all's count exchange) cannot be seen
  message by message: after the call each rank waits until the time of a bandwidth-optimal
  schedule over the group's emulated nodes (``latency * ceil(log2 N) + bytes / bandwidth``
  with the bytes that schedule moves per node) has passed since the last rank entered it
  (one more ``MPI_Allreduce`` of the entry times), so that, as for messages, the emulated
  time absorbs the real one.
- **Accounted apart.** Seconds waited for emulated arrivals, and the messages and bytes
  delayed, are counted per process (:func:`totals`) and, with ``runtime.trace`` on, shown
  as ``emulated transfer`` spans. Waits shorter than the OS timer slack (~0.05 ms) overshoot
  by about that much.

:class:`Channel` is the one place where this happens: it stands in for the communicator in
the toolkit's point-to-point code (``Send``, ``Recv``, ``Sendrecv``, ``Isend``, ``Irecv``,
:meth:`Channel.wait_all`, :meth:`Channel.receive`) and passes straight through when
emulation is off or both ranks share a node.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from mpi4py import MPI

from hpctrain.config import CommConfig, emulated_network
from hpctrain.runtime import trace
from hpctrain.runtime.waiting import watching
from hpctrain.runtime.waits import Backoff, Wait, waiting

__all__ = ["Network", "NetStats", "Channel", "network", "totals", "ps_nodes"]

_STAMP = 2  # float64 values of a companion: arrival time, bytes


@dataclass(frozen=True)
class Network:
    """A link of ``latency_s`` seconds and ``bandwidth`` bytes per second."""

    latency_s: float
    bandwidth: float

    def transfer_s(self, nbytes: float) -> float:
        return nbytes / self.bandwidth


def network(config: CommConfig) -> Network | None:
    """The network ``config.emulate`` describes (``None``: off)."""
    parsed = emulated_network(config.emulate)
    return None if parsed is None else Network(*parsed)


def ps_nodes(workers: int, servers: int, node_size: int) -> list[int]:
    """Emulated node of each world rank of a parameter-server job: workers in blocks of
    ``node_size`` (0: all on one node, as on one machine), each server a node of its own."""
    per = node_size or max(workers, 1)
    worker_nodes = [w // per for w in range(workers)]
    first = (worker_nodes[-1] + 1) if worker_nodes else 0
    return worker_nodes + [first + s for s in range(servers)]


@dataclass
class NetStats:
    """Emulated traffic of one rank: seconds waited for arrivals beyond the real transfer,
    and the messages and bytes received across emulated nodes (an MPI library collective
    counts as one message of the bytes its schedule moves per node)."""

    emulated_s: float = 0.0
    messages: int = 0
    bytes: int = 0

    def __sub__(self, other: NetStats) -> NetStats:
        return NetStats(*(getattr(self, f.name) - getattr(other, f.name)
                          for f in fields(self)))


class _Link:
    """This process's outgoing link (shared by every channel and thread of the rank)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free_at = 0.0
        self.stats = NetStats()

    def depart(self, net: Network, nbytes: int) -> float:
        """Book ``nbytes`` on the link; the time they arrive."""
        with self.lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + net.transfer_s(nbytes)
            return self.free_at + net.latency_s

    def wait_until(self, arrival: float, messages: int, nbytes: int) -> float:
        """Sleep until ``arrival`` (messages and bytes received); the seconds slept."""
        begin = time.perf_counter()
        waited = 0.0
        if arrival > begin:
            with trace.span("emulated transfer"):
                time.sleep(arrival - begin)
            waited = time.perf_counter() - begin
        with self.lock:
            self.stats.emulated_s += waited
            self.stats.messages += messages
            self.stats.bytes += nbytes
        return waited

    def count(self, nbytes: int) -> None:
        """A message received across nodes that nobody waits for (it is held)."""
        with self.lock:
            self.stats.messages += 1
            self.stats.bytes += nbytes


_LINK = _Link()


def totals() -> NetStats:
    """A copy of this process's emulated-network counters (subtract two for a span)."""
    with _LINK.lock:
        return NetStats(_LINK.stats.emulated_s, _LINK.stats.messages, _LINK.stats.bytes)


def _nbytes(buf: Any) -> int:
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    return memoryview(buf).nbytes


class Channel:
    """Point-to-point messages on ``comm`` with emulated delays between nodes.

    ``nodes[r]`` is rank ``r``'s emulated node. Stands in for the communicator in the
    toolkit's algorithms (the methods they call, with mpi4py's signatures); everything else
    is the communicator's own. Receives of messages that may come from another node must go
    through the channel (they consume the companions).
    """

    def __init__(self, comm: MPI.Intracomm, nodes: Sequence[int], net: Network | None,
                 yield_s: float = 0.0) -> None:
        """``yield_s``: how long a wait yields its core before it sleeps
        (:class:`~hpctrain.runtime.waits.Backoff`; 0 where ranks share cores)."""
        self.comm = comm
        self.yield_s = yield_s
        self.nodes = list(nodes)
        self.node = self.nodes[comm.Get_rank()]
        self.net = net if net is not None and len(set(self.nodes)) > 1 else None
        self._stamps = None
        if self.net is not None:
            with watching("create", comm):
                self._stamps = comm.Dup()
        self._sent: list[tuple[MPI.Request, np.ndarray]] = []
        self._expected: dict[int, tuple[MPI.Request, MPI.Request, np.ndarray]] = {}
        self._held: list[tuple[float, int, int, np.ndarray]] = []
        self._order = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def over(cls, comm: MPI.Intracomm, node: int, net: Network | None,
             yield_s: float = 0.0) -> Channel:
        """A channel whose ranks name their own ``node`` (``MPI_Allgather`` over ``comm``
        when emulating, nothing otherwise)."""
        if net is None or comm.Get_size() == 1:
            return cls(comm, [node] * comm.Get_size(), None, yield_s)
        return cls(comm, comm.allgather(node), net, yield_s)

    def beside(self, comm: MPI.Intracomm) -> Channel:
        """A channel over ``comm``, a communicator of the same ranks in the same order, with
        this one's nodes and network (collective over ``comm`` when emulating): for MPI
        calls a component makes on a communicator of its own (:meth:`library`)."""
        return Channel(comm, self.nodes, self.net, self.yield_s)

    @property
    def emulating(self) -> bool:
        return self.net is not None

    @property
    def node_count(self) -> int:
        return len(set(self.nodes))

    def remote(self, rank: int) -> bool:
        return self.net is not None and self.nodes[rank] != self.node

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.comm.Get_rank()

    def Get_size(self) -> int:  # noqa: N802
        return self.comm.Get_size()

    # -- sending -------------------------------------------------------------------------

    def _announce(self, buf: Any, dest: int, tag: int) -> None:
        if not self.remote(dest):
            return
        nbytes = _nbytes(buf)
        stamp = np.array([_LINK.depart(self.net, nbytes), nbytes], np.float64)
        with self._lock:
            self._sent = [(r, b) for r, b in self._sent if not r.Test()]
            self._sent.append((self._stamps.Isend(stamp, dest=dest, tag=tag), stamp))

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        self._announce(buf, dest, tag)
        self.comm.Send(buf, dest, tag)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request:  # noqa: N802
        self._announce(buf, dest, tag)
        return self.comm.Isend(buf, dest=dest, tag=tag)

    # -- receiving -----------------------------------------------------------------------

    def _stamp_of(self, source: int, tag: int) -> np.ndarray:
        stamp = np.empty(_STAMP, np.float64)
        self._stamps.Recv(stamp, source=source, tag=tag)
        return stamp

    def _arrive(self, stamp: np.ndarray) -> float:
        return _LINK.wait_until(float(stamp[0]), 1, int(stamp[1]))

    def Recv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,  # noqa: N802
             status: MPI.Status | None = None) -> None:
        if self.net is None:
            self.comm.Recv(buf, source, tag, status)
            return
        status = status if status is not None else MPI.Status()
        self.comm.Recv(buf, source, tag, status)
        if self.remote(status.Get_source()):
            self._arrive(self._stamp_of(status.Get_source(), status.Get_tag()))

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int, recvbuf: Any,  # noqa: N802
                 source: int, recvtag: int) -> None:
        self._announce(sendbuf, dest, sendtag)
        self.comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)
        if self.remote(source):
            self._arrive(self._stamp_of(source, recvtag))

    def Irecv(self, buf: Any, source: int, tag: int) -> MPI.Request:  # noqa: N802
        """A receive from a named ``source``; complete it with :meth:`wait_all`."""
        request = self.comm.Irecv(buf, source=source, tag=tag)
        if self.remote(source):
            stamp = np.empty(_STAMP, np.float64)
            with self._lock:
                self._expected[id(request)] = (request, self._stamps.Irecv(
                    stamp, source=source, tag=tag), stamp)
        return request

    def wait_all(self, requests: list[MPI.Request], wait: Wait) -> float:
        """Complete ``requests`` as :func:`~hpctrain.runtime.waits.wait_all` does, then until
        the latest emulated arrival among the receives; returns the seconds of that wait."""
        with self._lock:
            mine = [self._expected.pop(id(r)) for r in requests if id(r) in self._expected]
        everything = requests + [c for _, c, _ in mine]
        backoff = Backoff(self.yield_s)
        with waiting(wait):
            while not MPI.Request.Testall(everything):
                backoff.idle()
            if not mine:
                return 0.0
            arrival = max(float(stamp[0]) for *_, stamp in mine)
            return _LINK.wait_until(arrival, len(mine), int(sum(s[1] for *_, s in mine)))

    def receive(self, tag: int) -> tuple[int, np.ndarray] | None:
        """A message with ``tag`` from any source whose emulated arrival has passed, as
        (source, bytes), or ``None``: messages that are here early are held, and handed out
        in order of arrival (one sender's in the order sent)."""
        status = MPI.Status()
        while True:
            message = self.comm.Improbe(MPI.ANY_SOURCE, tag, status)
            if message is None:
                break
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            message.Recv(buf)
            source = status.Get_source()
            if not self.remote(source):
                return source, buf
            stamp = self._stamp_of(source, tag)
            heapq.heappush(self._held, (float(stamp[0]), next(self._order), source, buf))
            _LINK.count(int(stamp[1]))
        if self._held and self._held[0][0] <= time.perf_counter():
            _, _, source, buf = heapq.heappop(self._held)
            return source, buf
        return None

    def next_arrival_in(self) -> float:
        """Seconds until the earliest held message is due (``inf`` when none is held)."""
        return max(0.0, self._held[0][0] - time.perf_counter()) if self._held else math.inf

    @property
    def holding(self) -> bool:
        return bool(self._held)

    # -- MPI's own collectives -----------------------------------------------------------

    def library(self, started: float, per_node_bytes: float, rounds: int | None = None
                ) -> None:
        """After an MPI library collective over the channel's ranks that this rank entered
        at ``started``: wait until ``rounds`` latencies (default ``ceil(log2 N)`` over ``N``
        emulated nodes) and ``per_node_bytes`` across the network have passed since the
        last rank entered (``MPI_Allreduce`` of the entry times, when emulating)."""
        if self.net is None:
            return
        n = self.node_count
        rounds = math.ceil(math.log2(n)) if rounds is None else rounds
        delay = rounds * self.net.latency_s + self.net.transfer_s(per_node_bytes)
        last = np.array([started])
        self.comm.Allreduce(MPI.IN_PLACE, last, op=MPI.MAX)
        _LINK.wait_until(float(last[0]) + delay, 1, int(per_node_bytes))

    # -- lifetime --------------------------------------------------------------------------

    def Free(self) -> None:  # noqa: N802
        """Finish the companions' sends and free both communicators."""
        self.close()
        self.comm.Free()

    def close(self) -> None:
        """Finish the companions' sends and free the twin communicator (not ``comm``)."""
        if self._stamps is None:
            return
        if self._sent:
            with Wait("send", self._stamps):
                MPI.Request.Waitall([r for r, _ in self._sent])
        self._sent = []
        self._stamps.Free()
        self._stamps = None
        self.net = None
