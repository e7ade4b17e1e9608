"""Interfaces of the embeddings package: table specs and the storage protocol.

An :class:`EmbeddingStore` is where rows live: local memory, replicas on every worker, or the
parameter servers behind a client. The trainer only pulls rows for the ids a batch touches
and pushes their gradients; the store applies the optimizer where the rows are.

A :class:`BackingStore` also hands rows out and takes them back together with their
optimizer state, so that a row can change owner without losing an update: the cold tier
under :class:`~embeddings.tiered.TieredStore`.

Each store writes and reads its own part of a checkpoint (:meth:`EmbeddingStore.save`,
:meth:`EmbeddingStore.restore`) through a :class:`RowSink` and a :class:`RowSource`, which
the trainer hands it and which know the file format, so that nothing above a store asks
what kind of store it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["TableSpec", "EmbeddingStore", "BackingStore", "RowSink", "RowSource"]


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: ``rows`` vectors of width ``dim``."""

    name: str
    rows: int
    dim: int


class RowSink(Protocol):
    """Where a store writes its rows in a checkpoint."""

    lead: bool
    """Whether this worker writes state that every worker holds alike (worker 0)."""

    def write(self, name: str, rows: np.ndarray, weight: np.ndarray,
              state: np.ndarray) -> None:
        """Write global ``rows`` with their values and optimizer state as part ``name``."""


class RowSource(Protocol):
    """The checkpoint a store restores from."""

    step: int
    """Steps completed when the checkpoint was taken."""

    def rows(self, dim: int, state_width: int) -> Iterator[tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]]:
        """(global rows, values, optimizer state) of every saved row, in parts; raises when
        their widths are not ``dim`` and ``state_width``."""


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

    holds_rows = True
    """False for a store that serves no row (a pipeline stage after the first)."""
    retier_s: float = 0.0
    """Seconds spent so far moving rows between tiers inside :meth:`push` (0 without tiers)."""

    def withhold(self, rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What to push instead of ``rows``' gradients when this worker's share of a step
        is dropped (non-finite values): nothing, unless the store's other workers already
        count on some of the rows."""
        return rows[:0], grads[:0]

    @abstractmethod
    def save(self, out: RowSink) -> None:
        """Write this store's part of a checkpoint (collective over the store's workers,
        which all call it after the same push)."""

    @abstractmethod
    def restore(self, source: RowSource) -> None:
        """Take up the rows and clocks of ``source`` (every worker, before training)."""

    def consistent_reads(self) -> AbstractContextManager[None]:
        """A block within which every :meth:`pull` sees every worker's updates of all
        earlier steps, whatever the sync model, so that an evaluation scores one model on
        every worker; entered by all the store's workers after the same push. Stores whose
        reads always do (replicas updated together) need nothing."""
        return nullcontext()

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Make the rows' current values readable where a checkpoint reads them (stores
        that cache rows write them back; collective over the store's workers)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """End of training: write back what is cached and release what the store holds."""


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
