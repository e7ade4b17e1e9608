"""Fused gradients over one rank (nothing to reduce) and over several: same sums, and the
one-sum finiteness check."""

import pytest
import torch
from mpi4py import MPI

from hpctrain.comm import Group
from hpctrain.comm.fusion import FusedGradients
from hpctrain.config import CommConfig


def run_step(comm):
    group = Group(comm, CommConfig())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1))
    fused = FusedGradients(list(model.parameters()), group, bucket_bytes=64, extra=1)
    value = MPI.COMM_WORLD.Get_rank() + 1.0  # differs between ranks
    fused.arm([value])
    model(torch.full((3, 5), value)).sum().backward()
    stats = fused.finish()
    return model, fused, stats


@pytest.mark.mpi(ranks=(2,))
def test_one_rank_skips_the_reduction_and_several_sum():
    world = MPI.COMM_WORLD
    alone_model, alone, alone_stats = run_step(MPI.COMM_SELF)
    assert alone_stats.tolist() == [world.Get_rank() + 1.0]
    assert alone.finite()
    model, fused, stats = run_step(world)
    assert stats.tolist() == [3.0]  # 1 + 2
    grads = [p.grad.clone() for p in model.parameters()]
    mine = [p.grad.clone() for p in alone_model.parameters()]
    summed = [torch.tensor(world.allreduce(g.numpy())) for g in mine]
    for got, want in zip(grads, summed, strict=True):
        torch.testing.assert_close(got, want)
    assert fused.finite()
    next(model.parameters()).grad[0, 0] = float("nan")
    assert not fused.finite()
    next(model.parameters()).grad[0, 0] = 0.0
    fused.stats[0] = float("inf")  # the extra slots are not gradients
    assert fused.finite()
    alone.close()
    fused.close()
