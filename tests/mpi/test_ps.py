"""The parameter server inside real MPI jobs: 1 server + 2 workers, 2 servers + 2 workers."""

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from embeddings.optim import SparseOptimizer
from embeddings.tables import TableLayout, init_rows
from hpctrain.config import load_config
from hpctrain.errors import EmbeddingError
from hpctrain.runtime.world import build_topology
from hpctrain.sync.bsp import BSP
from hpctrain.train.job import run_training
from hpctrain.train.trainer import Trainer
from ps.service import PSJob

SIZES = [40, 7, 300, 1000]
DIM = 4
SEED = 3


def worlds(ranks: int, sharding: str) -> tuple:
    servers = ranks - 2
    config = load_config(overrides=[f"ps.servers={servers}", f"ps.sharding={sharding!r}",
                                    "ps.table_wise_below=50", "train.seed=3"])
    topo = build_topology(config)
    layout = TableLayout.from_sizes(SIZES, DIM)
    return config, topo, layout, PSJob.create(topo.world, topo.roles, layout, config.ps, SEED)


def gradient(round_: int, worker: int, rows: np.ndarray) -> np.ndarray:
    base = rows[:, None] * 0.001 + np.arange(DIM) * 0.01 + round_ * 0.1 + worker
    return np.sin(base).astype(np.float32)


# Each draw is one round: the rows every worker touches (repeats and empty batches included;
# sometimes all rows come from one small range, i.e. one server's table).
ROUND = st.lists(st.one_of(
    st.lists(st.integers(0, sum(SIZES) - 1), max_size=40),
    st.lists(st.integers(40, 46), min_size=1, max_size=10),
), min_size=2, max_size=2)


@pytest.mark.mpi(ranks=(3, 4))
def test_no_lost_updates_and_bad_ids(mpi_ranks):
    """SGD with lr 1: every pull sees the initial rows minus every earlier pushed gradient."""
    _, topo, layout, job = worlds(mpi_ranks, "row_hash" if mpi_ranks == 4 else "auto")
    if not topo.is_worker:
        stats = job.serve(SparseOptimizer("sgd"), SEED, [BSP] * len(SIZES))
        assert topo.role_comm.allreduce(stats.errors) == 1 and stats.pushes > 5
        return
    client, me = job.client(), topo.worker_rank
    expected = init_rows(layout, np.arange(layout.total_rows), SEED).astype(np.float64)
    rounds = [0]

    @settings(derandomize=True, database=None, max_examples=30, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(ROUND)
    def one_round(batches):
        mine = np.array(batches[me], dtype=np.int64)
        unique = np.unique(mine)
        np.testing.assert_allclose(client.pull(unique), expected[unique], rtol=1e-5, atol=1e-6)
        # As the trainer's dense allreduce does, keep a fast worker from pushing this round
        # before a slow one has read it (BSP promises a read has *at least* earlier rounds).
        topo.role_comm.Barrier()
        client.push(mine, gradient(rounds[0], me, mine), lr=1.0)
        for worker, rows in enumerate(batches):
            rows = np.array(rows, dtype=np.int64)
            np.subtract.at(expected, rows, gradient(rounds[0], worker, rows))
        rounds[0] += 1

    one_round()
    assert client.clock == rounds[0] > 5

    def push_rows(rows: np.ndarray) -> None:
        topo.role_comm.Barrier()  # as above
        client.push(rows, gradient(rounds[0], me, rows), lr=1.0)
        for worker in range(topo.workers):
            np.subtract.at(expected, rows, gradient(rounds[0], worker, rows))
        rounds[0] += 1

    # A prefetch left unread at its step (a re-tiering changed the cold rows) is not served
    # at a later step: it holds the rows as they were then.
    rows = np.arange(10, 20, dtype=np.int64)
    client.prefetch(rows, ahead=1)
    push_rows(rows)
    np.testing.assert_allclose(client.pull(rows + 100), expected[rows + 100], rtol=1e-5,
                               atol=1e-6)
    push_rows(rows)
    np.testing.assert_allclose(client.pull(rows), expected[rows], rtol=1e-5, atol=1e-6)
    everything = np.arange(layout.total_rows)
    np.testing.assert_allclose(client.pull(everything), expected, rtol=1e-5, atol=1e-5)
    if me == 0:
        with pytest.raises(EmbeddingError, match=r"id 1005 is outside table 't3' of 1000 rows"):
            client.pull(np.array([layout.total_rows + 5]))
        np.testing.assert_allclose(client.pull(everything[:50]), expected[:50], rtol=1e-5,
                                   atol=1e-5)
    assert client.stats.rows_pulled <= client.stats.pulls * layout.total_rows
    client.close()


@pytest.mark.mpi(ranks=(3, 4))
def test_hybrid_training_equals_replicated(mpi_ranks, tmp_path):
    """Tables on the servers, dense data parallel: the same model as the replicated trainer."""
    servers = mpi_ranks - 2
    config = load_config(overrides=[
        f"ps.servers={servers}", "ps.table_wise_below=100", "data.table_sizes=[50, 200, 1000, 7]",
        "data.train_samples=3000", "data.eval_samples=300", "model.embedding_dim=8",
        "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.progress=false",
        "train.optimizer=sgd", "train.lr=0.5", "train.batch_size=25", "train.steps=6",
        f"train.run_dir={str(tmp_path)!r}"])
    topo = build_topology(config)
    read: dict[str, np.ndarray] = {}

    def read_back(trainer: Trainer) -> None:  # on the workers, while the servers serve
        read["tables"] = trainer.table_rows()
        read["dense"] = trainer.dense_parameters()

    run_training(config, topo, on_trained=read_back)
    if topo.rank == 0:
        tables, dense = read["tables"], read["dense"]
        plain = config.__class__(**{**config.__dict__, "ps": config.ps.__class__()})
        reference = Trainer(plain, build_topology(plain, MPI.COMM_SELF))
        reference.fit()
        np.testing.assert_allclose(dense, reference.dense_parameters(), rtol=2e-4, atol=2e-6)
        np.testing.assert_allclose(tables, reference.table_rows(), rtol=2e-4, atol=2e-6)
        assert (tmp_path / "plan.json").exists()
