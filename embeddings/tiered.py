"""Hot/cold tiering: the most used rows replicated on every worker, the long tail in a
backing store (the parameter servers), behind one :class:`EmbeddingStore`.

Every worker calls :meth:`TieredStore.push` once per step and :meth:`TieredStore.flush`
once at the end, and may call :meth:`TieredStore.warm_start` before the first step; all are
collective over ``group`` (the workers). One step:

1. Lookups: hot rows come from the local replica, the others from the cold store in one
   pull. Training lookups are counted (:meth:`~TieredStore.observe`).
2. Push: the step's rows are split by tier. Hot gradients are summed over the workers
   (the toolkit's allreduce of the whole hot block, or ``MPI_Allgatherv`` of the touched
   rows when the block would move many more bytes; the same choice on every worker, as
   it depends only on the
   workers' counts of hot rows, which the trainer's dense allreduce carries, see
   :meth:`~TieredStore.expect`) and every worker applies the same update to its replica.
   The sum is started here and completed before the replica is next read (the next pull,
   push or flush), so it overlaps the next step's start. Cold gradients are pushed to the
   cold store, which is the worker's clock tick.
3. Re-tiering, at the steps of :func:`~embeddings.hotcold.retier_due`, in two halves:

   a. planning, in the background: the lookup counts since the last due step are merged
      (``Allgatherv``) and every worker runs the same
      :class:`~embeddings.hotcold.HotSetPlanner`, so all agree on the new hot set. This runs
      on a thread of its own (its own communicator; inline where MPI lacks
      ``MPI_THREAD_MULTIPLE``) from one due step to the next, off the step's critical path;
   b. at the next due step, between the hot update and the cold push, the plan is installed:
      demoted rows, which already carry this step's update, are written back with their
      optimizer state, each worker writing its share and waiting for the acknowledgement;
      then a barrier, so no worker reads such a row before it is back;
   c. the step's cold push (it still carries the rows about to be promoted);
   d. promoted rows are read with their optimizer state at the next clock, which the servers
      answer only once every worker's pushes of this step are in.

   Each gradient is therefore applied exactly once, by the tier that owns its row that step.
   A hot set therefore reflects the counts up to one re-tiering interval before it is
   installed (the first due step only starts a plan); the rows move at one step boundary.

Carried hot sums: built with ``carry_rows``, the store leaves step 2's sum to the dense engine,
whose gradient reduction carries the hot gradients (:attr:`TieredStore.rider`,
:mod:`embeddings.hotsum`) and applies them before the push; the push then updates cold rows
only. Every step is summed, so hot rows are never stale (bound 0 whatever the sync model).
The store sums on its own where they cannot ride in that reduction (local SGD, ZeRO-2, a
16-bit wire, a GPU worker).

Staleness bound ``s`` (the sync model's): with ``s = 0`` (BSP) hot gradients are summed every
step and a replica is never behind. With ``s > 0`` (SSP) a worker applies its own hot
gradients to its replica at once, and every ``s + 1`` steps the workers sum what they
accumulated into a shared base that refreshes every replica: a cached row lacks at most ``s``
steps of the other workers' updates (for SGD at a constant rate the base equals BSP's).
``None`` (ASP) refreshes every ``interval`` steps. A re-tiering always refreshes first.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numba
import numpy as np
import torch
from mpi4py import MPI

from embeddings.collection import sorted_unique
from embeddings.freq import FrequencyTracker, LookupTotals
from embeddings.hotcold import HotSetPlanner, Retier, best, hot_row_bytes, merge_seen, retier_due
from embeddings.hotsum import HotRider
from embeddings.hottier import CHUNK, HotTier
from embeddings.optim import SparseOptimizer, coalesce
from embeddings.tables import TableLayout, pack_rows, unpack_rows
from embeddings.types import BackingStore, EmbeddingStore, RowSink, RowSource
from hpctrain.comm import Group, allreduce
from hpctrain.comm.native import allgatherv
from hpctrain.config import TieringConfig
from hpctrain.runtime import trace
from hpctrain.runtime.env import release_free_memory
from hpctrain.runtime.waiting import RETIER_THREAD
from hpctrain.runtime.waits import Wait, wait_all

__all__ = ["TieredStore", "TieringStats"]

_NO_ROWS = np.empty(0, dtype=np.int64)
# Inside one node the toolkit's shared-memory allreduce moves a byte far more cheaply than
# MPI's Allgatherv does (3 oversubscribed workers on 2 cores: a 3 MB hot block summed in
# less time than 0.25 MB of touched rows gathered), so there the block may be this many
# times the gathered bytes and still be the faster way.
_SHM_ADVANTAGE = 32


@dataclass
class TieringStats:
    """One worker's view of the tiers over a run (bytes are this worker's)."""

    capacity: int = 0  # hot rows the budget allows
    budget_bytes: int = 0  # capacity x bytes per hot row
    resident_bytes: int = 0  # the hot tier's arrays (peak over the run)
    frequency_bytes: int = 0  # counts and sketches
    hot_rows: int = 0  # rows hot at the end
    lookups: int = 0  # training lookups merged so far (ids, repeats included)
    hits: int = 0  # of which served by the hot tier
    table_lookups: list[int] = field(default_factory=list)
    table_hits: list[int] = field(default_factory=list)
    rows_hot: int = 0  # unique rows pulled from the hot tier
    rows_cold: int = 0  # unique rows pulled from the cold store
    dense_syncs: int = 0  # hot gradients summed by Allreduce of the block
    sparse_syncs: int = 0  # ... by Allgatherv of the touched rows
    carried_syncs: int = 0  # ... in the dense engine's gradient reduction
    carried_spills: int = 0  # of which some rows did not fit the reduction (an Allgatherv)
    carried_rows: int = 0  # hot rows those sums updated, on every worker's replica
    sync_bytes: int = 0  # received in those collectives (ring: 2 (W-1)/W of the block or segment)
    retiers: int = 0
    rows_promoted: int = 0
    rows_demoted: int = 0
    count_bytes: int = 0  # received when merging lookup counts
    retier_s: float = 0.0  # re-tiering on the step's path: waiting for the plan, moving rows
    plan_s: float = 0.0  # merging counts and planning (in the background where MPI allows)
    planned_in_background: bool = False
    warm_start_rows: int = 0  # made hot by a scan of the data before training
    warm_start_count_bytes: int = 0  # received merging the scan's counts
    warm_start_s: float = 0.0
    warm_start_bytes: int = 0  # client traffic of the warm start (not in its counters)
    oracle_hit_rate: float = float("nan")  # best static hot set of `capacity` (worker 0)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class TieredStore(EmbeddingStore):
    """Rows of ``layout``: the hot ones replicated on the workers of ``group``, the others in
    ``cold`` (this worker's handle on the shared backing store)."""

    def __init__(self, layout: TableLayout, cold: BackingStore, group: Group,
                 optimizer: SparseOptimizer, config: TieringConfig, capacity: int,
                 device: torch.device, staleness: int | None = 0,
                 carry_rows: int = 0, background: bool = True) -> None:
        """Hold at most ``capacity`` hot rows (every row when it covers the tables). With
        ``carry_rows`` (at most that many hot rows per worker and step) the dense engine
        sums the hot gradients through :attr:`rider`; ``staleness`` must then be 0.
        ``background``: plan re-tierings on a thread where MPI gives
        ``MPI_THREAD_MULTIPLE`` (inline otherwise; the plans are the same)."""
        if carry_rows and staleness != 0:
            raise ValueError(f"carried hot sums are summed every step: staleness must be 0, "
                             f"got {staleness}")
        self.layout = layout
        self.dim = layout.dim
        self.cold = cold
        self.group = group
        self.comm = group.comm
        self.config = config
        self.staleness = staleness
        self.hot = HotTier(layout.dim, optimizer, device)
        self.base = HotTier(layout.dim, optimizer, device) if staleness != 0 else None
        self.rider = HotRider(self.hot, capacity, self.comm, carry_rows, group.link) \
            if carry_rows else None
        tracker = FrequencyTracker(layout.sizes, config.exact_below, config.sketch_width,
                                   config.sketch_depth, capacity)
        self.planner = HotSetPlanner(tracker, capacity, config.policy, config.admission,
                                     config.decay)
        self.step = 0
        self.last_sync = -1  # the last step whose hot gradients every replica holds
        self._period = (staleness + 1) if staleness is not None else config.interval
        self._lr = 0.0
        self._summing: tuple[MPI.Request, np.ndarray, np.ndarray, np.ndarray, float] | None = None
        # the hot sums' buffer, reused so that its allreduce is checked and planned once
        self._block = np.empty((0, self.dim + 1), dtype=np.float32)
        self._expected: np.ndarray | None = None  # hot rows of each worker's coming push
        self._seen: list[tuple[np.ndarray, np.ndarray, int]] = []
        row = hot_row_bytes(layout.dim, optimizer.state_width(layout.dim), staleness != 0)
        # worker 0's exact lookup counts: of the rows seen, or of every row once that takes
        # less memory and no more than the hot tier
        self._oracle = LookupTotals(layout.total_rows, capacity * row) \
            if group.rank == 0 else None
        # [lookups, hits] per table since the last merge, and up to it (what the oracle saw)
        self._recent = np.zeros((2, len(layout.specs)), dtype=np.int64)
        self._merged = np.zeros((2, len(layout.specs)), dtype=np.int64)
        self.stats = TieringStats(capacity=capacity, budget_bytes=capacity * row,
                                  frequency_bytes=tracker.nbytes)
        self.everything_hot = capacity >= layout.total_rows
        # Re-tiering plans: their count merges on a communicator of their own, so that a
        # planning thread's collectives never interleave with the step's on ``comm``.
        self._plan_comm = self.comm.Dup()
        self._plan_comm.Set_name(f"{self.comm.Get_name()}.retier")  # the watchdog's name
        self._plan_link = group.link.beside(self._plan_comm)
        self._planning = ThreadPoolExecutor(1, thread_name_prefix=RETIER_THREAD) \
            if background and MPI.Query_thread() == MPI.THREAD_MULTIPLE else None
        self.stats.planned_in_background = self._planning is not None
        self._next: Future[Retier] | None = None  # started at the last due step
        if self.everything_hot:
            every = np.arange(layout.total_rows, dtype=np.int64)
            self._install(Retier(every, every, _NO_ROWS))
        else:
            self._install(Retier(_NO_ROWS, _NO_ROWS, _NO_ROWS))

    # -- EmbeddingStore ----------------------------------------------------------------------

    def pull(self, rows: np.ndarray) -> np.ndarray:
        """Hot rows from the replica, the rest in one pull from the cold store."""
        self._finish_sum()
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        cold = self.hot.read(rows, out)
        out[cold] = self.cold.pull(rows[cold])
        self.stats.rows_hot += len(rows) - len(cold)
        self.stats.rows_cold += len(cold)
        return out

    def prefetch(self, rows: np.ndarray, ahead: int) -> None:
        """Prefetch the cold ones; a re-tiering in between makes the cold store read afresh
        (the cold set differs), so no row is read from before it was hot."""
        self.cold.prefetch(rows[~self.hot.locate(rows)[0]], ahead)

    def observe(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Count the lookups per table and hits, and keep the rows for the next re-tiering
        (not when every row is hot: no re-tiering would ever merge them)."""
        _count_lookups(self.layout.offsets, rows, counts, self.hot.locate(rows)[0],
                       self._recent)
        if not self.everything_hot:
            self._seen.append((rows, counts, self.step))

    def warm_start(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """Count lookups seen outside training, ``(unique rows, counts)`` chunks of a scan of
        the data, and make the rows they rank hot (HugeCTR seeds its frequent embeddings
        from the data likewise). Collective over ``group``; before the first push.

        Memory stays in proportion to the hot tier, not to the rows the scan sees: each
        worker adds its chunks to the frequency tracker and keeps, now and then, only its
        ``capacity`` rows of highest count as candidates; then the trackers are summed (a
        sum of count-min sketches still never undercounts) and the candidates gathered, so
        every worker plans on the same input."""
        start = time.perf_counter()
        tracker, keep = self.planner.tracker, self.planner.capacity
        pending, size = [_NO_ROWS], 0
        for rows, counts in chunks:
            tracker.add(rows, np.asarray(counts, dtype=np.float32))
            pending.append(rows)
            size += len(rows)
            if size > keep:  # pruned now and then: each prune sorts and hashes all
                pending = [self._best_counted(sorted_unique(np.concatenate(pending)), keep)]
                size = len(pending[0])
        candidates = self._best_counted(sorted_unique(np.concatenate(pending)), keep)
        workers = self.comm.Get_size()
        for array in tracker.arrays():  # MPI's in place: no scratch as large as the tracker
            allreduce(array, comm=self.group, algorithm="native")
        everyone = allgatherv(candidates, self.comm)
        self.stats.warm_start_count_bytes = int(2 * (workers - 1) / workers * tracker.nbytes
                                                + (len(everyone) - len(candidates)) * 8)
        rows = sorted_unique(everyone)
        del everyone, candidates  # not held through the plan
        self.planner.consider(rows, np.full(len(rows), -1, dtype=np.int32))
        if not self.everything_hot:
            plan = self.planner.plan()
            self._write_back(plan.demoted)
            self._install(plan)
            self.stats.warm_start_rows = len(plan.promoted)
        release_free_memory()
        self.stats.warm_start_s = time.perf_counter() - start

    def _best_counted(self, rows: np.ndarray, keep: int) -> np.ndarray:
        """The ``keep`` of ``rows`` (sorted) with the highest counts, sorted."""
        counts = self.planner.tracker.estimate(rows)
        return np.sort(rows[best(counts, np.zeros(len(rows)), keep)])

    def push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        """Collective over ``group``: hot update, at a due step the last plan installed
        around the cold push and the next one started (module doc)."""
        self._finish_sum()
        rows, grads = coalesce(rows, grads)
        hot, slots = self.hot.locate(rows)
        step, self.step, self._lr = self.step, self.step + 1, lr
        due = not self.everything_hot and retier_due(step, self.config.interval,
                                                     warm_up=not self.stats.warm_start_s)
        pending, self._next = (self._next, None) if due else (None, self._next)
        counts, self._expected = self._expected, None
        if self.rider is None:
            self._update_hot(slots[hot], grads[hot], lr, pending is not None, counts)
        plan = None
        if pending is not None:
            start = time.perf_counter()
            plan = pending.result()
            trace.record("retier: wait plan", start, time.perf_counter(), step=step)
            self._write_back(plan.demoted)
            self.stats.retier_s += time.perf_counter() - start
            trace.record("retier: write back", start, time.perf_counter(), step=step)
        self.cold.push(rows[~hot], grads[~hot], lr)
        if plan is not None:
            start = time.perf_counter()
            if len(plan.promoted) or len(plan.demoted):
                self._install(plan)
            self.stats.retiers += 1
            self.stats.retier_s += time.perf_counter() - start
            trace.record("retier: install", start, time.perf_counter(), step=step)
        if due:
            start = time.perf_counter()
            self._next = self._start_plan()
            self.stats.retier_s += time.perf_counter() - start

    # -- end of training -----------------------------------------------------------------------

    def flush(self) -> None:
        """Write every hot row back with its optimizer state and merge the last counts;
        collective over ``group``. Afterwards the cold store holds every row's current value
        (hot rows stay hot and are still served locally)."""
        self._refresh()
        self._settle()
        self._merge_counts(self._take_seen())
        self._write_back(self.hot.rows)

    @contextmanager
    def consistent_reads(self) -> Iterator[None]:
        """Hot replicas refreshed with every worker's hot gradients so far (collective over
        ``group``; under a staleness bound this brings the next refresh forward), cold rows
        read as the cold store's :meth:`~embeddings.types.EmbeddingStore.consistent_reads`
        does."""
        self._refresh()
        with self.cold.consistent_reads():
            yield

    def _refresh(self) -> None:
        """Complete the hot sum in flight and, under a staleness bound, sum what the workers
        accumulated since the last refresh: every replica then holds every hot update."""
        self._finish_sum()
        if self.base is not None and self.last_sync < self.step - 1:
            self._update_hot(_NO_ROWS, np.empty((0, self.dim), np.float32), self._lr, True,
                             None)

    def save(self, out: RowSink) -> None:
        """The hot rows' current values go back to the cold store, which saves them."""
        self.flush()
        self.cold.save(out)

    def restore(self, source: RowSource) -> None:
        """The cold store takes up the checkpoint; the hot tier counts its own steps anew."""
        self.cold.restore(source)

    def close(self) -> None:
        """Write the hot rows back, so the cold store holds the whole model, and close it;
        a plan not installed yet is dropped."""
        self.flush()
        self.cold.close()
        if self._planning is not None:
            self._planning.shutdown()
        self._plan_link.close()
        self._plan_comm.Free()

    @property
    def retier_s(self) -> float:
        return self.stats.retier_s

    def report(self) -> TieringStats:
        """The counters so far. Hit rates cover the lookups merged so far (up to the last
        re-tiering, or all after :meth:`flush`), the same ones worker 0's oracle hit rate
        covers."""
        self._settle()  # the planning thread's counters
        stats = self.stats
        stats.hot_rows = len(self.hot)
        stats.table_lookups, stats.table_hits = self._merged.tolist()
        stats.lookups, stats.hits = sum(stats.table_lookups), sum(stats.table_hits)
        if self.rider is not None:  # the only hot sums in this mode
            workers = self.comm.Get_size()
            stats.carried_syncs = self.rider.applied
            stats.carried_spills = self.rider.spills
            stats.carried_rows = self.rider.rows_applied
            stats.sync_bytes = int(self.rider.applied * 2 * (workers - 1) / workers
                                   * self.rider.segment_bytes()) + self.rider.spill_bytes
        if self._oracle is not None:  # every row hot: so would the best static set be
            stats.oracle_hit_rate = 1.0 if self.everything_hot else \
                self._oracle.hit_rate(stats.capacity)
        return stats

    # -- internals -----------------------------------------------------------------------------

    def _update_hot(self, slots: np.ndarray, grads: np.ndarray, lr: float, retier: bool,
                    counts: np.ndarray | None) -> None:
        """Apply this step's hot gradients as the staleness bound asks: summed over the
        workers now or by the next read (bound 0), or locally with a periodic refresh."""
        if self.base is None:
            self._start_sum(slots, grads, lr, counts)
            if retier:
                self._finish_sum()
            return
        self._pending[slots] += grads
        self._touched[slots] = True
        if not retier and self.step % self._period:
            self.hot.apply(slots, grads, lr)
            return
        touched = np.flatnonzero(self._touched)
        self._start_sum(touched, self._pending[touched], lr, None)
        self._finish_sum(into=self.base)
        self.hot.copy_from(self.base)
        self._pending[:] = 0.0
        self._touched[:] = False

    def withhold(self, rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The push that drops this worker's gradients (a non-finite share): no cold row,
        and the hot rows with zero gradients, since every worker already counts on them in
        the hot sum (:meth:`expect`)."""
        hot = self.hot.locate(rows)[0]
        return rows[hot], np.zeros_like(grads[hot])

    def hot_count(self, rows: np.ndarray) -> int:
        """Hot rows among the unique ``rows`` of the coming push: a caller that sums these
        counts over the workers in a collective it issues anyway hands them to
        :meth:`expect`, and the push saves one collective."""
        return int(self.hot.locate(rows)[0].sum())

    def expect(self, counts: np.ndarray) -> None:
        """Every worker's :meth:`hot_count` for the coming push, in worker order."""
        self._expected = np.asarray(counts, dtype=np.int64)

    def _start_sum(self, slots: np.ndarray, grads: np.ndarray, lr: float,
                   counts: np.ndarray | None) -> None:
        """Start summing every worker's hot gradients: an ``Iallgather`` of their counts,
        unless :meth:`expect` gave them."""
        if counts is None:
            counts = np.empty(self.comm.Get_size(), dtype=np.int64)
            request = self.comm.Iallgather(np.array([len(slots)], dtype=np.int64), counts)
        elif counts[self.comm.Get_rank()] != len(slots):
            raise ValueError(f"expected {counts[self.comm.Get_rank()]} hot rows in this "
                             f"push, got {len(slots)}")
        else:
            request = MPI.REQUEST_NULL
        self._summing = (request, counts, slots, grads, lr)

    def _finish_sum(self, into: HotTier | None = None) -> None:
        """Complete the sum started by :meth:`_start_sum` and apply it to ``into`` (the
        replica by default); equal on every worker.

        By the counts, either the toolkit's allreduce (:func:`hpctrain.comm.allreduce`, shared
        memory inside a node) of the hot block with a touched flag per row, or an
        ``Iallgatherv`` of (slot, gradient) pairs when the block would move many more bytes
        (:data:`_SHM_ADVANTAGE`). The ``Iallgatherv`` is completed by
        :func:`~hpctrain.runtime.waits.wait_all`, which yields the core: a blocking MPICH
        collective spins, taking the core its peers need where ranks outnumber cores."""
        if self._summing is None:
            return
        request, counts, slots, grads, lr = self._summing
        self._summing = None
        wait_all([request], Wait("allgather", self.comm))
        total = int(counts.sum())
        self.last_sync = self.step - 1
        if total == 0:
            return
        into = into or self.hot
        workers = self.comm.Get_size()
        share = (workers - 1) / workers
        dense = 2 * share * into.slots * (self.dim + 1) * 4
        sparse = share * total * (self.dim + 2) * 4
        if dense <= sparse * (_SHM_ADVANTAGE if self.group.layout.nodes == 1 else 1):
            if len(self._block) != into.slots:
                self._block = np.empty((into.slots, self.dim + 1), dtype=np.float32)
            block = self._block
            block.fill(0.0)
            block[slots, : self.dim] = grads
            block[slots, self.dim] = 1.0
            allreduce(block, comm=self.group)
            self.stats.dense_syncs += 1
            self.stats.sync_bytes += int(dense)
            touched = np.flatnonzero(block[:, self.dim])
            into.apply(touched, np.ascontiguousarray(block[touched, : self.dim]), lr)
            return
        # One message per worker: each slot and its gradient as one line of int32 words.
        everyone = allgatherv(pack_rows(slots, grads), self.comm, yielding=True,
                              link=self.group.link, counts=counts)
        self.stats.sparse_syncs += 1
        self.stats.sync_bytes += (total - len(slots)) * (self.dim + 2) * 4
        into.apply(*coalesce(*unpack_rows(everyone)), lr)

    def _start_plan(self) -> Future[Retier]:
        """The next re-tiering from the lookups seen so far: planned on the planning thread,
        or here when there is none."""
        seen = self._take_seen()
        if self._planning is not None:
            return self._planning.submit(self._plan, seen)
        done: Future[Retier] = Future()
        done.set_result(self._plan(seen))
        return done

    def _plan(self, seen: list[tuple[np.ndarray, np.ndarray, int]]) -> Retier:
        """Counts merged, then the next hot set (the planner's state is this call's alone
        while a plan is in flight: :meth:`_settle` waits for it)."""
        start = time.perf_counter()
        with trace.span("retier: plan"):
            self._merge_counts(seen)
            plan = self.planner.plan()
        self.stats.plan_s += time.perf_counter() - start
        return plan

    def _settle(self) -> None:
        """Wait for the plan in flight, if any (it stays to be installed at the next due
        step): before anything else reads or counts into the planner."""
        if self._next is not None:
            self._next.result()

    def _take_seen(self) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """The lookups observed since the last merge, handed over; their per-table counts
        join the merged ones."""
        seen, self._seen = self._seen, []
        self._merged += self._recent
        self._recent[:] = 0
        return seen

    def _merge_counts(self, seen: list[tuple[np.ndarray, np.ndarray, int]]) -> None:
        """``Allgatherv`` of every worker's (row, lookups, last step) of ``seen``; every
        worker records the same merged counts (and worker 0 its oracle's)."""
        if seen:
            rows, counts, last = merge_seen(
                np.concatenate([r for r, _, _ in seen]),
                np.concatenate([c for _, c, _ in seen]),
                np.concatenate([np.full(len(r), s, dtype=np.int64) for r, _, s in seen]))
        else:
            rows, counts, last = _NO_ROWS, np.empty(0, np.float32), _NO_ROWS
        del seen[:]  # the observations go as soon as they are merged
        mine = np.stack([rows, counts.astype(np.int64), last], axis=1)
        everyone = allgatherv(mine, self._plan_comm, yielding=True, link=self._plan_link)
        self.stats.count_bytes += (len(everyone) - len(mine)) * mine.itemsize * 3
        rows, counts, last = merge_seen(everyone[:, 0], everyone[:, 1], everyone[:, 2])
        self.planner.record(rows, counts, last)
        if self._oracle is not None:
            self._oracle.add(rows, counts)

    def _write_back(self, rows: np.ndarray) -> None:
        """This worker's share of ``rows`` (every ``W``-th) written to the cold store with
        values and optimizer state in chunks of :data:`CHUNK` rows, acknowledged; then an
        ``Ibarrier`` over the workers."""
        mine = rows[self.comm.Get_rank():: self.comm.Get_size()]
        for lo in range(0, len(mine), CHUNK):  # a chunk's message at a time, not the tier's
            part = mine[lo: lo + CHUNK]
            self.cold.write(part, self.hot.export(self.hot.locate(part)[1]))
        wait_all([self.comm.Ibarrier()], Wait("barrier", self.comm))

    def _install(self, plan: Retier) -> None:
        """Become ``plan``'s hot set, the promoted rows read from the cold store in chunks
        (each ``READ`` at this worker's clock, so all see the same values) into the slots
        the demoted rows free: a re-tiering holds the tier and one chunk, not also every
        promoted row's message."""
        self.hot.replace(plan.hot, plan.promoted, self.cold.read)
        self.stats.rows_promoted += len(plan.promoted)
        self.stats.rows_demoted += len(plan.demoted)
        if self.base is not None:
            self.base.copy_from(self.hot)
            self._pending = np.zeros((self.hot.slots, self.dim), dtype=np.float32)
            self._touched = np.zeros(self.hot.slots, dtype=bool)
        shared = self.hot.rows.nbytes + self.hot.slot_of.nbytes  # the base shares them
        extra = 0 if self.base is None else (self.base.resident_bytes - shared
                                             + self._pending.nbytes + self._touched.nbytes)
        self.stats.resident_bytes = max(self.stats.resident_bytes,
                                        self.hot.resident_bytes + extra)


@numba.njit(cache=True, nogil=True)
def _count_lookups(offsets, rows, counts, hot, recent):  # pragma: no cover - compiled
    """Add each row's lookups to its table's count in ``recent[0]``, and in ``recent[1]``
    where the row is ``hot``; ``offsets`` are the tables' first rows, ascending."""
    table = 0
    for i in range(len(rows)):
        if i and rows[i] < rows[i - 1]:
            table = 0
        while table + 1 < len(offsets) and offsets[table + 1] <= rows[i]:
            table += 1
        recent[0, table] += counts[i]
        if hot[i]:
            recent[1, table] += counts[i]
