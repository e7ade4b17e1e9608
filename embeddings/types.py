"""Interfaces of the embeddings package: table specs and the storage protocol.

An :class:`EmbeddingStore` is where rows live: local memory, replicas on every worker, or the
parameter servers behind a client. The trainer only pulls rows for the ids a batch touches
and pushes their gradients; the store applies the optimizer where the rows are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

__all__ = ["TableSpec", "EmbeddingStore"]


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
