"""The hot tier: a sorted set of rows with their values and optimizer state, one replica per
worker, in host memory or on the worker's GPU (chosen at run time by the device passed in).

Each hot row sits in a slot of fixed value and state arrays; a re-tiering writes the
promoted rows into the slots the demoted ones free and leaves the kept rows where they are,
so it copies no kept row and holds no second tier. Looking a row up is a binary search in
the sorted row ids, then its slot; a step asks where the same rows are several times
(counting, pull, gradients, push), so the answers for the last few arrays of rows are
kept, by identity, until the hot set changes: arrays of rows handed to
:meth:`HotTier.locate` are never modified afterwards. An update runs the sparse optimizer
where the rows are (numba kernels on host memory, the same formulas as torch ops on a
GPU). Keeping the replicas equal is the caller's job
(:class:`~embeddings.tiered.TieredStore` applies the same summed gradients everywhere).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import torch

from embeddings.optim import SparseOptimizer

__all__ = ["HotTier", "CHUNK"]

CHUNK = 1 << 16  # rows per read and write-back of a re-tiering
_KEEP = 2  # located arrays remembered: this step's rows and the next step's


class HotTier:
    """Hot rows (sorted global row ids), each in a slot of values ``[S, dim]`` and state
    ``[S, state]``; ``S`` (:attr:`slots`) is the most rows the tier has held."""

    def __init__(self, dim: int, optimizer: SparseOptimizer, device: torch.device) -> None:
        self.dim = dim
        self.optimizer = optimizer
        self.device = device
        self.state_width = optimizer.state_width(dim)
        self.rows = np.empty(0, dtype=np.int64)
        self.slot_of = np.empty(0, dtype=np.int64)  # the slot of each of `rows`
        self.weight = torch.empty((0, dim), dtype=torch.float32, device=device)
        self.state = torch.empty((0, self.state_width), dtype=torch.float32, device=device)
        self._located: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def slots(self) -> int:
        """Slots of the value and state arrays: every slot :meth:`locate` gives is below."""
        return self.weight.shape[0]

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For global ``rows``: which are hot (bool mask) and their slots (valid where hot).
        Read-only results, shared by the calls on the same ``rows`` array."""
        for at, (seen, hot, slots) in enumerate(self._located):
            if seen is rows:
                self._located.insert(0, self._located.pop(at))
                return hot, slots
        hot, slots = _locate(self.rows, self.slot_of,
                             np.ascontiguousarray(rows, dtype=np.int64))
        hot.flags.writeable = slots.flags.writeable = False
        self._located = [(rows, hot, slots), *self._located[: _KEEP - 1]]
        return hot, slots

    def read(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The values of the hot ones of ``rows`` into their lines of ``out`` (host float32
        ``[len(rows), dim]``); returns the positions of the others, for the caller to fill."""
        hot, slots = self.locate(rows)
        if self.device.type == "cpu":
            return _read(self.weight.numpy(), hot, slots, out)
        out[hot] = self._host(self.weight[self._index(slots[hot])])
        return np.flatnonzero(~hot)

    def export(self, slots: np.ndarray) -> np.ndarray:
        """Values then optimizer state at ``slots``, host float32 ``[n, dim + state]``."""
        index = self._index(slots)
        return self._host(torch.cat([self.weight[index], self.state[index]], dim=1))

    def apply(self, slots: np.ndarray, grads: np.ndarray, lr: float) -> None:
        """Run the sparse optimizer on unique ``slots`` with summed ``grads``."""
        if len(slots) == 0:
            return
        if self.device.type == "cpu":
            self.optimizer.apply(self.weight.numpy(), self.state.numpy(), slots, grads, lr)
        else:
            self.optimizer.apply_torch(self.weight, self.state, self._index(slots),
                                       torch.from_numpy(grads).to(self.device), lr)

    def replace(self, hot: np.ndarray, promoted: np.ndarray,
                read: Callable[[np.ndarray], np.ndarray]) -> None:
        """Become the rows ``hot`` (sorted): rows already here keep their slots, values and
        state; ``promoted`` rows take the slots the others free, their values and state
        from ``read(rows)`` (laid out as :meth:`export` lays it out), called on chunks of
        :data:`CHUNK` rows, so that besides the tier only a chunk is held at a time."""
        if len(hot) > self.slots:
            self._grow(len(hot))
        slot_of, fresh = _reslot(self.rows, self.slot_of, hot, self.slots)
        if len(fresh) != len(promoted) or not np.array_equal(hot[fresh], promoted):
            raise ValueError("the new hot set must be the kept rows plus the promoted ones")
        for lo in range(0, len(fresh), CHUNK):
            to = self._index(slot_of[fresh[lo: lo + CHUNK]])
            incoming = torch.from_numpy(np.ascontiguousarray(
                read(promoted[lo: lo + CHUNK]))).to(self.device)
            self.weight[to] = incoming[:, : self.dim]
            self.state[to] = incoming[:, self.dim:]
        self.rows, self.slot_of = hot, slot_of
        self._located = []

    def _grow(self, slots: int) -> None:
        """Widen the value and state arrays to ``slots`` slots, keeping every slot's rows."""
        weight = torch.zeros((slots, self.dim), dtype=torch.float32, device=self.device)
        state = torch.zeros((slots, self.state_width), dtype=torch.float32, device=self.device)
        weight[: self.slots] = self.weight
        state[: self.slots] = self.state
        self.weight, self.state = weight, state

    def copy_from(self, other: HotTier) -> None:
        """Take ``other``'s rows, values and state (a replica refresh)."""
        self.rows, self.slot_of = other.rows, other.slot_of
        self._located = list(other._located)  # same rows and slots, same answers
        self.weight = other.weight.clone()
        self.state = other.state.clone()

    @property
    def resident_bytes(self) -> int:
        return (self.rows.nbytes + self.slot_of.nbytes + self.weight.numel() * 4
                + self.state.numel() * 4)

    def _index(self, slots: np.ndarray) -> torch.Tensor:
        # writable: torch warns on (and may not write through) a read-only array's tensor
        return torch.from_numpy(np.require(slots, np.int64, ("C", "W"))).to(self.device)

    @staticmethod
    def _host(values: torch.Tensor) -> np.ndarray:
        return values.cpu().numpy() if values.device.type != "cpu" else values.numpy()


@numba.njit(cache=True, nogil=True)
def _reslot(old_rows, old_slots, new_rows, slots):  # pragma: no cover - compiled
    """Slots of sorted ``new_rows``: a row also in sorted ``old_rows`` keeps its slot in
    ``old_slots``, the others take the free slots below ``slots`` in order. Returns the
    slots and the positions in ``new_rows`` of the rows not kept. One pass over both."""
    slot_of = np.empty(len(new_rows), np.int64)
    fresh = np.empty(len(new_rows), np.int64)
    used = np.zeros(slots, np.bool_)
    n = j = 0
    for i in range(len(new_rows)):
        while j < len(old_rows) and old_rows[j] < new_rows[i]:
            j += 1
        if j < len(old_rows) and old_rows[j] == new_rows[i]:
            slot_of[i] = old_slots[j]
            used[old_slots[j]] = True
        else:
            fresh[n] = i
            n += 1
    free = 0
    for k in range(n):
        while used[free]:
            free += 1
        slot_of[fresh[k]] = free
        free += 1
    return slot_of, fresh[:n]


@numba.njit(cache=True, nogil=True)
def _locate(hot_rows, slot_of, rows):  # pragma: no cover - compiled
    """Whether each of ``rows`` is in sorted ``hot_rows``, and its slot there (0 if not):
    a binary search per row, from the last one's place while ``rows`` ascend."""
    m = len(hot_rows)
    hot = np.zeros(len(rows), np.bool_)
    slots = np.zeros(len(rows), np.int64)
    lo = 0
    for i in range(len(rows)):
        row = rows[i]
        if i and row < rows[i - 1]:
            lo = 0
        hi = m
        while lo < hi:
            mid = (lo + hi) >> 1
            if hot_rows[mid] < row:
                lo = mid + 1
            else:
                hi = mid
        if lo < m and hot_rows[lo] == row:
            hot[i] = True
            slots[i] = slot_of[lo]
    return hot, slots


@numba.njit(cache=True, nogil=True)
def _read(weight, hot, slots, out):  # pragma: no cover - compiled
    """``out[i] = weight[slots[i]]`` where ``hot[i]``; returns the other positions."""
    cold = np.empty(len(hot), np.int64)
    n = 0
    for i in range(len(hot)):
        if hot[i]:
            out[i] = weight[slots[i]]
        else:
            cold[n] = i
            n += 1
    return cold[:n]
