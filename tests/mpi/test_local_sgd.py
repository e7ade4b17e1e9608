"""Local SGD (sync.dense = local:H): H = 1 is BSP, H = 4 syncs a quarter as often, and a
checkpoint between averages holds worker 0's replica."""

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import load_config
from hpctrain.runtime.world import build_topology
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.trainer import Trainer

WORLD = MPI.COMM_WORLD


def job(tmp_path, dense: str, *extra: str):
    return load_config(overrides=[
        "data.table_sizes=[50, 200, 1000, 7]", "data.train_samples=3000",
        "data.eval_samples=300", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
        "model.top_mlp=[16, 1]", "train.progress=false", "train.batch_size=48",
        "train.steps=8", "train.optimizer=sgd", "train.lr=0.3", "train.warmup_steps=0",
        f"sync.dense={dense!r}", f"train.run_dir={str(tmp_path / dense.replace(':', ''))!r}",
        *extra], env={})


def train(tmp_path, dense: str, *extra: str) -> tuple[np.ndarray, np.ndarray, object]:
    config = job(tmp_path, dense, *extra)
    trainer = Trainer(config, build_topology(config))
    summary = trainer.fit()
    return trainer.dense_parameters(), trainer.table_rows(), summary


@pytest.mark.mpi(ranks=(2, 3), timeout=300)
def test_local_sgd_h1_is_bsp_and_h4_syncs_a_quarter(tmp_path):
    bsp_dense, bsp_tables, bsp = train(tmp_path, "bsp")
    one_dense, one_tables, one = train(tmp_path, "local:1")
    np.testing.assert_allclose(one_dense, bsp_dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one_tables, bsp_tables, rtol=1e-5, atol=1e-6)
    four_dense, _, four = train(tmp_path, "local:4")
    # every replica ends with the same, averaged parameters, not BSP's
    replicas = WORLD.allgather(four_dense)
    assert all(np.array_equal(r, replicas[0]) for r in replicas)
    assert not np.allclose(four_dense, bsp_dense, rtol=1e-4, atol=1e-5)
    if WORLD.Get_rank() == 0:
        assert bsp.dense_syncs == one.dense_syncs == 8
        assert four.dense_syncs / bsp.dense_syncs == 0.25
        assert four.eval["log_loss"] == four.eval["log_loss"]  # trained and evaluated


@pytest.mark.mpi(ranks=(2, 3), timeout=300)
def test_all_to_all_tables_take_local_sgd_for_the_dense_layers(tmp_path):
    """With the tables sharded over the workers, H = 1 is still BSP and H = 4 still syncs
    the dense layers a quarter as often: the layout and the dense sync are independent."""
    a2a = ('embeddings.mode="alltoall"', 'embeddings.sharding="row_wise"')
    bsp_dense, bsp_tables, bsp = train(tmp_path, "bsp", *a2a)
    one_dense, one_tables, _ = train(tmp_path, "local:1", *a2a)
    np.testing.assert_allclose(one_dense, bsp_dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one_tables, bsp_tables, rtol=1e-5, atol=1e-6)
    _, _, four = train(tmp_path, "local:4", *a2a)
    if WORLD.Get_rank() == 0:
        assert four.dense_syncs / bsp.dense_syncs == 0.25


@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_a_checkpoint_between_averages_saves_worker_0s_replica(tmp_path):
    """Three steps of local:4 leave the replicas apart (parameters and momentum buffers);
    a checkpoint then holds worker 0's replica, parameters and optimizer state, and a run
    resumed from it starts every worker from that replica and continues from step 3. The
    other workers' progress since the last average is lost: the resumed run ends apart from
    the uninterrupted one."""
    config = job(tmp_path, "local:4", "train.momentum=0.9")
    trainer = Trainer(config, build_topology(config))
    nparams = len(list(trainer.parameters()))
    batches, ahead = trainer.micro_batches(), []
    for step in range(3):
        trainer.step(step, batches, ahead)
    replicas = WORLD.allgather(trainer.dense_parameters())
    states = WORLD.allgather(trainer.dense_state()[nparams:])
    assert not np.array_equal(replicas[0], replicas[1])  # no average yet
    assert len(states[0]) == nparams  # a momentum buffer per parameter
    assert not all(np.array_equal(a, b) for a, b in zip(*states, strict=True))
    trainer.save_checkpoint(3, clock_s=1.0, samples=3 * config.train.batch_size)
    if WORLD.Get_rank() == 0:
        path = ckpt.step_dir(config.train.run_dir, 3) / "dense.h5"
        with h5py.File(path) as f:
            saved = [f["param"][name][()] for name in sorted(f["param"], key=int)]
            optim = [f["optim"][name][()] for name in sorted(f["optim"], key=int)]
        np.testing.assert_array_equal(np.concatenate([p.ravel() for p in saved]), replicas[0])
        assert len(optim) == len(states[0])
        for kept, mine in zip(optim, states[0], strict=True):
            np.testing.assert_array_equal(kept, mine)
    for step in range(3, config.train.steps):  # the uninterrupted run, on to its end
        trainer.step(step, batches, ahead)
    uninterrupted = trainer.dense_parameters()
    trainer.close()

    manifest = ckpt.read_manifest(ckpt.step_dir(config.train.run_dir, 3))
    resumed = Trainer(config, build_topology(config), manifest=manifest)
    assert resumed.start_step == 3
    restored = resumed.dense_state()  # on every worker: worker 0's replica
    np.testing.assert_array_equal(np.concatenate([p.ravel() for p in restored[:nparams]]),
                                  replicas[0])
    for got, kept in zip(restored[nparams:], states[0], strict=True):
        np.testing.assert_array_equal(got, kept)
    summary = resumed.fit()
    final = WORLD.allgather(resumed.dense_parameters())
    resumed.close()
    assert all(np.array_equal(r, final[0]) for r in final)  # averaged after the last step
    assert not np.array_equal(final[0], uninterrupted)
    if WORLD.Get_rank() == 0:
        assert summary.dense_syncs == 2  # resumed steps 4-8: averages after steps 4 and 8
