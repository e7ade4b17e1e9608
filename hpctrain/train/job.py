"""A training job on every rank: each rank's role built from the config and the topology.

:class:`TrainingJob` does what every rank must agree on before training (the data's table
sizes, the parameter-server job and its sharding plan, the checkpoint to resume from, the
run's ``meta.json`` from :mod:`hpctrain.train.meta`), then gives each rank its role: a
worker runs a :class:`~hpctrain.train.trainer.Trainer` (its dense engine and embedding store
from :func:`~hpctrain.train.build.build_worker`), a parameter-server rank serves its shards
until the workers are done.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from embeddings.optim import SparseOptimizer
from embeddings.tables import TableLayout
from hpctrain.comm import emulate
from hpctrain.config import JobConfig
from hpctrain.data import Dataset, open_dataset
from hpctrain.errors import CheckpointError
from hpctrain.models.dlrm import DLRM
from hpctrain.runtime import trace
from hpctrain.runtime.abort import agree
from hpctrain.runtime.preempt import Preemption
from hpctrain.runtime.waits import Wait
from hpctrain.runtime.world import Topology
from hpctrain.sync.models import table_models
from hpctrain.train import checkpoint as ckpt
from hpctrain.train import checkpointing
from hpctrain.train.build import step_count
from hpctrain.train.dense_ps import with_dense_table
from hpctrain.train.inputs import agree_on_inputs, available_memory, check_memory
from hpctrain.train.meta import collect_meta, write_meta
from hpctrain.train.optim import dense_table_optimizer, sparse_optimizer
from hpctrain.train.report import Summary
from hpctrain.train.rundir import claim, default_run_dir
from hpctrain.train.trainer import Trainer
from hpctrain.train.warmup import prepare_kernels
from ps.server import ServerStats
from ps.service import PSJob

__all__ = ["TrainingJob", "run_training"]

log = logging.getLogger(__name__)


def run_training(config: JobConfig, topo: Topology,
                 on_trained: Callable[[Trainer], None] | None = None,
                 resume: bool = False) -> Summary:
    """Train on every rank of ``topo``: workers fit, parameter-server ranks serve their
    shards. Collective over the world; world rank 0 gets the full summary (the server
    counters included). ``on_trained`` runs on every worker after training, while the
    servers still serve (to read back the final state). With ``resume``, training continues
    from the newest complete checkpoint in ``train.run_dir``. With ``runtime.trace`` set,
    every rank records its timeline and world rank 0 writes them merged to that path."""

    def fit(trainer: Trainer) -> Summary:
        summary = trainer.fit()
        if on_trained:
            on_trained(trainer)
        return summary

    if config.runtime.trace:
        trace.start(config.runtime.trace, topo.world, "worker" if topo.is_worker else "server")
    job = TrainingJob(config, topo, resume)
    prepare_kernels([sparse_optimizer(config.train), *job.dense_table_optimizer()],
                    config.tiering.budget > 0, parameter_server=config.ps.servers > 0,
                    all_to_all=config.embeddings.layout(config.ps.servers) == "alltoall",
                    node=topo.node)
    summary = job.run(fit)
    written = trace.finish(topo.world)
    if written:
        log.info("wrote the timeline %s (hpctrain trace summarize %s)", written, written)
    return summary


class TrainingJob:
    """What the ranks of one training job agreed on; collective over the world."""

    def __init__(self, config: JobConfig, topo: Topology, resume: bool = False,
                 dataset: Dataset | None = None) -> None:
        """``dataset`` is the workers' data (opened from ``config.data`` when None)."""
        with Wait("bcast", topo.world):
            run_dir = topo.world.bcast(config.train.run_dir or default_run_dir(), root=0)
        agree(topo.world, lambda: claim(run_dir, resume) if topo.rank == 0 else None)
        self.config = config = dataclasses.replace(
            config, train=dataclasses.replace(config.train, run_dir=run_dir))
        self.topo = topo
        meta = collect_meta(topo)
        self.dataset = agree(topo.world, lambda: (dataset or open_dataset(config.data))
                             if topo.is_worker else None)
        if topo.rank == 0:
            for note in config.unused_keys():
                log.warning("%s", note)
        agree_on_inputs(topo.world, config, self.dataset)
        with Wait("bcast", topo.world):
            sizes = topo.world.bcast(self.dataset.table_sizes if topo.rank == 0 else None,
                                     root=0)
        self.layout = TableLayout.from_sizes(sizes, config.model.embedding_dim)
        with Wait("allreduce", topo.node):
            holders = topo.node.allreduce(int(topo.is_worker != bool(config.ps.servers)))
        agree(topo.world, lambda: check_memory(config, sizes, topo.workers, holders,
                                               available_memory()))
        self.ps, self.models = None, None
        if config.ps.servers:
            served = self.layout
            if config.ps.mode == "full":
                dense = sum(p.numel() for p in DLRM(config.model, len(sizes)).parameters())
                served = with_dense_table(self.layout, dense)
            self.models = table_models(config.sync.model, config.sync.table_models,
                                       [s.name for s in served.specs])
            self.ps = PSJob.create(topo.world, topo.roles, served, config.ps,
                                   config.train.seed, config.comm)
        self.manifest = None
        if resume:  # world rank 0 checks; an error there ends the job while the others wait
            with Wait("bcast", topo.world):
                self.manifest = topo.world.bcast(
                    self._resumable(self.ps.layout if self.ps else self.layout)
                    if topo.rank == 0 else None, root=0)
        # after the resume was checked: a refused resume is no resume of the run
        agree(topo.world, lambda: write_meta(run_dir, meta) if meta else None)

    def _resumable(self, layout: TableLayout) -> ckpt.Manifest:
        run_dir = self.config.train.run_dir
        manifest = ckpt.latest(run_dir)
        checkpointing.check_compatible(manifest, self.config, layout)
        steps = step_count(self.config, self.dataset)
        if manifest.step >= steps and (Path(run_dir) / "summary.json").exists():
            # resuming would train nothing and overwrite its summary with zero throughput
            raise CheckpointError(f"--resume {run_dir}: the run finished at step "
                                  f"{manifest.step} (summary.json); nothing is left to train "
                                  f"up to train.steps = {steps}: set more steps to extend it")
        log.info("resuming from %s (step %d)", manifest.path, manifest.step)
        return manifest

    def worker(self) -> Trainer:
        """This worker's trainer (workers only)."""
        return Trainer(self.config, self.topo, self.dataset, self.layout, self.ps, self.models,
                       self.manifest)

    def serve(self) -> ServerStats:
        """Serve this server's shards until every worker is done; its counters (servers
        only)."""
        config, topo = self.config, self.topo
        Preemption()  # a server outlives SIGTERM until the workers' checkpoint is written
        restore, on_save = checkpointing.server_hooks(
            topo.world, config.train.run_dir, config.checkpoint.keep, self.ps.layout,
            self.ps.placement, topo.rank - topo.workers, self.manifest)
        return self.ps.serve(sparse_optimizer(config.train), config.train.seed,
                             self.models, config.sums_pushes, restore,
                             on_save, *self.dense_table_optimizer(), threads=topo.threads)

    def dense_table_optimizer(self) -> list[SparseOptimizer]:
        """The servers' optimizer of the dense table: one in full mode, else none."""
        full = self.ps is not None and self.config.ps.mode == "full"
        return [dense_table_optimizer(self.config.train)] if full else []

    def run(self, work: Callable[[Trainer], Summary | None]) -> Summary:
        """Every rank's role: workers run ``work`` on their trainer, then close it; servers
        serve. World rank 0 returns the summary ``work`` returned there, with the server
        counters, and writes it into the run directory."""
        summary, server_stats, trainer = Summary(), None, None
        before = emulate.totals()
        if self.topo.is_worker:
            trainer = self.worker()
            summary = work(trainer) or summary
            trainer.close()
        else:
            server_stats = self.serve()
        with Wait("gather", self.topo.world):
            gathered = self.topo.world.gather((server_stats, emulate.totals() - before), root=0)
        if self.ps:
            self.ps.comm.Free()
        if self.topo.rank == 0:
            summary.ps_servers = [s for s, _ in gathered if s is not None]
            if self.config.comm.emulate:
                summary.emulated = [e for _, e in gathered]
            trainer.finish(summary)
        return summary
