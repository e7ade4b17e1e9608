"""The hot tier: a sorted set of rows with their values and optimizer state, one replica per
worker, in host memory or on the worker's GPU (chosen at run time by the device passed in).

Looking a row up is a binary search in the sorted row ids and a gather; a step asks where
the same rows are several times (counting, pull, gradients, push), so the answers for the
last few arrays of rows are kept, by identity, until the hot set changes: arrays of rows
handed to :meth:`HotTier.locate` are never modified afterwards. An update runs the
sparse optimizer where the rows are (numba kernels on host memory, the same formulas as
torch ops on a GPU). Keeping the replicas equal is the caller's job
(:class:`~embeddings.tiered.TieredStore` applies the same summed gradients everywhere).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import torch

from embeddings.optim import SparseOptimizer

__all__ = ["HotTier", "CHUNK"]

CHUNK = 1 << 16  # rows per read and copy of a re-tiering
_KEEP = 2  # located arrays remembered: this step's rows and the next step's


class HotTier:
    """Hot rows (sorted global row ids) with values ``[K, dim]`` and state ``[K, state]``."""

    def __init__(self, dim: int, optimizer: SparseOptimizer, device: torch.device) -> None:
        self.dim = dim
        self.optimizer = optimizer
        self.device = device
        self.state_width = optimizer.state_width(dim)
        self.rows = np.empty(0, dtype=np.int64)
        self.weight = torch.empty((0, dim), dtype=torch.float32, device=device)
        self.state = torch.empty((0, self.state_width), dtype=torch.float32, device=device)
        self._located: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For global ``rows``: which are hot (bool mask) and their slots (valid where hot).
        Read-only results, shared by the calls on the same ``rows`` array."""
        for at, (seen, hot, slots) in enumerate(self._located):
            if seen is rows:
                self._located.insert(0, self._located.pop(at))
                return hot, slots
        slots = np.searchsorted(self.rows, rows)
        hot = np.zeros(len(rows), dtype=bool)
        inside = slots < len(self.rows)
        hot[inside] = self.rows[slots[inside]] == rows[inside]
        hot.flags.writeable = slots.flags.writeable = False
        self._located = [(rows, hot, slots), *self._located[: _KEEP - 1]]
        return hot, slots

    def gather(self, slots: np.ndarray) -> np.ndarray:
        """Values at ``slots`` as host float32 ``[n, dim]``."""
        if self.device.type == "cpu":
            return self.weight.numpy().take(slots, axis=0)
        return self._host(self.weight[self._index(slots)])

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
        """Become the rows ``hot`` (sorted): rows already here keep their values and state,
        ``promoted`` rows take theirs from ``read(rows)`` (laid out as :meth:`export` lays
        it out), called on chunks of :data:`CHUNK` rows: besides the old and the new
        arrays only a chunk is held at a time."""
        weight = torch.empty((len(hot), self.dim), dtype=torch.float32, device=self.device)
        state = torch.empty((len(hot), self.state_width), dtype=torch.float32,
                            device=self.device)
        if self.device.type == "cpu":
            fresh = _carry(self.rows, hot, self.weight.numpy(), self.state.numpy(),
                           weight.numpy(), state.numpy())
        else:
            fresh = self._carry_on_device(hot, weight, state)
        if len(fresh) != len(promoted) or not np.array_equal(hot[fresh], promoted):
            raise ValueError("the new hot set must be the kept rows plus the promoted ones")
        for lo in range(0, len(fresh), CHUNK):
            to = self._index(fresh[lo: lo + CHUNK])
            incoming = torch.from_numpy(np.ascontiguousarray(
                read(promoted[lo: lo + CHUNK]))).to(self.device)
            weight[to] = incoming[:, : self.dim]
            state[to] = incoming[:, self.dim:]
        self.rows, self.weight, self.state = hot, weight, state
        self._located = []

    def _carry_on_device(self, hot: np.ndarray, weight: torch.Tensor,
                         state: torch.Tensor) -> np.ndarray:
        """:func:`_carry` by torch indexing in chunks of :data:`CHUNK` rows."""
        kept, slots = self.locate(hot)
        where_kept = np.flatnonzero(kept)
        for lo in range(0, len(where_kept), CHUNK):
            to = self._index(where_kept[lo: lo + CHUNK])
            source = self._index(slots[where_kept[lo: lo + CHUNK]])
            weight[to] = self.weight[source]
            state[to] = self.state[source]
        return np.flatnonzero(~kept)

    def copy_from(self, other: HotTier) -> None:
        """Take ``other``'s rows, values and state (a replica refresh)."""
        self.rows, self._located = other.rows, list(other._located)  # same rows, same answers
        self.weight = other.weight.clone()
        self.state = other.state.clone()

    @property
    def resident_bytes(self) -> int:
        return (self.rows.nbytes + self.weight.numel() * 4 + self.state.numel() * 4)

    def _index(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)

    @staticmethod
    def _host(values: torch.Tensor) -> np.ndarray:
        return values.cpu().numpy() if values.device.type != "cpu" else values.numpy()


@numba.njit(cache=True, nogil=True)
def _carry(old_rows, new_rows, old_weight, old_state, new_weight, new_state):  # pragma: no cover
    """Copy the values and state of the rows both sorted ``old_rows`` and ``new_rows`` hold
    to their new places, in one pass over both (a re-tiering keeps most of the hot set);
    returns the positions in ``new_rows`` of the others."""
    fresh = np.empty(len(new_rows), np.int64)
    n = j = 0
    for i in range(len(new_rows)):
        while j < len(old_rows) and old_rows[j] < new_rows[i]:
            j += 1
        if j < len(old_rows) and old_rows[j] == new_rows[i]:
            for k in range(new_weight.shape[1]):
                new_weight[i, k] = old_weight[j, k]
            for k in range(new_state.shape[1]):
                new_state[i, k] = old_state[j, k]
        else:
            fresh[n] = i
            n += 1
    return fresh[:n]
