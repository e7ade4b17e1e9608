"""Differentiable communication: the four regions of Megatron-LM's tensor parallelism.

Each region is an autograd function whose forward and backward collectives are stated
together; the tensor group is always passed explicitly. The last dimension is the one
split, in the balanced ranges of :func:`~hpctrain.runtime.topology.shard_range`.

============  =====================================  =====================================
region        forward                                backward
============  =====================================  =====================================
copy_to       identity                               all-reduce (sum) of the gradient
reduce_from   all-reduce (sum)                       identity
scatter_to    keep this rank's slice                 all-gather of the gradient slices
gather_from   all-gather of the slices               keep this rank's slice
============  =====================================  =====================================

``copy_to`` opens a tensor-parallel region (its input is replicated, each rank's partial
input gradient must be summed); ``reduce_from`` closes one after a row-parallel product.
With ``runtime.trace`` on, each collective is a ``tensor allreduce`` or ``tensor allgather``
span of the run's timeline.
"""

from __future__ import annotations

from typing import Any

import torch

from hpctrain.parallel.types import Group
from hpctrain.runtime import trace
from hpctrain.runtime.topology import shard_range

__all__ = ["copy_to", "reduce_from", "scatter_to", "gather_from", "split_sizes", "own_slice"]


def split_sizes(n: int, group: Group) -> list[int]:
    """Width of each member's share when ``n`` columns are split over ``group``."""
    return [hi - lo for lo, hi in (shard_range(n, group.size, r) for r in range(group.size))]


def own_slice(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's share of the last dimension of ``x`` (no communication)."""
    lo, hi = shard_range(x.shape[-1], group.size, group.rank)
    return x[..., lo:hi].contiguous()


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    with trace.span("tensor allreduce"):
        return group.all_reduce(x.contiguous().clone())


def _all_gather(x: torch.Tensor, group: Group, width: int) -> torch.Tensor:
    with trace.span("tensor allgather"):
        return group.all_gather(x.contiguous(), split_sizes(width, group))


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        return own_slice(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group, ctx.width), None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, width: int) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group, width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return own_slice(grad, ctx.group), None, None


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward identity; backward ``all_reduce`` (sum) over ``group``."""
    return x if group.size == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward ``all_reduce`` (sum) over ``group``; backward identity."""
    return x if group.size == 1 else _ReduceFrom.apply(x, group)


def scatter_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: this rank's slice of the last dimension; backward ``all_gather``."""
    return x if group.size == 1 else _ScatterTo.apply(x, group)


def gather_from(x: torch.Tensor, group: Group, width: int) -> torch.Tensor:
    """Forward ``all_gather`` of the last dimension into ``width`` columns; backward: this
    rank's slice."""
    return x if group.size == 1 else _GatherFrom.apply(x, group, width)
