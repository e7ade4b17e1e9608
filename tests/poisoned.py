"""A dataset with NaN in chosen samples, for the tests of the non-finite guard."""

from __future__ import annotations

import numpy as np

from hpctrain.data.types import Batch, Dataset


class Poisoned(Dataset):
    """``inner`` with feature I4 of ``samples`` (of either split) set to NaN."""

    def __init__(self, inner: Dataset, samples: set[int]) -> None:
        self.inner, self.samples, self.table_sizes = inner, samples, inner.table_sizes

    def num_samples(self, split: str) -> int:
        return self.inner.num_samples(split)

    def read(self, split: str, start: int, stop: int) -> Batch:
        batch = self.inner.read(split, start, stop)
        hit = [i - start for i in sorted(self.samples) if start <= i < stop]
        if hit:
            dense = batch.dense.copy()
            dense[hit, 3] = np.nan
            batch = Batch(dense, batch.sparse, batch.labels)
        return batch
