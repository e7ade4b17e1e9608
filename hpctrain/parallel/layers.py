"""Tensor-parallel layers (Megatron-LM) built on :mod:`hpctrain.parallel.mappings`.

A :class:`ColumnParallelLinear` followed by a :class:`RowParallelLinear` is an MLP block
with one all-reduce forward (closing the row product) and one backward (opening the column
product), whatever lies elementwise between them. Each layer is cut from a full "master"
layer built the same way on every rank (same seed), so a tensor-parallel model starts from
exactly the single-process model's parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.parallel.mappings import copy_to, gather_from, reduce_from, scatter_to
from hpctrain.parallel.types import Group
from hpctrain.runtime.topology import shard_range

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "tensor_parallel_mlp"]


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with the output features split: this rank holds rows
    ``shard_range(out, size, rank)`` of ``A`` and ``b``.

    Forward: ``copy_to`` (backward all-reduce of the input gradient over ``group``), the local
    product, and with ``gather_output`` an all-gather of the output columns.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True,
                 gather_output: bool = False, master: nn.Linear | None = None) -> None:
        super().__init__()
        master = master or nn.Linear(in_features, out_features, bias=bias)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output = group, gather_output
        lo, hi = shard_range(out_features, group.size, group.rank)
        self.weight = nn.Parameter(master.weight.detach()[lo:hi].clone())
        self.bias = nn.Parameter(master.bias.detach()[lo:hi].clone()) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to(x, self.group), self.weight, self.bias)
        return gather_from(y, self.group, self.out_features) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with the input features split: this rank holds columns
    ``shard_range(in, size, rank)`` of ``A``; ``b`` is replicated and added once.

    Forward: (``scatter_to`` when the input is whole), the local partial product, and
    ``reduce_from``: one all-reduce over ``group`` (backward: none).
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True,
                 input_is_parallel: bool = True, master: nn.Linear | None = None) -> None:
        super().__init__()
        master = master or nn.Linear(in_features, out_features, bias=bias)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.input_is_parallel = group, input_is_parallel
        lo, hi = shard_range(in_features, group.size, group.rank)
        self.weight = nn.Parameter(master.weight.detach()[:, lo:hi].clone())
        self.bias = nn.Parameter(master.bias.detach().clone()) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to(x, self.group)
        y = reduce_from(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows: this rank holds rows
    ``[lo, hi) = shard_range(num_embeddings, size, rank)``.

    Forward: ids outside ``[lo, hi)`` look up zeros, then ``reduce_from`` (all-reduce sum over
    ``group``) assembles every id's row. Backward: each rank's rows get their gradients only.
    """

    def __init__(self, num_embeddings: int, dim: int, group: Group,
                 master: nn.Embedding | None = None) -> None:
        super().__init__()
        master = master or nn.Embedding(num_embeddings, dim)
        self.group = group
        self.lo, self.hi = shard_range(num_embeddings, group.size, group.rank)
        self.weight = nn.Parameter(master.weight.detach()[self.lo:self.hi].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        foreign = (ids < self.lo) | (ids >= self.hi)
        local = (ids - self.lo).masked_fill(foreign, 0)
        rows = F.embedding(local, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        return reduce_from(rows, self.group)


def tensor_parallel_mlp(mlp: nn.Sequential, group: Group) -> nn.Sequential:
    """``mlp`` with consecutive pairs of ``nn.Linear`` as column/row-parallel blocks.

    Elementwise modules (ReLU) stay where they are, inside or between blocks; a last unpaired
    ``Linear`` stays replicated (every rank computes it on the same whole input, so its
    gradients agree without communication). Parameters are cut from ``mlp``'s.
    """
    if group.size == 1:
        return mlp
    out: list[nn.Module] = []
    linears = [i for i, m in enumerate(mlp) if isinstance(m, nn.Linear)]
    pairs = {linears[k]: linears[k + 1] for k in range(0, len(linears) - 1, 2)}
    rows = set(pairs.values())
    for i, module in enumerate(mlp):
        if i in pairs:
            out.append(ColumnParallelLinear(module.in_features, module.out_features, group,
                                            bias=module.bias is not None, master=module))
        elif i in rows:
            out.append(RowParallelLinear(module.in_features, module.out_features, group,
                                         bias=module.bias is not None, master=module))
        else:
            out.append(module)
    return nn.Sequential(*out)
