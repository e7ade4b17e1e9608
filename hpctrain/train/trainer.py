"""The training loop: one step path over a dense engine and an embedding store.

One step (``accumulate`` micro-batches per optimizer step), the same in every mode:

1. each worker reads its slice of the global batch (announcing the next micro-batch's rows
   to the store when it prefetches: ``ps.prefetch``, or all-to-all tables);
2. the dense engine (:mod:`hpctrain.train.engine`) brings its parameters up to date, runs
   forward and backward with the batch's unique rows from the embedding store, and reduces
   the gradients with the step statistics (:mod:`hpctrain.train.stats`);
3. the non-finite verdict (``train.on_nonfinite``, :mod:`hpctrain.train.nonfinite`) skips or
   stops the step on every worker that shares it;
4. the engine applies the step, and the touched rows' gradients (with the dense rows in full
   parameter-server mode) are pushed to the store, which applies the sparse optimizer where
   the rows live; a tiered store also moves rows between its tiers (the ``retier`` phase).

Which engine and store a worker has is decided once, by :func:`hpctrain.train.build.build_worker`;
the per-mode picture is in :mod:`hpctrain.train`. Every timed phase is also a span of the
timeline when ``runtime.trace`` is on (:mod:`hpctrain.runtime.trace`): ``step`` and in it
``data``, ``lookup``, the engine's own spans (``forward``, ``backward``), the reduce and
update phases, ``push``; ``checkpoint`` after the step.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from embeddings.tables import TableLayout
from hpctrain.comm.native import gatherv
from hpctrain.comm.owner import communicators
from hpctrain.config import JobConfig
from hpctrain.data import Batch, Dataset, open_dataset
from hpctrain.data.sharding import local_slice
from hpctrain.runtime import trace
from hpctrain.runtime.env import peak_rss_bytes
from hpctrain.runtime.preempt import Preemption
from hpctrain.runtime.topology import shard_range
from hpctrain.runtime.waits import Wait, wait_all, waited_s
from hpctrain.runtime.world import Topology
from hpctrain.sync.models import lr_factor
from hpctrain.sync.stragglers import Stragglers
from hpctrain.sync.types import SyncModel
from hpctrain.train import checkpoint as ckpt
from hpctrain.train import checkpointing, metrics
from hpctrain.train.build import Counters, build_worker, step_count
from hpctrain.train.checkpoint_rows import RowFiles
from hpctrain.train.engine import Embed, StepWork
from hpctrain.train.nonfinite import finite_samples
from hpctrain.train.optim import scheduled_lr
from hpctrain.train.report import PHASES, StepTimes, Summary
from hpctrain.train.rundir import RunDir, default_run_dir
from ps.service import PSJob

__all__ = ["Trainer"]

log = logging.getLogger(__name__)


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
        self.steps = step_count(config, self.dataset)
        self.run = (RunDir(config.train.run_dir or default_run_dir(), config,
                           manifest.step if manifest is not None else None)
                    if self.comm.Get_rank() == 0 else None)
        self.phase_s: dict[str, float] = defaultdict(float)
        # SIGTERM/SIGUSR1: stop at an agreed step, resumable
        self.preemption = Preemption(agreement_lag(models if job is not None else None))
        sc = config.sync
        self.stragglers = Stragglers(self.comm.Get_rank(), sc.slow_workers, sc.slow_factor,
                                     sc.straggle_probability, sc.straggle_factor,
                                     sc.straggler_seed)
        self.step_s: list[float] = []
        self.paused_s = 0.0  # evaluations and checkpoint writes, kept out of the run's clock
        self.lr_factor = lr_factor(sc.model, sc.ssp_lr)
        self.cadence = checkpointing.Cadence(config.checkpoint)
        self.parts = build_worker(config, topo, self.dataset, self.layout, job, models,
                                  manifest)
        self.engine, self.store = self.parts.engine, self.parts.store
        self.embeddings, self.guard = self.parts.tables, self.parts.guard
        if self.run and self.parts.plan_json:
            self.run.write_text("plan.json", self.parts.plan_json)
        self.prefetch = self.parts.announce
        self.start_step = manifest.step if manifest is not None else 0
        # where the run's clock and sample count stood at the checkpoint: the curve in
        # metrics.jsonl goes on from them (the summary is this launch's own); from zero
        # after a checkpoint that did not save them, which `hpctrain report` then flags
        self.resumed_at = (manifest.clock_s or 0.0, manifest.samples or 0) if manifest \
            else (0.0, 0)

    # -- reading the state back (tests, tools) ---------------------------------------------

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's live dense parameters (to hook their gradients, say)."""
        return self.engine.module.parameters()

    def dense_parameters(self) -> np.ndarray:
        """This rank's dense parameters, flattened (a copy)."""
        return torch.cat([p.detach().reshape(-1).cpu()
                          for p in self.engine.module.parameters()]).numpy()

    def dense_state(self) -> list[np.ndarray]:
        """This rank's dense parameters then dense optimizer state, as checkpoints hold them
        (copies)."""
        params, optim = self.engine.state()
        return [t.detach().cpu().numpy().copy() for t in [*params, *optim]]

    def table_rows(self) -> np.ndarray | None:
        """Every embedding row's current value as this worker reads it (None where it holds
        no table: a pipeline stage after the first)."""
        if not self.store.holds_rows:
            return None
        return self.store.pull(np.arange(self.layout.total_rows, dtype=np.int64))

    def server_rows(self) -> np.ndarray:
        """Every row's values then optimizer state as the parameter servers hold them, once
        cached rows are written back (collective over the workers)."""
        self.store.flush()
        return self.parts.servers.read(np.arange(self.layout.total_rows, dtype=np.int64))

    def server_clock(self) -> int:
        """Pushes this worker has made to the parameter servers (one per step)."""
        return self.parts.servers.clock

    def gradient_buckets(self) -> int:
        """Buckets the dense gradients are allreduced in (0 in full parameter-server mode)."""
        return self.engine.buckets()

    def counters(self) -> Counters:
        """This worker's parameter-server client and tiering counters (None where absent)."""
        return self.parts.counters()

    # -- checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, step: int, clock_s: float, samples: int) -> None:
        """Checkpoint after ``step`` completed steps, the run's clock at ``clock_s`` and
        ``samples`` trained; collective over the world (the servers join through their
        ``SAVE`` hook)."""
        started = time.perf_counter()
        folder = ckpt.step_dir(self.config.train.run_dir, step)
        out = RowFiles(folder, lead=self.comm.Get_rank() == 0)
        self.store.save(out)
        files = self.engine.save(folder, out.lead)
        manifest = None
        if self.topo.rank == 0:
            manifest = checkpointing.new_manifest(
                self.config, self.parts.served, step, self.topo.workers,
                self.topo.roles.servers, self.parts.plan_json, clock_s, samples)
        checkpointing.commit(self.topo.world, folder, files + out.files, manifest,
                             self.config.checkpoint.keep)
        ended = time.perf_counter()
        self._timed("checkpoint", started, ended, step)
        self.paused_s += ended - started
        self.cadence.saved(ended - started)
        self.preemption.saved()

    # -- one step --------------------------------------------------------------------------

    def learning_rate(self, step: int) -> float:
        """``train.lr`` after ``train.lr_scaling`` and the warm-up, times ``sync.ssp_lr``'s
        factor under a staleness bound."""
        return self.lr_factor * scheduled_lr(self.config.train, step)

    def micro_batches(self) -> Iterator[tuple[int, Batch]]:
        """(micro-batch index, this worker's slice) for every micro-batch left to run."""
        accumulate = self.config.train.accumulate
        for index in range(self.start_step * accumulate, self.steps * accumulate):
            start = time.perf_counter()
            batch = self.dataset.read("train", *self._slice(index))
            self._timed("data", start, time.perf_counter(), index // accumulate)
            yield index, batch

    def step(self, step: int, batches: Iterator[tuple[int, Batch]],
             ahead: list[tuple[int, Batch]]) -> tuple[int, float]:
        """Run optimizer step ``step``; returns (global samples, mean loss; NaN when the step
        was skipped for non-finite values).

        ``ahead`` holds the next micro-batch, read one early so its rows can be prefetched.
        """
        started, waited = time.perf_counter(), waited_s()
        self.engine.begin()
        self._timed("lookup", started, time.perf_counter(), step)
        work = StepWork(step)
        self.engine.forward_backward(work, self._step_batches(batches, ahead),
                                     self._embedder(work, ahead))
        self.phase_s["lookup"] += work.lookup_s
        self.phase_s["compute"] += work.compute_s
        # a slow node is slow at all its own work (reading, lookups, compute), not at waiting
        self.stragglers.delay(step, time.perf_counter() - started - (waited_s() - waited))
        lr = self.learning_rate(step)
        t0 = time.perf_counter()
        reduced = self.engine.reduce(work)
        skip = self.guard.settle(step, reduced.flagged + self.guard.flag)
        scale = 1.0 / max(reduced.samples, 1)
        t1 = time.perf_counter()
        self.engine.update(lr, skip, scale)
        self._timed(self.engine.reduce_phase, t0, t1, step)
        self._timed(self.engine.update_phase, t1, time.perf_counter(), step)
        ended = self._push(work, skip, scale, lr)
        trace.record("step", started, ended, step=step)
        self.step_s.append(ended - started)
        return reduced.samples, float("nan") if skip else reduced.loss

    def _step_batches(self, batches: Iterator[tuple[int, Batch]],
                      ahead: list[tuple[int, Batch]]) -> Iterator[Batch]:
        """The step's ``accumulate`` micro-batches, their features checked; with
        prefetching, each one's successor is read before it is handed out."""
        for _ in range(self.config.train.accumulate):
            index, batch = ahead.pop() if ahead else next(batches)
            if self.prefetch:
                upcoming = next(batches, None)
                if upcoming is not None:
                    ahead.append(upcoming)
            self.guard.features(batch.dense, self._slice(index)[0])
            yield batch

    def _embedder(self, work: StepWork, ahead: list[tuple[int, Batch]]) -> Embed:
        """Training lookups recorded in ``work``, each announcing the next micro-batch's."""
        accumulate = self.config.train.accumulate

        def embed(batch: Batch) -> torch.Tensor:
            start = time.perf_counter()
            embedded, lookup = self.embeddings.lookup(batch.sparse)
            if ahead and len(ahead[0][1]):
                self.embeddings.prefetch(ahead[0][1].sparse, ahead[0][0] // accumulate
                                         - work.step)
            work.lookups.append(lookup)
            end = time.perf_counter()
            work.lookup_s += end - start
            trace.record("lookup", start, end, step=work.step)
            return embedded

        return embed

    def _push(self, work: StepWork, skip: bool, scale: float, lr: float) -> float:
        """The touched rows' gradients (and the engine's dense rows) to the store, which
        applies them; a dropped share pushes what the store withholds. Returns when it
        ended."""
        start = time.perf_counter()
        keep = not skip and self.guard.embedding_share(work.step, work.lookups, self.layout)
        rows, grads = self.embeddings.gradients(work.lookups, scale)
        if not keep:
            rows, grads = self.store.withhold(rows, grads)
        moving = self.store.retier_s
        self.store.push(*self.engine.outgoing(rows, grads), lr)
        moved = self.store.retier_s - moving
        end = time.perf_counter()
        self.phase_s["push"] += end - start - moved
        self.phase_s["retier"] += moved
        trace.record("push", start, end, step=work.step)  # the retier spans nest in it
        return end

    def _timed(self, phase: str, start: float, end: float, step: int) -> None:
        """Count ``end - start`` seconds to ``phase`` and mark them on the timeline."""
        self.phase_s[phase] += end - start
        trace.record(phase, start, end, step=step)

    def _slice(self, index: int) -> tuple[int, int]:
        """Train samples ``[start, stop)`` of micro-batch ``index`` on this worker."""
        return local_slice(index, self.dataset.num_samples("train"),
                           self.config.train.batch_size, self.engine.replica,
                           self.engine.replicas)

    # -- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, limit: int = 0) -> dict[str, float]:
        """Metrics over the first ``limit`` samples of the eval split (0: all): each worker
        scores its contiguous part, then a ``Gatherv`` over the workers brings scores and
        labels to worker 0 (others get {}). Every worker reads the same model whatever the
        sync model (the store's
        :meth:`~embeddings.types.EmbeddingStore.consistent_reads`), and a barrier over the
        workers keeps anyone from pushing again before all have read."""
        with self.store.consistent_reads():
            self.engine.begin()
            probs, labels = self._scores(limit)
        wait_all([self.comm.Ibarrier()], Wait("barrier", self.comm))
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
    def _scores(self, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Probabilities and labels of this replica's contiguous part of the first ``limit``
        samples (0: all) of the eval split (empty on ranks whose engine does not score)."""
        engine = self.engine
        n = self.dataset.num_samples("eval")
        n = min(n, limit) if limit else n
        lo, hi = shard_range(n, engine.replicas, engine.replica)
        chunk = max(1, self.config.train.eval_batch_size // engine.replicas)
        probs, labels = [np.empty(0, np.float32)], [np.empty(0, np.float32)]
        left_out = 0
        engine.module.eval()
        for start in range(lo, hi, chunk):
            read = self.dataset.read("eval", start, min(hi, start + chunk))
            batch, dropped = finite_samples(read)
            left_out += dropped
            if len(batch) == 0:
                continue
            scored = engine.predict(batch, self._embed_eval)
            if scored is not None:
                probs.append(scored)
                labels.append(batch.labels)
        self.store.finish_lookups()
        engine.module.train()
        if left_out and engine.scores_here:
            log.warning("evaluation left out %d samples with non-finite dense features", left_out)
        return np.concatenate(probs), np.concatenate(labels)

    def _embed_eval(self, batch: Batch) -> torch.Tensor:
        return self.embeddings.lookup(batch.sparse, train=False)[0]

    # -- the loop --------------------------------------------------------------------------

    def fit(self) -> Summary:
        """Train ``self.steps`` steps, evaluate, and return this worker's summary."""
        tc = self.config.train
        run = self.run
        summary = Summary(run_dir=str(run.path) if run else "")
        clock_s, samples_before = self.resumed_at
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
                elapsed = time.perf_counter() - start - self.paused_s
                run.log({"step": done, "samples": samples_before + summary.samples,
                         "time_s": clock_s + elapsed, "train_loss": summary.train_loss,
                         "lr": self.learning_rate(step),
                         "samples_per_s": summary.samples / elapsed})
                bar.set_postfix(loss=f"{summary.train_loss:.4f}")
                window_loss, window_n = 0.0, 0
            if tc.eval_every and (done % tc.eval_every == 0 or done == self.steps):
                self._log_heldout(done, samples_before + summary.samples,
                                  clock_s + time.perf_counter() - start)
            agreed = self.preemption.after_step(self.comm, self.cadence.time_due())
            stop = agreed.stop and done < self.steps
            if self.cadence.due(done, final=done == self.steps) or agreed.save or stop:
                self.save_checkpoint(done, clock_s + time.perf_counter() - start -
                                     self.paused_s, samples_before + summary.samples)
            if stop:
                summary.stopped_at = done
                break
        self.preemption.drain(self.comm)
        bar.close()
        return self._summarize(summary, time.perf_counter() - start - self.paused_s)

    def _summarize(self, summary: Summary, wall_s: float) -> Summary:
        """Fill ``summary`` after the loop: the final evaluation (not after a signal's stop:
        the queue's grace period is for the checkpoint and the exit, and the resumed run
        evaluates at its end), traffic and every worker's facts (gathered on worker 0)."""
        summary.steps = summary.stopped_at or self.steps
        summary.wall_s = wall_s
        summary.phase_s = {k: self.phase_s[k] for k in PHASES}
        summary.eval = {} if summary.stopped_at else self._log_eval(summary.steps)
        traffic = self.engine.traffic()
        summary.dense_reduced_bytes, summary.dense_syncs = traffic.reduced_bytes, traffic.syncs
        summary.pipeline_sent_bytes = traffic.pipeline_bytes
        with Wait("gather", self.comm):
            facts = self.comm.gather(self._rank_facts(), root=0)
        if facts:
            summary.peak_rss_mb = [f.peak_rss_mb for f in facts]
            summary.skipped_lines = sum({f.replica: f.skipped_lines for f in facts}.values())
            summary.skipped_steps = [f.skipped_steps for f in facts]
            summary.ps_clients = [f.counters.client for f in facts if f.counters.client]
            summary.step_times = [f.step_times for f in facts]
            summary.tiering = [f.counters.tiering for f in facts if f.counters.tiering]
            summary.optimizer_state_bytes = [f.optimizer_state_bytes for f in facts]
            summary.gradient_bytes = [f.gradient_bytes for f in facts]
        return summary

    def close(self) -> None:
        """Write cached rows back to where they live (the servers then hold the whole
        model), release the store and stop the engine, and free the groups they used
        (collective over the workers)."""
        self.store.close()
        self.engine.close()
        if self.parts.group is not None:
            communicators(self.topo).release(self.parts.group)

    def finish(self, summary: Summary) -> None:
        """Write the summary into the run directory (worker 0) when the run is complete: a
        run stopped by a signal has none, so a sweep resumes it instead of counting it
        finished."""
        if self.run:
            if not summary.stopped_at:
                self.run.write_json("summary.json", summary.as_dict())
            self.run.close()

    def _log_heldout(self, step: int, samples: int, elapsed: float) -> None:
        """A point of the held-out curve (the first ``train.eval_subset`` eval samples) at
        the run's clock; the evaluation's own time is kept out of the clock and wall_s."""
        started = time.perf_counter()
        result = self.evaluate(self.config.train.eval_subset)
        if self.run:
            self.run.log({"step": step, "samples": samples, "time_s": elapsed - self.paused_s,
                          **{f"heldout_{k}": v for k, v in result.items()}})
        self.paused_s += time.perf_counter() - started

    def _log_eval(self, step: int) -> dict[str, float]:
        result = self.evaluate()
        if self.run:
            self.run.log({"step": step, **{f"eval_{k}": v for k, v in result.items()}})
        return result

    def _rank_facts(self) -> _RankFacts:
        state = sum(t.numel() * t.element_size() for t in self.engine.state()[1])
        return _RankFacts(peak_rss_bytes() / 2**20, self.engine.replica, self.dataset.skipped,
                          self.guard.skipped, StepTimes.of(self.step_s, self.stragglers.delayed_s),
                          self.counters(), state, self.engine.gradient_bytes())


_ASP_LAG = 32  # under ASP, how far a worker may run ahead of the slowest one


def agreement_lag(models: list[SyncModel] | None) -> int:
    """Steps between a worker's stop flag and the workers' agreement on it: none where
    the workers meet every step anyway (no servers), else beyond the largest staleness the
    tables' sync models allow (plus prefetch's slack), so the agreement never holds a
    worker the sync model would let run."""
    if not models:
        return 0
    bounds = [m.bound for m in models]
    return _ASP_LAG if None in bounds else max(bounds) + 2


@dataclass
class _RankFacts:
    """What each worker adds to the summary."""

    peak_rss_mb: float
    replica: int  # the ranks of a replica (tensor/pipeline parallel) read the same lines
    skipped_lines: int
    skipped_steps: int
    step_times: StepTimes
    counters: Counters
    optimizer_state_bytes: int
    gradient_bytes: int
