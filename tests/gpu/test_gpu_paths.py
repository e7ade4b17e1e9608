"""CUDA paths a CPU machine cannot run: NCCL over one GPU, and the tensor-parallel layers on a
torch.distributed (NCCL) group. Run by tests/gpu/run.sh; skipped without CUDA."""

import pytest
import torch
from cuda_checks import tensor_parallel_layers_match_on_cuda
from mpi4py import MPI

from hpctrain.comm import Group, allreduce
from hpctrain.config import CommConfig
from hpctrain.parallel.groups import TorchGroup
from hpctrain.runtime.torchdist import Rendezvous

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def nccl():
    """A one-rank NCCL process group on the job's kind of rendezvous."""
    torch.cuda.set_device(0)
    return Rendezvous(MPI.COMM_SELF).process_group("gpu-check", 0, 1, backend="nccl")


def test_a_one_rank_nccl_group_reduces_on_the_device(nccl):
    group = TorchGroup(nccl, MPI.COMM_SELF)
    assert group.nccl
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    group.all_reduce(x)
    torch.testing.assert_close(x.cpu(), torch.arange(8, dtype=torch.float32))
    got = group.all_gather(x.clone(), [8])
    torch.testing.assert_close(got.cpu(), x.cpu())


def test_tensor_parallel_layers_over_nccl_equal_cpu(nccl):
    tensor_parallel_layers_match_on_cuda(TorchGroup(nccl, MPI.COMM_SELF))


def test_the_torch_allreduce_algorithm_on_a_cuda_tensor():
    group = Group(MPI.COMM_SELF, CommConfig())
    x = torch.ones(1000, device="cuda")
    allreduce(x, comm=group, algorithm="torch")
    torch.testing.assert_close(x.cpu(), torch.ones(1000))
    group.free()
