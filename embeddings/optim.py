"""Fused sparse optimizers as numba kernels, shared by the trainer and the servers.

Each kernel updates only the rows a step touched, in place, one pass per row (weights and
optimizer state together). Rows must be unique: :func:`coalesce` sums duplicates first.

- ``sgd``: ``w -= lr * g``; no state.
- ``adagrad`` (row-wise, as DLRM/FBGEMM use for tables): one accumulator per row,
  ``a += mean(g^2)``; ``w -= lr * g / (sqrt(a) + eps)``.
- ``adam`` (lazy): moments and a step count per row, advanced only when the row is touched,
  so an untouched row's state does not decay (the usual sparse Adam).
- ``adagrad_values``: the dense optimizer's Adagrad, one accumulator ``a`` per value, for
  dense parameters kept as rows (the servers' dense table in full mode, see
  :meth:`SparseOptimizer.per_value`), where a step's gradient may arrive in parts (one push
  per worker, applied as each arrives). Each value also keeps ``s``, the sum of the parts of
  the current round; a part ``g`` moves it by
  ``lr t / (sqrt(a + t^2) + eps) - lr s / (sqrt(a + s^2) + eps)`` with ``t = s + g``, then
  ``s = t``; :meth:`SparseOptimizer.end_round` adds ``s^2`` to ``a`` and clears ``s``. The
  moves of a round telescope: together they are one Adagrad step on the round's summed
  gradient, whatever their order, and one part per round is the usual
  ``a += g^2; w -= lr g / (sqrt(a) + eps)`` bit for bit. Applying parts as plain steps would
  move the values up to ``sqrt(parts)`` times as far (Adagrad's early steps are about
  ``lr`` whatever the gradient's size). Not a table choice.

The kernels run on host memory. Rows that live on a GPU (the hot tier on a CUDA machine) are
updated by :meth:`SparseOptimizer.apply_torch`: the same formulas as vectorised torch ops on
the device, so the rows never leave it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from embeddings.prefetch import AHEAD, prefetch_row

__all__ = ["SparseOptimizer", "coalesce", "OPTIMIZERS"]

OPTIMIZERS = ("sgd", "adagrad", "adam")  # the tables' choices (train.sparse_optimizer)
_KINDS = (*OPTIMIZERS, "adagrad_values")


# The kernels below prefetch the rows AHEAD of the one they update (embeddings.prefetch).

@numba.njit(cache=True, nogil=True)
def _sgd(weight, rows, grads, lr):  # pragma: no cover - compiled
    n = rows.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            prefetch_row(weight, rows[i + AHEAD])
        r = rows[i]
        for j in range(weight.shape[1]):
            weight[r, j] -= lr * grads[i, j]


@numba.njit(cache=True, nogil=True)
def _rowwise_adagrad(weight, state, rows, grads, lr, eps):  # pragma: no cover - compiled
    n, dim = rows.shape[0], weight.shape[1]
    for i in range(n):
        if i + AHEAD < n:
            prefetch_row(weight, rows[i + AHEAD])
            prefetch_row(state, rows[i + AHEAD])
        r = rows[i]
        sq = 0.0
        for j in range(dim):
            sq += grads[i, j] * grads[i, j]
        state[r, 0] += sq / dim
        step = lr / (np.sqrt(state[r, 0]) + eps)
        for j in range(dim):
            weight[r, j] -= step * grads[i, j]


@numba.njit(cache=True, nogil=True)
def _adagrad_values(weight, state, rows, grads, lr, eps):  # pragma: no cover - compiled
    n, dim = rows.shape[0], weight.shape[1]
    for i in range(n):
        if i + AHEAD < n:
            prefetch_row(weight, rows[i + AHEAD])
            prefetch_row(state, rows[i + AHEAD])
        r = rows[i]
        for j in range(dim):
            a, s = state[r, j], state[r, dim + j]
            t = s + grads[i, j]
            moved = lr * t / (np.sqrt(a + t * t) + eps)
            weight[r, j] -= moved - lr * s / (np.sqrt(a + s * s) + eps)
            state[r, dim + j] = t


@numba.njit(cache=True, nogil=True)
def _lazy_adam(weight, state, rows, grads, lr, beta1, beta2, eps):  # pragma: no cover
    n, dim = rows.shape[0], weight.shape[1]
    for i in range(n):
        if i + AHEAD < n:
            prefetch_row(weight, rows[i + AHEAD])
            prefetch_row(state, rows[i + AHEAD])
        r = rows[i]
        state[r, 2 * dim] += 1.0
        t = state[r, 2 * dim]
        c1 = 1.0 - beta1**t
        c2 = 1.0 - beta2**t
        for j in range(dim):
            g = grads[i, j]
            m = beta1 * state[r, j] + (1.0 - beta1) * g
            v = beta2 * state[r, dim + j] + (1.0 - beta2) * g * g
            state[r, j] = m
            state[r, dim + j] = v
            weight[r, j] -= lr * (m / c1) / (np.sqrt(v / c2) + eps)


_MERGED_RUNS = 8  # up to this many sorted runs are merged; more are sorted


@numba.njit(cache=True, nogil=True)
def _coalesce(rows, grads):  # pragma: no cover - compiled
    n = rows.shape[0]
    # strictly increasing stretches (one per worker's lookup in a gathered push): where
    # each starts, noted while there are few enough to merge
    starts = np.zeros(_MERGED_RUNS, np.int64)
    runs = 1
    for i in range(1, n):
        if rows[i] <= rows[i - 1]:
            if runs < _MERGED_RUNS:
                starts[runs] = i
            runs += 1
    if runs <= _MERGED_RUNS:
        return _merge_runs(rows, grads, starts[:runs])
    order = np.argsort(rows, kind="mergesort")
    out_rows = np.empty(n, dtype=rows.dtype)
    out = np.zeros((n, grads.shape[1]), dtype=grads.dtype)
    k = -1
    for i in range(n):
        src = order[i]
        if k < 0 or rows[src] != out_rows[k]:
            k += 1
            out_rows[k] = rows[src]
        for j in range(grads.shape[1]):
            out[k, j] += grads[src, j]
    return out_rows[: k + 1], out[: k + 1]


@numba.njit(cache=True, nogil=True)
def _merge_runs(rows, grads, starts):  # pragma: no cover - compiled
    """``_coalesce`` of the strictly increasing stretches beginning at ``starts`` by one
    merge, each output row taking the smallest head: no sort, and each row's gradients
    summed in the order they come, as the stable sort sums them (the same bits)."""
    n, dim, runs = rows.shape[0], grads.shape[1], starts.shape[0]
    heads = starts.copy()
    ends = np.empty(runs, np.int64)
    ends[:-1] = starts[1:]
    ends[-1] = n
    out_rows = np.empty(n, dtype=rows.dtype)
    out = np.zeros((n, dim), dtype=grads.dtype)
    m = 0
    while True:
        low, found = rows[0], False
        for r in range(runs):
            if heads[r] < ends[r] and (not found or rows[heads[r]] < low):
                low, found = rows[heads[r]], True
        if not found:
            return out_rows[:m], out[:m]
        out_rows[m] = low
        for r in range(runs):
            h = heads[r]
            if h < ends[r] and rows[h] == low:
                for j in range(dim):
                    out[m, j] += grads[h, j]
                heads[r] = h + 1
        m += 1


def coalesce(rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``rows`` and the sum of each one's gradient rows (stable order), as
    contiguous arrays. Strided inputs (the views of
    :func:`~embeddings.tables.unpack_rows`) are read in place when there is work to do."""
    if rows.dtype != np.int64:
        # not asarray on every call: it wraps numba's arrays (a dtype instance of their own)
        # in a new view, and the hot tier finds the rows it located by the array itself
        rows = rows.astype(np.int64)
    if grads.dtype != np.float32:
        grads = grads.astype(np.float32)
    if rows.shape[0] != grads.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows but {grads.shape[0]} gradient rows")
    if rows.shape[0] < 2 or bool(np.all(rows[1:] > rows[:-1])):
        # already sorted and unique (one lookup's rows)
        if not rows.flags.c_contiguous:
            rows = np.ascontiguousarray(rows)
        return rows, np.ascontiguousarray(grads)
    return _coalesce(rows, grads)


@dataclass(frozen=True)
class SparseOptimizer:
    """A row-sparse optimizer: its kind, hyper-parameters and per-row state width."""

    kind: str = "sgd"
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown sparse optimizer {self.kind!r}; expected {OPTIMIZERS}")

    def per_value(self, adagrad_eps: float) -> SparseOptimizer:
        """This optimizer with its state per value rather than per row, for dense parameters
        kept as rows: row-wise Adagrad's one accumulator per ``dim`` values would give them
        one step size per block of unrelated weights. Adagrad becomes ``adagrad_values``
        (with ``adagrad_eps``, the dense optimizer's); sgd and lazy adam already are."""
        if self.kind != "adagrad":
            return self
        return SparseOptimizer("adagrad_values", eps=adagrad_eps)

    def state_width(self, dim: int) -> int:
        """float32 values of optimizer state per row."""
        return {"sgd": 0, "adagrad": 1, "adam": 2 * dim + 1, "adagrad_values": 2 * dim}[self.kind]

    def new_state(self, rows: int, dim: int) -> np.ndarray:
        """Zeroed state, its pages written now: ``np.zeros`` maps them lazily, and the first
        steps then page-fault on every touched row (the first 40 steps of
        ``synthetic_large.toml`` pushed 3x slower) while resident memory understates it."""
        return np.full((rows, self.state_width(dim)), 0.0, dtype=np.float32)

    def end_round(self, state: np.ndarray) -> None:
        """Close the round of ``adagrad_values``: fold each value's round sum into its
        accumulator (nothing for the other kinds, whose parts are plain steps)."""
        if self.kind == "adagrad_values":
            dim = state.shape[1] // 2
            state[:, :dim] += np.square(state[:, dim:])
            state[:, dim:] = 0.0

    def apply(self, weight: np.ndarray, state: np.ndarray, rows: np.ndarray,
              grads: np.ndarray, lr: float) -> None:
        """Update ``weight``/``state`` at unique local ``rows`` in place."""
        if self.kind == "sgd":
            _sgd(weight, rows, grads, np.float32(lr))
        elif self.kind == "adagrad":
            _rowwise_adagrad(weight, state, rows, grads, np.float32(lr), np.float32(self.eps))
        elif self.kind == "adagrad_values":
            _adagrad_values(weight, state, rows, grads, np.float32(lr), np.float32(self.eps))
        else:
            _lazy_adam(weight, state, rows, grads, np.float32(lr), np.float32(self.beta1),
                       np.float32(self.beta2), np.float32(self.eps))

    def apply_torch(self, weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                    grads: torch.Tensor, lr: float) -> None:
        """:meth:`apply` on torch tensors of any device (``rows`` unique, int64); tables'
        optimizers only (the hot tier's)."""
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"{self.kind} runs on host rows only")
        if self.kind == "sgd":
            weight.index_add_(0, rows, grads, alpha=-lr)
            return
        if self.kind == "adagrad":
            acc = state[rows, 0] + grads.square().mean(dim=1)
            state[rows, 0] = acc
            weight[rows] -= lr * grads / (acc.sqrt() + self.eps)[:, None]
            return
        dim = weight.shape[1]
        old = state[rows]
        t = old[:, 2 * dim] + 1.0
        m = self.beta1 * old[:, :dim] + (1.0 - self.beta1) * grads
        v = self.beta2 * old[:, dim: 2 * dim] + (1.0 - self.beta2) * grads * grads
        state[rows] = torch.cat([m, v, t[:, None]], dim=1)
        c1 = (1.0 - self.beta1 ** t)[:, None]
        c2 = (1.0 - self.beta2 ** t)[:, None]
        weight[rows] -= lr * (m / c1) / ((v / c2).sqrt() + self.eps)
