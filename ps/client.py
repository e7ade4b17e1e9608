"""The worker's side of the parameter server: an :class:`~embeddings.types.EmbeddingStore`.

``pull`` splits a batch's unique rows by owning server (the plan's placement), sends one
request per server without blocking, and scatters the replies back into batch order.
``push`` sums repeated rows, sends each server its rows' gradients (an empty push to the
others: every push is a clock tick) and advances the worker's clock.

Prefetch (``ps.prefetch``): the trainer announces the next batch's rows while the current
batch computes, and the pull is sent at once. Such a read is made before this step's pushes
and so cannot contain them: it is one step stale, declared to the servers as ``slack = 1``
(TorchRec's pipelined semi-synchronous mode). Exactness tests run with prefetch off.

As a :class:`~embeddings.types.BackingStore` (the cold tier of hot/cold tiering) it also
``read``s rows with their optimizer state and ``write``s them back (``READ``/``WRITE`` in
:mod:`ps.server`); both wait for their replies.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from mpi4py import MPI

from embeddings.optim import coalesce
from embeddings.sharding import Placement
from embeddings.tables import TableLayout
from embeddings.types import BackingStore
from hpctrain.errors import EmbeddingError
from hpctrain.runtime.waits import wait_all
from ps.types import TAG_REQUEST, Op, decode_reply, encode_request, reply_capacity, reply_tag

__all__ = ["PSClient", "ClientStats"]

_NO_IDS = np.empty(0, dtype=np.int64)


@dataclass
class ClientStats:
    """Traffic and waiting of one worker's client; bytes count whole messages."""

    pulls: int = 0
    pushes: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0
    pull_bytes_sent: int = 0  # pull requests (headers and ids)
    pull_bytes_received: int = 0  # pull replies (status and rows)
    push_bytes_sent: int = 0  # pushes (headers, ids and gradient rows) and clock ticks
    pull_wait_s: float = 0.0
    prefetch_hits: int = 0
    rows_read: int = 0  # READ: rows taken over with their optimizer state
    rows_written: int = 0  # WRITE: rows handed back
    move_bytes_sent: int = 0  # READ requests and WRITEs
    move_bytes_received: int = 0  # READ replies and WRITE acknowledgements

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class _Pending:
    """A pull or read in flight: its rows and row width, and per server the reply buffer and
    batch positions."""

    rows: np.ndarray
    op: Op
    width: int
    parts: list[tuple[np.ndarray, np.ndarray, MPI.Request]]  # reply, positions, receive
    sends: list[tuple[MPI.Request, np.ndarray]]


class PSClient(BackingStore):
    def __init__(self, comm: MPI.Intracomm, layout: TableLayout, placement: Placement,
                 servers: Sequence[int], state_width: int = 0) -> None:
        """``state_width``: the servers' optimizer state per row (for ``read``/``write``)."""
        self.comm = comm
        self.layout = layout
        self.dim = layout.dim
        self.state_width = state_width
        self.placement = placement
        self.servers = list(servers)  # comm rank of server index i
        self.clock = 0
        self._seq = 0
        self._prefetched: _Pending | None = None
        self._sends: list[tuple[MPI.Request, np.ndarray]] = []
        self.stats = ClientStats()

    # -- EmbeddingStore ----------------------------------------------------------------------

    def pull(self, rows: np.ndarray) -> np.ndarray:
        pending, self._prefetched = self._prefetched, None
        if pending is not None and np.array_equal(pending.rows, rows):
            self.stats.prefetch_hits += 1
        else:
            if pending is not None:
                self._complete(pending)  # a stale guess: drain it, then read afresh
            pending = self._send_pull(rows, self.clock, 0, Op.PULL)
        return self._complete(pending)

    def prefetch(self, rows: np.ndarray, ahead: int) -> None:
        """Start pulling ``rows``, to be read ``ahead`` (0 or 1) steps from now."""
        if self._prefetched is not None:
            self._complete(self._prefetched)
        self._prefetched = self._send_pull(rows, self.clock + ahead, ahead, Op.PULL)

    def push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        rows, grads = coalesce(rows, grads)
        self._reap()
        for index, (tables, counts, ids, positions) in enumerate(self._split(rows)):
            payload = np.ascontiguousarray(grads[positions])
            buf = encode_request(Op.PUSH, self.clock, self._next_seq(), 0, tables, counts,
                                 ids, payload, lr)
            self._send(index, buf)
            self.stats.push_bytes_sent += buf.nbytes
            self.stats.rows_pushed += len(ids)
        self.stats.pushes += 1
        self.clock += 1

    def read(self, rows: np.ndarray) -> np.ndarray:
        """``READ`` ``rows`` at this worker's clock: answered once every worker has pushed
        all earlier steps (BSP's rule under any sync model)."""
        return self._complete(self._send_pull(rows, self.clock, 0, Op.READ))

    def write(self, rows: np.ndarray, block: np.ndarray) -> None:
        """``WRITE`` ``rows`` with their values and state to their servers; returns once
        every server has acknowledged."""
        pending = _Pending(rows, Op.WRITE, 0, [], [])
        for index, (tables, counts, ids, positions) in enumerate(self._split(rows)):
            if len(ids) == 0:
                continue
            seq = self._next_seq()
            reply = np.empty(reply_capacity(0, self.dim), dtype=np.uint8)
            recv = self.comm.Irecv(reply, source=self.servers[index], tag=reply_tag(seq))
            buf = encode_request(Op.WRITE, self.clock, seq, 0, tables, counts, ids,
                                 np.ascontiguousarray(block[positions], dtype=np.float32))
            pending.sends.append((self.comm.Isend(buf, dest=self.servers[index],
                                                  tag=TAG_REQUEST), buf))
            pending.parts.append((reply, positions[:0], recv))
            self.stats.move_bytes_sent += buf.nbytes
        self.stats.rows_written += len(rows)
        self._complete(pending)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Tell every server this worker is done, and finish all sends."""
        if self._prefetched is not None:
            self._complete(self._prefetched)
            self._prefetched = None
        for index in range(len(self.servers)):
            self._send(index, encode_request(Op.DONE, self.clock, self._next_seq(), 0, _NO_IDS,
                                             _NO_IDS, _NO_IDS))
        wait_all([r for r, _ in self._sends])
        self._sends = []

    # -- internals ---------------------------------------------------------------------------

    def _split(self, rows: np.ndarray):
        """Per server index: (tables, counts, ids, positions in ``rows``); rows sorted."""
        tables = self.layout.table_of(rows)
        ids = rows - self.layout.offsets[tables]
        server = np.empty(len(rows), dtype=np.int64)
        bounds = np.searchsorted(tables, np.arange(len(self.layout.specs) + 1))
        for t in np.unique(tables).tolist():
            lo, hi = bounds[t], bounds[t + 1]
            server[lo:hi] = self.placement.locate(t, ids[lo:hi])[0]
        order = np.argsort(server, kind="stable")
        cuts = np.searchsorted(server[order], np.arange(len(self.servers) + 1))
        for index in range(len(self.servers)):
            positions = order[cuts[index]: cuts[index + 1]]
            part_tables, counts = np.unique(tables[positions], return_counts=True)
            yield part_tables, counts, ids[positions], positions

    def _send_pull(self, rows: np.ndarray, step: int, slack: int, op: Op) -> _Pending:
        """Send a PULL (rows) or READ (rows with optimizer state) of sorted unique rows."""
        if len(rows) and not bool(np.all(rows[1:] > rows[:-1])):
            raise ValueError(f"{op.name.lower()} needs sorted unique rows")
        width = self.dim + (self.state_width if op == Op.READ else 0)
        pending = _Pending(rows, op, width, [], [])
        for index, (tables, counts, ids, positions) in enumerate(self._split(rows)):
            if len(ids) == 0:
                continue
            seq = self._next_seq()
            reply = np.empty(reply_capacity(len(ids), width), dtype=np.uint8)
            recv = self.comm.Irecv(reply, source=self.servers[index], tag=reply_tag(seq))
            buf = encode_request(op, step, seq, slack, tables, counts, ids)
            pending.sends.append((self.comm.Isend(buf, dest=self.servers[index],
                                                  tag=TAG_REQUEST), buf))
            pending.parts.append((reply, positions, recv))
            if op == Op.READ:
                self.stats.move_bytes_sent += buf.nbytes
            else:
                self.stats.pull_bytes_sent += buf.nbytes
        if op == Op.PULL:
            self.stats.pulls += 1
        return pending

    def _complete(self, pending: _Pending) -> np.ndarray:
        start = time.perf_counter()
        wait_all([recv for *_, recv in pending.parts] + [r for r, _ in pending.sends])
        self.stats.pull_wait_s += time.perf_counter() - start
        out = np.empty((len(pending.rows), pending.width), dtype=np.float32)
        for reply, positions, _ in pending.parts:
            values = decode_reply(reply, len(positions), pending.width)
            if isinstance(values, str):
                raise EmbeddingError(values)
            out[positions] = values
            if pending.op == Op.PULL:
                self.stats.rows_pulled += len(positions)
                self.stats.pull_bytes_received += 16 + values.nbytes
            else:
                self.stats.rows_read += len(positions)
                self.stats.move_bytes_received += 16 + values.nbytes
        return out

    def _send(self, index: int, buf: np.ndarray) -> None:
        request = self.comm.Isend(buf, dest=self.servers[index], tag=TAG_REQUEST)
        self._sends.append((request, buf))

    def _reap(self) -> None:
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
