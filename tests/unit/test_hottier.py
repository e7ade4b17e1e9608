"""The hot tier: row lookups (binary search, remembered per array until the hot set changes)
and re-tierings (promoted rows into freed slots, a chunk at a time)."""

import numpy as np
import torch

from embeddings import hottier
from embeddings.hottier import HotTier
from embeddings.optim import SparseOptimizer


def _tier(rows: list[int]) -> HotTier:
    tier = HotTier(2, SparseOptimizer(), torch.device("cpu"))
    hot = np.array(rows, dtype=np.int64)
    tier.replace(hot, hot, lambda r: np.repeat(r[:, None], 2, axis=1).astype(np.float32))
    return tier


def _read(tier: HotTier, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values of ``rows`` read from the tier (NaN where not hot) and the positions not hot."""
    out = np.full((len(rows), tier.dim), np.nan, dtype=np.float32)
    cold = tier.read(rows, out)
    return out, cold


def test_locate_finds_hot_rows_and_remembers_the_answer_until_the_hot_set_changes():
    tier = _tier([3, 7, 9])
    rows = np.array([1, 3, 9, 12], dtype=np.int64)
    hot, slots = tier.locate(rows)
    np.testing.assert_array_equal(hot, [False, True, True, False])
    np.testing.assert_array_equal(slots[hot], [0, 2])
    values, cold = _read(tier, rows)
    np.testing.assert_array_equal(values[hot], [[3, 3], [9, 9]])
    np.testing.assert_array_equal(cold, [0, 3])
    assert np.isnan(values[cold]).all()  # the caller's to fill
    assert tier.locate(rows)[0] is hot  # the same array: answered from memory
    assert not hot.flags.writeable  # shared answers cannot be changed by a caller
    np.testing.assert_array_equal(tier.locate(rows.copy())[0], hot)  # an equal array: searched
    np.testing.assert_array_equal(tier.locate(rows[::-1].copy())[0], hot[::-1])  # any order

    tier.replace(np.array([1, 3, 9], dtype=np.int64), np.array([1], dtype=np.int64),
                 lambda r: np.zeros((len(r), 2), np.float32))
    hot, slots = tier.locate(rows)  # the same array after a re-tiering: searched again
    np.testing.assert_array_equal(hot, [True, True, True, False])
    np.testing.assert_array_equal(_read(tier, rows)[0][hot], [[0, 0], [3, 3], [9, 9]])


def test_a_retiering_writes_promoted_rows_into_freed_slots_and_leaves_kept_rows_in_place():
    tier = _tier([2, 4, 6, 8])
    weight = tier.weight
    kept_slots = tier.locate(np.array([4, 8], dtype=np.int64))[1].copy()
    tier.apply(kept_slots, np.ones((2, 2), np.float32), 0.5)  # kept rows move away from 4, 8
    tier.replace(np.array([1, 4, 8, 9], dtype=np.int64), np.array([1, 9], dtype=np.int64),
                 lambda r: np.full((len(r), 2), -1.0, np.float32))
    assert tier.weight is weight  # no second tier: the arrays are the same
    rows = np.array([1, 4, 8, 9], dtype=np.int64)
    hot, slots = tier.locate(rows)
    assert hot.all()
    np.testing.assert_array_equal(slots[1:3], kept_slots)
    np.testing.assert_array_equal(sorted(slots), [0, 1, 2, 3])  # the freed slots, reused
    np.testing.assert_array_equal(_read(tier, rows)[0], [[-1, -1], [3.5, 3.5], [7.5, 7.5],
                                                        [-1, -1]])

    tier.replace(np.arange(6, dtype=np.int64), np.array([0, 2, 3, 5], dtype=np.int64),
                 lambda r: np.repeat(r[:, None], 2, axis=1).astype(np.float32))
    assert tier.slots == 6  # grown for more rows, the kept ones still there
    np.testing.assert_array_equal(_read(tier, np.arange(6, dtype=np.int64))[0],
                                  [[0, 0], [-1, -1], [2, 2], [3, 3], [3.5, 3.5], [5, 5]])
    with np.testing.assert_raises(ValueError):  # a promoted row that is kept
        tier.replace(np.arange(6, dtype=np.int64), np.array([1], dtype=np.int64),
                     lambda r: np.zeros((len(r), 2), np.float32))


def test_promoted_rows_are_read_a_chunk_at_a_time(monkeypatch):
    monkeypatch.setattr(hottier, "CHUNK", 2)
    asked = []
    tier = HotTier(2, SparseOptimizer(), torch.device("cpu"))
    hot = np.arange(5, dtype=np.int64)
    tier.replace(hot, hot, lambda r: asked.append(len(r)) or np.zeros((len(r), 2), np.float32))
    assert asked == [2, 2, 1]
