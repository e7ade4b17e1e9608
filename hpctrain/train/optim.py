"""Dense optimizers (SGD, Adagrad) as a few multi-tensor operations.

Why not ``torch.optim``: constructing the first torch optimizer imports ``torch._dynamo`` and
its dependencies (about 800 modules, 75 MB and one to five seconds), and every MPI rank of
every job would pay that for two updates that are three lines each. The updates match
``torch.optim.SGD`` and ``torch.optim.Adagrad`` (defaults: no momentum, no decay, eps 1e-10);
a test checks them against torch's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["DenseOptimizer"]


class DenseOptimizer:
    def __init__(self, params: Iterable[torch.nn.Parameter], kind: str, eps: float = 1e-10):
        if kind not in ("sgd", "adagrad"):
            raise ValueError(f"unknown dense optimizer {kind!r}")
        self.params = [p for p in params if p.requires_grad]
        self.kind = kind
        self.eps = eps
        self.state = ([torch.zeros_like(p) for p in self.params] if kind == "adagrad" else [])

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One update from the parameters' ``.grad``."""
        grads = [p.grad for p in self.params]
        if self.kind == "sgd":
            torch._foreach_add_(self.params, grads, alpha=-lr)
            return
        torch._foreach_addcmul_(self.state, grads, grads, value=1.0)
        std = torch._foreach_sqrt(self.state)
        torch._foreach_add_(std, self.eps)
        torch._foreach_addcdiv_(self.params, grads, std, value=-lr)
