"""One stage of a pipeline: runs a schedule's order with real activations and gradients.

Every rank of a pipeline group calls :meth:`PipelineStage.train` with the same micro-batch
sizes. A forward ``F i`` takes micro-batch ``i`` from ``inputs(i)`` on the first stage or
from the previous stage, and sends its output on (the last stage turns it into a summed
loss with ``loss(i, output)``); a backward ``B i`` takes the output gradient from the next
stage (the loss on the last), and sends the input gradient back. Parameter gradients
accumulate over the micro-batches; the caller steps the optimizer once per batch. The
stage keeps a trace (wall and CPU time of every action) and the peak number of micro-batches
whose activations it held, for ``hpctrain bench pipeline``; with ``runtime.trace`` on,
each action is also a ``forward`` or ``backward`` span of the run's timeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hpctrain.parallel.p2p import StageLinks
from hpctrain.parallel.schedules import SCHEDULES, Action, forward_only
from hpctrain.parallel.types import Group
from hpctrain.runtime import trace
from hpctrain.runtime.topology import shard_range

__all__ = ["PipelineStage", "Traced", "micro_sizes"]


def micro_sizes(n: int, m: int) -> list[int]:
    """Sizes of the ``m`` micro-batches of a batch of ``n`` (balanced, possibly empty)."""
    return [hi - lo for lo, hi in (shard_range(n, m, i) for i in range(m))]


@dataclass(frozen=True)
class Traced:
    """One action as it ran: wall-clock span (``time.perf_counter``) and process CPU time."""

    action: Action
    start: float
    end: float
    cpu: float


class PipelineStage:
    """``module`` as stage ``group.rank`` of a ``group.size``-stage pipeline.

    Stages after the first start with a linear layer (``nn.Linear`` or a parallel one):
    its ``in_features`` is the width of the activation they receive.
    """

    def __init__(self, module: nn.Module, group: Group, schedule: str,
                 device: torch.device, wire: str = "float32") -> None:
        """``wire``: the format of activations and input gradients between stages
        (:class:`~hpctrain.parallel.p2p.StageLinks`)."""
        self.module, self.order = module, SCHEDULES[schedule]
        self.links = StageLinks(group, device, wire)
        self.in_features = 0 if self.links.first else next(
            m.in_features for m in module.modules() if hasattr(m, "in_features"))
        self.trace: list[Traced] = []
        self.peak_held = 0
        self._held: dict[int, tuple[Any, torch.Tensor]] = {}
        self._loss_sum: torch.Tensor | float = 0.0

    def train(self, sizes: list[int], inputs: Callable[[int], Any] | None,
              loss: Callable[[int, torch.Tensor], torch.Tensor] | None) -> float:
        """Forward and backward of ``len(sizes)`` micro-batches; returns the summed loss
        (on the last stage; 0 elsewhere). ``inputs`` is needed on the first stage, ``loss``
        on the last."""
        links = self.links
        order = self.order(links.stages, len(sizes), links.stage)
        self._run(order, sizes, inputs, loss, train=True)
        return float(self._loss_sum)

    @torch.no_grad()
    def infer(self, sizes: list[int], inputs: Callable[[int], Any] | None) -> list[torch.Tensor]:
        """Forwards only; returns the outputs of every micro-batch on the last stage."""
        order = forward_only(self.links.stages, len(sizes), self.links.stage)
        return self._run(order, sizes, inputs, None, train=False)

    def _run(self, order: list[Action], sizes: list[int], inputs: Callable[[int], Any] | None,
             loss: Callable[[int, torch.Tensor], torch.Tensor] | None,
             train: bool) -> list[torch.Tensor]:
        self.trace, self._held, self.peak_held, self._loss_sum = [], {}, 0, 0.0
        outputs: list[torch.Tensor] = []
        send = None
        for action in order:
            received = self.links.exchange(send, self._needs(action, sizes))
            if action.kind == "F":
                send = self._forward(action, received, inputs, loss, train, outputs)
            else:
                send = self._backward(action, received)
        self.links.exchange(send, None)
        self.links.flush()
        return outputs

    def _needs(self, action: Action, sizes: list[int]) -> tuple[tuple[int, ...], int] | None:
        """Shape and sender of the message ``action`` waits for, if any."""
        if action.kind == "F" and not self.links.first:
            return (sizes[action.micro], self.in_features), self.links.stage - 1
        if action.kind == "B" and not self.links.last:
            return tuple(self._held[action.micro][1].shape), self.links.stage + 1
        return None

    def _forward(self, action: Action, received: torch.Tensor | None,
                 inputs: Callable[[int], Any] | None,
                 loss: Callable[[int, torch.Tensor], torch.Tensor] | None, train: bool,
                 outputs: list[torch.Tensor]) -> tuple[torch.Tensor, int] | None:
        i, links = action.micro, self.links
        t0, c0 = time.perf_counter(), time.process_time()
        x = inputs(i) if links.first else received.requires_grad_(train)
        y = self.module(x)
        if links.last and train:
            y = loss(i, y)
            self._loss_sum = self._loss_sum + y.detach()
        t1 = time.perf_counter()
        self.trace.append(Traced(action, t0, t1, time.process_time() - c0))
        trace.record("forward", t0, t1, micro=i)
        if train:
            self._held[i] = (x, y)
            self.peak_held = max(self.peak_held, len(self._held))
        if links.last:
            if not train:
                outputs.append(y)
            return None
        return y.detach(), links.stage + 1

    def _backward(self, action: Action,
                  received: torch.Tensor | None) -> tuple[torch.Tensor, int] | None:
        links = self.links
        t0, c0 = time.perf_counter(), time.process_time()
        x, y = self._held.pop(action.micro)
        torch.autograd.backward(y, None if links.last else received)
        t1 = time.perf_counter()
        self.trace.append(Traced(action, t0, t1, time.process_time() - c0))
        trace.record("backward", t0, t1, micro=action.micro)
        return None if links.first else (x.grad, links.stage - 1)
