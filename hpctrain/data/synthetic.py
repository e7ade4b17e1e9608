"""Synthetic Zipf click logs with a hidden logistic model: the embedded default data.

Sample ``i`` of a split is a pure function of ``(seed, split, i)`` (counter-based hashing,
:mod:`hpctrain.runtime.rng`), so any rank generates any slice without coordination and a run
on W workers sees exactly the global batches of a run on one.

- Categorical id of table ``t``: a Zipf rank ``k`` in ``[0, n_t)`` with exponent ``s``
  (inverse CDF of the continuous power law on ``[1, n_t + 1)``, floored), then scattered over
  the table by the bijection ``(a_t * k + b_t) mod n_t`` so hot rows are not all at the front.
- Dense features: log-normal counts ``c``, delivered as ``log(1 + c)`` like Criteo's.
- Label: Bernoulli of ``sigmoid(bias + w . dense + sum_t sigma_t * h(t, id_t))`` where
  ``h`` is a standard normal value per (table, row). Frequent ids carry learnable signal;
  the long tail is noise to the model, as in real logs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hpctrain.config import NUM_DENSE
from hpctrain.data.types import SPLITS, Batch, Dataset
from hpctrain.errors import ConfigError
from hpctrain.runtime import rng

__all__ = ["SyntheticClicks"]

_FIELDS = 64  # hash keys reserved per sample: 2 per dense feature, 1 per table, 1 for the label
# Tables of at most this many rows in all keep every row's label effect (8 bytes a row),
# drawn once, instead of drawing each sample's afresh (a third of a batch's time).
_CACHED_EFFECTS = 1 << 20
_SPLIT_BASE = {"train": 0, "eval": 1 << 44}
_BIAS = -1.3


class SyntheticClicks(Dataset):
    def __init__(self, table_sizes: Sequence[int], train_samples: int, eval_samples: int,
                 zipf: float, seed: int) -> None:
        if len(table_sizes) * 1 + 2 * NUM_DENSE + 1 > _FIELDS:
            raise ConfigError(f"data.table_sizes: {len(table_sizes)} tables; the synthetic "
                              f"generator supports at most {_FIELDS - 2 * NUM_DENSE - 1}")
        self.table_sizes = tuple(int(n) for n in table_sizes)
        self.zipf = float(zipf)
        self.seed = int(seed)
        self._sizes = {"train": int(train_samples), "eval": int(eval_samples)}
        n = np.array(self.table_sizes, dtype=np.int64)
        self._n = n
        self._mult = np.array([_coprime_multiplier(int(k), self.seed + t)
                               for t, k in enumerate(n)], dtype=np.int64)
        self._shift = (rng.mix64(np.arange(len(n)), self.seed + 7) % n.astype(np.uint64)
                       ).astype(np.int64)
        t_keys = np.arange(len(n), dtype=np.uint64)
        self._table_scale = 0.3 + 0.5 * rng.uniform(t_keys, self.seed + 11)
        self._dense_weight = 0.6 * rng.normal(np.arange(NUM_DENSE), self.seed + 13)
        self._dense_mu = 1.0 + 2.0 * rng.uniform(np.arange(NUM_DENSE), self.seed + 17)
        self._effects: np.ndarray | None = None  # every table's rows, one after another
        self._first = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
        if n.sum() <= _CACHED_EFFECTS:  # drawn as ``_row_effect`` draws them
            self._effects = np.concatenate([self._draw_effects(t, np.arange(k, dtype=np.int64))
                                            for t, k in enumerate(n)])

    def num_samples(self, split: str) -> int:
        return self._sizes[_check_split(split)]

    def read(self, split: str, start: int, stop: int) -> Batch:
        index = self._index(split, start, stop)
        keys = index[:, None] * np.uint64(_FIELDS) + np.arange(_FIELDS, dtype=np.uint64)
        u = rng.uniform(keys, self.seed)
        dense = self._dense(u[:, : 2 * NUM_DENSE])
        sparse = self._ids(u[:, 2 * NUM_DENSE: 2 * NUM_DENSE + len(self._n)])
        logit = _BIAS + (dense - 1.5) @ self._dense_weight + self._row_effect(sparse).sum(1)
        labels = (u[:, _FIELDS - 1] < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return Batch(dense.astype(np.float32), sparse, labels)

    def sparse(self, split: str, start: int, stop: int) -> np.ndarray:
        """The categorical ids of samples ``[start, stop)``, as ``read(...).sparse``, without
        drawing dense features and labels (for id-stream studies such as hit rates)."""
        index = self._index(split, start, stop)
        fields = np.arange(2 * NUM_DENSE, 2 * NUM_DENSE + len(self._n), dtype=np.uint64)
        return self._ids(rng.uniform(index[:, None] * np.uint64(_FIELDS) + fields, self.seed))

    def _index(self, split: str, start: int, stop: int) -> np.ndarray:
        total = self.num_samples(split)
        if not 0 <= start <= stop <= total:
            raise IndexError(f"samples [{start}, {stop}) outside the {split} split of {total}")
        return np.arange(start, stop, dtype=np.uint64) + np.uint64(_SPLIT_BASE[split])

    def _dense(self, u: np.ndarray) -> np.ndarray:
        u1, u2 = u[:, 0::2], u[:, 1::2]
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        counts = np.floor(np.expm1(np.maximum(0.0, self._dense_mu + 1.2 * z)))
        return np.log1p(counts)

    def _ids(self, u: np.ndarray) -> np.ndarray:
        n = self._n.astype(np.float64)
        s = self.zipf
        if abs(s - 1.0) < 1e-9:
            x = np.exp(u * np.log(n + 1.0))
        else:
            x = (1.0 + u * ((n + 1.0) ** (1.0 - s) - 1.0)) ** (1.0 / (1.0 - s))
        k = np.minimum(np.floor(x).astype(np.int64) - 1, self._n - 1)
        k = np.maximum(k, 0)
        return (k * self._mult + self._shift) % self._n

    def _row_effect(self, sparse: np.ndarray) -> np.ndarray:
        """Each id's effect on the label logit: a standard normal per (table, row), times
        the table's scale."""
        if self._effects is not None:
            return self._effects[sparse + self._first]
        return self._draw_effects(np.arange(sparse.shape[1]), sparse)

    def _draw_effects(self, table: int | np.ndarray, ids: np.ndarray) -> np.ndarray:
        keys = (np.asarray(table, dtype=np.uint64) << np.uint64(40)) + ids.astype(np.uint64)
        return rng.normal(keys, self.seed + 19) * self._table_scale[table]


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return split


def _coprime_multiplier(n: int, seed: int) -> int:
    """A multiplier coprime to ``n``, so ``k -> a*k + b mod n`` permutes the table's rows."""
    if n <= 2:
        return 1
    a = int(rng.mix64(np.array([n]), seed)[0] % np.uint64(n - 1)) + 1
    while math.gcd(a, n) != 1:
        a += 1
    return a
