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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hpctrain.comm import Group, allreduce
from hpctrain.parallel.data import DataParallel

__all__ = ["LocalSGD"]


class LocalSGD:
    """The dense side of ``local:H`` over ``dp``'s group (every worker)."""

    def __init__(self, dp: DataParallel, period: int, steps: int) -> None:
        self.dp, self.period, self.steps = dp, period, steps
        self.group: Group = dp.group
        self.params = dp.params
        self.flat = torch.empty(sum(p.numel() for p in self.params), dtype=torch.float32,
                                device=self.params[0].device)
        self.stats = np.zeros(dp.fused.extra, np.float32)
        self.averages = 0
        """Parameter averages made (the dense synchronisations)."""

    def allreduce(self, stats: Sequence[float]) -> np.ndarray:
        """Sum the step statistics alone over the workers (``allreduce`` of
        ``len(stats)`` float32 values); the gradients stay local."""
        self.stats[:] = stats
        allreduce(self.stats, comm=self.group)
        return self.stats.astype(np.float64)

    @staticmethod
    def scale(local_count: int) -> float:
        """The factor that makes this worker's summed gradient its own mean."""
        return 1.0 / max(local_count, 1)

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        """Average the parameters over the workers after every ``period``-th step and after
        the last (``allreduce`` of all parameters, float32 sum, then / workers); returns
        whether it did."""
        if (step + 1) % self.period and step + 1 != self.steps:
            return False
        offset = 0
        for p in self.params:
            self.flat[offset: offset + p.numel()].copy_(p.reshape(-1))
            offset += p.numel()
        allreduce(self.flat, comm=self.group)
        self.flat.div_(self.group.size)
        offset = 0
        for p in self.params:
            p.copy_(self.flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        self.averages += 1
        return True
