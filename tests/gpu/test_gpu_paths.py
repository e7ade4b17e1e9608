"""CUDA paths a CPU machine cannot run: NCCL over one GPU, and the tensor-parallel layers on a
torch.distributed (NCCL) group. Run by tests/gpu/run.sh; skipped without CUDA."""

import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from hpctrain.comm import Group, allreduce
from hpctrain.config import CommConfig
from hpctrain.parallel.cross_entropy import parallel_cross_entropy
from hpctrain.parallel.groups import TorchGroup
from hpctrain.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from hpctrain.runtime.torchdist import Rendezvous

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def nccl():
    """A one-rank NCCL process group on the job's kind of rendezvous."""
    torch.cuda.set_device(0)
    return Rendezvous(MPI.COMM_SELF).process_group("gpu-check", 0, 1, backend="nccl")


def test_a_one_rank_nccl_group_reduces_on_the_device(nccl):
    group = TorchGroup(nccl, 0, 1)
    assert group.nccl
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    group.all_reduce(x)
    torch.testing.assert_close(x.cpu(), torch.arange(8, dtype=torch.float32))
    got = group.all_gather(x.clone(), [8])
    torch.testing.assert_close(got.cpu(), x.cpu())


def test_tensor_parallel_layers_over_nccl_equal_cpu(nccl):
    group = TorchGroup(nccl, 0, 1)
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


def test_the_torch_allreduce_algorithm_on_a_cuda_tensor():
    group = Group(MPI.COMM_SELF, CommConfig())
    x = torch.ones(1000, device="cuda")
    allreduce(x, comm=group, algorithm="torch")
    torch.testing.assert_close(x.cpu(), torch.ones(1000))
    group.free()
