"""The worker's side of the parameter server: an :class:`~embeddings.types.EmbeddingStore`.

``pull`` splits a batch's unique rows by owning server (the plan's placement), and by sync
model where tables follow different ones, sends one request per part without blocking, and
scatters the replies back into batch order.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
from mpi4py import MPI

from embeddings.optim import coalesce
from embeddings.sharding import Placement
from embeddings.tables import TableLayout
from embeddings.types import BackingStore, RowSink, RowSource
from hpctrain.comm.emulate import Channel
from hpctrain.comm.wire import itemsize
from hpctrain.errors import EmbeddingError
from hpctrain.runtime import preempt, trace
from hpctrain.runtime.waits import Wait, wait_all
from ps.kernels import route, scatter_rows
from ps.types import (
    TAG_REQUEST,
    Op,
    decode_reply,
    encode_request,
    reply_bytes,
    reply_capacity,
    reply_signal,
    reply_tag,
)

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
    pull_payload_bytes: int = 0  # of pull_bytes_received: the rows (ps.wire_dtype)
    push_payload_bytes: int = 0  # of push_bytes_sent: the gradient rows (ps.wire_dtype)
    pull_wait_s: float = 0.0  # waiting for pulls, less the emulated network's part
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
    servers: tuple[int, ...] = ()  # ranks asked
    step: int = 0  # the clock whose read it is


class PSClient(BackingStore):
    def __init__(self, link: Channel, layout: TableLayout, placement: Placement,
                 servers: Sequence[int], table_groups: Sequence[int] | None = None,
                 state_width: int = 0, wire: str = "float32") -> None:
        """``table_groups[t]`` labels table ``t``'s sync model; tables of different labels
        never share a pull request, so each request is governed by one model.
        ``state_width``: the servers' optimizer state per row (for ``read``/``write``).
        ``wire``: the format of pulled rows and pushed gradients (``ps.wire_dtype``).
        Messages go through ``link`` (the parameter-server communicator's channel)."""
        self.wire = wire
        self.link = link
        self.comm = link.comm
        self.layout = layout
        self.dim = layout.dim
        self.state_width = state_width
        self.placement = placement
        self.servers = list(servers)  # comm rank of server index i
        groups = np.zeros(len(layout.specs), np.int64) if table_groups is None else table_groups
        self.groups = np.asarray(groups, dtype=np.int64)
        self.clock = 0
        self._seq = 0
        self._prefetched: list[_Pending] = []
        self._consistent = False
        self._sends: list[tuple[MPI.Request, np.ndarray]] = []
        self.stats = ClientStats()

    # -- EmbeddingStore ----------------------------------------------------------------------

    @contextmanager
    def consistent_reads(self) -> Iterator[None]:
        """Within the block, :meth:`pull` is a BSP read (a ``READ`` at this worker's clock,
        answered once every worker's pushes of all earlier steps are applied), whatever the
        sync model: an evaluation then sees the same model on every worker."""
        self._consistent = True
        try:
            yield
        finally:
            self._consistent = False

    def pull(self, rows: np.ndarray) -> np.ndarray:
        if self._consistent:
            return self.read(rows)[:, : self.dim]
        while self._prefetched and self._prefetched[0].step < self.clock:  # for a step gone
            self._complete(self._prefetched.pop(0))  # by unread (a re-tiering changed rows)
        for i, pending in enumerate(self._prefetched):
            if pending.step == self.clock and np.array_equal(pending.rows, rows):
                self.stats.prefetch_hits += 1
                return self._complete(self._prefetched.pop(i))
        return self._complete(self._send_pull(rows, self.clock, 0, Op.PULL))

    def prefetch(self, rows: np.ndarray, ahead: int) -> None:
        """Start pulling ``rows``, to be read ``ahead`` (0 or 1) steps from now."""
        if len(self._prefetched) > 1:  # a guess nobody read: drain it
            self._complete(self._prefetched.pop(0))
        self._prefetched.append(self._send_pull(rows, self.clock + ahead, ahead, Op.PULL))

    def write(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Overwrite ``rows`` (sorted unique) on their servers with ``values``: ``dim`` wide
        (optimizer state reset), or ``dim + state_width`` (values then optimizer state, as
        :meth:`read` returns them); returns once every server has applied it."""
        receives, keep, acks = [], [], []
        for index, _, tables, counts, ids, positions in self._split(rows, by_model=True):
            seq = self._next_seq()
            ack = np.empty(reply_capacity(0, self.dim), dtype=np.uint8)
            acks.append(ack)
            receives.append(self.link.Irecv(ack, source=self.servers[index], tag=reply_tag(seq)))
            buf = encode_request(Op.WRITE, self.clock, seq, 0, tables, counts, ids, values,
                                 positions=positions)
            keep.append((self.link.Isend(buf, dest=self.servers[index], tag=TAG_REQUEST), buf))
            self.stats.move_bytes_sent += buf.nbytes
        self.stats.rows_written += len(rows)
        self.link.wait_all(receives + [r for r, _ in keep],
                           Wait("write", self.comm, self._peers(rows)))
        self.stats.move_bytes_received += sum(reply_bytes(ack) for ack in acks)

    def push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        with trace.span("ps push", rows=len(rows)):
            self._push(rows, grads, lr)

    def _push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        rows, grads = coalesce(rows, grads)
        self._reap()
        for index, _, tables, counts, ids, positions in self._split(rows, by_model=False):
            buf = encode_request(Op.PUSH, self.clock, self._next_seq(), 0, tables, counts,
                                 ids, grads, lr, self.wire, positions)
            self._send(index, buf)
            self.stats.push_bytes_sent += buf.nbytes
            self.stats.push_payload_bytes += len(ids) * self.dim * itemsize(self.wire)
            self.stats.rows_pushed += len(ids)
        self.stats.pushes += 1
        self.clock += 1

    def read(self, rows: np.ndarray) -> np.ndarray:
        """``READ`` ``rows`` (values then optimizer state) at this worker's clock: answered
        once every worker's pushes of all earlier steps are applied (BSP's rule under any
        sync model)."""
        return self._complete(self._send_pull(rows, self.clock, 0, Op.READ))

    def wait_ready(self) -> float:
        """Read one row of every server that holds any and wait for the answers: a server
        builds its shard (initial values for every row: seconds for millions of rows) and
        loads its kernels before it serves, and without this the first step waited for
        that and counted it as a pull. Returns the seconds waited; the read is not counted
        in :attr:`stats` (no training traffic, no pull wait)."""
        start, before = time.perf_counter(), asdict(self.stats)
        held = [np.flatnonzero(counts) for counts in self.placement.counts]
        firsts = [self.layout.offsets[t[0]] + self.placement.ids_at(s, int(t[0]), 0, 1)[0]
                  for s, t in enumerate(held) if len(t)]
        with trace.span("wait servers"):
            self.read(np.unique(np.array(firsts, dtype=np.int64)))
        for key, value in before.items():
            setattr(self.stats, key, value)
        return time.perf_counter() - start

    def save(self, out: RowSink) -> None:
        """Ask every server to checkpoint its shard at this worker's clock (after its pushes:
        MPI keeps one sender's messages in order); the servers write their own files, so
        ``out`` receives nothing."""
        self._reap()
        for index in range(len(self.servers)):
            self._send(index, encode_request(Op.SAVE, self.clock, self._next_seq(), 0, _NO_IDS,
                                             _NO_IDS, _NO_IDS))

    def restore(self, source: RowSource) -> None:
        """The servers restore their shards themselves; the client takes up the clock."""
        self.clock = source.step

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Tell every server this worker is done, and finish all sends."""
        while self._prefetched:
            self._complete(self._prefetched.pop())
        for index in range(len(self.servers)):
            self._send(index, encode_request(Op.DONE, self.clock, self._next_seq(), 0, _NO_IDS,
                                             _NO_IDS, _NO_IDS))
        wait_all([r for r, _ in self._sends], Wait("push", self.comm, tuple(self.servers)))
        self._sends = []

    # -- internals ---------------------------------------------------------------------------

    def _split(self, rows: np.ndarray, by_model: bool):
        """Parts of sorted ``rows``: (server index, model group, tables, counts, ids,
        positions in ``rows``). ``by_model`` splits each server's rows by sync-model group
        and omits empty parts; otherwise there is exactly one part per server."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        tables = self.layout.table_of(rows)
        ids = rows - self.layout.offsets[tables]
        ngroups = int(self.groups.max()) + 1 if by_model else 1
        groups = self.groups if by_model else np.zeros(len(self.groups), np.int64)
        order, ids, start, run_table, run_count, run_start = route(
            tables, ids, groups, ngroups, *self.placement.arrays)
        for key in range(len(self.servers) * ngroups):
            a, z = start[key], start[key + 1]
            if by_model and a == z:
                continue
            runs = slice(run_start[key], run_start[key + 1])
            yield (key // ngroups, key % ngroups, run_table[runs], run_count[runs], ids[a:z],
                   order[a:z])

    def _send_pull(self, rows: np.ndarray, step: int, slack: int, op: Op) -> _Pending:
        """Send a PULL (rows) or READ (rows with optimizer state) of sorted unique rows."""
        if len(rows) and not bool(np.all(rows[1:] > rows[:-1])):
            raise ValueError(f"{op.name.lower()} needs sorted unique rows")
        width = self.dim + (self.state_width if op == Op.READ else 0)
        pending = _Pending(rows, op, width, [], [], step=step)
        for index, _, tables, counts, ids, positions in self._split(rows, by_model=True):
            seq = self._next_seq()
            reply = np.empty(reply_capacity(len(ids), width), dtype=np.uint8)
            recv = self.link.Irecv(reply, source=self.servers[index], tag=reply_tag(seq))
            buf = encode_request(op, step, seq, slack, tables, counts, ids,
                                 wire=self.wire if op == Op.PULL else "float32")
            pending.sends.append((self.link.Isend(buf, dest=self.servers[index],
                                                  tag=TAG_REQUEST), buf))
            pending.parts.append((reply, positions, recv))
            pending.servers += (self.servers[index],)
            if op == Op.READ:
                self.stats.move_bytes_sent += buf.nbytes
            else:
                self.stats.pull_bytes_sent += buf.nbytes
        if op == Op.PULL:
            self.stats.pulls += 1
        return pending

    def _complete(self, pending: _Pending) -> np.ndarray:
        start = time.perf_counter()
        emulated = self.link.wait_all([recv for *_, recv in pending.parts] +
                                      [r for r, _ in pending.sends],
                                      Wait("pull", self.comm, pending.servers))
        self.stats.pull_wait_s += time.perf_counter() - start - emulated
        out = None
        for reply, positions, _ in pending.parts:
            values = decode_reply(reply, len(positions), pending.width)
            if isinstance(values, str):
                raise EmbeddingError(values)
            signum = reply_signal(reply)
            if signum:  # the server was signalled: stop as if this worker were
                preempt.relay(signum)
            if len(pending.parts) == 1 and len(positions) == len(pending.rows):
                out = values  # one server holds them all, in order: the reply is the result
            else:
                if out is None:
                    out = np.empty((len(pending.rows), pending.width), np.float32)
                scatter_rows(out, positions, values)
            if pending.op == Op.PULL:
                self.stats.rows_pulled += len(positions)
                self.stats.pull_bytes_received += reply_bytes(reply)
                self.stats.pull_payload_bytes += values.size * itemsize(self.wire)
            else:
                self.stats.rows_read += len(positions)
                self.stats.move_bytes_received += reply_bytes(reply)
        return np.empty((0, pending.width), np.float32) if out is None else out

    def _send(self, index: int, buf: np.ndarray) -> None:
        request = self.link.Isend(buf, dest=self.servers[index], tag=TAG_REQUEST)
        self._sends.append((request, buf))

    def _peers(self, rows: np.ndarray) -> tuple[int, ...]:
        return tuple(self.servers[i] for i, *_ in self._split(rows, by_model=False))

    def _reap(self) -> None:
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
