"""Interfaces of the embeddings package: table specs and the storage protocol.

An :class:`EmbeddingStore` is where rows live: local memory, replicas on every worker, or the
parameter servers behind a client. The trainer only pulls rows for the ids a batch touches
and pushes their gradients; the store applies the optimizer where the rows are.

A :class:`BackingStore` also hands rows out and takes them back together with their
optimizer state, so that a row can change owner without losing an update: the cold tier
under :class:`~embeddings.tiered.TieredStore`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

__all__ = ["TableSpec", "EmbeddingStore", "BackingStore"]


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: ``rows`` vectors of width ``dim``."""

    name: str
    rows: int
    dim: int


class EmbeddingStore(ABC):
    """Rows addressed by global row id (table offset + id, see :class:`TableLayout`)."""

    dim: int

    @abstractmethod
    def pull(self, rows: np.ndarray) -> np.ndarray:
        """Current values of ``rows`` (int64 [n], unique) as float32 [n, dim]."""

    @abstractmethod
    def push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        """Apply gradients ``grads`` (float32 [n, dim]) of ``rows`` with learning rate ``lr``.

        Rows may repeat; their gradients are summed before the optimizer sees them. A push
        ends the caller's step.
        """

    def prefetch(self, rows: np.ndarray, ahead: int) -> None:  # noqa: B027 - optional hook
        """Hint: the next :meth:`pull` asks for ``rows`` (unique), ``ahead`` pushes from now.

        Stores whose rows are remote start fetching them; local stores need nothing.
        """

    def finish_lookups(self) -> None:  # noqa: B027 - optional hook
        """Lookups outside training have ended here (workers may have made different
        numbers of them); stores whose pulls are collective serve the others' remaining
        ones, others need nothing."""

    def observe(self, rows: np.ndarray, counts: np.ndarray) -> None:  # noqa: B027 - optional
        """The unique ``rows`` of a training lookup and how many lookups each had.

        Stores that place rows by how often they are used count them; others need nothing.
        """


class BackingStore(EmbeddingStore):
    """A store whose rows can leave and come back with their optimizer state."""

    state_width: int
    """float32 optimizer-state values per row (:meth:`SparseOptimizer.state_width`)."""

    @abstractmethod
    def read(self, rows: np.ndarray) -> np.ndarray:
        """Values then optimizer state of ``rows`` (sorted, unique), float32
        ``[n, dim + state_width]``, with every worker's updates of all earlier steps
        whatever the sync model (the caller is taking the rows over)."""

    @abstractmethod
    def write(self, rows: np.ndarray, block: np.ndarray) -> None:
        """Replace values and optimizer state of ``rows`` (sorted, unique) with ``block``
        (as :meth:`read` returns it); returns once stored, so later reads see it."""
