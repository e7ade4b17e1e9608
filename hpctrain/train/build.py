"""Build a worker's parts from the config: its dense engine and its embedding store.

The one place that asks which mode a job runs in. A worker gets

- a dense engine (:mod:`hpctrain.train.engine`): :class:`~hpctrain.train.dense_grid.GridDense`
  when ``parallel.tp * parallel.pp > 1``, :class:`~hpctrain.train.dense_ps.ServerDense` when
  ``ps.mode = "full"``, :class:`~hpctrain.train.local_sgd.LocalSGDDense` when
  ``sync.dense = "local:H"``, else :class:`~hpctrain.train.dense_dp.ReplicatedDense`, stepping
  the dense optimizer of ``train.optimizer`` (state sharded by ZeRO-1 with ``train.zero = 1``);
- an embedding store: replicas on every worker (on pipeline stage 0 with tp/pp), shards
  reached by all-to-all exchanges (``embeddings.mode = "alltoall"``, planned on worker 0),
  the parameter servers' client, or the tiered store over that client when
  ``tiering.budget`` holds a row;
- the step statistics those parts register (:mod:`hpctrain.train.stats`), the non-finite
  guard, and the state restored from ``manifest`` when resuming.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from embeddings.alltoall import ShardedTables
from embeddings.collection import EmbeddingCollection, lookup_rows, sorted_unique
from embeddings.hotcold import hot_capacity, hot_row_bytes
from embeddings.optim import SparseOptimizer
from embeddings.replicated import ReplicatedTables
from embeddings.tables import LocalTables, TableLayout
from embeddings.tiered import TieredStore, TieringStats
from embeddings.types import EmbeddingStore
from embeddings.worker_sharding import WorkerPlan, plan_workers
from hpctrain.comm import Group
from hpctrain.comm.owner import communicators
from hpctrain.config import JobConfig, local_period
from hpctrain.data import Dataset
from hpctrain.data.sharding import batches_per_epoch, local_slice
from hpctrain.models.dlrm import DLRM
from hpctrain.parallel.data import DataParallel
from hpctrain.parallel.groups import parallel_groups
from hpctrain.runtime.abort import agree
from hpctrain.runtime.topology import shard_range
from hpctrain.runtime.waits import Wait
from hpctrain.runtime.world import Topology
from hpctrain.sync.types import SyncModel
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.checkpoint_rows import SavedRows
from hpctrain.train.dense_dp import ReplicatedDense
from hpctrain.train.dense_grid import GridDense, NoTables, wants_model_parallel
from hpctrain.train.dense_ps import DenseOnServers, ServerDense
from hpctrain.train.engine import DenseEngine, Rider, StepWork
from hpctrain.train.local_sgd import LocalSGDDense
from hpctrain.train.nonfinite import NonFiniteGuard
from hpctrain.train.optim import DenseOptimizer, sparse_optimizer
from hpctrain.train.stats import StepStats
from hpctrain.train.zero import ZeroOptimizer
from ps.client import ClientStats, PSClient
from ps.service import PSJob

__all__ = ["Counters", "WorkerParts", "build_worker", "step_count"]

log = logging.getLogger(__name__)

_SCAN = 1 << 15  # samples per chunk of the warm start's scan (its memory is in proportion)
_SIZING_STEPS = 16  # steps whose unique rows size the hot gradients' share of the reduction


@dataclass
class Counters:
    """A worker's parameter-server client and tiering counters (None where absent)."""

    client: ClientStats | None
    tiering: TieringStats | None


@dataclass
class WorkerParts:
    """What one worker trains with."""

    engine: DenseEngine
    store: EmbeddingStore
    tables: EmbeddingCollection
    guard: NonFiniteGuard
    served: TableLayout
    """The tables a checkpoint's shape names (with the dense table in full PS mode)."""
    plan_json: str
    """The servers' or the all-to-all sharding plan ("" with replicated tables)."""
    counters: Callable[[], Counters]
    """This worker's client and tiering counters for the summary (None where absent)."""
    servers: PSClient | None
    """The parameter servers' client, when the rows live there."""
    group: Group | None
    """The workers' group the engine and store share, released by the trainer when done
    (None with tensor/pipeline parallelism, whose engine frees its own groups)."""
    announce: bool = False
    """Whether the trainer reads one micro-batch ahead and announces its rows to the store
    (:meth:`~embeddings.types.EmbeddingStore.prefetch`): with ``ps.prefetch``, and for the
    all-to-all store, whose next ids ride with the push."""


def build_worker(config: JobConfig, topo: Topology, dataset: Dataset, layout: TableLayout,
                 job: PSJob | None, models: list[SyncModel] | None,
                 manifest: ckpt.Manifest | None) -> WorkerParts:
    """A worker's parts; collective over the workers (and the servers through ``job``)."""
    comm, tc = topo.role_comm, config.train
    full = job is not None and config.ps.mode == "full"
    guard = NonFiniteGuard(tc.on_nonfinite, None if full else comm)
    if wants_model_parallel(config.parallel):
        return _grid_worker(config, topo, layout, guard, manifest)
    stats: StepStats[StepWork] = StepStats()
    stats.add("samples", lambda work: [work.count])
    stats.add("loss", lambda work: [work.loss_sum])
    guard.register(stats)
    torch.manual_seed(tc.seed)
    model = DLRM(config.model, len(layout.specs)).to(topo.device)
    group = communicators(topo).workers()
    sparse = sparse_optimizer(tc)
    client, store, tiered = None, None, None
    plan_json = job.plan.to_json() if job else ""
    if job is None and config.embeddings.layout(config.ps.servers) == "alltoall":
        plan_json = _alltoall_plan(config, layout, group)
        store = ShardedTables(layout, WorkerPlan.from_json(plan_json), sparse, tc.seed, group)
    elif job is None:
        store = ReplicatedTables(LocalTables(layout, sparse, tc.seed), comm,
                                 group.link.beside(comm))
    else:
        client = job.client(models, sparse.state_width(layout.dim))
        carry = not full and not local_period(config.sync.dense) and tc.zero < 2 and \
            config.comm.wire_dtype == "float32" and topo.device.type == "cpu"
        tiered = _tiered(config, topo, layout, client, group, sparse, models, stats,
                         _carried_rows(config, dataset, layout, group) if carry else 0)
        store = tiered or client
    if full:
        dense = DenseOnServers([p for p in model.parameters() if p.requires_grad], client,
                               job.layout)
        if manifest is None:
            dense.place_initial(comm)
        samples = tc.accumulate * min(tc.batch_size, dataset.num_samples("train"))
        engine = ServerDense(model, guard, tc.accumulate, comm, dense, samples, topo.device)
    else:
        engine = _replicated(config, model, guard, group, stats, step_count(config, dataset),
                             topo.device, tiered.rider if tiered else None)
    if manifest is not None:
        _restore(engine, store, manifest)
    if client is not None:
        log.info("parameter servers ready (waited %.2f s for them to build their shards)",
                 client.wait_ready())
    if tiered:
        tiered.stats.warm_start_bytes = _warm_start(config, topo, dataset, layout, tiered,
                                                    client)
    return WorkerParts(engine, store, EmbeddingCollection(layout, store, topo.device), guard,
                       job.layout if job else layout, plan_json,
                       lambda: Counters(client.stats if client else None,
                                        tiered.report() if tiered else None), client,
                       group, announce=isinstance(store, ShardedTables) or (
                           job is not None and config.ps.prefetch))


def _alltoall_plan(config: JobConfig, layout: TableLayout, group: Group) -> str:
    """The all-to-all sharding plan as JSON: computed and logged on worker 0 from the table
    sizes and the workers (and their nodes), then broadcast (collective over ``group``)."""
    node = group.layout.local_size if group.layout.uniform else 0

    def plan() -> WorkerPlan | None:
        if group.rank != 0:
            return None
        made = plan_workers(layout.specs, group.size, config.embeddings.sharding, node,
                            config.train.seed)
        log.info("all-to-all plan: %s", made.describe())
        return made

    made = agree(group.comm, plan)
    with Wait("bcast", group.comm):
        return group.comm.bcast(made.to_json() if made else None, root=0)


def step_count(config: JobConfig, dataset: Dataset) -> int:
    """Optimizer steps the job runs: ``train.steps``, or one pass over the training split."""
    tc = config.train
    epoch = batches_per_epoch(dataset.num_samples("train"), tc.batch_size)
    return tc.steps or max(1, epoch // tc.accumulate)


def _replicated(config: JobConfig, model: DLRM, guard: NonFiniteGuard, group: Group,
                stats: StepStats[StepWork], steps: int, device: torch.device,
                rider: Rider | None) -> ReplicatedDense:
    """The data-parallel engine: gradients reduced every step (``rider`` in their tail), or
    local SGD's averages every H steps; its optimizer is ``train.optimizer``, sharded when
    ``train.zero`` is 1 or 2 (2 reduce-scatters the gradients too)."""
    tc = config.train
    dp = DataParallel(model, group, config.comm, extra=stats.size,
                      tail=rider.size if rider else 0, sharded=tc.zero == 2)
    period = local_period(config.sync.dense)
    optimizer = ZeroOptimizer(dp, tc) if tc.zero else DenseOptimizer.from_config(dp.params, tc)
    if period:
        return LocalSGDDense(model, guard, tc.accumulate, dp, stats, optimizer, device,
                             period, steps)
    return ReplicatedDense(model, guard, tc.accumulate, dp, stats, optimizer, device, rider)


def _restore(engine: DenseEngine, store: EmbeddingStore, manifest: ckpt.Manifest) -> None:
    """Dense state, then the store's rows and clock, from ``manifest``."""
    engine.restore(Path(manifest.path))
    store.restore(SavedRows(manifest))


def _grid_worker(config: JobConfig, topo: Topology, layout: TableLayout,
                 guard: NonFiniteGuard, manifest: ckpt.Manifest | None) -> WorkerParts:
    """Tensor/pipeline parallel: tables replicated over stage 0's data group."""
    groups = parallel_groups(topo.grid, communicators(topo))
    engine = GridDense(config, topo, groups, layout, guard)
    tc = config.train
    store = (ReplicatedTables(LocalTables(layout, sparse_optimizer(tc), seed=tc.seed),
                              groups.data, groups.data_group.link.beside(groups.data))
             if engine.stage == 0 else NoTables(layout.dim))
    if manifest is not None:
        _restore(engine, store, manifest)
    return WorkerParts(engine, store, EmbeddingCollection(layout, store, topo.device), guard,
                       layout, "", lambda: Counters(None, None), None, None)


def _carried_rows(config: JobConfig, dataset: Dataset, layout: TableLayout,
                  group: Group) -> int:
    """Hot rows a worker's step carries in the dense reduction: the most unique rows a
    worker reads in one of the first :data:`_SIZING_STEPS` steps, over the workers, plus an
    eighth, at most the most it could read (its share of the batch, rounded up, times the
    micro-batches and the tables). Hot rows are a part of the unique ones; a step with more
    sends the rest after the reduction (:class:`~embeddings.hotsum.HotRider`)."""
    tc, num = config.train, dataset.num_samples("train")
    bound = tc.accumulate * -(-min(tc.batch_size, num) // group.size) * len(layout.specs)
    seen = 0
    for step in range(min(_SIZING_STEPS, step_count(config, dataset))):
        ids = [dataset.sparse("train", *local_slice(step * tc.accumulate + m, num,
                                                    tc.batch_size, group.rank, group.size))
               for m in range(tc.accumulate)]
        # unchecked: a bad id is the step's to report, with its step
        seen = max(seen, len(sorted_unique(np.concatenate(ids) + layout.offsets)))
    with Wait("allreduce", group.comm):
        most = group.comm.allreduce(seen, op=MPI.MAX)
    return max(1, min(bound, most + most // 8))


def _tiered(config: JobConfig, topo: Topology, layout: TableLayout, client: PSClient,
            group: Group, sparse: SparseOptimizer, models: list[SyncModel] | None,
            stats: StepStats[StepWork], carry_rows: int) -> TieredStore | None:
    """The hot tier over the servers' client, or None when the budget allows no row.
    With ``carry_rows`` (the dense engine reduces gradients every step) the hot gradients
    ride in that reduction, at most ``carry_rows`` hot rows per worker, and hot rows are
    never stale. Otherwise hot rows keep the strictest staleness bound among the tables'
    sync models, and each worker's count of hot rows in the coming push rides in the
    step's statistics as ``hot`` (its own slot set, the others zero), so the push saves a
    collective."""
    tc = config.tiering
    bounds = [m.bound for m in models or [] if m.bound is not None]
    staleness = 0 if carry_rows else (min(bounds) if bounds else (None if models else 0))
    # (None: all ASP.) A row under a staleness bound above 0 also costs the base copy, the
    # accumulated gradient and a flag: a byte budget counts them.
    row = hot_row_bytes(layout.dim, sparse.state_width(layout.dim), staleness != 0)
    capacity = hot_capacity(tc.budget, tc.budget_unit, layout.total_rows, row)
    if capacity == 0:
        if tc.budget > 0:
            log.warning("tiering.budget = %s %s holds no row; tiering is off", tc.budget,
                        tc.budget_unit)
        return None
    log.info("hot tier: %d of %d rows (%.1f MB per worker), %s", capacity,
             layout.total_rows, capacity * row / 2**20, tc.policy)
    tiered = TieredStore(layout, client, group, sparse, tc, capacity, topo.device,
                         staleness=staleness, carry_rows=carry_rows)
    if carry_rows:
        log.info("hot gradients ride in the dense gradient reduction (%.1f MB per worker)",
                 tiered.rider.segment_bytes() / 2**20)
        return tiered

    def hot(work: StepWork) -> list[float]:
        counts = [0.0] * group.size
        rows = lookup_rows(work.lookups)  # one lookup's rows are unique: the tier knows them
        counts[group.rank] = tiered.hot_count(rows if len(work.lookups) == 1
                                              else sorted_unique(rows))
        return counts

    stats.add("hot", hot, size=group.size, then=tiered.expect)
    return tiered


def _warm_start(config: JobConfig, topo: Topology, dataset: Dataset, layout: TableLayout,
                tiered: TieredStore, client: PSClient) -> int:
    """Seed the hot set from the ids of the first ``tiering.prescan`` training samples,
    each worker scanning its share; returns the bytes that moved the rows, which are
    then taken out of the client's counters (they are not per-step traffic)."""
    n = min(config.tiering.prescan, dataset.num_samples("train"))
    if n == 0:
        return 0
    comm = topo.role_comm
    lo, hi = shard_range(n, comm.Get_size(), comm.Get_rank())
    tiered.warm_start(
        np.unique(layout.global_rows(dataset.sparse("train", a, min(hi, a + _SCAN))),
                  return_counts=True) for a in range(lo, hi, _SCAN))
    moved = client.stats.move_bytes_sent + client.stats.move_bytes_received
    client.stats = type(client.stats)()
    return moved
