import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from hpctrain.train import metrics


def brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=2, max_size=60))
def test_auc_is_exact_with_ties(pairs):
    scores = np.array([s for s, _ in pairs], dtype=np.float64)
    labels = np.array([y for _, y in pairs], dtype=np.float32)
    if labels.min() == labels.max():
        assert np.isnan(metrics.auc(scores, labels))
    else:
        assert abs(metrics.auc(scores, labels) - brute_force_auc(scores, labels)) < 1e-12


def test_log_loss_and_base_rate():
    labels = np.array([1, 0, 0, 0], dtype=np.float32)
    assert abs(metrics.base_rate_log_loss(labels) - 0.5623351446) < 1e-9
    assert metrics.log_loss(np.array([1.0, 0.0, 0.0, 0.0]), labels) < 1e-6
    assert metrics.accuracy(np.array([0.9, 0.2, 0.6, 0.1]), labels) == 0.75
