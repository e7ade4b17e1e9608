"""Tensor, pipeline and data parallelism composed: one rank's share of a dense model.

The rank holds one pipeline stage, already tensor-parallel over its tensor group
(:func:`~hpctrain.parallel.layers.tensor_parallel_mlp`). A step runs the batch's
micro-batches through the pipeline schedule, then sums the stage's gradients, the sample
count and the loss over the data-parallel group in one all-reduce
(:class:`~hpctrain.parallel.data.DataParallel`) and divides by the global count, so the
update is the exact mean over the global batch, as in the single-process model. A flag
(non-finite values found by a rank) rides along, so the whole grid agrees on it. Every
member of a tensor group holds its own shard's gradients, every stage its own layers', so
each data-parallel group averages exactly one shard of one stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpctrain.config import CommConfig
from hpctrain.parallel.data import DataParallel
from hpctrain.parallel.groups import ParallelGroups
from hpctrain.parallel.pipeline import PipelineStage

__all__ = ["ParallelEngine"]


class ParallelEngine:
    """``stage`` trained through ``groups``: pipeline traffic on ``groups.pipeline``,
    gradient averaging on ``groups.data``. Parameters start as data-parallel rank 0's
    (an ``MPI_Bcast`` over the data group)."""

    def __init__(self, stage: nn.Module, groups: ParallelGroups, schedule: str,
                 device: torch.device, comm: CommConfig | None = None,
                 wire: str = "float32", sharded: bool = False) -> None:
        """``sharded``: keep only this rank's shard of the reduced gradient (ZeRO-2)."""
        self.stage, self.groups = stage, groups
        self.pipeline = PipelineStage(stage, groups.pipeline, schedule, device, wire)
        self.dp = DataParallel(stage, groups.data_group, comm or CommConfig(), extra=3,
                               sharded=sharded)
        self.device = device

    @property
    def first(self) -> bool:
        return self.pipeline.links.first

    @property
    def last(self) -> bool:
        return self.pipeline.links.last

    def backward(self, sizes: list[int], inputs: Callable[[int], Any] | None,
                 loss: Callable[[int, torch.Tensor], torch.Tensor] | None,
                 check: Callable[[float], float] | None = None) -> tuple[int, float, bool]:
        """Accumulate the mean gradient of this batch (micro-batch ``sizes``, the same on
        every stage of the pipeline); returns the global sample count, the loss sum and
        whether any rank of the grid flagged the batch, the same on every rank.

        ``check(loss_sum)`` runs after the backward with this rank's loss sum (0 off the
        last stage) and returns 1.0 to flag its share (non-finite values), else 0.0.
        Collectives: the pipeline's point-to-point traffic, with ``tp > 1`` one max
        all-reduce of the flag over the tensor group, one all-reduce over the data group
        (gradients, count, loss, flag), one all-reduce over the pipeline group (the last
        stage's loss and the flag).
        """
        loss_sum = self.pipeline.train(sizes, inputs, loss)
        flag = check(loss_sum) if check else 0.0
        if check is not None and self.groups.tensor.size > 1:
            shared = torch.tensor([flag], device=self.device)
            flag = float(self.groups.tensor.all_reduce(shared, op="max").item())
        count, loss_sum, flag = self.dp.allreduce([float(sum(sizes)), loss_sum, flag])
        self.dp.scale(1.0 / max(count, 1.0))
        shared = torch.tensor([loss_sum if self.last else 0.0, flag], dtype=torch.float64,
                              device=self.device)
        self.groups.pipeline.all_reduce(shared)
        return int(count), float(shared[0].item()), bool(shared[1].item() > 0)

    def infer(self, sizes: list[int], inputs: Callable[[int], Any] | None) -> list[torch.Tensor]:
        """Forward-only pipeline; the outputs of every micro-batch on the last stage."""
        return self.pipeline.infer(sizes, inputs)

    def zero_grad(self) -> None:
        self.dp.zero()

    def close(self) -> None:
        self.dp.close()
