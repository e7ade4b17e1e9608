"""The parameter server's event loop.

Protocol (on the parameter-server communicator, a ``Dup`` of the world made by every rank;
message layouts in :mod:`ps.types`):

1. A worker sends requests with tag ``TAG_REQUEST``. MPI keeps the messages of one
   (worker, server) pair in order, so a worker's pull always sees its own earlier pushes.
2. ``PULL`` carries ids grouped by table and the worker's clock (its completed steps). The
   server answers with the rows in request order, tag ``reply_tag(seq)``, as soon as the sync
   model allows a read at that clock given the slowest worker's clock; until then the request
   is parked (a deferred reply) and retried after every push. A bad id (out of range, another
   server's row, unknown table) is answered with an error reply naming table and id, and the
   server goes on serving.
3. ``PUSH`` carries unique ids per table, their summed gradient rows and the learning rate.
   It is applied on arrival by the sparse optimizer kernel, then the sender's clock becomes
   ``step + 1`` and parked pulls are retried. Every worker pushes to every server once per
   step, empty if none of its rows live there: the push is the clock tick.
4. ``DONE``: the worker will send nothing more; its clock stops holding others back. The loop
   ends once every worker has sent ``DONE`` and every reply has been delivered.
5. ``READ`` (hot/cold tiering, :mod:`embeddings.tiered`: rows become hot on the workers) is a
   ``PULL`` answered with values and optimizer state, ``[n, dim + state]``, and always under
   BSP's rule, whatever the sync model: it waits until every worker has pushed all steps
   before its clock. The rows change owner, so a gradient still on its way would be lost.
6. ``WRITE`` (rows go back cold) carries unique ids and ``[n, dim + state]`` values and
   optimizer state, replaces them, and is acknowledged with an empty reply once stored. It
   is not a clock tick. While a row is hot no worker pushes it, so the write is its only
   update; the writers wait for the acknowledgements and then pass a barrier among the
   workers before any of them pushes again, so no read can see the row before it is back.

Receives are non-blocking probes on ``ANY_SOURCE`` with a backoff
(:class:`hpctrain.runtime.waits.Backoff`) so an idle server leaves its core to the workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from mpi4py import MPI

from hpctrain.errors import EmbeddingError, PSError
from hpctrain.runtime.waits import Backoff, wait_all
from hpctrain.sync.types import SyncModel
from ps.store import ShardStore
from ps.types import TAG_REQUEST, Op, Request, decode_request, encode_error, encode_rows, reply_tag

__all__ = ["Server", "ServerStats"]

log = logging.getLogger(__name__)


@dataclass
class ServerStats:
    """Counters of one server over a run."""

    rank: int = -1
    pulls: int = 0
    pushes: int = 0
    rows_out: int = 0
    rows_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    deferred: int = 0
    deferred_wait_s: float = 0.0
    resident_bytes: int = 0  # the shard's arrays
    rss_growth_bytes: int = 0  # the process's resident memory growth while building them
    rows_read: int = 0  # READ: rows handed to the workers' hot tier with optimizer state
    rows_written: int = 0  # WRITE: rows handed back

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class _Parked:
    source: int
    request: Request
    since: float


class Server:
    """Serves ``store``'s rows to the ``workers`` (ranks of ``comm``) under ``sync``."""

    def __init__(self, comm: MPI.Intracomm, store: ShardStore, workers: Sequence[int],
                 sync: SyncModel) -> None:
        self.comm = comm
        self.store = store
        self.dim = store.layout.dim
        self.sync = sync
        self.clock = {w: 0 for w in workers}
        self.active = set(workers)
        self.parked: list[_Parked] = []
        self.sending: list[tuple[MPI.Request, np.ndarray]] = []
        self.stats = ServerStats(rank=comm.Get_rank(), resident_bytes=store.resident_bytes())

    def serve(self) -> ServerStats:
        """Run until every worker is done; returns the counters."""
        status = MPI.Status()
        backoff = Backoff()
        while self.active or self.parked:
            message = self.comm.Improbe(MPI.ANY_SOURCE, TAG_REQUEST, status)
            if message is None:
                self._reap_sends()
                backoff.idle()
                continue
            backoff.reset()
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            message.Recv(buf)
            self.stats.bytes_in += buf.nbytes
            self._handle(status.Get_source(), decode_request(buf, self.dim))
        wait_all([r for r, _ in self.sending])
        return self.stats

    def slowest_clock(self) -> float:
        """The lowest clock among workers still running (finished ones hold nobody back)."""
        return min((self.clock[w] for w in self.active), default=float("inf"))

    def _ready(self, request: Request, slowest: float) -> bool:
        """Whether a read may be served now: PULL under the sync model, READ under BSP."""
        if request.op == Op.READ:
            return slowest >= request.step
        return self.sync.ready(request.step, slowest, request.slack)

    def _handle(self, source: int, request: Request) -> None:
        if request.op in (Op.PULL, Op.READ):
            if self._ready(request, self.slowest_clock()):
                self._answer(source, request)
            else:
                self.stats.deferred += 1
                self.parked.append(_Parked(source, request, time.perf_counter()))
        elif request.op == Op.PUSH:
            self._apply(source, request)
            self._retry_parked()
        elif request.op == Op.DONE:
            self.active.discard(source)
            self._retry_parked()
        elif request.op == Op.WRITE:
            self._write(source, request)
        else:  # pragma: no cover - a corrupt message is a bug
            raise PSError(f"server rank {self.comm.Get_rank()}: unknown op {request.op} "
                          f"from rank {source}")

    def _answer(self, source: int, request: Request) -> None:
        self.stats.pulls += 1
        try:
            slots = self._slots(request)
        except EmbeddingError as exc:
            self.stats.errors += 1
            reply = encode_error(f"server rank {self.comm.Get_rank()}: {exc}")
        else:
            if request.op == Op.READ:
                reply = encode_rows(self.store.tables.read(slots))
                self.stats.rows_read += len(slots)
            else:
                reply = encode_rows(self.store.tables.pull(slots))
                self.stats.rows_out += len(slots)
        self.stats.bytes_out += reply.nbytes
        self.sending.append((self.comm.Isend(reply, dest=source, tag=reply_tag(request.seq)),
                             reply))

    def _apply(self, source: int, request: Request) -> None:
        try:
            slots = self._slots(request)
        except EmbeddingError as exc:  # pushes carry only rows that were pulled: a bug
            raise PSError(f"server rank {self.comm.Get_rank()}: bad push from rank "
                          f"{source}: {exc}") from exc
        if len(slots):
            self.store.tables.push(slots, request.grads, request.lr)
        self.stats.pushes += 1
        self.stats.rows_in += len(slots)
        self.clock[source] = request.step + 1

    def _write(self, source: int, request: Request) -> None:
        tables = self.store.tables
        try:
            slots = self._slots(request)
        except EmbeddingError as exc:  # writes carry only rows that were read: a bug
            raise PSError(f"server rank {self.comm.Get_rank()}: bad write from rank "
                          f"{source}: {exc}") from exc
        if request.grads.shape[1] != self.dim + tables.state_width:
            raise PSError(f"server rank {self.comm.Get_rank()}: a write from rank {source} "
                          f"has rows of {request.grads.shape[1]} values; this server keeps "
                          f"{self.dim} + {tables.state_width} optimizer state")
        tables.write(slots, request.grads)
        self.stats.rows_written += len(slots)
        reply = encode_rows(np.empty(0, dtype=np.float32))
        self.stats.bytes_out += reply.nbytes
        self.sending.append((self.comm.Isend(reply, dest=source, tag=reply_tag(request.seq)),
                             reply))

    def _slots(self, request: Request) -> np.ndarray:
        parts = [self.store.slots(t, ids) for t, ids in request.table_ids()]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _retry_parked(self) -> None:
        slowest = self.slowest_clock()
        waiting = []
        for parked in self.parked:
            if self._ready(parked.request, slowest):
                self.stats.deferred_wait_s += time.perf_counter() - parked.since
                self._answer(parked.source, parked.request)
            else:
                waiting.append(parked)
        self.parked = waiting

    def _reap_sends(self) -> None:
        self.sending = [(r, b) for r, b in self.sending if not r.Test()]
