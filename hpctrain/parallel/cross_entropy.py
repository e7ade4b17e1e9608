"""Cross-entropy over class-sharded logits, without ever gathering the logits.

Rank ``r`` of the tensor group holds the logits of classes ``[lo, hi)``. With ``m`` the
row maximum and ``S = sum_c exp(z_c - m)``, the loss of a row with target ``y`` is
``log S - (z_y - m)``:

1. all-reduce (max) of the local row maxima gives ``m``;
2. each rank computes its local ``sum exp(z - m)`` and, for targets it owns, ``z_y - m``
   (zero elsewhere); one all-reduce (sum) of both gives ``S`` and ``z_y - m``;
3. backward needs no communication: ``d loss / d z_c = softmax_c - [c == y]`` on the rank
   that owns ``c``.
"""

from __future__ import annotations

from typing import Any

import torch

from hpctrain.parallel.types import Group

__all__ = ["parallel_cross_entropy"]


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Group,
                lo: int) -> torch.Tensor:
        row_max = group.all_reduce(logits.max(dim=-1).values.contiguous(), op="max")
        shifted = logits - row_max.unsqueeze(-1)
        foreign = (target < lo) | (target >= lo + logits.shape[-1])
        local = (target - lo).masked_fill(foreign, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(foreign, 0.0)
        exp = shifted.exp()
        sums = group.all_reduce(torch.stack([exp.sum(dim=-1), picked]))
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local, foreign)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, foreign = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1),
                                                   (~foreign).to(softmax.dtype).unsqueeze(-1))
        return (softmax - onehot) * grad.unsqueeze(-1), None, None, None


def parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                           lo: int) -> torch.Tensor:
    """Per-row cross-entropy ``[N]`` of class-sharded ``logits`` (``[N, hi - lo]``, classes
    ``[lo, hi)`` on this rank) against global class ids ``target`` ``[N]``; two
    all-reduces over ``group`` forward (max, then sum), none backward."""
    return _ParallelCrossEntropy.apply(logits, target, group, lo)
