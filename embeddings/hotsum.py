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
nothing: its share of the step is dropped, as the trainer drops its cold rows.
"""

from __future__ import annotations

import numpy as np
import torch

from embeddings.collection import Lookup
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
        self.width = hot.dim + 1
        self.max_rows = min(max_rows, capacity)
        self.region = 1 + self.max_rows * self.width
        self.records = (workers * self.region < capacity * self.width
                        and capacity < EXACT_BELOW)
        self.size = workers * self.region if self.records else capacity * self.width
        """Float32 values of the segment."""
        self.applied = 0  # sums applied
        self.rows_applied = 0  # unique hot rows updated by them

    def fill(self, lookups: list[Lookup], out: torch.Tensor) -> None:
        """Write this step's hot-row gradients (unscaled, summed over ``lookups``) into
        ``out``, which holds zeros."""
        parts = [(lk.rows, lk.values.grad) for lk in lookups if lk.values.grad is not None]
        if not parts or not all(bool(torch.isfinite(g).all()) for _, g in parts):
            return
        slots, grads = [], []
        for rows, grad in parts:
            hot, where = self.hot.locate(rows)
            slots.append(where[hot])
            grads.append(grad.detach()[torch.from_numpy(np.flatnonzero(hot)).to(grad.device)])
        index = torch.from_numpy(np.concatenate(slots)).to(out.device)
        values = torch.cat(grads).to(out.device)
        if not self.records:
            block = out.view(-1, self.width)
            block[:, :-1].index_add_(0, index, values)
            block[index, -1] = 1.0
            return
        unique, inverse = torch.unique(index, return_inverse=True)
        if len(unique) > self.max_rows:
            raise ValueError(f"{len(unique)} hot rows in one step, more than the "
                             f"{self.max_rows} the segment was sized for")
        summed = torch.zeros((len(unique), self.width - 1), dtype=torch.float32,
                             device=out.device).index_add_(0, inverse, values)
        region = out[self.rank * self.region: (self.rank + 1) * self.region]
        region[0] = float(len(unique))
        lines = region[1: 1 + len(unique) * self.width].view(-1, self.width)
        lines[:, 0] = unique.to(torch.float32)
        lines[:, 1:] = summed

    def apply(self, summed: torch.Tensor, lr: float, scale: float) -> None:
        """Apply every worker's gradients, read from the reduced segment ``summed`` and
        times ``scale``, to the hot tier; then zero what was read."""
        slots, grads = self._read(summed)
        if len(slots):
            self.hot.apply(slots, grads * np.float32(scale), lr)
        self.applied += 1
        self.rows_applied += len(slots)

    def _read(self, summed: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(unique slots, summed gradients) of the reduced segment, which is then zero."""
        if not self.records:
            block = summed.view(-1, self.width)
            touched = torch.nonzero(block[:, -1]).view(-1)
            grads = block[touched, :-1].cpu().numpy()
            block[touched] = 0.0
            return touched.cpu().numpy(), grads
        regions = summed.view(self.workers, self.region)
        counts = regions[:, 0].to(torch.int64).tolist()
        lines = [regions[w, 1: 1 + n * self.width].view(-1, self.width)
                 for w, n in enumerate(counts)]
        every = torch.cat(lines).cpu().numpy()
        for w, n in enumerate(counts):
            regions[w, : 1 + n * self.width] = 0.0
        return coalesce(every[:, 0].astype(np.int64), np.ascontiguousarray(every[:, 1:]))

    def segment_bytes(self) -> int:
        """Bytes of the segment each worker hands to the reduction."""
        return 4 * self.size
