"""The all-to-all store trains like the replicated one, for every sharding and world size."""

import numpy as np
import pytest
from mpi4py import MPI

from embeddings.alltoall import ShardedTables
from hpctrain.config import load_config
from hpctrain.errors import EmbeddingError
from hpctrain.runtime.world import build_topology
from hpctrain.train.trainer import Trainer

WORLD = MPI.COMM_WORLD
# 26 tables, uneven over 3 and 4 workers; the first is larger than the other 25 together.
SIZES = [2500, *(7 + 4 * t for t in range(25))]
SMALL = [f"data.table_sizes={SIZES}", "data.train_samples=2000", "data.eval_samples=500",
         "train.eval_batch_size=249", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
         "model.top_mlp=[16, 1]", "train.progress=false", "train.batch_size=48",
         "train.steps=4"]
OPTIMIZERS = {"sgd": ["train.optimizer=sgd", "train.lr=0.5"],
              "adagrad": ["train.optimizer=adagrad", "train.lr=0.1", "train.accumulate=2"],
              "adam": ["train.optimizer=adam", "train.lr=0.01"]}  # lazy adam tables
SHARDINGS = ("table_wise", "row_wise", "column_wise", "table_row_wise")
# lazy adam's state: whole rows on their owner (row-wise), or moments per column block with
# the row's step count on every block's owner (column-wise)
ADAM_SHARDINGS = ("row_wise", "column_wise")


def train(tmp_path, name: str, *extra: str) -> tuple[Trainer, dict]:
    config = load_config(overrides=[*SMALL, *extra, f"train.run_dir={str(tmp_path / name)!r}"])
    trainer = Trainer(config, build_topology(config))
    summary = trainer.fit()
    return trainer, summary.eval


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=900)
def test_every_sharding_trains_like_replicated(tmp_path):
    tmp_path = WORLD.bcast(tmp_path, root=0)
    node = "comm.node_size=2" if WORLD.Get_size() % 2 == 0 else "comm.node_size=0"
    for opt, extra in OPTIMIZERS.items():
        ref, ref_eval = train(tmp_path, f"replicated-{opt}", *extra)
        ref_rows = ref.table_rows()
        for sharding in ADAM_SHARDINGS if opt == "adam" else SHARDINGS:
            mode = ['embeddings.mode="alltoall"', f'embeddings.sharding="{sharding}"']
            trainer, got_eval = train(tmp_path, f"{sharding}-{opt}", *extra, *mode, node)
            store = trainer.store
            assert isinstance(store, ShardedTables) and store.tables.optimizer.kind == opt
            what = f"{sharding} {opt} on {WORLD.Get_size()} workers"
            np.testing.assert_allclose(trainer.table_rows(), ref_rows, rtol=1e-5, atol=1e-6,
                                       err_msg=what)
            np.testing.assert_allclose(trainer.dense_parameters(), ref.dense_parameters(),
                                       rtol=1e-4, atol=1e-6, err_msg=what)
            if WORLD.Get_rank() == 0:
                assert got_eval["log_loss"] == pytest.approx(ref_eval["log_loss"], abs=1e-5)
                assert (tmp_path / f"{sharding}-{opt}" / "plan.json").exists()
            stats = store.stats
            assert stats.pushes == 4
            assert stats.pulls_ahead == 3, what  # steps 2-4: their first pull's ids rode ahead
            # over all workers: at least the minimum; with one micro-batch a step the push
            # reuses its pull's ids (within 5%: the count matrices), with two it sends them
            sent, least = WORLD.allreduce(np.array([stats.train_bytes_sent, stats.min_bytes]))
            most = 1.5 if opt == "adagrad" else 1.05
            assert least > 0 and least <= sent <= most * least, (what, sent, least)
            bad = np.array([store.layout.total_rows + 5])
            with pytest.raises(EmbeddingError, match=r"id 108 is outside table 't25' of 103"):
                store.pull(bad)
    assert not np.allclose(ref_rows, Trainer(ref.config, build_topology(ref.config))
                           .table_rows()), "training changed nothing"
