"""ZeRO-1 and ZeRO-2 (train.zero = 1, 2): the same model as plain data parallel, 1/N of the
state (ZeRO-2: and of the gradient); ZeRO-1 also on the data axis of a tensor/pipeline grid."""

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

from hpctrain.comm import Group
from hpctrain.config import CommConfig, load_config
from hpctrain.parallel.data import DataParallel
from hpctrain.runtime.world import build_topology
from hpctrain.train.trainer import Trainer

WORLD = MPI.COMM_WORLD


def train(tmp_path, zero: int, optimizer: str) -> tuple[np.ndarray, Trainer]:
    extra = ["train.momentum=0.9"] if optimizer == "sgd" else ["train.weight_decay=0.01"]
    config = load_config(overrides=[
        "data.table_sizes=[50, 200, 1000, 7]", "data.train_samples=3000",
        "data.eval_samples=300", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
        "model.top_mlp=[16, 1]", "train.progress=false", "train.batch_size=48",
        "train.steps=6", f"train.optimizer={optimizer!r}", "train.lr=0.05",
        "train.clip_norm=0.5", f"train.zero={zero}", "comm.bucket_kib=1", *extra,
        f"train.run_dir={str(tmp_path / f'{optimizer}{zero}')!r}"], env={})
    trainer = Trainer(config, build_topology(config))
    trainer.summary = trainer.fit()
    return trainer.dense_parameters(), trainer


def optimizer_values(trainer: Trainer) -> int:
    """float32 optimizer state values this worker holds (the step count is float64)."""
    state = trainer.dense_state()[len(list(trainer.parameters())):]
    return sum(s.size for s in state if s.dtype == np.float32)


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=300)
def test_zero1_and_zero2_equal_plain_data_parallel(tmp_path):
    """Two buckets or more (1 KiB each), so ZeRO-2 reduce-scatters each during backward."""
    for optimizer, stage in (("adamw", 1), ("sgd", 1), ("adamw", 2), ("sgd", 2)):
        plain, reference = train(tmp_path, 0, optimizer)
        sharded, trainer = train(tmp_path, stage, optimizer)
        assert len(trainer.engine.dp.fused.buckets) >= 2
        np.testing.assert_allclose(sharded, plain, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{optimizer} stage {stage}")
        replicas = WORLD.allgather(sharded)
        assert all(np.array_equal(r, replicas[0]) for r in replicas)
        total = trainer.dense_parameters().size
        mine, full = optimizer_values(trainer), optimizer_values(reference)
        per_param = full // total  # Adam: m and v; momentum: one buffer
        pieces = len(trainer.engine.dp.fused.buckets) if stage == 2 else 1  # <= 1 more each
        assert abs(mine - per_param * total / WORLD.Get_size()) <= per_param * pieces
        assert WORLD.allreduce(mine) == full
        if WORLD.Get_rank() == 0:  # the summary reports every worker's share, in bytes
            shares = trainer.summary.optimizer_state_bytes
            assert len(shares) == WORLD.Get_size()
            replica = reference.summary.optimizer_state_bytes[0]  # the whole state
            counts = 8 * (WORLD.Get_size() - 1) * (optimizer == "adamw")  # a step count each
            assert sum(shares) == replica + counts
            grads = trainer.summary.gradient_bytes  # ZeRO-2 keeps a shard of the gradient
            whole = 4 * total
            if stage == 2:  # the shard (chunks differ by <= 1 each) and the staging buffer
                fused = trainer.engine.dp.fused
                staging = fused.staging_bytes
                assert staging <= 1024 // 16  # small parameters only, 1/16 of a bucket
                n = WORLD.Get_size()
                assert sum(grads) == whole + n * staging, grads
                assert max(grads) - min(grads) <= 4 * len(fused.buckets), grads
            else:
                assert all(g >= whole for g in grads), grads


def grid_run(run_dir: str, grid: list[str], zero: int) -> tuple[np.ndarray, Trainer]:
    config = load_config(overrides=[
        "data.table_sizes=[50, 200, 1000, 7]", "data.train_samples=3000",
        "data.eval_samples=300", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
        "model.top_mlp=[16, 1]", "train.progress=false", "train.batch_size=48",
        "train.steps=6", "train.optimizer='adamw'", "train.lr=0.05",
        "train.weight_decay=0.01", f"train.zero={zero}", *grid,
        f"train.run_dir={run_dir!r}"], env={})
    trainer = Trainer(config, build_topology(config))
    trainer.fit()
    return trainer.dense_parameters(), trainer


@pytest.mark.mpi(ranks=(4,), timeout=300)
def test_zero1_and_zero2_on_the_data_axis_of_a_grid(tmp_path):
    """pp = 2 and tp = 2, each over dp = 2: every (stage, tensor shard) shards its state
    (ZeRO-2: and its reduced gradient) over its two replicas, and trains the plain grid's
    model."""
    for grid, stage in ((["parallel.pp=2"], 1), (["parallel.tp=2"], 1), (["parallel.pp=2"], 2),
                        (["parallel.tp=2"], 2)):
        plain, reference = grid_run(f"{tmp_path}/{grid[0]}-plain{stage}", grid, 0)
        sharded, trainer = grid_run(f"{tmp_path}/{grid[0]}-zero{stage}", grid, stage)
        np.testing.assert_allclose(sharded, plain, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{grid[0]} stage {stage}")
        mine, full = optimizer_values(trainer), optimizer_values(reference)
        assert abs(mine - full / 2) <= 2, (grid, mine, full)  # m and v: one value each side
        whole = trainer.dense_parameters().size * 4
        kept = trainer.engine.gradient_bytes()
        if stage == 2:  # half the gradient and the staging buffer
            fused = trainer.engine.engine.dp.fused
            staging = fused.staging_bytes
            assert abs(kept - staging - whole / 2) <= 4 * len(fused.buckets), (grid, kept)
        else:
            assert kept >= whole, (grid, stage, kept, whole)
        trainer.close()
        reference.close()


@pytest.mark.mpi(ranks=(3,))
def test_a_nonfinite_gradient_in_one_shard_is_seen_by_every_worker():
    """ZeRO-2: one element of rank 1's gradient of the first layer's weight is NaN. After
    the reduce-scatter it sits in one worker's shard only; ``finite()`` is False on every
    worker, and only the worker holding it names the parameter."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 40), nn.ReLU(), nn.Linear(40, 1))
    config = CommConfig(bucket_kib=1)
    group = Group(WORLD, config)
    dp = DataParallel(module, group, config, extra=1, sharded=True)
    dp.arm([1.0])
    module(torch.ones(4, 6)).sum().backward()
    assert dp.allreduce([1.0])[0] == 3.0
    assert dp.finite()
    dp.zero()
    dp.arm([1.0])
    out = module(torch.ones(4, 6)).sum()
    if WORLD.Get_rank() == 1:
        module[0].weight.register_hook(lambda g: g.index_put((torch.tensor([0]),
                                                              torch.tensor([0])),
                                                             torch.tensor(float("nan"))))
    out.backward()
    dp.allreduce([1.0])
    assert not dp.finite()
    named = [name for name, piece in dp.named_gradients(module)
             if not bool(torch.isfinite(piece.grad).all())]
    holders = WORLD.allgather(named)
    assert sorted(holders) == [[], [], ["0.weight"]], holders
    assert all(p.grad is None for p in module.parameters())  # freed once sent
    dp.close()
    group.free()
