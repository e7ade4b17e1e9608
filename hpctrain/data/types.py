"""What every data source yields: batches of dense features, categorical ids and labels.

A :class:`Dataset` gives random access to contiguous samples of a split, so that one rule
(:mod:`hpctrain.data.sharding`) assigns samples to steps and ranks for every source: global
batch ``g`` is samples ``[g*B, (g+1)*B)`` of the split and worker ``w`` reads its balanced
slice of it. A run on any number of workers therefore sees the same global batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

__all__ = ["Batch", "Dataset", "SPLITS"]

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Batch:
    """A batch of samples; ``sparse[:, t]`` indexes rows of table ``t``."""

    dense: np.ndarray  # float32 [n, 13], already transformed (log(1 + max(x, 0)) for Criteo)
    sparse: np.ndarray  # int64 [n, T], each column in [0, table_sizes[t])
    labels: np.ndarray  # float32 [n], 0.0 or 1.0

    def __len__(self) -> int:
        return len(self.labels)

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        return Batch(np.concatenate([b.dense for b in batches]),
                     np.concatenate([b.sparse for b in batches]),
                     np.concatenate([b.labels for b in batches]))


class Dataset(ABC):
    """Random access to the samples of a ``train`` and an ``eval`` split."""

    table_sizes: tuple[int, ...]
    skipped: int = 0
    """Malformed input lines skipped so far (``data.on_bad_line = "skip"``)."""

    @abstractmethod
    def num_samples(self, split: str) -> int:
        """Samples in ``split`` (one of :data:`SPLITS`)."""

    @abstractmethod
    def read(self, split: str, start: int, stop: int) -> Batch:
        """Samples ``[start, stop)`` of ``split``; fewer only where lines were skipped."""

    def sparse(self, split: str, start: int, stop: int) -> np.ndarray:
        """Only the categorical ids of samples ``[start, stop)`` (a scan of the ids, such as
        the one that seeds the hot tier); sources that can skip the rest override this."""
        return self.read(split, start, stop).sparse
