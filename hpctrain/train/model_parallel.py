"""DLRM's dense part tensor- and pipeline-parallel, data-parallel over the grid's ``dp`` axis.

The trainer uses this instead of its data-parallel path when ``parallel.tp`` or
``parallel.pp`` exceeds 1. Stage 0 runs the embedding lookups, the bottom MLP, the dot
interaction and the top-MLP layers before the first cut; each later stage runs the next
top-MLP layers; the last one turns the logits into the summed log loss. With ``tp > 1``
every MLP of a stage runs as column/row-parallel pairs over the tensor group.

Every rank builds the whole DLRM from ``train.seed`` (the dense part is small) and keeps
its stage's shard, so the parallel model starts from the single-process parameters and,
with every update an exact mean over the global batch, follows the same trajectory up to
float rounding. Embedding tables live on stage 0 only, replicated over its data group (each
tensor rank of stage 0 keeps an identical replica, updated identically).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embeddings.collection import EmbeddingCollection, Lookup
from embeddings.optim import SparseOptimizer
from embeddings.replicated import ReplicatedTables
from embeddings.tables import LocalTables, TableLayout
from hpctrain.config import JobConfig, ParallelConfig
from hpctrain.data.sharding import local_slice
from hpctrain.data.types import Batch, Dataset
from hpctrain.models.dlrm import DLRM, dot_interaction
from hpctrain.parallel.engine import ParallelEngine
from hpctrain.parallel.groups import parallel_groups
from hpctrain.parallel.layers import tensor_parallel_mlp
from hpctrain.parallel.pipeline import micro_sizes
from hpctrain.parallel.stages import layers_of
from hpctrain.runtime.topology import shard_range
from hpctrain.runtime.world import Topology
from hpctrain.train.nonfinite import NonFiniteGuard, finite_samples
from hpctrain.train.optim import DenseOptimizer

__all__ = ["ModelParallelDLRM", "wants_model_parallel", "top_cuts"]

log = logging.getLogger(__name__)


def wants_model_parallel(config: ParallelConfig) -> bool:
    return config.tp * config.pp > 1


def top_cuts(top_layers: int, pp: int, cuts: tuple[int, ...] = ()) -> list[int]:
    """Top-MLP layer where each stage after the first begins: ``cuts``, or a balanced split
    of the features part (counted as one layer) and the ``top_layers`` layers."""
    if cuts:
        return list(cuts)
    return [shard_range(top_layers + 1, pp, s)[0] - 1 for s in range(1, pp)]


class FirstStage(nn.Module):
    """Bottom MLP, dot interaction and the first top-MLP layers; input ``(dense,
    embedded)``."""

    def __init__(self, bottom: nn.Module, pairs: torch.Tensor, top: nn.Module) -> None:
        super().__init__()
        self.bottom, self.top = bottom, top
        self.register_buffer("pairs", pairs, persistent=False)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        dense, embedded = inputs
        return self.top(dot_interaction(self.bottom(dense), embedded, self.pairs))


class ModelParallelDLRM:
    """This rank's stage of the DLRM, its optimizer and (on stage 0) the embedding tables."""

    def __init__(self, config: JobConfig, topo: Topology, dataset: Dataset,
                 layout: TableLayout, guard: NonFiniteGuard) -> None:
        """``guard`` (over all the workers) judges each step's non-finite values."""
        self.config, self.topo, self.dataset, self.guard = config, topo, dataset, guard
        self.layout = layout
        par, tc = config.parallel, config.train
        self.replica, self.stage, self.shard = topo.grid.coords
        self.replicas = topo.grid.grid.dp
        groups = parallel_groups(topo.grid)
        torch.manual_seed(tc.seed)
        full = DLRM(config.model, len(layout.specs))
        top = layers_of(full.top)
        bounds = [0, *top_cuts(len(top), par.pp, par.stage_cuts), len(top)]
        mine = tensor_parallel_mlp(nn.Sequential(*(
            m for layer in top[bounds[self.stage]:bounds[self.stage + 1]] for m in layer)),
            groups.tensor)
        if self.stage == 0:
            mine = FirstStage(tensor_parallel_mlp(full.bottom, groups.tensor), full._pairs, mine)
        self.module = mine.to(topo.device)
        self.engine = ParallelEngine(self.module, groups, par.schedule, topo.device, config.comm)
        self.optimizer = DenseOptimizer(self.module.parameters(), tc.optimizer)
        self.embeddings = None
        if self.engine.first:
            tables = LocalTables(layout, SparseOptimizer(tc.optimizer), seed=tc.seed)
            self.embeddings = EmbeddingCollection(layout, ReplicatedTables(tables, groups.data),
                                                  topo.device)

    def step(self, step: int, lr: float) -> tuple[int, float, float]:
        """Optimizer step ``step``: every stage reads this replica's slice of the
        ``accumulate`` global batches, each split into ``parallel.micro_batches``;
        returns (global samples, mean loss, data seconds)."""
        tc, m = self.config.train, self.config.parallel.micro_batches
        t0 = time.perf_counter()
        batches = []
        for index in range(step * tc.accumulate, (step + 1) * tc.accumulate):
            start, stop = self._slice("train", index)
            batches.append(self.dataset.read("train", start, stop))
            self.guard.features(batches[-1].dense, start)
        micro = [b for batch in batches for b in _split(batch, m)]
        data_s = time.perf_counter() - t0
        lookups: list[Lookup] = []

        def inputs(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            embedded, lookup = self.embeddings.lookup(micro[i].sparse)
            lookups.append(lookup)
            return self._tensor(micro[i].dense), embedded

        def loss(i: int, logits: torch.Tensor) -> torch.Tensor:
            return F.binary_cross_entropy_with_logits(
                logits.squeeze(1), self._tensor(micro[i].labels), reduction="sum")

        def check(local_loss: float) -> float:
            self.guard.loss(local_loss)
            self.guard.gradients(
                (f"{name} (stage {self.stage}, tensor shard {self.shard})", p)
                for name, p in self.module.named_parameters())
            if self.embeddings is not None:
                self.guard.embedding_gradients(lookups, self.layout)
            return self.guard.flag

        count, loss_sum, flagged = self.engine.backward([len(b) for b in micro], inputs, loss,
                                                        check)
        skip = self.guard.settle(step, flagged)
        scale = 1.0 / max(count, 1)
        if not skip:
            self.optimizer.step(lr)
        if self.embeddings is not None:
            self.embeddings.store.push(
                *self.embeddings.gradients([] if skip else lookups, scale), lr)
        self.engine.zero_grad()
        return count, float("nan") if skip else loss_sum * scale, data_s

    @torch.no_grad()
    def scores(self, limit: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Predicted probabilities and labels of this replica's share of the first ``limit``
        samples (0: all) of the eval split, on the last stage's first tensor rank (empty
        elsewhere), via forward-only pipelines."""
        n = self.dataset.num_samples("eval")
        n = min(n, limit) if limit else n
        lo, hi = shard_range(n, self.replicas, self.replica)
        chunk = max(1, self.config.train.eval_batch_size // self.replicas)
        keep = self.engine.last and self.shard == 0
        probs, labels = [np.empty(0, np.float32)], [np.empty(0, np.float32)]
        self.module.eval()
        left_out = 0
        for start in range(lo, hi, chunk):
            read = self.dataset.read("eval", start, min(hi, start + chunk))
            batch, dropped = finite_samples(read)
            left_out += dropped
            micro = _split(batch, self.config.parallel.micro_batches)
            outputs = self.engine.infer(
                [len(b) for b in micro],
                lambda i, micro=micro: (self._tensor(micro[i].dense),
                                        self.embeddings.lookup(micro[i].sparse)[0]))
            if keep:
                probs += [torch.sigmoid(y.squeeze(1)).cpu().numpy() for y in outputs]
                labels += [b.labels for b in micro]
        self.module.train()
        if left_out and keep:
            log.warning("evaluation left out %d samples with non-finite dense features",
                        left_out)
        return np.concatenate(probs), np.concatenate(labels)

    def _slice(self, split: str, index: int) -> tuple[int, int]:
        return local_slice(index, self.dataset.num_samples(split),
                           self.config.train.batch_size, self.replica, self.replicas)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.topo.device)


def _split(batch: Batch, m: int) -> list[Batch]:
    """``batch`` as ``m`` balanced micro-batches (some empty when it holds fewer than m)."""
    bounds = np.cumsum([0, *micro_sizes(len(batch), m)])
    return [Batch(batch.dense[a:b], batch.sparse[a:b], batch.labels[a:b])
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
