"""Hot/cold tiering inside real MPI jobs: rows moving between the workers' hot tier and the
parameter servers lose no update and apply none twice; tiered training equals untiered."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import run_mpi
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from embeddings import tiered
from embeddings.collection import Lookup
from embeddings.hotsum import HotRider
from embeddings.hottier import HotTier
from embeddings.optim import SparseOptimizer
from embeddings.tables import LocalTables, TableLayout
from embeddings.tiered import TieredStore
from hpctrain.comm import Group
from hpctrain.config import TieringConfig, load_config
from hpctrain.runtime.world import build_topology
from hpctrain.sync.bsp import BSP
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.job import run_training
from hpctrain.train.trainer import Trainer
from ps.service import PSJob

SIZES = [40, 7, 300, 1000]
DIM = 4
SEED = 3
# Re-tier after every other step, forget fast, admit anything: rows churn between the tiers.
CHURN = TieringConfig(interval=2, decay=0.3, admission=0.0, exact_below=200, sketch_width=64)

# One draw is one round: the rows each worker touches, with repeats; a Zipf-like head (rows
# 40..46, a 7-row table) keeps a hot set worth having, the rest comes from anywhere.
ROUND = st.lists(st.lists(st.one_of(st.integers(40, 46), st.integers(0, sum(SIZES) - 1)),
                          min_size=4, max_size=30), min_size=3, max_size=3)


def gradient(round_: int, worker: int, rows: np.ndarray) -> np.ndarray:
    base = rows[:, None] * 0.001 + np.arange(DIM) * 0.01 + round_ * 0.1 + worker
    return np.sin(base).astype(np.float32)


def tiered_rounds(topo, layout, servers, capacity, examples, kind="sgd", staleness=0,
                  tiering=CHURN, background=True):
    """Hypothesis rounds through a tiered store over fresh servers, against a local replica
    that applies every round's summed gradients. A pull must equal the replica as it was
    ``L <= staleness`` rounds ago (ASP, ``staleness=None``: the refresh period
    ``tiering.interval`` less one) plus this worker's own updates since (SGD); at the end the
    servers hold every row, optimizer state included, exactly as the replica. With adagrad
    each row is touched by one worker per round (the servers apply each worker's push on
    its own, which only SGD makes equal to applying the sum). Returns the store, or None on
    servers."""
    config = load_config(overrides=[f"ps.servers={servers}", "ps.sharding='row_hash'"])
    job = PSJob.create(topo.world, topo.roles, layout, config.ps, SEED)
    optimizer, lr = SparseOptimizer(kind), (1.0 if kind == "sgd" else 0.1)
    if not topo.is_worker:
        job.serve(optimizer, SEED, [BSP] * len(SIZES))
        return None
    workers, me = topo.workers, topo.worker_rank
    client = job.client(state_width=optimizer.state_width(DIM))
    store = TieredStore(layout, client, Group(topo.role_comm), optimizer, tiering, capacity,
                        torch.device("cpu"), staleness, background=background)
    assert store.stats.planned_in_background == background  # mpi4py asks for THREAD_MULTIPLE
    reference = LocalTables(layout, optimizer, SEED)
    history = [reference.weight.astype(np.float64)]  # the replica after each round
    own = [np.zeros_like(history[0])]  # the changes of this worker's own SGD updates, cumulative
    lagged = [0]
    bound = tiering.interval - 1 if staleness is None else staleness

    def rows_of(batches, worker):
        rows = np.array(batches[worker % len(batches)], dtype=np.int64)
        return rows if kind == "sgd" else rows[rows % workers == worker]

    @settings(derandomize=True, database=None, max_examples=examples, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(ROUND)
    def one_round(batches):
        t = len(history) - 1
        mine = rows_of(batches, me)
        unique, counts = np.unique(mine, return_counts=True)
        store.observe(unique, counts)
        pulled = store.pull(unique).astype(np.float64)
        ok = np.zeros(len(unique), dtype=bool)
        for lag in range(0, min(bound, t) + 1):
            expected = history[t - lag] + (own[t] - own[t - lag])
            match = np.isclose(pulled, expected[unique], rtol=1e-5, atol=1e-6).all(axis=1)
            if lag == 0:
                lagged[0] += int((~match).sum())
            ok |= match
        assert ok.all(), f"round {t}: rows {unique[~ok]} are staler than {bound} steps"
        topo.role_comm.Barrier()  # as the trainer's dense allreduce does
        store.push(mine, gradient(t, me, mine), lr)
        everyone = [rows_of(batches, w) for w in range(workers)]
        reference.push(np.concatenate(everyone), np.concatenate(
            [gradient(t, w, rows) for w, rows in enumerate(everyone)]), lr)
        history.append(reference.weight.astype(np.float64))
        step = np.zeros_like(own[-1])
        np.add.at(step, mine, gradient(t, me, mine))
        own.append(own[-1] - lr * step)

    one_round()
    kept = len(store._seen)  # lookups kept for the next re-tiering
    with store.consistent_reads():  # as an evaluation reads: every update, hot and cold
        np.testing.assert_allclose(store.pull(np.arange(layout.total_rows)), reference.weight,
                                   rtol=1e-5, atol=1e-6)
    store.flush()
    stats = store.report()
    everything = np.arange(layout.total_rows)
    np.testing.assert_allclose(client.read(everything), reference.read(everything),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(store.pull(everything), reference.weight, rtol=1e-5, atol=1e-6)
    replicas = topo.role_comm.allgather(store.hot.weight.numpy().tobytes())
    assert all(r == replicas[0] for r in replicas), "hot replicas differ"
    if capacity < layout.total_rows:
        # rows churn: more promotions than the tier holds, some of them replacing rows
        assert stats.retiers > 4 and stats.rows_promoted > capacity and stats.rows_demoted > 3, \
            stats
    else:  # a budget over the tables: every row hot from the start, never a cold pull,
        # and no lookup kept for a re-tiering that never comes (memory stays bounded)
        assert len(store.hot) == layout.total_rows and stats.rows_cold == 0, stats
        assert not kept and stats.hit_rate == 1.0 and stats.lookups > 0, stats
        assert topo.role_comm.Get_rank() != 0 or stats.oracle_hit_rate == 1.0, stats
    assert len(store.hot) <= capacity and stats.resident_bytes <= stats.budget_bytes
    assert (topo.role_comm.allreduce(lagged[0]) > 0) == (bound > 0), "stale reads?"
    client.close()
    return store


@pytest.mark.mpi(ranks=(3, 4))
def test_no_update_lost_or_doubled_through_promotions_and_demotions(mpi_ranks):
    """Rounds against 1 server (np3: 2 workers) or 2 servers (np4: 2 workers): SGD (lr 1)
    with a small hot tier (gradients summed by allreduce) and a larger one (Allgatherv),
    adagrad (state moves with the rows), SGD under a staleness bound of 2 (SSP: a replica
    lags at most 2 steps, then is refreshed; 31 rounds end between refreshes, so the
    consistent read must refresh first), under ASP (refreshed every ``tiering.interval``
    steps, so at most 3 behind at 4), and every row hot."""
    servers = mpi_ranks - 2
    topo = build_topology(load_config(overrides=[f"ps.servers={servers}"]))
    layout = TableLayout.from_sizes(SIZES, DIM)
    small = tiered_rounds(topo, layout, servers, capacity=6, examples=20)
    advantage, tiered._SHM_ADVANTAGE = tiered._SHM_ADVANTAGE, 1  # bytes alone decide
    try:
        large = tiered_rounds(topo, layout, servers, capacity=40, examples=20)
    finally:
        tiered._SHM_ADVANTAGE = advantage
    tiered_rounds(topo, layout, servers, capacity=20, examples=20, kind="adagrad")
    tiered_rounds(topo, layout, servers, capacity=20, examples=31, staleness=2,
                  tiering=dataclasses.replace(CHURN, interval=7))
    tiered_rounds(topo, layout, servers, capacity=20, examples=19, staleness=None,
                  tiering=dataclasses.replace(CHURN, interval=4))
    tiered_rounds(topo, layout, servers, capacity=layout.total_rows, examples=8)
    if topo.is_worker:
        assert small.stats.dense_syncs > 0 and large.stats.sparse_syncs > 0


@pytest.mark.mpi(ranks=(3,))
def test_background_planning_installs_the_plans_inline_planning_does(mpi_ranks):
    """The same rounds with re-tierings planned on the planning thread and inline: the same
    hot sets at the same steps, so the same rows moved and the same hits (1 server, 2
    workers)."""
    topo = build_topology(load_config(overrides=["ps.servers=1"]))
    layout = TableLayout.from_sizes(SIZES, DIM)
    runs = [tiered_rounds(topo, layout, 1, capacity=6, examples=20, background=background)
            for background in (True, False)]
    if topo.is_worker:
        threaded, inline = (run.stats for run in runs)
        assert threaded.plan_s > 0 and inline.plan_s > 0
        np.testing.assert_array_equal(runs[0].hot.rows, runs[1].hot.rows)
        for key in ("retiers", "rows_promoted", "rows_demoted", "hits", "lookups",
                    "rows_hot", "rows_cold", "count_bytes"):
            assert getattr(threaded, key) == getattr(inline, key), key


TRAIN = ["data.table_sizes=[50, 200, 1000, 7]", "data.train_samples=3000",
         "data.eval_samples=300", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
         "model.top_mlp=[16, 1]", "train.progress=false", "train.batch_size=48",
         "train.steps=9", "tiering.interval=2", "tiering.admission=0", "tiering.decay=0.5",
         "tiering.budget=0.1", "tiering.prescan=500"]


def parameters(trainer: Trainer) -> np.ndarray:
    return trainer.dense_parameters()


@pytest.mark.mpi(ranks=(2, 3))
def test_hot_rows_beyond_a_workers_region_are_summed_after_the_reduction(mpi_ranks):
    """Regions of 2 records; worker w touches 1 + 2w hot rows (and a cold one), so all but
    worker 0 spill: every replica still gets the sum of every worker's gradients (SGD at lr
    1). A worker whose gradients hold a NaN writes nothing, and nothing of it spills."""
    comm = MPI.COMM_WORLD
    me, workers = comm.Get_rank(), comm.Get_size()
    hot_rows = np.arange(0, 40, 2, dtype=np.int64)  # 20 hot rows: the even ones
    tier = HotTier(DIM, SparseOptimizer(), torch.device("cpu"))
    tier.replace(hot_rows, hot_rows, lambda r: np.zeros((len(r), DIM), np.float32))
    rider = HotRider(tier, len(hot_rows), comm, max_rows=2)
    assert rider.records and rider.size == workers * (1 + 2 * (DIM + 1))

    def touched(w: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.append(hot_rows[w: w + 1 + 2 * w], 41)  # ... and a cold row
        return rows, gradient(0, w, rows)

    def step(nan_on: int) -> None:
        rows, grads = touched(me)
        if me == nan_on:
            grads[-1, 0] = np.nan  # a cold row's: the whole share goes
        lookup = Lookup(rows, torch.zeros((len(rows), DIM), requires_grad=True))
        lookup.values.grad = torch.from_numpy(grads)
        tail = torch.zeros(rider.size)
        rider.fill([lookup], tail)
        comm.Allreduce(MPI.IN_PLACE, tail.numpy())
        rider.apply(tail, lr=1.0, scale=1.0)
        assert not tail.numpy().any()  # read and zeroed

    expected = np.zeros((len(hot_rows), DIM), np.float32)
    for nan_on in (-1, workers - 1):
        step(nan_on)
        for w in range(workers):
            if w != nan_on:
                rows, grads = touched(w)
                expected[rows[:-1] // 2] -= grads[:-1]
        np.testing.assert_allclose(tier.weight.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert rider.spills == (2 if workers > 2 else 1)  # with the NaN, only worker 1 of 3 spills


def untiered(config, steps: int, run_dir: Path) -> Trainer:
    """``config``'s job without servers or tiering, ``steps`` steps in this process alone."""
    train = dataclasses.replace(config.train, steps=steps, run_dir=str(run_dir))
    plain = dataclasses.replace(config, ps=config.ps.__class__(),
                                tiering=config.tiering.__class__(), train=train)
    reference = Trainer(plain, build_topology(plain, MPI.COMM_SELF))
    reference.fit()
    return reference


@pytest.mark.mpi(ranks=(3, 4))
def test_tiered_training_equals_untiered(mpi_ranks, tmp_path):
    """1 server and 2 or 3 workers, BSP, SGD, the hot set warm-started from a scan of the
    data, the hot gradients riding in the dense gradient reduction in either layout (a
    line per hot row at budget 0.1, per-worker records at 0.5; under ZeRO-2, whose
    reduce-scatter carries no tail, the store's own sum): the tiered run ends with the model
    of the untiered one (which equals the single-process replicated run, see test_ps), and
    its checkpoint of step 4 holds the untiered model of step 4: the hot rows are written
    back before the servers save."""
    for budget, records, zero in ((0.1, False, 0), (0.5, True, 0), (0.1, None, 2)):
        config = load_config(overrides=[*TRAIN, "ps.servers=1", "train.optimizer='sgd'",
                                        "train.lr=0.3", f"tiering.budget={budget}",
                                        f"train.zero={zero}",
                                        f"comm.bucket_kib={1 if zero else 25600}",
                                        "checkpoint.every_steps=4", "checkpoint.keep=5",
                                        f"train.run_dir={str(tmp_path / f'{budget}-{zero}')!r}"])
        topo = build_topology(config)
        read: dict[str, object] = {}

        def read_back(trainer: Trainer, records: bool | None = records,
                      read: dict[str, object] = read, budget: float = budget) -> None:
            # on the workers
            read["pulled"] = trainer.table_rows()
            read["block"] = trainer.server_rows()  # hot rows written back, as close() does
            read["trainer"] = trainer
            stats = trainer.counters().tiering
            # the first due step only starts a plan: 3 installed in 9 steps, moving rows at 0.1
            assert stats.retiers >= 3 and stats.warm_start_rows > 0 and stats.hits > 0, stats
            assert budget > 0.1 or stats.rows_demoted > 0, stats
            if records is None:
                assert stats.carried_syncs == 0 and stats.dense_syncs + stats.sparse_syncs == 9
                return
            assert trainer.store.rider.records == records
            assert stats.carried_syncs == 9 and stats.dense_syncs == stats.sparse_syncs == 0

        summary = run_training(config, topo, on_trained=read_back)
        if topo.rank != 0:
            continue
        trainer, pulled, block = read["trainer"], read["pulled"], read["block"]
        first = summary.tiering[0]
        assert first.hit_rate > 0.3 and 0 < first.oracle_hit_rate <= 1
        manifest = ckpt.read_manifest(ckpt.step_dir(config.train.run_dir, 4))
        parts = list(ckpt.read_rows(Path(manifest.path), manifest.row_files()))
        saved = np.concatenate([p[1] for p in parts])[np.argsort(
            np.concatenate([p[0] for p in parts]))]
        folder = tmp_path / f"untiered-{budget}-{zero}"
        np.testing.assert_allclose(saved, untiered(config, 4, folder / "4").table_rows(),
                                   rtol=2e-4, atol=2e-6)
        reference = untiered(config, 9, folder / "9")
        tables = reference.table_rows()
        np.testing.assert_allclose(parameters(trainer), parameters(reference), rtol=2e-4,
                                   atol=2e-6)
        np.testing.assert_allclose(pulled, tables, rtol=2e-4, atol=2e-6)
        np.testing.assert_allclose(block, tables, rtol=2e-4, atol=2e-6)


HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]


def test_tiered_job_trains_and_bench_tiering_reports(tmp_path):
    """The acceptance job (1 server + 3 workers) trains; the benchmark writes its rows."""
    result = run_mpi([*HPCTRAIN, "train", "jobs/configs/tiered.toml", "--set",
                      "train.progress=false", "--set", "data.train_samples=30000", "--set",
                      "data.eval_samples=2000", "--set", f"train.run_dir={str(tmp_path)!r}"],
                     ranks=4, timeout=150)
    assert result.returncode == 0, result.stdout
    assert "hot hit rate" in result.stdout and "retier" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    first = summary["tiering"][0]
    assert len(summary["tiering"]) == 3 and first["hits"] > 0.5 * first["lookups"]
    assert first["resident_bytes"] <= first["budget_bytes"]

    out = tmp_path / "bench.json"
    bench = run_mpi([*HPCTRAIN, "bench", "tiering", "--rows", "20000", "--tables", "2",
                     "--zipf", "1.05", "--budgets", "0.1", "--stream-steps", "40",
                     "--train-steps", "12", "--repeat", "2", "--json", str(out),
                     "--set", "comm.node_size=1", "--set", "comm.emulate='20,10'"], ranks=3,
                    timeout=150)
    assert bench.returncode == 0, bench.stdout
    assert "Student t interval of their logarithms over 2 pairs" in bench.stdout
    assert "no cut in network time speeds them up more than" in bench.stdout
    rows = json.loads(out.read_text())
    assert len(rows) == 1
    row = rows[0]
    for key in ("zipf", "hot_fraction", "lfu_hit_rate", "lru_hit_rate", "oracle_hit_rate",
                "bytes_ratio", "samples_per_s", "baseline_samples_per_s"):
        assert key in row, key
    # the speedup is the pairs' geometric mean, inside its interval
    pairs = row["pair_speedups"]
    assert len(pairs) == 2
    assert row["speedup"] == pytest.approx(math.sqrt(pairs[0] * pairs[1]))
    assert row["speedup_lo"] <= row["speedup"] <= row["speedup_hi"]
    assert 0 < row["lfu_hit_rate"] <= row["oracle_hit_rate"] <= 1
    assert 0 < row["bytes_ratio"] < 1
    # the wire also carries the tiered workers' hot sums, which the untiered ones do not send
    assert row["wire_ratio"] == pytest.approx(
        (row["bytes_per_step"] + row["peer_bytes_per_step"]) / row["baseline_bytes_per_step"])
    assert row["wire_ratio"] > row["bytes_ratio"]
    # a message that arrives later than the network model says waits for nothing more
    assert 0 <= row["network_share"] < 1 and 0 <= row["tiered_network_share"] < 1
    assert row["network_bound"] == pytest.approx(1 / (1 - row["network_share"]))
    # a seeded hot set is not re-tiered within 12 steps, and the hot rows written back when
    # the run ends (4000 rows of 16 values and a state word) are traffic of no step; what
    # moves is the final evaluation's reads of cold rows
    assert row["move_bytes_per_step"] * 12 < 0.5 * 4000 * 17 * 4


def test_a_byte_budget_under_ssp_counts_the_delayed_rows_extra_bytes(tmp_path):
    """Under a staleness bound above 0 a hot row also costs its base copy, accumulated
    gradient and flag (``hot_row_bytes(..., delayed=True)``): a budget in bytes holds
    that many fewer rows, so the tier stays within it. (A 16-bit wire keeps the hot sums
    out of the dense buckets, so the hot rows take SSP's bound.)"""
    budget = 20_000
    result = run_mpi([*HPCTRAIN, "train", "--set", "ps.servers=1", "--set",
                      "sync.model='ssp:2'", "--set", "comm.wire_dtype='bf16'", "--set",
                      f"tiering.budget={budget}", "--set",
                      "tiering.budget_unit='bytes'", "--set", "train.steps=12", "--set",
                      "data.train_samples=20000", "--set", "data.eval_samples=1000", "--set",
                      "train.progress=false", "--set", "checkpoint.at_end=false", "--set",
                      f"train.run_dir={str(tmp_path)!r}"], ranks=3, timeout=150)
    assert result.returncode == 0, result.stdout
    for worker in json.loads((tmp_path / "summary.json").read_text())["tiering"]:
        assert 0 < worker["resident_bytes"] <= worker["budget_bytes"] <= budget, worker
