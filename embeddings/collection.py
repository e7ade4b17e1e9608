"""The torch bridge: look up a batch's embeddings from a store, push their gradients back.

A lookup de-duplicates the batch's rows, pulls each once, and makes the pulled block a leaf
tensor; the batch's ``[B, T, dim]`` embeddings index into it, so autograd itself sums the
gradient of every repeated row (the backward of indexing is an index-add). The trainer then
pushes one gradient row per touched row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embeddings.tables import TableLayout
from embeddings.types import EmbeddingStore

__all__ = ["EmbeddingCollection", "Lookup"]


@dataclass
class Lookup:
    """The unique rows of one lookup and the leaf tensor that receives their gradients."""

    rows: np.ndarray
    values: torch.Tensor

    def grads(self) -> np.ndarray:
        if self.values.grad is None:
            return np.zeros((len(self.rows), self.values.shape[1]), dtype=np.float32)
        return self.values.grad.detach().cpu().numpy()


class EmbeddingCollection:
    """All tables of a model behind one store; one fused lookup per batch."""

    def __init__(self, layout: TableLayout, store: EmbeddingStore,
                 device: torch.device | None = None) -> None:
        self.layout = layout
        self.store = store
        self.device = device or torch.device("cpu")
        self._last: tuple[np.ndarray, np.ndarray, torch.Tensor, np.ndarray] | None = None

    def lookup(self, ids: np.ndarray, train: bool = True) -> tuple[torch.Tensor, Lookup]:
        """Embeddings ``[B, T, dim]`` of ``ids`` (int [B, T]) and the handle for their gradients.

        A ``train`` lookup tells the store how often it used each row
        (:meth:`~embeddings.types.EmbeddingStore.observe`); evaluation does not count.
        """
        unique, inverse, counts = self._unique(ids)
        if train:
            self.store.observe(unique, counts)
        values = torch.from_numpy(self.store.pull(unique)).to(self.device).requires_grad_()
        # index_select's backward is an index_add, several times faster than indexing's.
        embedded = values.index_select(0, inverse.to(self.device))
        return embedded.view(*ids.shape, self.layout.dim), Lookup(unique, values)

    def prefetch(self, ids: np.ndarray, ahead: int) -> None:
        """Announce the ids of the next :meth:`lookup`, ``ahead`` (0 or 1) steps from now."""
        self.store.prefetch(self._unique(ids)[0], ahead)

    def _unique(self, ids: np.ndarray) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
        """Sorted unique global rows of ``ids``, each id's index among them, and each row's
        number of ids (the last result is kept, so a prefetch and the lookup that follows
        share one sort)."""
        if self._last is not None and self._last[0] is ids:
            return self._last[1:]
        rows = torch.from_numpy(self.layout.global_rows(ids))
        unique, inverse, counts = torch.unique(rows.view(-1), return_inverse=True,
                                               return_counts=True)
        self._last = (ids, unique.numpy(), inverse, counts.numpy())
        return self._last[1:]

    def gradients(self, lookups: list[Lookup], scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Rows and gradients of ``lookups`` (one per micro-batch) times ``scale``, ready for
        :meth:`EmbeddingStore.push` (rows of different lookups may repeat)."""
        if not lookups:
            return np.empty(0, np.int64), np.empty((0, self.layout.dim), np.float32)
        rows = np.concatenate([lk.rows for lk in lookups])
        grads = np.concatenate([lk.grads() for lk in lookups])
        if scale != 1.0:
            grads *= np.float32(scale)
        return rows, grads
