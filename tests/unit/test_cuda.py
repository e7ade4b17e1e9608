"""The CUDA compute path against CPU results; skipped where torch sees no CUDA device.

This is the issue's single-GPU check: a tp = 1 / pp = 1 DLRM step and the tensor-parallel
layers' arithmetic on one GPU. Multi-rank NCCL traffic needs a GPU per rank and is not
covered here; the same torch.distributed code runs on CPU over gloo in tests/mpi.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from cuda_checks import TOL, tensor_parallel_layers_match_on_cuda

from hpctrain.config import ModelConfig
from hpctrain.models.dlrm import DLRM
from hpctrain.parallel.types import Group

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class Alone(Group):
    """A one-member group: every collective is the identity."""

    rank, size = 0, 1

    def all_reduce(self, tensor, op="sum"):
        return tensor

    def all_gather(self, tensor, sizes):
        return tensor

    def broadcast(self, tensor, root):
        return tensor

    def post(self, sends, recvs):
        raise AssertionError("a one-member group has no peer")


def both(module):
    return module, copy.deepcopy(module).cuda()


def test_a_dlrm_step_on_cuda_equals_cpu():
    torch.manual_seed(0)
    cpu, gpu = both(DLRM(ModelConfig(), num_tables=26))
    dense, emb = torch.rand(64, 13), torch.randn(64, 26, 16) / 4
    labels = (torch.rand(64) < 0.3).float()
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
        logits = model(dense.to(device), emb.to(device))
        F.binary_cross_entropy_with_logits(logits, labels.to(device), reduction="sum").backward()
        optimizer.step()
    for p, q in zip(cpu.parameters(), gpu.parameters(), strict=True):
        torch.testing.assert_close(q.grad.cpu(), p.grad, **TOL)
        torch.testing.assert_close(q.detach().cpu(), p.detach(), **TOL)


def test_tensor_parallel_layers_on_cuda_equal_cpu():
    tensor_parallel_layers_match_on_cuda(Alone())
