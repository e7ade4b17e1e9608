"""Hot-row gradients that ride in the dense gradient reduction: one collective per step.

A tiered store's replicas stay equal only if every worker applies the sum of every worker's
hot-row gradients. Summing them in a collective of their own costs a second reduction per
step; instead :class:`HotRider` writes this worker's hot gradients into a fixed-size float32
segment that the dense engine appends to its gradient buckets (the tail of
:class:`~hpctrain.comm.fusion.FusedGradients`), and reads the sums back once that reduction
is done. The segment's size is fixed when the buckets are laid out, so it has one of two
layouts, the smaller for the job (the same on every worker):

- **dense**: one ``dim + 1`` line per hot slot: the summed gradient and a touched count, so
  a row that some worker touched is updated even when its gradients sum to zero (lazy
  Adam advances such a row);
- **records**: one region per worker, ``1 + max_rows * (dim + 1)`` values: a record count,
  then ``(slot, gradient)`` records. Only the owner writes a region, so the reduction's sum
  is an exact copy of it, and the segment does the work of an allgather. Slots and counts
  are float32, exact below 2**24, so this layout needs fewer hot rows than that.

``max_rows`` is what a worker's region holds, sized from the data (the trainer takes the
most unique rows in a sample of steps, :mod:`hpctrain.train.build`), not from the most
a step could touch (its samples times the tables, two to three times as many on Zipf ids),
since every value of the segment costs every worker a copy in the reduction. A step whose
hot rows outnumber it still sums them all: its count says so, and the records beyond the
region travel in an ``Allgatherv`` of their own once the reduction is done, which every
worker joins, having read the same counts. A worker whose embedding gradients hold a NaN or
Inf writes nothing: its share of the step is dropped, as the trainer drops its cold rows.
The segment lives in host memory (the CPU engine's buffers); on a GPU the tiered store sums
on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numba
import numpy as np
import torch
from mpi4py import MPI

from embeddings.collection import Lookup, lookup_rows
from embeddings.hottier import HotTier
from embeddings.optim import coalesce
from hpctrain.comm.native import allgatherv

if TYPE_CHECKING:
    from hpctrain.comm.emulate import Channel

__all__ = ["HotRider", "EXACT_BELOW"]

EXACT_BELOW = 1 << 24  # float32 holds every integer below this exactly


class HotRider:
    """This worker's hot-row gradients as the float32 tail of the dense reduction over the
    workers of ``comm``, applied to ``hot`` once summed."""

    def __init__(self, hot: HotTier, capacity: int, comm: MPI.Comm, max_rows: int,
                 link: Channel | None = None) -> None:
        """``link``: a :class:`~hpctrain.comm.emulate.Channel` over ``comm``, which delays the
        spilled records' ``Allgatherv`` under ``comm.emulate``."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.hot, self.comm, self.link = hot, comm, link
        self.workers, self.rank = comm.Get_size(), comm.Get_rank()
        self.dim = hot.dim
        self.width = hot.dim + 1
        self.max_rows = min(max_rows, capacity)
        self.region = 1 + self.max_rows * self.width
        self.records = (self.workers * self.region < capacity * self.width
                        and capacity < EXACT_BELOW)
        self.size = self.workers * self.region if self.records else capacity * self.width
        """Float32 values of the segment."""
        # scratch of the records' sum; slots are below EXACT_BELOW
        self._where = np.full(capacity, -1, dtype=np.int32)
        self._spill = np.empty((0, self.width), dtype=np.float32)  # this step's extra records
        self.applied = 0  # sums applied
        self.rows_applied = 0  # unique hot rows updated by them
        self.spills = 0  # of the sums, those whose records did not all fit the regions
        self.spill_bytes = 0  # received in their exchanges

    def fill(self, lookups: list[Lookup], out: torch.Tensor) -> None:
        """Write this step's hot-row gradients (unscaled, summed over ``lookups``) into
        ``out`` (host memory, zeros); records beyond this worker's region wait for
        :meth:`apply`."""
        self._spill = self._spill[:0]
        if not lookups:
            return
        # rows made unique first (one lookup's already are), so their slots are unique
        rows, grads = coalesce(lookup_rows(lookups),
                               np.concatenate([lk.grads() for lk in lookups]))
        hot, slots = self.hot.locate(rows)
        extra = max(int(np.count_nonzero(hot)) - self.max_rows, 0) if self.records else 0
        spill = np.empty((extra, self.width), dtype=np.float32)
        written = _write(out.numpy(), self.rank * self.region, self.max_rows, hot, slots, grads,
                         self.records, spill)
        if written > self.max_rows:
            self._spill = spill

    def apply(self, summed: torch.Tensor, lr: float, scale: float) -> None:
        """Apply every worker's gradients, read from the reduced segment ``summed`` and
        times ``scale``, to the hot tier; then zero what was read. Collective over the
        workers when a region overflowed (every worker reads the same counts)."""
        flat = summed.numpy()
        if self.records:
            counts = flat[:: self.region].astype(np.int64)
            spilled = np.maximum(counts - self.max_rows, 0)
            slots, grads = _sum_records(flat, self.workers, self.region, self.width,
                                        self.max_rows, self._exchange(spilled), spilled,
                                        self._where, np.float32(scale))
        else:
            block = flat.reshape(-1, self.width)
            slots = np.flatnonzero(block[:, self.dim])
            grads = block[slots, : self.dim] * np.float32(scale)
            block[slots] = 0.0
        if len(slots):
            self.hot.apply(slots, grads, lr)
        self.applied += 1
        self.rows_applied += len(slots)

    def _exchange(self, spilled: np.ndarray) -> np.ndarray:
        """Every worker's records beyond its region (``spilled`` of each, this worker's are
        :attr:`_spill`), in worker order: an ``Iallgatherv``, completed by a yielding wait,
        when there are any."""
        if not spilled.any():
            return np.empty((0, self.width), dtype=np.float32)
        everyone = allgatherv(self._spill, self.comm, yielding=True, link=self.link,
                              counts=spilled)
        self.spills += 1
        self.spill_bytes += (len(everyone) - len(self._spill)) * self.width * 4
        return everyone

    def segment_bytes(self) -> int:
        """Bytes of the segment each worker hands to the reduction."""
        return 4 * self.size


@numba.njit(cache=True, nogil=True)
def _write(flat, at, limit, hot, slots, grads, records, spill):  # pragma: no cover - compiled
    """The ``hot`` rows' gradients into ``flat``, in one pass: as records (count, then up to
    ``limit`` ``(slot, gradient)`` lines from ``at``, the rest into ``spill``), or each on its
    slot's line with a touched count of 1. Returns the hot rows written. If any gradient,
    hot or cold, is not finite, what was written is zeroed and 0 returned (the worker's
    share of the step is dropped)."""
    n, dim = grads.shape
    width = dim + 1
    count = 0
    for i in range(n):
        finite = True
        for k in range(dim):
            if not np.isfinite(grads[i, k]):
                finite = False
        if not finite:
            if records:
                flat[at: at + 1 + min(count, limit) * width] = 0.0
            else:
                for j in range(i):
                    if hot[j]:
                        flat[slots[j] * width: (slots[j] + 1) * width] = 0.0
            return 0
        if not hot[i]:
            continue
        if not records:
            base = slots[i] * width
            flat[base + dim] = 1.0
            for k in range(dim):
                flat[base + k] = grads[i, k]
        elif count < limit:
            base = at + 1 + count * width
            flat[base] = slots[i]
            for k in range(dim):
                flat[base + 1 + k] = grads[i, k]
        else:
            spill[count - limit, 0] = slots[i]
            for k in range(dim):
                spill[count - limit, 1 + k] = grads[i, k]
        count += 1
    if records:
        flat[at] = count
    return count


@numba.njit(cache=True, nogil=True)
def _sum_records(flat, workers, region, width, limit, spills, spilled, where,
                 scale):  # pragma: no cover - compiled
    """The records of every worker, its region's then its ``spilled`` ones in ``spills``
    (in worker order), summed per slot and times ``scale``: (slots in order of first
    appearance, gradients). ``where`` (-1 everywhere, left so) maps a slot to its output
    line; the regions are zeroed."""
    total = 0
    for w in range(workers):
        total += int(flat[w * region])
    slots = np.empty(total, dtype=np.int64)
    grads = np.zeros((total, width - 1), dtype=np.float32)
    n = 0
    spill = 0
    for w in range(workers):
        base = w * region
        inside = min(int(flat[base]), limit)
        for i in range(inside + spilled[w]):
            if i < inside:
                line = flat[base + 1 + i * width: base + 1 + (i + 1) * width]
            else:
                line = spills[spill]
                spill += 1
            slot = int(line[0])
            at = where[slot]
            if at < 0:
                at = n
                where[slot] = n
                slots[n] = slot
                n += 1
            for k in range(width - 1):
                grads[at, k] += line[1 + k]
        flat[base: base + 1 + inside * width] = 0.0
    for i in range(n):
        where[slots[i]] = -1
        for k in range(width - 1):
            grads[i, k] *= scale
    return slots[:n], grads[:n]
