"""The parameter server's kernels equal local tables update for update, bit for bit.

Every optimizer under every sync model: workers pull, push (with repeated rows) and finally
read all rows with their optimizer state; a :class:`~embeddings.tables.LocalTables` replica on
each worker applies the same pushes and must hold the very same bits. Outside deterministic
mode, worker ``w`` touches only rows ``r`` with ``r % workers == w``, so every row's updates
arrive in one order (MPI keeps one sender's messages in order) whatever the model lets run
ahead; in deterministic mode the workers share rows and the server sums each step's pushes in
worker order, as the replica does. Every other case the server splits its row passes over
three threads, in chunks of a few rows, and must hold the same bits.
"""

import numpy as np
import pytest

from embeddings.optim import OPTIMIZERS, SparseOptimizer, coalesce
from embeddings.tables import LocalTables, TableLayout
from hpctrain.config import load_config
from hpctrain.runtime.world import build_topology
from hpctrain.sync.asp import ASP
from hpctrain.sync.bsp import BSP
from hpctrain.sync.ssp import ssp
from ps import threads
from ps.service import PSJob

SIZES = [40, 7, 300, 1000]
DIM = 4
SEED = 5
STEPS = 6
MODELS = {"bsp": BSP, "ssp:2": ssp(2), "asp": ASP, "deterministic": BSP}


def batch(case: int, step: int, worker: int, workers: int, shared: bool,
          total: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``worker``'s rows (with repeats) and gradients at ``step``; every worker can
    recompute everyone's."""
    rng = np.random.default_rng([case, step, worker])
    rows = rng.integers(0, total, size=int(rng.integers(0, 60)))
    if not shared:
        rows = rows - rows % workers + worker
        rows = rows[rows < total]
    grads = rng.normal(size=(len(rows), DIM)).astype(np.float32)
    return rows.astype(np.int64), grads


@pytest.mark.mpi(ranks=(3, 4), timeout=600)
def test_server_equals_local_tables(mpi_ranks, monkeypatch):
    monkeypatch.setattr(threads, "MIN_ROWS", 8)  # this test's requests: up to 60 rows
    config = load_config(overrides=[f"ps.servers={mpi_ranks - 2}", "ps.table_wise_below=50",
                                    f"ps.sharding={'auto' if mpi_ranks == 3 else 'row_range'!r}"])
    topo = build_topology(config)
    layout = TableLayout.from_sizes(SIZES, DIM)
    workers, total = topo.workers, layout.total_rows
    for case, (kind, mode) in enumerate((k, m) for k in OPTIMIZERS for m in MODELS):
        optimizer, shared = SparseOptimizer(kind), mode == "deterministic"
        job = PSJob.create(topo.world, topo.roles, layout, config.ps, SEED)
        if not topo.is_worker:
            stats = job.serve(optimizer, SEED, [MODELS[mode]] * len(SIZES), shared,
                              threads=1 + 2 * (case % 2))
            assert stats.pushes == workers * STEPS and stats.errors == 0
            assert stats.threads == 1 + 2 * (case % 2)
            assert 0 < stats.busy_s <= stats.serve_s
            continue
        client, me = job.client([MODELS[mode]] * len(SIZES), optimizer.state_width(DIM)), \
            topo.worker_rank
        mine = LocalTables(layout, optimizer, SEED)  # this worker's pushes (own rows)
        everyone = LocalTables(layout, optimizer, SEED)  # all pushes, as the server applies
        for step in range(STEPS):
            rows, grads = batch(case, step, me, workers, shared, total)
            unique = np.unique(rows)
            if shared:  # BSP, one update per step: the reads see every earlier step
                np.testing.assert_array_equal(client.pull(unique), everyone.weight[unique],
                                              err_msg=f"{kind} {mode} step {step}")
            else:  # own rows have seen exactly this worker's earlier pushes
                np.testing.assert_array_equal(client.pull(unique), mine.weight[unique],
                                              err_msg=f"{kind} {mode} step {step}")
                mine.push(rows, grads, 0.1)
            client.push(rows, grads, 0.1)
            parts = [coalesce(*batch(case, step, w, workers, shared, total))
                     for w in range(workers)]  # the client sums repeats; workers in order
            everyone.push(np.concatenate([r for r, _ in parts]),
                          np.concatenate([g for _, g in parts]), 0.1)
        got = client.read(np.arange(total))  # BSP's rule: after every push
        expected = np.concatenate([everyone.weight, everyone.state], axis=1)
        np.testing.assert_array_equal(got, expected, err_msg=f"{kind} {mode}")
        assert not np.array_equal(got[:, :DIM], LocalTables(layout, optimizer, SEED).weight)
        client.close()
