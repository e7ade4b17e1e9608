"""DLRM's dense part tensor- and pipeline-parallel, data-parallel over the grid's ``dp`` axis.

The dense engine (:mod:`hpctrain.train.engine`) when ``parallel.tp`` or ``parallel.pp``
exceeds 1. Stage 0 runs the embedding lookups, the bottom MLP, the dot
interaction and the top-MLP layers before the first cut; each later stage runs the next
top-MLP layers; the last one turns the logits into the summed log loss. With ``tp > 1``
every MLP of a stage runs as column/row-parallel pairs over the tensor group.

Every rank builds the whole DLRM from ``train.seed`` (the dense part is small) and keeps
its stage's shard, so the parallel model starts from the single-process parameters and,
with every update an exact mean over the global batch, follows the same trajectory up to
float rounding. Embedding tables live on stage 0 only, replicated over its data group (each
tensor rank of stage 0 keeps an identical replica, updated identically). A checkpoint holds
one dense file per (stage, tensor shard), written by the first replica, so a run resumes
onto the same ``tp``, ``pp`` and cuts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embeddings.tables import TableLayout
from embeddings.types import EmbeddingStore, RowSink, RowSource
from hpctrain.config import JobConfig, ParallelConfig
from hpctrain.data.types import Batch
from hpctrain.models.dlrm import DLRM, DotInteraction
from hpctrain.parallel.engine import ParallelEngine
from hpctrain.parallel.groups import ParallelGroups
from hpctrain.parallel.layers import tensor_parallel_mlp
from hpctrain.parallel.pipeline import micro_sizes
from hpctrain.parallel.stages import layers_of
from hpctrain.runtime.topology import shard_range
from hpctrain.runtime.world import Topology
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.engine import DenseEngine, DenseTraffic, Embed, Reduced, StepWork
from hpctrain.train.nonfinite import NonFiniteGuard
from hpctrain.train.optim import DenseOptimizer
from hpctrain.train.zero import ZeroOptimizer, restore_dense, save_dense

__all__ = ["GridDense", "NoTables", "wants_model_parallel", "top_cuts"]


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

    def __init__(self, bottom: nn.Module, interaction: DotInteraction, top: nn.Module) -> None:
        super().__init__()
        self.bottom, self.interaction, self.top = bottom, interaction, top

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        dense, embedded = inputs
        return self.top(self.interaction(self.bottom(dense), embedded))


class GridDense(DenseEngine):
    """This rank's stage of the DLRM (tensor-parallel within it) and its optimizer."""

    def __init__(self, config: JobConfig, topo: Topology, groups: ParallelGroups,
                 layout: TableLayout, guard: NonFiniteGuard) -> None:
        """``guard`` (over all the workers) judges each step's non-finite values."""
        self.config, self.guard, self.layout, self.device = config, guard, layout, topo.device
        par, tc = config.parallel, config.train
        self.replica, self.stage, self.shard = topo.grid.coords
        self.replicas = topo.grid.grid.dp
        torch.manual_seed(tc.seed)
        full = DLRM(config.model, len(layout.specs))
        top = layers_of(full.top)
        bounds = [0, *top_cuts(len(top), par.pp, par.stage_cuts), len(top)]
        mine = tensor_parallel_mlp(nn.Sequential(*(
            m for layer in top[bounds[self.stage]:bounds[self.stage + 1]] for m in layer)),
            groups.tensor)
        if self.stage == 0:
            mine = FirstStage(tensor_parallel_mlp(full.bottom, groups.tensor),
                              full.interaction, mine)
        self.module = mine.to(topo.device)
        self.groups = groups
        self.engine = ParallelEngine(self.module, groups, par.schedule, topo.device, config.comm,
                                     par.wire_dtype, sharded=tc.zero == 2)
        self.optimizer = (ZeroOptimizer(self.engine.dp, tc) if tc.zero else
                          DenseOptimizer.from_config(self.module.parameters(), tc))
        self.scores_here = self.engine.last and self.shard == 0
        self._reduced: Reduced | None = None

    def forward_backward(self, work: StepWork, batches: Iterator[Batch], embed: Embed) -> None:
        """Every stage reads this replica's slices of the step's ``accumulate`` global
        batches, each split into ``parallel.micro_batches``; the pipeline schedule runs
        them and reduces the gradients and statistics over the grid (see
        :meth:`~hpctrain.parallel.engine.ParallelEngine.backward`)."""
        micro = [b for batch in batches for b in _split(batch, self.config.parallel.micro_batches)]
        start, looked_up = time.perf_counter(), work.lookup_s

        def inputs(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.tensor(micro[i].dense), embed(micro[i])

        def loss(i: int, logits: torch.Tensor) -> torch.Tensor:
            return F.binary_cross_entropy_with_logits(
                logits.squeeze(1), self.tensor(micro[i].labels), reduction="sum")

        def check(local_loss: float) -> float:
            self.guard.loss(local_loss)
            self.guard.gradients(
                (f"{name} (stage {self.stage}, tensor shard {self.shard})", p)
                for name, p in self.module.named_parameters())
            self.guard.embedding_gradients(work.lookups, self.layout)
            return self.guard.flag

        count, loss_sum, flagged = self.engine.backward([len(b) for b in micro], inputs, loss,
                                                        check)
        work.count, work.loss_sum = count, loss_sum
        work.compute_s += time.perf_counter() - start - (work.lookup_s - looked_up)
        self._reduced = Reduced(count, loss_sum * (1.0 / max(count, 1)), float(flagged))

    def reduce(self, work: StepWork) -> Reduced:
        """Already reduced by the pipeline's backward."""
        return self._reduced

    def update(self, lr: float, skip: bool, scale: float) -> None:
        if not skip:
            self.optimizer.step(lr)
        self.engine.zero_grad()

    @torch.no_grad()
    def predict(self, batch: Batch, embed: Embed) -> np.ndarray | None:
        """A forward-only pipeline; the probabilities on the last stage's first tensor
        rank."""
        micro = _split(batch, self.config.parallel.micro_batches)
        outputs = self.engine.infer([len(b) for b in micro],
                                    lambda i: (self.tensor(micro[i].dense), embed(micro[i])))
        if not self.scores_here:
            return None
        return np.concatenate([torch.sigmoid(y.squeeze(1)).cpu().numpy() for y in outputs])

    def state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return list(self.module.parameters()), self.optimizer.state

    def save(self, folder: Path, lead: bool) -> list[ckpt.FileEntry]:
        """The first replica of every (stage, tensor shard) writes that shard's file; the
        other replicas hold the same state."""
        return save_dense(folder / self._file, list(self.module.parameters()), self.optimizer,
                          self.replica == 0)

    def restore(self, folder: Path) -> None:
        restore_dense(folder / self._file, list(self.module.parameters()), self.optimizer)

    @property
    def _file(self) -> str:
        return f"dense-stage{self.stage}-tensor{self.shard}.h5"

    def buckets(self) -> int:
        return len(self.engine.dp.fused.buckets)

    def gradient_bytes(self) -> int:
        return self.engine.dp.gradient_bytes

    def close(self) -> None:
        self.engine.close()
        self.groups.close()

    def traffic(self) -> DenseTraffic:
        fused = self.engine.dp.fused
        return DenseTraffic(fused.reduced_bytes, fused.reductions,
                            self.engine.pipeline.links.sent_bytes)


class NoTables(EmbeddingStore):
    """What a pipeline stage after the first holds of the tables: nothing (its lookups and
    pushes are empty; checkpoints of tensor/pipeline runs are refused by the config)."""

    holds_rows = False

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def pull(self, rows: np.ndarray) -> np.ndarray:
        if len(rows):
            raise ValueError("a pipeline stage after the first holds no embedding rows")
        return np.empty((0, self.dim), np.float32)

    def push(self, rows: np.ndarray, grads: np.ndarray, lr: float) -> None:
        self.pull(rows)

    def save(self, out: RowSink) -> None:
        """No rows to write."""

    def restore(self, source: RowSource) -> None:
        """No rows to read."""


def _split(batch: Batch, m: int) -> list[Batch]:
    """``batch`` as ``m`` balanced micro-batches (some empty when it holds fewer than m)."""
    bounds = np.cumsum([0, *micro_sizes(len(batch), m)])
    return [Batch(batch.dense[a:b], batch.sparse[a:b], batch.labels[a:b])
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
