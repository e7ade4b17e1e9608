"""Data-parallel training across real MPI worlds of 2 and 3 ranks."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import load_config
from hpctrain.runtime.world import build_topology
from hpctrain.train.trainer import Trainer

SMALL = ["data.table_sizes=[50, 200, 1000, 7]", "data.train_samples=3000",
         "data.eval_samples=500", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
         "model.top_mlp=[16, 1]", "train.progress=false", "train.log_every=2"]


def parameters(trainer: Trainer) -> tuple[np.ndarray, np.ndarray]:
    return trainer.dense_parameters(), trainer.table_rows()


@pytest.mark.mpi(ranks=(2, 3))
@pytest.mark.parametrize("extra", [
    ["train.optimizer=sgd", "train.lr=0.5", "train.batch_size=25", "train.steps=6"],
    ["train.optimizer=adagrad", "train.lr=0.05", "train.batch_size=16", "train.accumulate=2",
     "train.steps=4", "train.warmup_steps=2"],
], ids=["sgd-uneven", "adagrad-accumulate"])
def test_data_parallel_equals_one_process(tmp_path, extra):
    """W workers over the same global batches end with the 1-process parameters."""
    config = load_config(overrides=[*SMALL, *extra, f"train.run_dir={str(tmp_path)!r}"])
    trainer = Trainer(config, build_topology(config))
    summary = trainer.fit()
    dense, tables = parameters(trainer)
    world = MPI.COMM_WORLD
    # Replicas agree exactly (same updates applied in the same order everywhere).
    for mine, first in zip((dense, tables), world.bcast((dense, tables)), strict=True):
        np.testing.assert_array_equal(mine, first)
    if world.Get_rank() == 0:
        assert summary.samples == config.train.steps * config.train.accumulate * \
            config.train.batch_size
        single = Trainer(config, build_topology(config, MPI.COMM_SELF))
        single.fit()
        ref_dense, ref_tables = parameters(single)
        np.testing.assert_allclose(dense, ref_dense, rtol=2e-4, atol=2e-6)
        np.testing.assert_allclose(tables, ref_tables, rtol=2e-4, atol=2e-6)
        assert not np.allclose(ref_tables, Trainer(config, build_topology(
            config, MPI.COMM_SELF)).table_rows()), "training changed nothing"
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(lines) >= config.train.steps // 2
        assert (tmp_path / "config.toml").exists()


@pytest.mark.mpi(ranks=(2,))
def test_loss_beats_the_base_rate(tmp_path):
    """A short synthetic run learns: held-out log loss at least 10% under the base rate."""
    config = load_config(overrides=[
        *SMALL, "data.train_samples=60000", "train.batch_size=256", "train.lr=0.05",
        f"train.run_dir={str(tmp_path)!r}"])
    summary = Trainer(config, build_topology(config)).fit()
    if MPI.COMM_WORLD.Get_rank() == 0:
        ev = summary.eval
        assert ev["samples"] == config.data.eval_samples
        assert ev["log_loss"] < 0.9 * ev["base_rate_log_loss"], ev
        assert ev["auc"] > 0.75, ev
