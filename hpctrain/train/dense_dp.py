"""The whole dense model on every worker: data parallel by bucketed allreduce.

:class:`LocalDense` runs the forward and backward of the whole DLRM on this worker's
micro-batches; :class:`ReplicatedDense` sums the gradients over the workers by the
allreduces of :class:`~hpctrain.parallel.data.DataParallel`, which start during the last
backward, with the step's named statistics (:mod:`hpctrain.train.stats`) in the first
bucket, then divides by the global sample count (an exact mean, also for uneven slices). A
:class:`~hpctrain.train.engine.Rider` (the tiered store's hot-row gradients) rides in the
tail of the last bucket: filled after the backward, applied with the dense update, discarded
when the step is skipped.
The optimizer it steps is the builder's choice: :class:`~hpctrain.train.optim.DenseOptimizer`,
or ZeRO's :class:`~hpctrain.train.zero.ZeroOptimizer` (state sharded over the group; with
ZeRO-2 the gradients are reduce-scattered, :class:`~hpctrain.parallel.sharded.ShardedGradients`).
With ``runtime.trace`` on, each micro-batch's ``forward`` and ``backward`` are spans.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hpctrain.data.types import Batch
from hpctrain.models.dlrm import DLRM
from hpctrain.parallel.data import DataParallel
from hpctrain.runtime import trace
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.engine import DenseEngine, DenseTraffic, Embed, Reduced, Rider, StepWork
from hpctrain.train.nonfinite import NonFiniteGuard
from hpctrain.train.optim import DenseOptimizer
from hpctrain.train.stats import StepStats
from hpctrain.train.zero import ZeroOptimizer, restore_dense, save_dense

__all__ = ["LocalDense", "ReplicatedDense"]


class LocalDense(DenseEngine):
    """The whole ``model`` on this worker, share ``replica`` of ``replicas``."""

    def __init__(self, model: DLRM, guard: NonFiniteGuard, accumulate: int,
                 replica: int, replicas: int, device: torch.device) -> None:
        self.module, self.guard, self.accumulate = model, guard, accumulate
        self.replica, self.replicas, self.device = replica, replicas, device

    def forward_backward(self, work: StepWork, batches: Iterator[Batch], embed: Embed) -> None:
        for micro, batch in enumerate(batches):
            embedded = embed(batch)
            start = time.perf_counter()
            logits = self.module(self.tensor(batch.dense), embedded)
            loss = F.binary_cross_entropy_with_logits(logits, self.tensor(batch.labels),
                                                      reduction="sum")
            work.count += len(batch)
            work.loss_sum += loss.item()
            self.guard.loss(work.loss_sum)
            if micro == self.accumulate - 1:
                self.last_backward(work)
            middle = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            trace.record("forward", start, middle, step=work.step)
            trace.record("backward", middle, end, step=work.step)
            work.compute_s += end - start

    def last_backward(self, work: StepWork) -> None:  # noqa: B027 - optional hook
        """Just before the step's last backward."""

    @torch.no_grad()
    def predict(self, batch: Batch, embed: Embed) -> np.ndarray:
        return torch.sigmoid(self.module(self.tensor(batch.dense), embed(batch))).cpu().numpy()


class ReplicatedDense(LocalDense):
    """A replica of the dense model on each worker of ``dp``'s group, kept identical by
    summing the gradients (and ``stats``) over the group."""

    def __init__(self, model: DLRM, guard: NonFiniteGuard, accumulate: int, dp: DataParallel,
                 stats: StepStats[StepWork], optimizer: DenseOptimizer | ZeroOptimizer,
                 device: torch.device, rider: Rider | None = None) -> None:
        """``dp`` carries ``stats.size`` extra values in its first bucket and
        ``rider.size`` in its tail."""
        super().__init__(model, guard, accumulate, dp.group.rank, dp.group.size, device)
        self.stats, self.dp, self.optimizer, self.rider = stats, dp, optimizer, rider

    def last_backward(self, work: StepWork) -> None:
        """The last backward starts the bucket allreduces, the statistics in the first."""
        self.dp.arm(self.stats.values(work))

    def reduce(self, work: StepWork) -> Reduced:
        if self.rider is not None:
            self.rider.fill(work.lookups, self.dp.fused.tail)
            self.dp.fused.tail_ready()
        sums = self.stats.read(self.dp.allreduce(self.stats.values(work)))
        flagged = sums["nonfinite"]
        # no root cause anywhere: the summed gradients (the same everywhere), one sum per
        # buffer, scanned parameter by parameter only to name a non-finite one
        if not flagged and not self.dp.finite():
            self.guard.gradients(self.dp.named_gradients(self.module))
            if self.dp.sharded:  # exact and agreed, but only the shard's holder names it
                flagged = 1.0
        scale = 1.0 / max(sums["samples"], 1.0)
        self.dp.scale(scale)
        return Reduced(int(sums["samples"]), sums["loss"] * scale, flagged)

    def update(self, lr: float, skip: bool, scale: float) -> None:
        if not skip:
            self.optimizer.step(lr)
        if self.rider is not None:
            if skip:
                self.dp.fused.tail.zero_()
            else:
                self.rider.apply(self.dp.fused.tail, lr, scale)
        self.dp.zero()

    def state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.dp.params, self.optimizer.state

    def save(self, folder: Path, lead: bool) -> list[ckpt.FileEntry]:
        """``dense.h5`` from worker 0 (ZeRO's state unsharded: collective over the group)."""
        return save_dense(folder / "dense.h5", self.dp.params, self.optimizer, lead)

    def restore(self, folder: Path) -> None:
        restore_dense(folder / "dense.h5", self.dp.params, self.optimizer)

    def buckets(self) -> int:
        """Gradient buckets of the allreduce (the fused layout's size)."""
        return len(self.dp.fused.buckets)

    def gradient_bytes(self) -> int:
        return self.dp.gradient_bytes

    def close(self) -> None:
        self.dp.close()

    def traffic(self) -> DenseTraffic:
        fused = self.dp.fused
        return DenseTraffic(fused.reduced_bytes, fused.reductions)
