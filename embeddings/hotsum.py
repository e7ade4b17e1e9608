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

``max_rows`` bounds the hot rows one worker touches in a step (its samples times the
tables, at most the capacity). A worker whose embedding gradients hold a NaN or Inf writes
nothing: its share of the step is dropped, as the trainer drops its cold rows. The segment
lives in host memory (the CPU engine's buffers); on a GPU the tiered store sums on its own.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from embeddings.collection import Lookup, lookup_rows
from embeddings.hottier import HotTier
from embeddings.optim import coalesce

__all__ = ["HotRider", "EXACT_BELOW"]

EXACT_BELOW = 1 << 24  # float32 holds every integer below this exactly


class HotRider:
    """This worker's hot-row gradients as the float32 tail of the dense reduction over
    ``workers`` workers (it is worker ``rank``), applied to ``hot`` once summed."""

    def __init__(self, hot: HotTier, capacity: int, workers: int, rank: int,
                 max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.hot, self.workers, self.rank = hot, workers, rank
        self.dim = hot.dim
        self.width = hot.dim + 1
        self.max_rows = min(max_rows, capacity)
        self.region = 1 + self.max_rows * self.width
        self.records = (workers * self.region < capacity * self.width
                        and capacity < EXACT_BELOW)
        self.size = workers * self.region if self.records else capacity * self.width
        """Float32 values of the segment."""
        # scratch of the records' sum; slots are below EXACT_BELOW
        self._where = np.full(capacity, -1, dtype=np.int32)
        self.applied = 0  # sums applied
        self.rows_applied = 0  # unique hot rows updated by them

    def fill(self, lookups: list[Lookup], out: torch.Tensor) -> None:
        """Write this step's hot-row gradients (unscaled, summed over ``lookups``) into
        ``out`` (host memory, zeros)."""
        if not lookups:
            return
        # rows made unique first (one lookup's already are), so their slots are unique
        rows, grads = coalesce(lookup_rows(lookups),
                               np.concatenate([lk.grads() for lk in lookups]))
        hot, slots = self.hot.locate(rows)
        flat = out.numpy()
        if not self.records:
            _write(flat, 0, hot, slots, grads, False)
            return
        count = int(np.count_nonzero(hot))
        if count > self.max_rows:
            raise ValueError(f"{count} hot rows in one step, more than the "
                             f"{self.max_rows} the segment was sized for")
        _write(flat, self.rank * self.region, hot, slots, grads, True)

    def apply(self, summed: torch.Tensor, lr: float, scale: float) -> None:
        """Apply every worker's gradients, read from the reduced segment ``summed`` and
        times ``scale``, to the hot tier; then zero what was read."""
        flat = summed.numpy()
        if self.records:
            slots, grads = _sum_records(flat, self.workers, self.region, self.width,
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

    def segment_bytes(self) -> int:
        """Bytes of the segment each worker hands to the reduction."""
        return 4 * self.size


@numba.njit(cache=True, nogil=True)
def _write(flat, at, hot, slots, grads, records):  # pragma: no cover - compiled
    """The ``hot`` rows' gradients into ``flat``: as records (count, then ``(slot,
    gradient)`` lines) from ``at``, or each on its slot's line with a touched count of 1.
    Nothing is written if any gradient, hot or cold, is not finite (the worker's share of
    the step is dropped)."""
    n, dim = grads.shape
    for i in range(n):
        for k in range(dim):
            if not np.isfinite(grads[i, k]):
                return
    width = dim + 1
    line = at + 1
    for i in range(n):
        if not hot[i]:
            continue
        if records:
            flat[line] = slots[i]
            base = line + 1
            line += width
        else:
            base = slots[i] * width
            flat[base + dim] = 1.0
        for k in range(dim):
            flat[base + k] = grads[i, k]
    if records:
        flat[at] = (line - at - 1) // width


@numba.njit(cache=True, nogil=True)
def _sum_records(flat, workers, region, width, where, scale):  # pragma: no cover - compiled
    """The records of every region, in worker order, summed per slot and times ``scale``:
    (slots in order of first appearance, gradients). ``where`` (-1 everywhere, left so) maps
    a slot to its output line; the regions are zeroed."""
    total = 0
    for w in range(workers):
        total += int(flat[w * region])
    slots = np.empty(total, dtype=np.int64)
    grads = np.zeros((total, width - 1), dtype=np.float32)
    n = 0
    for w in range(workers):
        base = w * region
        count = int(flat[base])
        for i in range(count):
            line = base + 1 + i * width
            slot = int(flat[line])
            at = where[slot]
            if at < 0:
                at = n
                where[slot] = n
                slots[n] = slot
                n += 1
            for k in range(width - 1):
                grads[at, k] += flat[line + 1 + k]
        flat[base: base + 1 + count * width] = 0.0
    for i in range(n):
        where[slots[i]] = -1
        for k in range(width - 1):
            grads[i, k] *= scale
    return slots[:n], grads[:n]
