"""Tables sharded over the workers, reached by all-to-all exchanges (DLRM's and TorchRec's
model-parallel embeddings, beside the replicated and the parameter-server layouts).

Each worker owns the rows (or, column-wise, the column blocks) that its
:class:`~embeddings.worker_sharding.WorkerPlan` gives it. A :meth:`pull` sends each of the
batch's unique rows to its owner (column-wise: to every worker), the owners answer with the
rows' current values (column-wise: their columns, concatenated by the asker), and the
:class:`~embeddings.collection.EmbeddingCollection` pools them on the worker; ids arrive
de-duplicated per destination, and only touched rows move. Returning unique rows rather than
pooled vectors: DLRM's bags hold one id per sample and table, so a bag's pooled vector is
one row and the unique rows are never more than the pooled vectors. A :meth:`push` sums
this worker's gradients per row, sends each to the row's owner, and the owner sums them over
all workers and applies the sparse optimizer to the rows it owns (SGD, row-wise Adagrad,
lazy Adam).

Every pull and push is collective over the workers: one ``MPI_Allgather`` of the count
matrix, then :func:`~hpctrain.comm.alltoall.alltoallv` (whose algorithm the cost model
picks). A push of exactly the last training pull's rows (one micro-batch a step) sends no
ids: the owners kept the pull's, in the order the gradients come. The next step's first
pull, announced by :meth:`ShardedTables.prefetch`, is done inside the push: its ids travel
with the gradients and its values come back once the owners have applied them. Training
steps pull in lockstep; evaluation, where workers may make different numbers of lookups,
ends with :meth:`finish_lookups`, which serves the others' remaining pulls.

A checkpoint holds full rows with global ids (``shard-w{rank}.h5``, one part per worker),
whatever the sharding: column-wise shards first trade their blocks so that each worker
writes full rows of a balanced range. :meth:`ShardedTables.restore` reads every saved row
and keeps the rows (or columns) the plan gives this worker, so a run can resume onto
another number of workers, another sharding, or from a replicated checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numba
import numpy as np

from embeddings import worker_sharding
from embeddings.optim import SparseOptimizer, coalesce
from embeddings.tables import LocalTables, TableLayout, init_rows
from embeddings.types import EmbeddingStore, RowSink, RowSource
from embeddings.worker_sharding import WorkerPlacement, WorkerPlan
from hpctrain.comm import allreduce
from hpctrain.comm.alltoall import alltoallv, exchange_counts
from hpctrain.comm.bytecopy import copy_bytes
from hpctrain.comm.group import Group
from hpctrain.errors import EmbeddingError
from hpctrain.runtime.topology import shard_range
from hpctrain.runtime.waiting import watching

__all__ = ["ShardedTables", "ColumnTables", "ExchangeStats", "compile_kernels"]

_ID = 8  # bytes of one id on the wire
_INIT_BLOCK = 1 << 14


@dataclass
class ExchangeStats:
    """Bytes this worker sent to other workers (what leaves the rank), and the minimum the
    steps' batches needed: each remote row's id once, its value once, its gradient once."""

    pulls: int = 0
    pushes: int = 0
    pulls_ahead: int = 0  # training pulls done inside the push before them
    id_bytes_sent: int = 0
    value_bytes_sent: int = 0
    grad_bytes_sent: int = 0
    count_bytes_sent: int = 0  # the count matrices (allgathered)
    train_bytes_sent: int = 0  # pulls marked as training (by observe) and pushes
    min_bytes: int = 0

    @property
    def bytes_sent(self) -> int:
        return (self.id_bytes_sent + self.value_bytes_sent + self.grad_bytes_sent +
                self.count_bytes_sent)

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "bytes_sent": self.bytes_sent}


@dataclass(frozen=True)
class _Routed:
    """One training pull's routing: its rows, the order that groups them by owner, rows per
    owner, the slots this worker was asked for (as owner) in the order asked, and the
    count matrix."""

    rows: np.ndarray
    order: np.ndarray
    counts: np.ndarray
    got_slots: np.ndarray
    matrix: np.ndarray


@dataclass(frozen=True)
class _Fetched:
    """The next step's first pull, done ahead: its routing and the values it gets."""

    routed: _Routed
    values: np.ndarray


class ColumnTables:
    """Columns ``[lo, hi)`` of every row, with their optimizer state (column-wise shards).

    Row-wise Adagrad keeps one accumulator per row of the mean squared gradient over the
    whole row; the owners of a row's blocks sum their partial squares with one allreduce
    over ``group`` (they all see the same touched rows, in the same order), so the update
    equals the unsharded one. SGD and lazy Adam are per element and need nothing.
    """

    def __init__(self, layout: TableLayout, optimizer: SparseOptimizer, seed: int, lo: int,
                 hi: int, group: Group) -> None:
        self.layout, self.optimizer, self.group = layout, optimizer, group
        self.dim, self.full_dim = hi - lo, layout.dim
        n = layout.total_rows
        self.weight = np.empty((n, self.dim), np.float32)
        for a in range(0, n, _INIT_BLOCK):
            b = min(n, a + _INIT_BLOCK)
            self.weight[a:b] = init_rows(layout, np.arange(a, b, dtype=np.int64), seed)[:, lo:hi]
        width = 1 if optimizer.kind == "adagrad" else optimizer.state_width(self.dim)
        self.state = np.zeros((n, width), np.float32)

    def pull(self, rows: np.ndarray) -> np.ndarray:
        return np.take(self.weight, rows, axis=0)

    def push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        rows, grads = coalesce(rows, grads)
        if self.optimizer.kind != "adagrad":
            self.optimizer.apply(self.weight, self.state, rows, grads, lr)
            return
        # rounded as the row-wise kernel does: float32 squares summed in float64, one
        # rounding of the new accumulator to float32
        squares = np.square(grads).astype(np.float64).sum(axis=1)
        allreduce(squares, comm=self.group, algorithm="native")
        acc = (self.state[rows, 0].astype(np.float64) + squares / self.full_dim).astype(
            np.float32)
        self.state[rows, 0] = acc
        step = np.float32(lr) / (np.sqrt(acc) + np.float32(self.optimizer.eps))
        self.weight[rows] -= step[:, None] * grads


class ShardedTables(EmbeddingStore):
    """This worker's shard of every table; ``pull`` and ``push`` are collective over
    ``group``'s ranks (the workers)."""

    def __init__(self, layout: TableLayout, plan: WorkerPlan, optimizer: SparseOptimizer,
                 seed: int, group: Group) -> None:
        self.layout, self.plan, self.group = layout, plan, group
        self.dim = layout.dim
        self.placement = WorkerPlacement(plan)
        r, p = group.rank, group.size
        self.lo, self.hi = plan.columns(r)
        self.widths = np.array([np.subtract(*plan.columns(w)[::-1]) for w in range(p)],
                               np.int64)
        if plan.by_columns:
            self.tables: LocalTables | ColumnTables = ColumnTables(
                layout, optimizer, seed, self.lo, self.hi, group)
        else:
            self.tables = LocalTables(layout, optimizer, seed, self.placement.rows_on(r),
                                      self.placement.rows_of(r))
        self.stats = ExchangeStats()
        self._training = False
        self._routed: _Routed | None = None  # the last training pull's, for its push
        self._next: np.ndarray | None = None  # the next step's first pull, announced
        self._fetched: _Fetched | None = None  # that pull, done inside the push

    # -- the protocol ----------------------------------------------------------------------

    def observe(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Marks the next pull as a training lookup (for the byte accounting)."""
        self._training = True

    def pull(self, rows: np.ndarray) -> np.ndarray:
        """Values of the unique global ``rows``: ids to their owners, values back."""
        rows = np.asarray(rows, dtype=np.int64)
        out = self._pull(rows, active=1)
        self._training = False
        return out

    def prefetch(self, rows: np.ndarray, ahead: int) -> None:
        """The next step's first pull asks for ``rows`` (``ahead`` 1): their ids ride to
        their owners with this step's push, and the owners answer with the rows' values
        once they have applied it, so that pull moves nothing."""
        if ahead == 1:
            self._next = np.asarray(rows, dtype=np.int64)

    def push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        """Sum gradients per row, send each to the row's owner(s), who apply them.

        One count exchange carries two agreements. When every worker pushes exactly the
        rows of its last training pull (one micro-batch a step), the owners already hold
        those rows' ids in the order the gradients come, and no id is sent again; a
        worker whose rows differ (accumulated micro-batches, a withheld share) makes every
        worker send them. When every worker announced its next pull (:meth:`prefetch`),
        those ids travel in the gradients' exchange and their values come back as soon as
        the owners have applied the gradients: the values that pull would read, since
        nothing else writes rows between a push and the next training pull."""
        with watching("alltoallv", self.group.comm):
            self._push(*coalesce(rows, grads), lr)

    def _push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        routed, upcoming, self._routed, self._next = self._routed, self._next, None, None
        mine = routed is not None and np.array_equal(rows, routed.rows)
        order, counts, slots = (routed.order, routed.counts, None) if mine else \
            self._route(rows)
        ahead = self._route(upcoming) if upcoming is not None else None
        p = self.group.size
        both = np.concatenate([counts, ahead[1] if ahead else np.zeros(p, np.int64)])
        matrices, flags = self._counts(both, int(mine) | 2 * (ahead is not None), train=True)
        matrix, next_matrix = matrices[:, :p], matrices[:, p:]
        if (flags & 1).all():
            got_slots = routed.got_slots
        else:
            if slots is None:
                order, counts, slots = self._route(rows)
            got_slots, _ = self._send_ids(slots, counts, matrix, train=True)
        ride = ahead is not None and bool((flags & 2).all())
        got, next_slots = self._send_grads(grads, order, counts, matrix,
                                           (ahead, next_matrix) if ride else None)
        self.stats.min_bytes += self._minimum(counts)
        self.stats.pushes += 1
        self.tables.push(got_slots, got.reshape(len(got_slots), self.tables.dim), lr)
        if ride:
            routed = _Routed(upcoming, ahead[0], ahead[1], next_slots, next_matrix)
            self._fetched = _Fetched(routed, self._values(routed, train=True))

    def finish_lookups(self) -> None:
        """Serve the other workers' pulls until every worker has called this (after an
        evaluation, where workers may have looked up different numbers of batches)."""
        while self._pull(np.empty(0, np.int64), active=0) is not None:
            pass

    def save(self, out: RowSink) -> None:
        """Write this worker's rows as part ``shard-w{rank}.h5``: full width with global
        ids, optimizer state in the unsharded layout (column-wise: after one exchange of
        blocks)."""
        name = f"shard-w{self.group.rank}.h5"
        if self.plan.by_columns:
            with watching("alltoallv", self.group.comm):
                rows = self._full_rows()
            out.write(name, *rows)
        else:
            tables = self.tables
            rows = self.placement.rows_of(self.group.rank)(0, len(tables.weight))
            out.write(name, rows, tables.weight, tables.state)

    def restore(self, source: RowSource) -> None:
        """Keep the saved rows (column-wise: their columns) this worker owns under its
        plan, whatever layout wrote them."""
        tables, plan, r, dim = self.tables, self.plan, self.group.rank, self.plan.dim
        c0, c1 = self.lo, self.hi
        adam = plan.by_columns and tables.optimizer.kind == "adam"
        for rows, weight, state in source.rows(dim, tables.optimizer.state_width(dim)):
            owner, slots = self.placement.locate(rows)
            keep = slice(None) if plan.by_columns else owner == r
            slots = slots[keep]
            tables.weight[slots] = weight[keep, c0:c1]
            if adam:  # moments per column, then the row's step count
                tables.state[slots] = np.concatenate(
                    [state[keep, c0:c1], state[keep, dim + c0:dim + c1],
                     state[keep, 2 * dim:]], axis=1)
            else:
                tables.state[slots] = state[keep, :tables.state.shape[1]]

    def _full_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Column-wise: full rows ``shard_range(rows, p, rank)``, gathered from every
        worker's block (collective)."""
        tables, plan = self.tables, self.plan
        p, r, n = self.group.size, self.group.rank, len(tables.weight)
        ranges = [shard_range(n, p, j) for j in range(p)]
        block = np.concatenate([tables.weight, tables.state], axis=1)
        counts = np.array([hi - lo for lo, hi in ranges], np.int64)
        got, _ = alltoallv(np.ascontiguousarray(block.reshape(-1)), counts * block.shape[1],
                           comm=self.group)
        lo, hi = ranges[r]
        mine, dim = hi - lo, plan.dim
        adam = tables.optimizer.kind == "adam"
        weight = np.empty((mine, dim), np.float32)
        state = np.empty((mine, tables.optimizer.state_width(dim)), np.float32)
        start = 0
        for j in range(p):
            c0, c1 = plan.columns(j)
            w = c1 - c0
            cols = w + (2 * w + 1 if adam else tables.state.shape[1])
            part = got[start:start + mine * cols].reshape(mine, cols)
            start += part.size
            weight[:, c0:c1] = part[:, :w]
            if adam:  # moments per column, then the row's step count
                state[:, c0:c1] = part[:, w:2 * w]
                state[:, dim + c0:dim + c1] = part[:, 2 * w:3 * w]
                state[:, 2 * dim] = part[:, 3 * w]
            elif state.shape[1]:  # row-wise Adagrad: one accumulator, alike on every block
                state[:, 0] = part[:, w]
        return np.arange(lo, hi, dtype=np.int64), weight, state

    # -- the exchanges ---------------------------------------------------------------------

    def _pull(self, rows: np.ndarray, active: int) -> np.ndarray | None:
        """One pull round; ``None`` when no worker is pulling any more (``active`` 0 on
        all). A training pull that the last push did ahead moves nothing."""
        fetched = self._fetched if self._training else None
        if fetched is not None:
            self._fetched = None
            if not np.array_equal(rows, fetched.routed.rows):  # every worker's rode ahead
                raise RuntimeError("all-to-all store: a training pull of other rows than "
                                   "its prefetch announced")
            self._routed = fetched.routed
            self.stats.pulls += 1
            self.stats.pulls_ahead += 1
            return fetched.values
        order, counts, slots = self._route(rows)
        with watching("alltoallv", self.group.comm):
            matrix, flags = self._counts(counts, active, train=self._training)
            if not flags.any():
                return None
            got_slots, _ = self._send_ids(slots, counts, matrix, train=self._training)
            routed = _Routed(rows, order, counts, got_slots, matrix)
            if self._training:
                self._routed = routed
            self.stats.pulls += active
            return self._values(routed, self._training)

    def _values(self, routed: _Routed, train: bool) -> np.ndarray:
        """Values of ``routed.rows``: every owner sends those it was asked for (one
        ``alltoallv``; column-wise each sends its columns, concatenated here)."""
        values = self.tables.pull(routed.got_slots)
        r, n, matrix = self.group.rank, len(routed.rows), routed.matrix
        asked = matrix[:, r]
        out = np.empty((n, self.dim), np.float32)
        if self.plan.by_columns:
            reply, _ = alltoallv(values.reshape(-1), asked * self.widths[r], comm=self.group,
                                 matrix=matrix.T * self.widths[:, None])
            start = 0
            for j in range(self.group.size):
                width = int(self.widths[j])
                out[:, self._cols(j)] = reply[start:start + n * width].reshape(n, width)
                start += n * width
        else:
            reply, _ = alltoallv(values, asked, comm=self.group, matrix=matrix.T)
            out[routed.order] = reply
        self._account("value_bytes_sent", 4 * int(self.widths[r]), asked, train)
        return out

    def _send_grads(self, grads: np.ndarray, order: np.ndarray, counts: np.ndarray,
                    matrix: np.ndarray, ahead: tuple[tuple[np.ndarray, ...], np.ndarray] | None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Each owner's gradients (column-wise: each block's columns), and with ``ahead``
        (the next pull's routing and count matrix) each owner's next ids behind them, in
        one exchange of bytes; returns the gradients received (float32, flat) and the next
        ids received as owner."""
        p, r = self.group.size, self.group.rank
        flat = np.concatenate([grads[:, self._cols(j)].reshape(-1) for j in range(p)]) \
            if self.plan.by_columns else grads[order].reshape(-1)
        sizes = counts * self.widths  # values to each owner
        self._account("grad_bytes_sent", 4 * self.widths, counts, train=True)
        if ahead is None:
            got, _ = alltoallv(flat, sizes, comm=self.group,
                               matrix=matrix * self.widths[None, :])
            return got, np.empty(0, np.int64)
        (_, next_counts, next_slots), next_matrix = ahead
        self._account("id_bytes_sent", _ID, next_counts, train=True)
        send = _interleave(flat.view(np.uint8), 4 * sizes, next_slots.view(np.uint8),
                           _ID * next_counts)
        got, _ = alltoallv(send, 4 * sizes + _ID * next_counts, comm=self.group,
                           matrix=matrix * 4 * self.widths[None, :] + next_matrix * _ID)
        grads_in, ids_in = _deinterleave(got, matrix[:, r] * 4 * self.widths[r],
                                         next_matrix[:, r] * _ID)
        return grads_in.view(np.float32), ids_in.view(np.int64)

    def _route(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order that groups ``rows`` by owner, rows per owner, their slots in that order);
        column-wise every row goes to every worker."""
        order, counts, slots, bad = self.placement.route(rows)
        if bad >= 0:  # checked before any message: no owner is asked for a row it lacks
            row = int(rows[bad])
            t = max(0, int(self.layout.table_of(np.array([row]))[0]))
            spec = self.layout.specs[t]
            raise EmbeddingError(f"id {row - int(self.layout.offsets[t])} is outside table "
                                 f"{spec.name!r} of {spec.rows} rows")
        return order, counts, slots

    def _counts(self, counts: np.ndarray, flag: int, train: bool
                ) -> tuple[np.ndarray, np.ndarray]:
        """Every worker's ``counts`` (rows: workers) and ``flag`` (``MPI_Allgather``)."""
        matrix, flags = exchange_counts(counts, self.group, flag)
        self._account("count_bytes_sent", _ID * (len(counts) + 1),
                      np.ones(self.group.size, np.int64), train)
        return matrix, flags

    def _send_ids(self, slots: np.ndarray, counts: np.ndarray, matrix: np.ndarray,
                  train: bool) -> tuple[np.ndarray, np.ndarray]:
        self._account("id_bytes_sent", _ID, counts, train)
        return alltoallv(slots, counts, comm=self.group, matrix=matrix)

    def _account(self, field: str, row_bytes: int | np.ndarray, counts: np.ndarray,
                 train: bool) -> None:
        """Add the bytes of ``counts[j]`` rows of ``row_bytes`` (or ``row_bytes[j]``) for
        each destination ``j`` other than this rank."""
        remote = counts.copy()
        remote[self.group.rank] = 0
        sent = int((remote * row_bytes).sum())
        setattr(self.stats, field, getattr(self.stats, field) + sent)
        if train:
            self.stats.train_bytes_sent += sent

    def _minimum(self, counts: np.ndarray) -> int:
        """Bytes this step's pushed rows needed at least: per remote destination, the id,
        the value and the gradient (column-wise: of that destination's columns)."""
        remote = counts.copy()
        remote[self.group.rank] = 0
        return int((remote * (_ID + 2 * 4 * self.widths)).sum())

    def _cols(self, worker: int) -> slice:
        lo, hi = self.plan.columns(worker)
        return slice(lo, hi)


def _interleave(a, a_sizes, b, b_sizes):
    """Bytes ``a`` and ``b``, cut into consecutive segments of ``a_sizes`` and ``b_sizes``
    bytes, as one buffer of ``a``'s segment 0, ``b``'s segment 0, ``a``'s 1, ..."""
    whole = np.empty(a.size + b.size, np.uint8)
    _weave(whole, a, a_sizes, b, b_sizes, True)
    return whole


def _deinterleave(whole, a_sizes, b_sizes):
    """The inverse of :func:`_interleave`: (``a``'s segments, ``b``'s segments)."""
    a, b = np.empty(a_sizes.sum(), np.uint8), np.empty(b_sizes.sum(), np.uint8)
    _weave(whole, a, a_sizes, b, b_sizes, False)
    return a, b


@numba.njit(cache=True, nogil=True)
def _weave(whole, a, a_sizes, b, b_sizes, pack):
    """Copy between ``whole`` and the segments of ``a`` and ``b`` that alternate in it, into
    ``whole`` when ``pack`` (one ``memcpy`` a segment: numba's slice assignment copies a byte
    at a time)."""
    at = i = k = 0
    for j in range(a_sizes.size):
        for part, start, n in ((a, i, a_sizes[j]), (b, k, b_sizes[j])):
            if pack:
                copy_bytes(whole, at, part, start, n)
            else:
                copy_bytes(part, start, whole, at, n)
            at += n
        i, k = i + a_sizes[j], k + b_sizes[j]


def compile_kernels() -> None:
    """Run the store's numba passes once on a few elements with a step's argument types
    (placement, grouping by owner, the gradients' and ids' packing)."""
    one = np.ones(1, np.int64)
    locate = worker_sharding._locate(one, one - 1, one + 1, one - 1, one, one, one - 1,
                                     np.zeros((1, 1), np.int64))
    worker_sharding._group(locate[0], locate[1], 1)
    sizes = np.ones(1, np.int64)
    _deinterleave(_interleave(np.zeros(1, np.uint8), sizes, np.zeros(1, np.uint8), sizes),
                  sizes, sizes)
