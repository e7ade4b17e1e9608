"""The training loop: the one place that wires data, embeddings, the dense model and sync.

One step (data-parallel, every worker holding all tables, BSP):

1. each worker reads its slice of the global batch (``accumulate`` micro-batches);
2. embeddings of the batch's unique rows are pulled from the store, the dense model runs
   forward and backward on the summed loss;
3. dense gradients, the sample count and the loss sum are summed over the workers by
   bucketed allreduces that start during the last backward (:mod:`hpctrain.comm.fusion`),
   then divided by the global sample count (exact mean even for uneven slices);
4. the dense optimizer steps; the touched rows' gradients are pushed to the store, which
   exchanges them among the workers and applies the sparse optimizer.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from embeddings.collection import EmbeddingCollection, Lookup
from embeddings.optim import SparseOptimizer
from embeddings.replicated import ReplicatedTables
from embeddings.tables import LocalTables, TableLayout
from hpctrain.comm import Group
from hpctrain.comm.native import gatherv
from hpctrain.config import JobConfig
from hpctrain.data import open_dataset
from hpctrain.data.sharding import batches_per_epoch, local_slice
from hpctrain.errors import ConfigError
from hpctrain.models.dlrm import DLRM
from hpctrain.parallel.data import DataParallel
from hpctrain.runtime.topology import shard_range
from hpctrain.runtime.world import Topology
from hpctrain.train import metrics
from hpctrain.train.rundir import RunDir, default_run_dir

__all__ = ["Trainer", "Summary"]

log = logging.getLogger(__name__)


@dataclass
class Summary:
    """What a finished run reports (rank 0 holds the evaluation figures)."""

    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0
    step_s: float = 0.0
    train_loss: float = float("nan")
    eval: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: list[float] = field(default_factory=list)
    skipped_lines: int = 0
    run_dir: str = ""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s else 0.0

    @property
    def step_samples_per_s(self) -> float:
        return self.samples / self.step_s if self.step_s else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"steps": self.steps, "samples": self.samples, "wall_s": self.wall_s,
                "step_s": self.step_s, "samples_per_s": self.samples_per_s,
                "step_samples_per_s": self.step_samples_per_s, "train_loss": self.train_loss,
                "eval": self.eval, "peak_rss_mb": self.peak_rss_mb,
                "skipped_lines": self.skipped_lines}


class Trainer:
    def __init__(self, config: JobConfig, topo: Topology) -> None:
        if config.ps.servers:
            raise ConfigError("ps.servers > 0: the parameter server is not part of this build")
        self.config = config
        self.topo = topo
        self.comm = topo.role_comm
        self.dataset = open_dataset(config.data)
        self.layout = TableLayout.from_sizes(self.dataset.table_sizes,
                                             config.model.embedding_dim)
        tc = config.train
        torch.manual_seed(tc.seed)
        self.model = DLRM(config.model, len(self.layout.specs)).to(topo.device)
        self.group = Group(self.comm, config.comm)
        self.dp = DataParallel(self.model, self.group, config.comm)
        optim_cls = torch.optim.SGD if tc.optimizer == "sgd" else torch.optim.Adagrad
        self.optimizer = optim_cls(self.model.parameters(), lr=tc.lr)
        tables = LocalTables(self.layout, SparseOptimizer(tc.optimizer), seed=tc.seed)
        self.embeddings = EmbeddingCollection(self.layout, ReplicatedTables(tables, self.comm),
                                              topo.device)
        epoch = batches_per_epoch(self.dataset.num_samples("train"), tc.batch_size)
        self.steps = tc.steps or max(1, epoch // tc.accumulate)

    # -- one step --------------------------------------------------------------------------

    def learning_rate(self, step: int) -> float:
        tc = self.config.train
        return tc.lr * min(1.0, (step + 1) / tc.warmup_steps) if tc.warmup_steps else tc.lr

    def step(self, step: int) -> tuple[int, float, float]:
        """Run optimizer step ``step``; returns (global samples, mean loss, data seconds)."""
        tc = self.config.train
        lookups: list[Lookup] = []
        count, loss_sum, data_s = 0, 0.0, 0.0
        for micro in range(tc.accumulate):
            t0 = time.perf_counter()
            batch = self._read("train", step * tc.accumulate + micro, tc.batch_size)
            data_s += time.perf_counter() - t0
            if len(batch) == 0:
                continue
            embedded, lookup = self.embeddings.lookup(batch.sparse)
            logits = self.model(self._tensor(batch.dense), embedded)
            loss = F.binary_cross_entropy_with_logits(logits, self._tensor(batch.labels),
                                                      reduction="sum")
            count += len(batch)
            loss_sum += loss.item()
            if micro == tc.accumulate - 1:
                self.dp.arm([count, loss_sum])
            loss.backward()
            lookups.append(lookup)
        total, total_loss = self.dp.allreduce([count, loss_sum])
        scale = 1.0 / max(total, 1.0)
        self.dp.scale(scale)
        lr = self.learning_rate(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.embeddings.push(lookups, scale, lr)
        self.dp.zero()
        return int(total), total_loss * scale, data_s

    def _read(self, split: str, index: int, global_batch: int):
        start, stop = local_slice(index, self.dataset.num_samples(split), global_batch,
                                  self.comm.Get_rank(), self.comm.Get_size())
        return self.dataset.read(split, start, stop)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.topo.device)

    # -- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole eval split: each worker scores its contiguous part, then a
        ``Gatherv`` over the workers brings scores and labels to worker 0 (others get {})."""
        self.model.eval()
        n = self.dataset.num_samples("eval")
        lo, hi = shard_range(n, self.comm.Get_size(), self.comm.Get_rank())
        chunk = max(1, self.config.train.eval_batch_size // self.comm.Get_size())
        probs, labels = [np.empty(0, np.float32)], [np.empty(0, np.float32)]
        for start in range(lo, hi, chunk):
            batch = self.dataset.read("eval", start, min(hi, start + chunk))
            if len(batch) == 0:
                continue
            embedded, _ = self.embeddings.lookup(batch.sparse)
            logits = self.model(self._tensor(batch.dense), embedded)
            probs.append(torch.sigmoid(logits).cpu().numpy())
            labels.append(batch.labels)
        self.model.train()
        all_probs = gatherv(np.concatenate(probs), self.comm)
        all_labels = gatherv(np.concatenate(labels), self.comm)
        if all_probs is None:
            return {}
        return {"log_loss": metrics.log_loss(all_probs, all_labels),
                "auc": metrics.auc(all_probs, all_labels),
                "accuracy": metrics.accuracy(all_probs, all_labels),
                "base_rate_log_loss": metrics.base_rate_log_loss(all_labels),
                "samples": int(len(all_labels))}

    # -- the loop --------------------------------------------------------------------------

    def fit(self) -> Summary:
        tc = self.config.train
        lead = self.comm.Get_rank() == 0
        run = RunDir(tc.run_dir or default_run_dir(), self.config) if lead else None
        summary = Summary(run_dir=str(run.path) if run else "")
        bar = tqdm(total=self.steps, unit="step", disable=not (lead and tc.progress))
        window_loss, window_n = 0.0, 0
        start = time.perf_counter()
        for step in range(self.steps):
            t0 = time.perf_counter()
            samples, loss, data_s = self.step(step)
            summary.step_s += time.perf_counter() - t0 - data_s
            summary.samples += samples
            window_loss, window_n = window_loss + loss, window_n + 1
            bar.update()
            done = step + 1
            if run and (done % tc.log_every == 0 or done == self.steps):
                summary.train_loss = window_loss / window_n
                elapsed = time.perf_counter() - start
                run.log({"step": done, "samples": summary.samples, "time_s": elapsed,
                         "train_loss": summary.train_loss, "lr": self.learning_rate(step),
                         "samples_per_s": summary.samples / elapsed})
                bar.set_postfix(loss=f"{summary.train_loss:.4f}")
                window_loss, window_n = 0.0, 0
            if tc.eval_every and done % tc.eval_every == 0 and done != self.steps:
                self._log_eval(run, done)
        bar.close()
        summary.steps = self.steps
        summary.wall_s = time.perf_counter() - start
        summary.eval = self._log_eval(run, self.steps)
        summary.peak_rss_mb, summary.skipped_lines = self._rank_facts()
        if run:
            run.write_json("summary.json", summary.as_dict())
            run.close()
        return summary

    def _log_eval(self, run: RunDir | None, step: int) -> dict[str, float]:
        result = self.evaluate()
        if run:
            run.log({"step": step, **{f"eval_{k}": v for k, v in result.items()}})
        return result

    def _rank_facts(self) -> tuple[list[float], int]:
        """Peak resident MB of every worker and the total of skipped input lines
        (``allgather`` over the workers)."""
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        facts = self.comm.allgather((kib, self.dataset.skipped))
        return [k / 1024.0 for k, _ in facts], sum(s for _, s in facts)
