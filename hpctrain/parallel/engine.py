"""Tensor, pipeline and data parallelism composed: one rank's share of a dense model.

The rank holds one pipeline stage, already tensor-parallel over its tensor group
(:func:`~hpctrain.parallel.layers.tensor_parallel_mlp`). A step runs the batch's
micro-batches through the pipeline schedule, then sums the stage's gradients, the sample
count and the loss over the data-parallel group in one all-reduce
(:class:`~hpctrain.parallel.data.DataParallel`) and divides by the global count, so the
update is the exact mean over the global batch, as in the single-process model. Every
member of a tensor group holds its own shard's gradients, every stage its own layers', so
each data-parallel group averages exactly one shard of one stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpctrain.parallel.data import DataParallel
from hpctrain.parallel.groups import ParallelGroups
from hpctrain.parallel.pipeline import PipelineStage

__all__ = ["ParallelEngine"]


class ParallelEngine:
    """``stage`` trained through ``groups``: pipeline traffic on ``groups.pipeline``,
    gradient averaging on ``groups.data``. Parameters start as data-parallel rank 0's
    (an ``MPI_Bcast`` over the data group)."""

    def __init__(self, stage: nn.Module, groups: ParallelGroups, schedule: str,
                 device: torch.device) -> None:
        self.stage, self.groups = stage, groups
        self.pipeline = PipelineStage(stage, groups.pipeline, schedule, device)
        self.dp = DataParallel(stage, groups.data)
        self.device = device

    @property
    def first(self) -> bool:
        return self.pipeline.links.first

    @property
    def last(self) -> bool:
        return self.pipeline.links.last

    def backward(self, sizes: list[int], inputs: Callable[[int], Any] | None,
                 loss: Callable[[int, torch.Tensor], torch.Tensor] | None) -> tuple[int, float]:
        """Accumulate the mean gradient of this batch (micro-batch ``sizes``, the same on
        every stage of the pipeline); returns the global sample count and loss sum on every
        rank.

        Collectives: the pipeline's point-to-point traffic, one all-reduce over the data
        group (gradients, count, loss), one broadcast of the loss over the pipeline group
        from the last stage.
        """
        loss_sum = self.pipeline.train(sizes, inputs, loss)
        count, loss_sum = self.dp.allreduce([float(sum(sizes)), loss_sum])
        self.dp.scale(1.0 / max(count, 1.0))
        shared = torch.tensor([loss_sum], dtype=torch.float64, device=self.device)
        self.groups.pipeline.broadcast(shared, root=self.groups.pipeline.size - 1)
        return int(count), float(shared.item())

    def infer(self, sizes: list[int], inputs: Callable[[int], Any] | None) -> list[torch.Tensor]:
        """Forward-only pipeline; the outputs of every micro-batch on the last stage."""
        return self.pipeline.infer(sizes, inputs)

    def zero_grad(self) -> None:
        self.dp.zero()
