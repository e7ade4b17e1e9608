"""Local SGD for the dense part (``sync.dense = "local:H"``): H local steps, then an average.

Each worker steps its own replica of the dense model on its own gradient (divided by its
own sample count), and every H optimizer steps, and after the last, the replicas' parameters
are averaged over the workers: one allreduce of all parameters instead of one gradient
reduction per step, so the dense synchronisations drop H-fold (Stich 2019; Lin et al. 2020).
Optimizer state (moments, accumulators) stays local. With plain SGD, H = 1 and equal slices
this is BSP: the mean of the workers' steps is the step on the mean gradient.

The embedding tables keep their own sync model (replicated tables and the parameter server
are reduced every step, as under BSP), and the step statistics (sample count, loss sum,
non-finite verdicts, hot counts) are still summed every step: a few float32 values.
:class:`LocalSGDDense` is the dense engine of such a job (chosen by
:func:`~hpctrain.train.build.build_worker`); its averages are timed in the optimizer phase.
"""

from __future__ import annotations

import numpy as np
import torch

from hpctrain.comm import allreduce
from hpctrain.models.dlrm import DLRM
from hpctrain.parallel.data import DataParallel
from hpctrain.train.dense_dp import ReplicatedDense
from hpctrain.train.engine import DenseTraffic, Reduced, StepWork
from hpctrain.train.nonfinite import NonFiniteGuard
from hpctrain.train.optim import DenseOptimizer
from hpctrain.train.stats import StepStats

__all__ = ["LocalSGDDense"]


class LocalSGDDense(ReplicatedDense):
    """A replica of the dense model on each worker of ``dp``'s group, stepped on its own
    gradient and averaged over the group every ``period`` steps and after step ``steps``."""

    def __init__(self, model: DLRM, guard: NonFiniteGuard, accumulate: int, dp: DataParallel,
                 stats: StepStats[StepWork], optimizer: DenseOptimizer, device: torch.device,
                 period: int, steps: int) -> None:
        super().__init__(model, guard, accumulate, dp, stats, optimizer, device)
        self.period, self.steps = period, steps
        self.flat = torch.empty(sum(p.numel() for p in dp.params), dtype=torch.float32,
                                device=device)
        self.sums = np.zeros(stats.size, np.float32)
        self.averages = 0
        """Parameter averages made (the dense synchronisations)."""
        self._step = 0

    def last_backward(self, work: StepWork) -> None:
        """Nothing to start: the gradients stay local."""

    def reduce(self, work: StepWork) -> Reduced:
        """Sum the step statistics alone over the workers (``len(stats)`` float32 values);
        this worker's gradient becomes the mean over its own samples."""
        self.sums[:] = self.stats.values(work)
        allreduce(self.sums, comm=self.dp.group)
        sums = self.stats.read(self.sums)
        flagged = sums["nonfinite"]
        if not flagged:
            self.guard.gradients(self.module.named_parameters())
        self.dp.scale(1.0 / max(work.count, 1))
        self._step = work.step
        return Reduced(int(sums["samples"]), sums["loss"] / max(sums["samples"], 1.0), flagged)

    def update(self, lr: float, skip: bool, scale: float) -> None:
        """The local step, then the parameter average when one is due."""
        super().update(lr, skip, scale)
        if (self._step + 1) % self.period == 0 or self._step + 1 == self.steps:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        """``allreduce`` of all parameters (float32 sum), then / workers."""
        params, offset = self.dp.params, 0
        for p in params:
            self.flat[offset: offset + p.numel()].copy_(p.reshape(-1))
            offset += p.numel()
        allreduce(self.flat, comm=self.dp.group)
        self.flat.div_(self.dp.group.size)
        offset = 0
        for p in params:
            p.copy_(self.flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        self.averages += 1

    def traffic(self) -> DenseTraffic:
        fused = self.dp.fused
        return DenseTraffic(fused.reduced_bytes, fused.reductions + self.averages)
