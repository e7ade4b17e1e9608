"""The parameter server's event loop.

Protocol (on the parameter-server communicator, a ``Dup`` of the world made by every rank;
message layouts in :mod:`ps.types`):

1. A worker sends requests with tag ``TAG_REQUEST``. MPI keeps the messages of one
   (worker, server) pair in order, so a worker's pull always sees its own earlier pushes.
2. ``PULL`` carries ids grouped by table, the worker's clock (its completed steps) and a
   slack (1 for a prefetch). The server answers with the rows in request order, tag
   ``reply_tag(seq)``, as soon as the sync model of the request's tables (the strictest, if
   several) allows a read at that clock given the slowest worker's clock (see
   :class:`hpctrain.sync.types.SyncModel`); until then the request is parked (a deferred
   reply) and retried after every push. Each served read records its staleness (reader's
   clock minus the slowest clock) per table; one beyond the model's bound plus slack is a
   bug and stops the job. A bad id (out of range, another server's row, unknown table) is
   answered with an error reply naming table and id, and the server goes on serving.
3. ``PUSH`` carries unique ids per table, their summed gradient rows and the learning rate.
   It is applied on arrival by the sparse optimizer kernel, then the sender's clock becomes
   ``step + 1`` and parked pulls are retried. Every worker pushes to every server once per
   step, empty if none of its rows live there: the push is the clock tick. In deterministic
   mode the pushes of a step are held until every running worker's has arrived, then summed
   and applied as one update (the replicated trainer's semantics, bitwise reproducible).
   Whenever a push moves the slowest worker's clock, a round ends for the dense table's
   optimizer (:meth:`~ps.store.ShardStore.end_round`): full mode's Adagrad then moves the
   values of a round's pushes as far as one update of their sum.
4. ``WRITE`` overwrites rows and is answered with an empty reply once applied. With ``dim``
   values per row the optimizer state is reset (workers place initial dense parameters so);
   with ``dim + state`` values it is replaced too (hot/cold tiering, :mod:`embeddings.tiered`:
   rows go back cold). It is not a clock tick. While a row is hot no worker pushes it, so
   the write is its only update; the tiering writers wait for the acknowledgements and then
   pass a barrier among the workers before any of them pushes again, so no read can see the
   row before it is back.
5. ``SAVE`` (checkpoint): each worker sends one to every server after its last push of the
   step. Once every running worker's has arrived (so every push before it has been applied),
   the server hands its shard to the save hook, which writes it and joins the checkpoint's
   commit, a collective with the workers; no request is pending meanwhile.
6. ``DONE``: the worker will send nothing more; its clock stops holding others back. The loop
   ends once every worker has sent ``DONE`` and every reply has been delivered.
7. ``READ`` (hot/cold tiering: rows become hot on the workers) is a ``PULL`` answered with
   values and optimizer state, ``[n, dim + state]``, and always under BSP's rule, whatever
   the sync model: it waits until every worker's pushes of all steps before its clock have
   been applied. The rows change owner, so a gradient still on its way would be lost. Its
   staleness is 0 by that rule and is not recorded with the training reads'.

A big request's row passes (the gather into the reply, the optimizer on a push) are split
over the rank's threads (:class:`~ps.threads.RowThreads`); MPI calls stay on the main thread.

Receives are non-blocking probes on ``ANY_SOURCE`` with a backoff
(:class:`hpctrain.runtime.waits.Backoff`) so an idle server leaves its core to the workers,
through the parameter-server communicator's :class:`~hpctrain.comm.emulate.Channel`: with
``comm.emulate`` a request is handled once its emulated arrival time has passed, in order of
arrival, and replies leave over this server's emulated link one after another.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from mpi4py import MPI

from embeddings.optim import coalesce
from hpctrain.comm.emulate import Channel
from hpctrain.errors import EmbeddingError, PSError
from hpctrain.runtime import preempt, trace
from hpctrain.runtime.waits import Backoff, Wait, wait_all
from hpctrain.sync.types import SyncModel
from ps.kernels import gather_rows
from ps.store import ShardStore
from ps.threads import RowThreads
from ps.types import (
    TAG_REQUEST,
    Op,
    Request,
    decode_request,
    encode_error,
    encode_rows,
    reply_tag,
    rows_reply,
    stamp_signal,
)

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
    staleness: dict[str, dict[int, int]] = field(default_factory=dict)
    """Per table: how many reads were served with each staleness (in clocks)."""
    rows_read: int = 0  # READ: rows handed to the workers' hot tier with optimizer state
    rows_written: int = 0  # WRITE: rows handed back
    serve_s: float = 0.0  # wall time from the first request to the end of the loop
    busy_s: float = 0.0  # of serve_s: receiving, decoding, serving and applying requests
    busy_cpu_s: float = 0.0  # the process's CPU time within busy_s (less: preempted)
    threads: int = 1  # threads sharing each big request's row passes

    @property
    def busy_fraction(self) -> float:
        """Share of the serving time spent working on requests (1.0: the server limits)."""
        return self.busy_s / self.serve_s if self.serve_s > 0 else 0.0

    @property
    def rows_per_s(self) -> float:
        """Rows pulled and pushed per second of serving time."""
        return (self.rows_out + self.rows_in) / self.serve_s if self.serve_s > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "busy_fraction": self.busy_fraction,
                "rows_per_s": self.rows_per_s}


@dataclass
class _Parked:
    source: int
    request: Request
    since: float


class Server:
    """Serves ``store``'s rows to the ``workers`` (ranks of ``comm``) under ``sync``."""

    def __init__(self, link: Channel, store: ShardStore, workers: Sequence[int],
                 models: Sequence[SyncModel], deterministic: bool = False,
                 clock: int = 0, on_save: Callable[[ShardStore, int], None] | None = None,
                 threads: int = 1) -> None:
        """``models[t]`` governs table ``t``; every worker starts at ``clock`` (a resumed
        run's step); ``on_save(store, step)`` writes a checkpoint of the shard; big
        requests' row passes run on ``threads`` threads. Messages go through ``link``, the
        parameter-server communicator's channel."""
        self.link = link
        self.comm = comm = link.comm
        self.store = store
        self.dim = store.layout.dim
        self.models = list(models)
        self.deterministic = deterministic
        self.clock = dict.fromkeys(workers, clock)
        self.on_save = on_save
        self.saves: dict[int, set[int]] = {}
        self.active = set(workers)
        self.parked: list[_Parked] = []
        self.held: dict[int, dict[int, Request]] = {}  # step -> worker -> push (deterministic)
        self.sending: list[tuple[MPI.Request, np.ndarray]] = []
        self.rows = RowThreads(threads)
        self.stats = ServerStats(rank=comm.Get_rank(), resident_bytes=store.resident_bytes(),
                                 threads=self.rows.threads)
        self._seen: dict[str, Counter[int]] = {}

    def _load_kernels(self) -> None:
        """Call every kernel of the request paths once on no rows, so that loading them
        (numba's cache, seconds on a busy node) happens before the first request, not in it."""
        tables, none = self.store.tables, np.empty(0, dtype=np.int64)
        slots, _ = self.store.request_slots(none, none, none)
        gather_rows(np.empty((0, self.dim), np.float32), tables.weight, slots)
        self.store.apply(slots, np.empty((0, self.dim), np.float32), 0.0)
        coalesce(np.array([1, 0]), np.zeros((2, self.dim), np.float32))  # repeated rows

    def serve(self) -> ServerStats:
        """Run until every worker is done; returns the counters."""
        try:
            return self._serve()
        finally:
            self.rows.close()

    def _serve(self) -> ServerStats:
        self._load_kernels()
        backoff = Backoff()
        first = None
        # idle: workers may compute for long; the watchdog ends the loop only when one stopped
        with Wait("serve", self.comm, tuple(self.active), idle=True):
            while self.active or self.parked or self.link.holding:
                received = self.link.receive(TAG_REQUEST)
                if received is None:
                    self._reap_sends()
                    backoff.idle(self.link.next_arrival_in())
                    continue
                start, cpu = time.perf_counter(), time.process_time()
                first = start if first is None else first
                backoff.reset()
                source, buf = received
                self.stats.bytes_in += buf.nbytes
                request = decode_request(buf, self.dim)
                with trace.span(f"serve {request.op.name.lower()}", source=source,
                                step=request.step):
                    self._handle(source, request)
                self.stats.busy_s += time.perf_counter() - start
                self.stats.busy_cpu_s += time.process_time() - cpu
        wait_all([r for r, _ in self.sending], Wait("send", self.comm, tuple(self.clock)))
        self.stats.serve_s = 0.0 if first is None else time.perf_counter() - first
        self.stats.staleness = {t: dict(sorted(c.items())) for t, c in self._seen.items()}
        return self.stats

    def slowest_clock(self) -> float:
        """The lowest clock among workers still running (finished ones hold nobody back)."""
        return min((self.clock[w] for w in self.active), default=float("inf"))

    def model_of(self, request: Request) -> SyncModel:
        """The strictest model among the request's tables."""
        models = [self.models[t] for t in request.tables.tolist() if 0 <= t < len(self.models)]
        bounded = [m for m in models if m.bound is not None]
        return min(bounded, key=lambda m: m.bound) if bounded else (models or self.models)[0]

    def _ready(self, request: Request) -> bool:
        """Whether a read may be served now: PULL under its sync model, READ under BSP."""
        if request.op == Op.READ:
            return self.slowest_clock() >= request.step
        return self.model_of(request).ready(request.step, self.slowest_clock(), request.slack)

    def _handle(self, source: int, request: Request) -> None:
        if request.op in (Op.PULL, Op.READ):
            if self._ready(request):
                self._answer(source, request)
            else:
                self.stats.deferred += 1
                self.parked.append(_Parked(source, request, time.perf_counter()))
        elif request.op == Op.PUSH:
            if self.deterministic:
                self.held.setdefault(request.step, {})[source] = request
                self._apply_complete_steps()
            else:
                self._apply([(source, request)])
            self._retry_parked()
        elif request.op == Op.WRITE:
            self._write(source, request)
        elif request.op == Op.SAVE:
            asked = self.saves.setdefault(request.step, set())
            asked.add(source)
            if self.active <= asked:
                del self.saves[request.step]
                if self.on_save is None:
                    raise PSError(f"server rank {self.comm.Get_rank()}: asked to save a "
                                  f"checkpoint, but no checkpoint directory is configured")
                self.on_save(self.store, request.step)
        elif request.op == Op.DONE:
            self.active.discard(source)
            if self.deterministic:
                self._apply_complete_steps()
            self._retry_parked()
        else:  # pragma: no cover - a corrupt message is a bug
            raise PSError(f"server rank {self.comm.Get_rank()}: unknown op {request.op} "
                          f"from rank {source}")

    def _answer(self, source: int, request: Request) -> None:
        if request.op == Op.PULL:
            self.stats.pulls += 1
            self._record_staleness(source, request)
        try:
            slots, _ = self._slots(request)
        except EmbeddingError as exc:
            self.stats.errors += 1
            reply = encode_error(f"server rank {self.comm.Get_rank()}: {exc}")
        else:
            tables = self.store.tables
            if request.op == Op.READ:
                reply, rows = rows_reply(len(slots), self.dim + tables.state_width)
                self._gather(rows, tables.weight, slots)
                self._gather(rows[:, self.dim:], tables.state, slots)
                self.stats.rows_read += len(slots)
            elif request.wire == "float32":
                reply, rows = rows_reply(len(slots), self.dim)
                self._gather(rows, tables.weight, slots)
                self.stats.rows_out += len(slots)
            else:
                reply = encode_rows(tables.pull(slots), request.wire)
                self.stats.rows_out += len(slots)
        signum = preempt.received()
        if signum:  # the workers stop on it as on their own (a node of servers only)
            stamp_signal(reply, signum)
        self.stats.bytes_out += reply.nbytes
        self.sending.append((self.link.Isend(reply, dest=source, tag=reply_tag(request.seq)),
                             reply))

    def _gather(self, out: np.ndarray, source: np.ndarray, slots: np.ndarray) -> None:
        """``out[i, :w] = source[slots[i]]``, chunks of rows on the rank's threads."""
        self.rows.run(lambda lo, hi: gather_rows(out[lo:hi], source, slots[lo:hi]),
                      len(slots))

    def _record_staleness(self, source: int, request: Request) -> None:
        slowest = self.slowest_clock()
        model = self.model_of(request)
        gap = 0 if slowest == float("inf") else model.staleness(request.step, int(slowest))
        if model.bound is not None and gap > model.bound + request.slack:
            raise PSError(f"server rank {self.comm.Get_rank()}: a read by rank {source} at "
                          f"clock {request.step} was served {gap} clocks stale, beyond "
                          f"{model.name}'s bound {model.bound} (+{request.slack} slack)")
        for t in request.tables.tolist():
            name = self.store.layout.specs[t].name if 0 <= t < len(self.models) else str(t)
            self._seen.setdefault(name, Counter())[gap] += 1

    def _apply(self, pushes: list[tuple[int, Request]]) -> None:
        """Apply pushes as one update (their rows summed) and advance their senders' clocks.

        A push's ids are unique per table (the client sums repeats), so a lone push goes
        straight to the optimizer kernel; several (deterministic mode), or a push whose ids
        are not strictly increasing, are summed per slot first."""
        slots, grads, unique = [], [], True
        for source, request in pushes:
            try:
                mine, distinct = self._slots(request)
            except EmbeddingError as exc:  # pushes carry only rows that were pulled: a bug
                raise PSError(f"server rank {self.comm.Get_rank()}: bad push from rank "
                              f"{source}: {exc}") from exc
            slots.append(mine)
            grads.append(request.grads)
            unique = unique and distinct
            self.stats.pushes += 1
            self.stats.rows_in += len(mine)
        if len(pushes) > 1 or not unique:
            rows, summed = coalesce(np.concatenate(slots), np.concatenate(grads))
        else:
            rows, summed = slots[0], np.ascontiguousarray(grads[0], dtype=np.float32)
        lr = pushes[0][1].lr
        if len(rows):
            self.rows.run(lambda lo, hi: self.store.apply(rows[lo:hi], summed[lo:hi], lr),
                          len(rows))
        slowest = self.slowest_clock()
        for source, request in pushes:
            self.clock[source] = request.step + 1
        if self.slowest_clock() > slowest:
            self.store.end_round()

    def _apply_complete_steps(self) -> None:
        """Deterministic mode: apply held steps, oldest first, once no running worker's push
        of that step is missing; workers in rank order so sums are reproducible."""
        while self.held:
            step = min(self.held)
            arrived = self.held[step]
            if any(w not in arrived for w in self.active):
                return
            del self.held[step]
            self._apply([(w, arrived[w]) for w in sorted(arrived)])

    def _write(self, source: int, request: Request) -> None:
        """Values alone (optimizer state reset), or values then optimizer state (tiering)."""
        tables = self.store.tables
        try:
            slots, _ = self._slots(request)
        except EmbeddingError as exc:  # writes carry only rows the worker may place: a bug
            raise PSError(f"server rank {self.comm.Get_rank()}: bad write from rank "
                          f"{source}: {exc}") from exc
        width = request.grads.shape[1]
        if width == self.dim:
            self.store.write_values(slots, request.grads)
        elif width == self.dim + tables.state_width:
            tables.write(slots, request.grads)
        else:
            raise PSError(f"server rank {self.comm.Get_rank()}: a write from rank {source} "
                          f"has rows of {width} values; this server keeps {self.dim} and "
                          f"{tables.state_width} of optimizer state")
        self.stats.rows_written += len(slots)
        reply = encode_rows(np.empty((0, self.dim), dtype=np.float32))
        self.stats.bytes_out += reply.nbytes
        self.sending.append((self.link.Isend(reply, dest=source, tag=reply_tag(request.seq)),
                             reply))

    def _slots(self, request: Request) -> tuple[np.ndarray, bool]:
        """The request's slots and whether they are unique (one kernel call)."""
        return self.store.request_slots(request.tables, request.counts, request.ids)

    def _retry_parked(self) -> None:
        waiting = []
        for parked in self.parked:
            if self._ready(parked.request):
                self.stats.deferred_wait_s += time.perf_counter() - parked.since
                self._answer(parked.source, parked.request)
            else:
                waiting.append(parked)
        self.parked = waiting

    def _reap_sends(self) -> None:
        self.sending = [(r, b) for r, b in self.sending if not r.Test()]
