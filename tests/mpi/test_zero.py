"""ZeRO-1 (train.zero = 1): the same model as plain data parallel, 1/N of the state, also
on the data axis of a tensor/pipeline grid."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import load_config
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
        "train.clip_norm=0.5", f"train.zero={zero}", *extra,
        f"train.run_dir={str(tmp_path / f'{optimizer}{zero}')!r}"], env={})
    trainer = Trainer(config, build_topology(config))
    trainer.summary = trainer.fit()
    return trainer.dense_parameters(), trainer


def optimizer_values(trainer: Trainer) -> int:
    """float32 optimizer state values this worker holds (the step count is float64)."""
    state = trainer.dense_state()[len(list(trainer.parameters())):]
    return sum(s.size for s in state if s.dtype == np.float32)


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=300)
def test_zero1_equals_plain_data_parallel(tmp_path):
    for optimizer in ("adamw", "sgd"):
        plain, reference = train(tmp_path, 0, optimizer)
        sharded, trainer = train(tmp_path, 1, optimizer)
        np.testing.assert_allclose(sharded, plain, rtol=1e-5, atol=1e-6, err_msg=optimizer)
        replicas = WORLD.allgather(sharded)
        assert all(np.array_equal(r, replicas[0]) for r in replicas)
        total = trainer.dense_parameters().size
        mine, full = optimizer_values(trainer), optimizer_values(reference)
        per_param = full // total  # Adam: m and v; momentum: one buffer
        assert abs(mine - per_param * total / WORLD.Get_size()) <= per_param
        assert WORLD.allreduce(mine) == full
        if WORLD.Get_rank() == 0:  # the summary reports every worker's share, in bytes
            shares = trainer.summary.optimizer_state_bytes
            assert len(shares) == WORLD.Get_size()
            replica = reference.summary.optimizer_state_bytes[0]  # the whole state
            counts = 8 * (WORLD.Get_size() - 1) * (optimizer == "adamw")  # a step count each
            assert sum(shares) == replica + counts


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
def test_zero1_on_the_data_axis_of_a_grid(tmp_path):
    """pp = 2 and tp = 2, each over dp = 2: every (stage, tensor shard) shards its state
    over its two replicas, and trains the plain grid's model."""
    for grid in (["parallel.pp=2"], ["parallel.tp=2"]):
        plain, reference = grid_run(f"{tmp_path}/{grid[0]}-plain", grid, 0)
        sharded, trainer = grid_run(f"{tmp_path}/{grid[0]}-zero", grid, 1)
        np.testing.assert_allclose(sharded, plain, rtol=1e-5, atol=1e-6, err_msg=grid[0])
        mine, full = optimizer_values(trainer), optimizer_values(reference)
        assert abs(mine - full / 2) <= 2, (grid, mine, full)  # m and v: one value each side
        trainer.close()
        reference.close()
