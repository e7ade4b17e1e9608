"""Checks shared by the CUDA tests (tests/unit/test_cuda.py, tests/gpu): the tensor-parallel
layers' arithmetic on the device against the CPU, over a given group."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.parallel.cross_entropy import parallel_cross_entropy
from hpctrain.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from hpctrain.parallel.types import Group

TOL = {"rtol": 1e-4, "atol": 1e-5}


def tensor_parallel_layers_match_on_cuda(group: Group) -> None:
    """A column/row-parallel block over a vocab-parallel embedding, with the parallel cross
    entropy, gives the CPU's loss and gradients on CUDA (``group`` of one member)."""
    torch.manual_seed(1)
    block = nn.Sequential(ColumnParallelLinear(12, 9, group), nn.ReLU(),
                          RowParallelLinear(9, 11, group))
    table = VocabParallelEmbedding(11, 12, group)
    ids, target = torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (30,))
    results = []
    for device in ("cpu", "cuda"):
        b, t = copy.deepcopy(block).to(device), copy.deepcopy(table).to(device)
        logits = b(t(ids.to(device))).reshape(30, 11)
        loss = parallel_cross_entropy(logits, target.to(device), group, 0)
        torch.testing.assert_close(loss, F.cross_entropy(logits, target.to(device),
                                                         reduction="none"), **TOL)
        loss.sum().backward()
        results.append([loss.detach().cpu()] + [p.grad.cpu() for p in
                                                (*b.parameters(), *t.parameters())])
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, **TOL)
