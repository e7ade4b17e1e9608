"""The training loop: the one place that wires data, embeddings, parameter server and dense.

One step (``accumulate`` micro-batches per optimizer step):

1. each worker reads its slice of the global batch;
2. the batch's unique embedding rows come from the store: replicas on every worker, or the
   parameter servers (prefetched during the previous micro-batch when ``ps.prefetch``),
   with the most used rows replicated on the workers when ``tiering.budget`` is set;
3. the dense model runs forward and backward on the summed loss;
4. dense gradients, the sample count and the loss sum are summed over the workers by
   bucketed allreduces that start during the last backward (:mod:`hpctrain.comm.fusion`),
   then divided by the global count (an exact mean, also for uneven slices);
5. the dense optimizer steps, and the touched rows' gradients are pushed to the store, which
   applies the sparse optimizer where the rows live. The push ends the worker's step; with
   tiering it also moves rows between the tiers every ``tiering.interval`` steps (timed as
   the ``retier`` phase).

A step with a NaN or Inf is stopped or skipped by every worker alike (``train.on_nonfinite``,
:mod:`hpctrain.train.nonfinite`): each worker's verdict rides in step 4's allreduce.

In full parameter-server mode (``ps.mode = "full"``) steps 4-5 change: there is no
allreduce; the dense parameters are pulled from the servers before the step and their
gradients, divided by the global batch, travel in the same push as the embedding rows
(:mod:`hpctrain.train.dense_ps`), so workers advance as the sync model lets them.

With ``parallel.tp`` or ``parallel.pp`` above 1, steps 2-5 run tensor/pipeline parallel in
:class:`~hpctrain.train.model_parallel.ModelParallelDLRM`, data parallel over the grid's
``dp`` axis, with the same exact-mean semantics (tables replicated on stage 0).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from embeddings.collection import EmbeddingCollection, Lookup
from embeddings.hotcold import hot_capacity, hot_row_bytes
from embeddings.optim import SparseOptimizer
from embeddings.replicated import ReplicatedTables
from embeddings.tables import LocalTables, TableLayout
from embeddings.tiered import TieredStore
from hpctrain.comm import Group
from hpctrain.comm.native import gatherv
from hpctrain.config import JobConfig
from hpctrain.data import Batch, Dataset, open_dataset
from hpctrain.data.sharding import batches_per_epoch, local_slice
from hpctrain.models.dlrm import DLRM
from hpctrain.parallel.data import DataParallel
from hpctrain.runtime.abort import agree
from hpctrain.runtime.env import peak_rss_bytes
from hpctrain.runtime.preempt import Preemption
from hpctrain.runtime.topology import shard_range
from hpctrain.runtime.waits import Wait
from hpctrain.runtime.world import Topology
from hpctrain.sync.models import table_models
from hpctrain.sync.stragglers import Stragglers
from hpctrain.sync.types import SyncModel
from hpctrain.train import checkpoint as ckpt
from hpctrain.train import checkpointing, metrics
from hpctrain.train.dense_ps import DenseOnServers, with_dense_table
from hpctrain.train.inputs import agree_on_inputs, available_memory, check_memory
from hpctrain.train.model_parallel import ModelParallelDLRM, wants_model_parallel
from hpctrain.train.nonfinite import NonFiniteGuard, finite_samples
from hpctrain.train.optim import DenseOptimizer
from hpctrain.train.rundir import RunDir, claim, default_run_dir
from ps.service import PSJob

__all__ = ["Trainer", "Summary", "run_training"]

log = logging.getLogger(__name__)

PHASES = ("data", "lookup", "compute", "dense_sync", "optimizer", "push", "retier",
          "checkpoint")


@dataclass
class Summary:
    """What a finished run reports (rank 0 holds the evaluation figures)."""

    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    train_loss: float = float("nan")
    eval: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: list[float] = field(default_factory=list)
    skipped_lines: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    """Per worker: steps (full PS mode: own contributions) skipped for non-finite values."""
    run_dir: str = ""
    ps_clients: list[dict[str, float]] = field(default_factory=list)
    ps_servers: list[dict[str, object]] = field(default_factory=list)
    step_times: list[dict[str, float]] = field(default_factory=list)
    """Per worker: mean, p50, p99 and max step seconds, and straggler sleep."""
    tiering: list[dict[str, object]] = field(default_factory=list)
    stopped_at: int = 0
    """The step after which SIGTERM/SIGUSR1 stopped the run (0: it ran to the end)."""

    @property
    def step_s(self) -> float:
        """Time in the training step proper (everything but reading data)."""
        return sum(v for k, v in self.phase_s.items() if k != "data")

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s else 0.0

    @property
    def step_samples_per_s(self) -> float:
        return self.samples / self.step_s if self.step_s else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"steps": self.steps, "samples": self.samples, "wall_s": self.wall_s,
                "step_s": self.step_s, "phase_s": self.phase_s,
                "samples_per_s": self.samples_per_s,
                "step_samples_per_s": self.step_samples_per_s, "train_loss": self.train_loss,
                "eval": self.eval, "peak_rss_mb": self.peak_rss_mb,
                "skipped_lines": self.skipped_lines, "skipped_steps": self.skipped_steps,
                "ps_clients": self.ps_clients,
                "ps_servers": self.ps_servers, "step_times": self.step_times,
                "staleness": self.staleness(), "tiering": self.tiering}

    def staleness(self) -> dict[str, dict[str, float]]:
        """Per table, over all servers: reads, mean, p99 and max staleness in clocks."""
        merged: dict[str, dict[int, int]] = {}
        for server in self.ps_servers:
            for table, counts in server.get("staleness", {}).items():
                for gap, n in counts.items():
                    merged.setdefault(table, {})
                    merged[table][int(gap)] = merged[table].get(int(gap), 0) + n
        out = {}
        for table, counts in merged.items():
            gaps = np.array(sorted(counts))
            weights = np.array([counts[g] for g in gaps])
            cumulative = np.cumsum(weights) / weights.sum()
            out[table] = {"reads": int(weights.sum()),
                          "mean": float((gaps * weights).sum() / weights.sum()),
                          "p99": float(gaps[np.searchsorted(cumulative, 0.99)]),
                          "max": float(gaps.max())}
        return out


def run_training(config: JobConfig, topo: Topology,
                 on_trained: Callable[[Trainer], None] | None = None,
                 resume: bool = False) -> Summary:
    """Train on every rank of ``topo``: workers run the :class:`Trainer`, parameter-server
    ranks serve their shards. Collective over the world; world rank 0 gets the full summary
    (the server counters included). ``on_trained`` runs on every worker after training,
    while the servers still serve (to read back or save the final state). With ``resume``,
    training continues from the newest complete checkpoint in ``train.run_dir``."""
    run_dir = topo.world.bcast(config.train.run_dir or default_run_dir(), root=0)
    agree(topo.world, lambda: claim(run_dir, resume) if topo.rank == 0 else None)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                   run_dir=run_dir))
    dataset = agree(topo.world, lambda: open_dataset(config.data) if topo.is_worker else None)
    agree_on_inputs(topo.world, config, dataset)
    sizes = topo.world.bcast(dataset.table_sizes if topo.rank == 0 else None, root=0)
    layout = TableLayout.from_sizes(sizes, config.model.embedding_dim)
    holders = topo.node.allreduce(int(topo.is_worker != bool(config.ps.servers)))
    agree(topo.world, lambda: check_memory(config, sizes, holders, available_memory()))
    job, models = None, None
    if config.ps.servers:
        served = layout
        if config.ps.mode == "full":
            dense = sum(p.numel() for p in DLRM(config.model, len(sizes)).parameters())
            served = with_dense_table(layout, dense)
        models = table_models(config.sync.model, config.sync.table_models,
                              [s.name for s in served.specs])
        job = PSJob.create(topo.world, topo.roles, served, config.ps, config.train.seed)
    manifest = None
    if resume:  # world rank 0 checks; an error there ends the job while the others wait
        manifest = topo.world.bcast(_resumable(config, job.layout if job else layout)
                                    if topo.rank == 0 else None, root=0)
    summary, server_stats = Summary(), None
    if topo.is_worker:
        trainer = Trainer(config, topo, dataset, layout, job, models, manifest)
        summary = trainer.fit()
        if on_trained:
            on_trained(trainer)
        trainer.close()
    else:
        Preemption()  # a server outlives SIGTERM until the workers' checkpoint is written
        optimizer = SparseOptimizer(config.train.optimizer)
        restore, on_save = checkpointing.server_hooks(
            topo.world, run_dir, config.checkpoint.keep, job.layout, job.placement,
            topo.rank - topo.workers, manifest)
        server_stats = job.serve(optimizer, config.train.seed, models,
                                 config.sync.deterministic, restore, on_save).as_dict()
    with Wait("gather", topo.world):
        gathered = topo.world.gather(server_stats, root=0)
    if job:
        job.comm.Free()
    if topo.rank == 0:
        summary.ps_servers = [s for s in gathered if s is not None]
        trainer.finish(summary)
    return summary


def _resumable(config: JobConfig, layout: TableLayout) -> ckpt.Manifest:
    manifest = ckpt.latest(config.train.run_dir)
    checkpointing.check_compatible(manifest, config, layout)
    log.info("resuming from %s (step %d)", manifest.path, manifest.step)
    return manifest


class Trainer:
    """Trains the DLRM on this worker; collective over the workers (``topo.role_comm``)."""

    def __init__(self, config: JobConfig, topo: Topology, dataset: Dataset | None = None,
                 layout: TableLayout | None = None, job: PSJob | None = None,
                 models: list[SyncModel] | None = None,
                 manifest: ckpt.Manifest | None = None) -> None:
        """Tables live on ``job``'s servers (``models[t]`` governing table ``t``) when given,
        else replicated on every worker. ``layout`` holds the embedding tables only.
        ``manifest`` is the checkpoint to resume from."""
        self.config = config
        self.topo = topo
        self.comm = topo.role_comm
        self.dataset = dataset or open_dataset(config.data)
        self.layout = layout or TableLayout.from_sizes(self.dataset.table_sizes,
                                                       config.model.embedding_dim)
        tc = config.train
        epoch = batches_per_epoch(self.dataset.num_samples("train"), tc.batch_size)
        self.steps = tc.steps or max(1, epoch // tc.accumulate)
        self.run = (RunDir(tc.run_dir or default_run_dir(), config)
                    if self.comm.Get_rank() == 0 else None)
        if self.run and job:
            self.run.write_text("plan.json", job.plan.to_json())
        self.phase_s: dict[str, float] = defaultdict(float)
        self.preemption = Preemption()  # SIGTERM/SIGUSR1: stop at an agreed step, resumable
        sc = config.sync
        self.stragglers = Stragglers(self.comm.Get_rank(), sc.slow_workers, sc.slow_factor,
                                     sc.straggle_probability, sc.straggle_factor,
                                     sc.straggler_seed)
        self.step_s: list[float] = []
        self.store, self.dense_ps, self.prefetch = None, None, False
        self.client, self.tiered, self.warm_start_bytes = None, None, 0
        self.cadence = checkpointing.Cadence(config.checkpoint, self.comm)
        self.start_step = 0
        full = job is not None and config.ps.mode == "full"
        self.guard = NonFiniteGuard(tc.on_nonfinite, None if full else self.comm)
        # tp/pp > 1: the dense model, its optimizer and the tables live in the parallel engine.
        self.hybrid = ModelParallelDLRM(config, topo, self.dataset, self.layout, self.guard) if (
            wants_model_parallel(config.parallel)) else None
        if self.hybrid is not None:
            return
        torch.manual_seed(tc.seed)
        self.model = DLRM(config.model, len(self.layout.specs)).to(topo.device)
        # with tiering, each worker's count of hot rows rides in the dense allreduce
        self.hot_counts = self.comm.Get_size() if config.tiering.budget > 0 else 0
        self.group = Group(self.comm, config.comm)
        self.dp = DataParallel(self.model, self.group, config.comm, extra=3 + self.hot_counts)
        self.optimizer = DenseOptimizer(self.model.parameters(), tc.optimizer)
        self.job = job
        sparse = SparseOptimizer(tc.optimizer)
        if job:
            self.store = self.client = job.client(models, sparse.state_width(self.layout.dim))
            if config.ps.mode == "full":
                self.dense_ps = DenseOnServers(self.dp.params, self.store, job.layout)
                if manifest is None:
                    self.dense_ps.place_initial(self.comm)
            self.tiered = self._tiered(sparse, models)
            self.store = self.tiered or self.client
        else:
            self.store = ReplicatedTables(LocalTables(self.layout, sparse, tc.seed), self.comm)
        self.embeddings = EmbeddingCollection(self.layout, self.store, topo.device)
        self.prefetch = job is not None and config.ps.prefetch
        if manifest is not None:
            self._restore(manifest)
        if self.tiered:
            self.warm_start_bytes = self._warm_start()

    # -- checkpoints -----------------------------------------------------------------------

    def _restore(self, manifest: ckpt.Manifest) -> None:
        """Dense state, rows held here, clock and data position from ``manifest``."""
        checkpointing.read_dense(Path(manifest.path), self.dp.params, self.optimizer.state)
        if isinstance(self.store, ReplicatedTables):
            checkpointing.restore_rows(manifest, self.store.tables,
                                       checkpointing.replicated_select)
        else:
            self.client.clock = manifest.step  # the hot tier counts its own steps anew
        self.start_step = manifest.step

    def save_checkpoint(self, step: int) -> None:
        """Checkpoint after ``step`` completed steps; collective over the world (the servers
        join through their ``SAVE`` hook)."""
        started = time.perf_counter()
        folder = ckpt.step_dir(self.config.train.run_dir, step)
        files = []
        if self.tiered:  # the hot rows' current values go into the servers' shards
            self.tiered.flush()
        if self.client:
            self.client.save()
        if self.comm.Get_rank() == 0:
            files.append(checkpointing.write_dense(folder, self.dp.params, self.optimizer.state))
            if isinstance(self.store, ReplicatedTables):
                tables = self.store.tables
                files.append(ckpt.write_rows(folder / "tables.h5",
                                             np.arange(len(tables.weight), dtype=np.int64),
                                             tables.weight, tables.state))
        manifest = None
        if self.topo.rank == 0:
            layout = self.job.layout if self.job else self.layout
            manifest = checkpointing.new_manifest(
                self.config, layout, step, self.topo.workers, self.topo.roles.servers,
                self.job.plan.to_json() if self.job else "")
        checkpointing.commit(self.topo.world, folder, files, manifest,
                             self.config.checkpoint.keep)
        seconds = time.perf_counter() - started
        self.phase_s["checkpoint"] += seconds
        self.cadence.saved(seconds)

    def _tiered(self, sparse: SparseOptimizer,
                models: list[SyncModel] | None) -> TieredStore | None:
        """The hot tier over the servers' client, or None when the budget allows no row.
        Hot rows keep the strictest staleness bound among the tables' sync models."""
        tc = self.config.tiering
        row = hot_row_bytes(self.layout.dim, sparse.state_width(self.layout.dim))
        capacity = hot_capacity(tc.budget, tc.budget_unit, self.layout.total_rows, row)
        if capacity == 0:
            if tc.budget > 0:
                log.warning("tiering.budget = %s %s holds no row; tiering is off", tc.budget,
                            tc.budget_unit)
            return None
        log.info("hot tier: %d of %d rows (%.1f MB per worker), %s", capacity,
                 self.layout.total_rows, capacity * row / 2**20, tc.policy)
        bounds = [m.bound for m in models or [] if m.bound is not None]
        staleness = min(bounds) if bounds else (None if models else 0)  # None: all ASP
        return TieredStore(self.layout, self.client, self.group, sparse, tc, capacity,
                           self.topo.device, staleness=staleness)

    def _warm_start(self) -> int:
        """Seed the hot set from the ids of the first ``tiering.prescan`` training samples,
        each worker scanning its share; returns the bytes that moved the rows, which are
        then taken out of the client's counters (they are not per-step traffic)."""
        n = min(self.config.tiering.prescan, self.dataset.num_samples("train"))
        if n == 0:
            return 0
        lo, hi = shard_range(n, self.comm.Get_size(), self.comm.Get_rank())
        self.tiered.warm_start(
            np.unique(self.layout.global_rows(self.dataset.sparse("train", a, min(hi, a + 65536))),
                      return_counts=True) for a in range(lo, hi, 65536))
        moved = self.client.stats.move_bytes_sent + self.client.stats.move_bytes_received
        self.client.stats = type(self.client.stats)()
        return moved

    # -- one step --------------------------------------------------------------------------

    def learning_rate(self, step: int) -> float:
        tc = self.config.train
        return tc.lr * min(1.0, (step + 1) / tc.warmup_steps) if tc.warmup_steps else tc.lr

    def micro_batches(self) -> Iterator[tuple[int, Batch]]:
        """(micro-batch index, this worker's slice) for every micro-batch left to run."""
        accumulate = self.config.train.accumulate
        for index in range(self.start_step * accumulate, self.steps * accumulate):
            start = time.perf_counter()
            batch = self.dataset.read("train", *self._slice(index))
            self.phase_s["data"] += time.perf_counter() - start
            yield index, batch

    def step(self, step: int, batches: Iterator[tuple[int, Batch]],
             ahead: list[tuple[int, Batch]]) -> tuple[int, float]:
        """Run optimizer step ``step``; returns (global samples, mean loss; NaN when the step
        was skipped for non-finite values).

        ``ahead`` holds the next micro-batch, read one early so its rows can be prefetched.
        """
        if self.hybrid is not None:
            return self._model_parallel_step(step)
        tc = self.config.train
        lookups: list[Lookup] = []
        count, loss_sum, compute_s = 0, 0.0, 0.0
        started = time.perf_counter()
        if self.dense_ps:
            self.dense_ps.pull()
            self.phase_s["lookup"] += time.perf_counter() - started
        for micro in range(tc.accumulate):
            index, batch = ahead.pop() if ahead else next(batches)
            if self.prefetch:
                upcoming = next(batches, None)
                if upcoming is not None:
                    ahead.append(upcoming)
            t0 = time.perf_counter()
            embedded, lookup = self.embeddings.lookup(batch.sparse)
            if ahead and len(ahead[0][1]):
                next_step = ahead[0][0] // tc.accumulate
                self.embeddings.prefetch(ahead[0][1].sparse, next_step - step)
            t1 = time.perf_counter()
            self.guard.features(batch.dense, self._slice(index)[0])
            logits = self.model(self._tensor(batch.dense), embedded)
            loss = F.binary_cross_entropy_with_logits(logits, self._tensor(batch.labels),
                                                      reduction="sum")
            count += len(batch)
            loss_sum += loss.item()
            self.guard.loss(loss_sum)
            if micro == tc.accumulate - 1 and not self.dense_ps:
                # the last backward starts the bucket allreduces; the step's statistics and
                # this worker's verdict on its features and loss ride in the first bucket
                self.dp.arm(self._stats(count, loss_sum, [*lookups, lookup]))
            loss.backward()
            compute_s += time.perf_counter() - t1
            self.phase_s["lookup"] += t1 - t0
            lookups.append(lookup)
        self.phase_s["compute"] += compute_s
        self.stragglers.delay(step, compute_s)
        lr = self.learning_rate(step)
        if self.dense_ps:
            total, scale = tc.batch_size * tc.accumulate, 1.0 / (tc.batch_size * tc.accumulate)
            t0 = time.perf_counter()
            self.guard.gradients(self.model.named_parameters())
            skip = self.guard.settle(step, self.guard.flag)  # drops this worker's share only
            keep = not skip and self.guard.embedding_share(step, lookups, self.layout)
            rows, grads = self.embeddings.gradients(lookups if keep else [], scale)
            if not skip:
                dense_rows, dense_grads = self.dense_ps.gradients(scale)
                rows, grads = np.concatenate([rows, dense_rows]), np.concatenate([grads,
                                                                                   dense_grads])
            self.store.push(rows, grads, lr)
            self.dp.zero()
            self.phase_s["push"] += time.perf_counter() - t0
            self.step_s.append(time.perf_counter() - started)
            return total, float("nan") if skip else loss_sum / max(count, 1)
        t0 = time.perf_counter()
        total, total_loss, flagged, *hot = self.dp.allreduce(self._stats(count, loss_sum,
                                                                           lookups))
        if self.tiered:
            self.tiered.expect(np.array(hot))
        if not flagged:  # no root cause anywhere: the summed gradients, the same everywhere
            self.guard.gradients(self.model.named_parameters())
        skip = self.guard.settle(step, flagged + self.guard.flag)
        keep = not skip and self.guard.embedding_share(step, lookups, self.layout)
        scale = 1.0 / max(total, 1.0)
        self.dp.scale(scale)
        t1 = time.perf_counter()
        if not skip:
            self.optimizer.step(lr)
        self.dp.zero()
        t2 = time.perf_counter()
        moving = self.tiered.stats.retier_s if self.tiered else 0.0
        rows, grads = self.embeddings.gradients(lookups if keep or self.tiered else [], scale)
        if not keep and self.tiered:  # this worker's share is dropped, but not its hot rows
            rows, grads = self.tiered.withhold(rows, grads)
        self.store.push(rows, grads, lr)
        moved = (self.tiered.stats.retier_s - moving) if self.tiered else 0.0
        t3 = time.perf_counter()
        for phase, seconds in (("dense_sync", t1 - t0), ("optimizer", t2 - t1),
                               ("push", t3 - t2 - moved), ("retier", moved)):
            self.phase_s[phase] += seconds
        self.step_s.append(t3 - started)
        return int(total), float("nan") if skip else total_loss * scale

    def _stats(self, count: int, loss_sum: float, lookups: list[Lookup]) -> list[float]:
        """What rides in the first gradient bucket: sample count, loss sum, this worker's
        verdict on its features and loss, and with tiering each worker's count of hot rows in
        the coming push (its own slot set, the others zero; see TieredStore.expect)."""
        hot = [0.0] * self.hot_counts
        if self.tiered:
            hot[self.comm.Get_rank()] = self.tiered.hot_count(np.unique(np.concatenate(
                [lk.rows for lk in lookups])))
        return [count, loss_sum, self.guard.flag, *hot]

    def _model_parallel_step(self, step: int) -> tuple[int, float]:
        started = time.perf_counter()
        samples, loss, data_s = self.hybrid.step(step, self.learning_rate(step))
        elapsed = time.perf_counter() - started
        self.phase_s["data"] += data_s
        self.phase_s["compute"] += elapsed - data_s
        self.step_s.append(elapsed - data_s)
        return samples, loss

    def _slice(self, index: int) -> tuple[int, int]:
        """Train samples ``[start, stop)`` of micro-batch ``index`` on this worker."""
        return local_slice(index, self.dataset.num_samples("train"),
                           self.config.train.batch_size, self.comm.Get_rank(),
                           self.comm.Get_size())

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.topo.device)

    # -- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole eval split: each worker scores its contiguous part, then a
        ``Gatherv`` over the workers brings scores and labels to worker 0 (others get {})."""
        if self.dense_ps:
            self.dense_ps.pull()
        probs, labels = self.hybrid.scores() if self.hybrid is not None else self._scores()
        all_probs = gatherv(probs, self.comm)
        all_labels = gatherv(labels, self.comm)
        if all_probs is None:
            return {}
        return {"log_loss": metrics.log_loss(all_probs, all_labels),
                "auc": metrics.auc(all_probs, all_labels),
                "accuracy": metrics.accuracy(all_probs, all_labels),
                "base_rate_log_loss": metrics.base_rate_log_loss(all_labels),
                "samples": int(len(all_labels))}

    @torch.no_grad()
    def _scores(self) -> tuple[np.ndarray, np.ndarray]:
        """Probabilities and labels of this worker's contiguous part of the eval split."""
        self.model.eval()
        n = self.dataset.num_samples("eval")
        lo, hi = shard_range(n, self.comm.Get_size(), self.comm.Get_rank())
        chunk = max(1, self.config.train.eval_batch_size // self.comm.Get_size())
        probs, labels = [np.empty(0, np.float32)], [np.empty(0, np.float32)]
        left_out = 0
        for start in range(lo, hi, chunk):
            read = self.dataset.read("eval", start, min(hi, start + chunk))
            batch, dropped = finite_samples(read)
            left_out += dropped
            if len(batch) == 0:
                continue
            embedded, _ = self.embeddings.lookup(batch.sparse, train=False)
            logits = self.model(self._tensor(batch.dense), embedded)
            probs.append(torch.sigmoid(logits).cpu().numpy())
            labels.append(batch.labels)
        self.model.train()
        if left_out:
            log.warning("evaluation left out %d samples with non-finite dense features", left_out)
        return np.concatenate(probs), np.concatenate(labels)

    # -- the loop --------------------------------------------------------------------------

    def fit(self) -> Summary:
        """Train ``self.steps`` steps, evaluate, and return this worker's summary."""
        tc = self.config.train
        run = self.run
        summary = Summary(run_dir=str(run.path) if run else "")
        bar = tqdm(total=self.steps, unit="step", disable=not (run and tc.progress))
        batches, ahead = self.micro_batches(), []
        window_loss, window_n = 0.0, 0
        start = time.perf_counter()
        for step in range(self.start_step, self.steps):
            samples, loss = self.step(step, batches, ahead)
            summary.samples += samples
            if loss == loss:  # a skipped step has no loss
                window_loss, window_n = window_loss + loss, window_n + 1
            bar.update()
            done = step + 1
            if run and (done % tc.log_every == 0 or done == self.steps):
                summary.train_loss = window_loss / window_n if window_n else float("nan")
                elapsed = time.perf_counter() - start
                run.log({"step": done, "samples": summary.samples, "time_s": elapsed,
                         "train_loss": summary.train_loss, "lr": self.learning_rate(step),
                         "samples_per_s": summary.samples / elapsed})
                bar.set_postfix(loss=f"{summary.train_loss:.4f}")
                window_loss, window_n = 0.0, 0
            if tc.eval_every and done % tc.eval_every == 0 and done != self.steps:
                self._log_eval(done)
            saved = self.cadence.due(done, final=done == self.steps)
            if saved:
                self.save_checkpoint(done)
            if done < self.steps and self.preemption.stop_now(self.comm):
                if not saved:
                    self.save_checkpoint(done)
                summary.stopped_at = done
                break
        bar.close()
        summary.steps = summary.stopped_at or self.steps
        summary.wall_s = time.perf_counter() - start
        summary.phase_s = {k: self.phase_s[k] for k in PHASES}
        summary.eval = self._log_eval(summary.steps)
        with Wait("gather", self.comm):
            facts = self.comm.gather(self._rank_facts(), root=0)
        if facts:
            summary.peak_rss_mb = [f["peak_rss_mb"] for f in facts]
            summary.skipped_lines = sum(f["skipped"] for f in facts)
            summary.skipped_steps = [f["skipped_steps"] for f in facts]
            summary.ps_clients = [f["client"] for f in facts if f["client"]]
            summary.step_times = [f["step_times"] for f in facts]
            summary.tiering = [f["tiering"] for f in facts if f["tiering"]]
        return summary

    def close(self) -> None:
        """Write the hot rows back to the servers, which then hold the whole model, and tell
        them this worker is done (collective over the workers; no-op for replicated tables)."""
        if self.tiered:
            self.tiered.flush()
        if self.client:
            self.client.close()

    def finish(self, summary: Summary) -> None:
        """Write the summary into the run directory (worker 0)."""
        if self.run:
            self.run.write_json("summary.json", summary.as_dict())
            self.run.close()

    def _log_eval(self, step: int) -> dict[str, float]:
        result = self.evaluate()
        if self.run:
            self.run.log({"step": step, **{f"eval_{k}": v for k, v in result.items()}})
        return result

    def _rank_facts(self) -> dict[str, object]:
        steps = np.array(self.step_s or [0.0])
        times = {"mean": float(steps.mean()), "p50": float(np.percentile(steps, 50)),
                 "p99": float(np.percentile(steps, 99)), "max": float(steps.max()),
                 "straggler_sleep": self.stragglers.delayed_s}
        return {"peak_rss_mb": peak_rss_bytes() / 2**20, "skipped": self.dataset.skipped,
                "skipped_steps": self.guard.skipped,
                "client": self.client.stats.as_dict() if self.client else None,
                "step_times": times,
                "tiering": ({**self.tiered.report().as_dict(),
                             "warm_start_bytes": self.warm_start_bytes} if self.tiered else None)}
