"""Evaluation metrics over a whole (gathered) evaluation set: exact AUC, log loss, accuracy."""

from __future__ import annotations

import numpy as np

__all__ = ["auc", "log_loss", "accuracy", "base_rate_log_loss"]

_EPS = 1e-7


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U with tied scores given their average rank)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels) > 0.5
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts + 1) / 2.0  # 1-based average rank of each tie group
    ranks[order] = np.repeat(average, counts)
    u = ranks[labels].sum() - positives * (positives + 1) / 2.0
    return float(u / (positives * negatives))


def log_loss(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of predicted click probabilities."""
    p = np.clip(np.asarray(probs, dtype=np.float64), _EPS, 1.0 - _EPS)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean((np.asarray(probs) > 0.5) == (np.asarray(labels) > 0.5)))


def base_rate_log_loss(labels: np.ndarray) -> float:
    """Log loss of always predicting the mean label: the bar a model must clear."""
    labels = np.asarray(labels, dtype=np.float64)
    return log_loss(np.full(len(labels), labels.mean()), labels)
