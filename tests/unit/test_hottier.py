"""The hot tier's row lookups: binary search, remembered per array until the hot set changes."""

import numpy as np
import torch

from embeddings.hottier import HotTier
from embeddings.optim import SparseOptimizer


def _tier(rows: list[int]) -> HotTier:
    tier = HotTier(2, SparseOptimizer(), torch.device("cpu"))
    hot = np.array(rows, dtype=np.int64)
    tier.replace(hot, hot, lambda r: np.repeat(r[:, None], 2, axis=1).astype(np.float32))
    return tier


def test_locate_finds_hot_rows_and_remembers_the_answer_until_the_hot_set_changes():
    tier = _tier([3, 7, 9])
    rows = np.array([1, 3, 9, 12], dtype=np.int64)
    hot, slots = tier.locate(rows)
    np.testing.assert_array_equal(hot, [False, True, True, False])
    np.testing.assert_array_equal(slots[hot], [0, 2])
    np.testing.assert_array_equal(tier.gather(slots[hot]), [[3, 3], [9, 9]])
    assert tier.locate(rows)[0] is hot  # the same array: answered from memory
    assert not hot.flags.writeable  # shared answers cannot be changed by a caller
    np.testing.assert_array_equal(tier.locate(rows.copy())[0], hot)  # an equal array: searched

    tier.replace(np.array([1, 3, 9], dtype=np.int64), np.array([1], dtype=np.int64),
                 lambda r: np.zeros((len(r), 2), np.float32))
    hot, slots = tier.locate(rows)  # the same array after a re-tiering: searched again
    np.testing.assert_array_equal(hot, [True, True, True, False])
    np.testing.assert_array_equal(tier.gather(slots[hot]), [[0, 0], [3, 3], [9, 9]])
