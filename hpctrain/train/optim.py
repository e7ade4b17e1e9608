"""Dense optimizers as a few multi-tensor operations, global-norm clipping, and the
learning-rate rules keyed to the global batch.

Why not ``torch.optim``: constructing the first torch optimizer imports ``torch._dynamo`` and
its dependencies (about 800 modules, 75 MB and one to five seconds), and every MPI rank of
every job would pay that for updates that are a few lines each. Tests check each update
against ``torch.optim`` (SGD with momentum and Nesterov, Adagrad, Adam, AdamW) or a numpy
reference (LARS, LAMB).

- ``sgd``: ``g += wd w``; with momentum ``b = mu b + g`` and ``g = b`` (Nesterov:
  ``g += mu b``); ``w -= lr g`` (``torch.optim.SGD``, dampening 0).
- ``adagrad``: ``g += wd w``; ``a += g^2``; ``w -= lr g / (sqrt(a) + 1e-10)``.
- ``adam`` (``g += wd w``, L2) and ``adamw`` (``w *= 1 - lr wd``, decoupled): bias-corrected
  moments, ``w -= lr m^ / (sqrt(v^) + eps)`` (``torch.optim.Adam``/``AdamW``).
- ``lars`` (You et al. 2017): per parameter tensor ("layer") the trust ratio
  ``t = ||w|| / (||g|| + wd ||w||)`` (1 where either norm is 0), ``b = mu b + lr t (g + wd w)``,
  ``w -= b``.
- ``lamb`` (You et al. 2019): the Adam direction ``u = m^ / (sqrt(v^) + eps) + wd w``, per
  tensor ``t = ||w|| / ||u||`` (1 where either norm is 0), ``w -= lr t u``.

The state (moments, accumulators, the step count) is :attr:`DenseOptimizer.state`, a list of
tensors the checkpoint writes and restores in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from embeddings.optim import SparseOptimizer
from hpctrain.comm import Group, allreduce
from hpctrain.config import TrainConfig

__all__ = ["DenseOptimizer", "DENSE_OPTIMIZERS", "clip_grad_norm", "empty_state",
           "dense_table_optimizer", "scaled_lr", "scheduled_lr", "sparse_optimizer",
           "state_groups"]

DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam", "adamw", "lars", "lamb")

_ADAGRAD_EPS = 1e-10
_COUNTED = ("adam", "adamw", "lamb")  # optimizers whose state ends with the step count


def state_groups(kind: str, momentum: float) -> int:
    """Per-parameter tensors of ``kind``'s state: 0, 1 (accumulator or momentum) or 2
    (Adam's moments)."""
    if kind in _COUNTED:
        return 2
    return int(kind == "adagrad" or (kind in ("sgd", "lars") and momentum > 0))


def empty_state(params: list[torch.Tensor], kind: str, momentum: float) -> list[torch.Tensor]:
    """``kind``'s initial state over ``params``: :func:`state_groups` lists of zeros shaped
    like them, then (Adam, AdamW, LAMB) the step count."""
    state = [torch.zeros_like(p) for _ in range(state_groups(kind, momentum)) for p in params]
    return [*state, torch.zeros(1, dtype=torch.float64)] if kind in _COUNTED else state


class DenseOptimizer:
    """One of :data:`DENSE_OPTIMIZERS` over ``params``; ``clip_norm > 0`` first clips the
    gradients to that global L2 norm (see :func:`clip_grad_norm`)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], kind: str, *,
                 momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 clip_norm: float = 0.0) -> None:
        if kind not in DENSE_OPTIMIZERS:
            raise ValueError(f"unknown dense optimizer {kind!r}; expected {DENSE_OPTIMIZERS}")
        if momentum and kind not in ("sgd", "lars"):
            raise ValueError(f"momentum applies to sgd and lars, not {kind!r}")
        if nesterov and (kind != "sgd" or not momentum):
            raise ValueError("nesterov needs sgd with momentum > 0")
        self.params = [p for p in params if p.requires_grad]
        self.kind = kind
        self.momentum, self.nesterov, self.weight_decay = momentum, nesterov, weight_decay
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.clip_norm = clip_norm
        self.state = empty_state(self.params, kind, momentum)
        self._steps = self.state[-1] if kind in _COUNTED else None  # Adam's step count

    @classmethod
    def from_config(cls, params: Iterable[torch.nn.Parameter],
                    tc: TrainConfig) -> DenseOptimizer:
        return cls(params, tc.optimizer, momentum=tc.momentum, nesterov=tc.nesterov,
                   weight_decay=tc.weight_decay, betas=tc.betas, eps=tc.eps,
                   clip_norm=tc.clip_norm)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One update from the parameters' ``.grad`` (clipped first with ``clip_norm``)."""
        if not self.params:  # a ZeRO worker whose chunk is empty: only the count moves on
            if self._steps is not None:
                self._steps += 1
            return
        if self.clip_norm > 0:
            clip_grad_norm(self.params, self.clip_norm)
        grads = [p.grad for p in self.params]
        wd = self.weight_decay
        if wd and self.kind in ("sgd", "adagrad", "adam"):  # L2: a new list, .grad untouched
            grads = torch._foreach_add(grads, self.params, alpha=wd)
        getattr(self, f"_{self.kind}")(grads, lr)

    def _sgd(self, grads: list[torch.Tensor], lr: float) -> None:
        if self.momentum:
            torch._foreach_mul_(self.state, self.momentum)
            torch._foreach_add_(self.state, grads)
            grads = (torch._foreach_add(grads, self.state, alpha=self.momentum)
                     if self.nesterov else self.state)
        torch._foreach_add_(self.params, grads, alpha=-lr)

    def _adagrad(self, grads: list[torch.Tensor], lr: float) -> None:
        torch._foreach_addcmul_(self.state, grads, grads, value=1.0)
        std = torch._foreach_sqrt(self.state)
        torch._foreach_add_(std, _ADAGRAD_EPS)
        torch._foreach_addcdiv_(self.params, grads, std, value=-lr)

    def _moments(self, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], float, float]:
        """Advance the Adam moments; returns (sqrt(v) / sqrt(1 - b2^t) + eps, 1 - b1^t)."""
        n = len(self.params)
        m, v = self.state[:n], self.state[n: 2 * n]
        self._steps += 1
        t = float(self._steps)
        torch._foreach_lerp_(m, grads, 1.0 - self.beta1)
        torch._foreach_mul_(v, self.beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1.0 - self.beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1.0 - self.beta2**t))
        torch._foreach_add_(denom, self.eps)
        return denom, 1.0 - self.beta1**t, t

    def _adam(self, grads: list[torch.Tensor], lr: float) -> None:
        denom, c1, _ = self._moments(grads)
        torch._foreach_addcdiv_(self.params, self.state[: len(self.params)], denom,
                                value=-lr / c1)

    def _adamw(self, grads: list[torch.Tensor], lr: float) -> None:
        if self.weight_decay:
            torch._foreach_mul_(self.params, 1.0 - lr * self.weight_decay)
        self._adam(grads, lr)

    def _lars(self, grads: list[torch.Tensor], lr: float) -> None:
        wd = self.weight_decay
        w_norms = torch._foreach_norm(self.params)
        g_norms = torch._foreach_norm(grads)
        updates = torch._foreach_add(grads, self.params, alpha=wd) if wd else list(grads)
        for u, wn, gn in zip(updates, w_norms, g_norms, strict=True):
            u.mul_(lr * _trust(wn, gn + wd * wn))
        if self.momentum:
            torch._foreach_mul_(self.state, self.momentum)
            torch._foreach_add_(self.state, updates)
            updates = self.state
        torch._foreach_sub_(self.params, updates)

    def _lamb(self, grads: list[torch.Tensor], lr: float) -> None:
        denom, c1, _ = self._moments(grads)
        updates = torch._foreach_div(self.state[: len(self.params)], denom)
        torch._foreach_div_(updates, c1)
        if self.weight_decay:
            torch._foreach_add_(updates, self.params, alpha=self.weight_decay)
        w_norms = torch._foreach_norm(self.params)
        u_norms = torch._foreach_norm(updates)
        for u, wn, un in zip(updates, w_norms, u_norms, strict=True):
            u.mul_(lr * _trust(wn, un))
        torch._foreach_sub_(self.params, updates)


def _trust(w_norm: torch.Tensor, g_norm: torch.Tensor) -> float:
    w, g = float(w_norm), float(g_norm)
    return w / g if w > 0 and g > 0 else 1.0


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float,
                   group: Group | None = None) -> float:
    """Scale the gradients so their global L2 norm is at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``: factor ``max_norm / (norm + 1e-6)`` when below 1);
    returns the norm before clipping. Called on the reduced gradient, which is the same on
    every data-parallel rank, so every rank clips alike without a collective; when the ranks
    of ``group`` hold disjoint pieces of it (ZeRO), the squared norm is summed over them."""
    grads = [p.grad for p in params]
    norms = torch._foreach_norm(grads) if grads else []
    if group is None:
        norm = float(torch.linalg.vector_norm(torch.stack(norms)))
    else:
        squares = np.array([sum(float(n) ** 2 for n in norms)])
        allreduce(squares, comm=group)
        norm = math.sqrt(squares[0])
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0 and grads:
        torch._foreach_mul_(grads, factor)
    return norm


def scaled_lr(tc: TrainConfig) -> float:
    """``train.lr`` scaled to the global batch (``batch_size x accumulate`` samples per
    step) against ``lr_base_batch``: linearly (Goyal et al. 2017) or by the square root."""
    ratio = tc.batch_size * tc.accumulate / tc.lr_base_batch
    return tc.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[tc.lr_scaling]


def scheduled_lr(tc: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step``: :func:`scaled_lr` after a linear
    warm-up over ``warmup_steps``."""
    lr = scaled_lr(tc)
    return lr * min(1.0, (step + 1) / tc.warmup_steps) if tc.warmup_steps else lr


def sparse_optimizer(tc: TrainConfig) -> SparseOptimizer:
    """The tables' optimizer (``train.sparse_optimizer``, resolved by
    :attr:`TrainConfig.table_optimizer`), with the Adam hyper-parameters for lazy Adam."""
    return _row_optimizer(tc.table_optimizer, tc)


def dense_table_optimizer(tc: TrainConfig) -> SparseOptimizer:
    """The servers' optimizer of full mode's dense table: ``train.optimizer`` per value
    (Adagrad with the dense optimizer's epsilon), the update hybrid mode's
    :class:`DenseOptimizer` makes."""
    return _row_optimizer(tc.optimizer, tc).per_value(_ADAGRAD_EPS)


def _row_optimizer(kind: str, tc: TrainConfig) -> SparseOptimizer:
    if kind == "adam":
        return SparseOptimizer(kind, eps=tc.eps, beta1=tc.betas[0], beta2=tc.betas[1])
    return SparseOptimizer(kind)
