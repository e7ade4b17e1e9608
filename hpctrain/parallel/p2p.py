"""Point-to-point links of one pipeline stage to its neighbours.

Between two actions a stage sends what the finished action produced (an activation to the
next stage, or an input gradient to the previous one) and receives what the coming action
needs, as one batch (:meth:`~hpctrain.parallel.types.Group.post`): Megatron's
``send_forward_recv_backward`` / ``send_backward_recv_forward`` pairs fall out of this
rule, and on NCCL the pair is one group call so facing stages cannot deadlock. Receives
are waited for at once; sends complete in the background and are waited for by
:meth:`StageLinks.flush` at the end of the batch.
"""

from __future__ import annotations

import torch

from hpctrain.parallel.types import Group, Pending

__all__ = ["StageLinks"]


class StageLinks:
    """This stage's links over the pipeline ``group`` (stage = group rank)."""

    def __init__(self, group: Group, device: torch.device) -> None:
        self.group, self.device = group, device
        self.stage, self.stages = group.rank, group.size
        self._sending: list[Pending] = []

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def exchange(self, send: tuple[torch.Tensor, int] | None,
                 recv: tuple[tuple[int, ...], int] | None) -> torch.Tensor | None:
        """Send ``(tensor, peer stage)`` and receive a float32 tensor of ``(shape, peer
        stage)`` in one batch; returns the received tensor once it has arrived."""
        buffer = None if recv is None else torch.empty(recv[0], dtype=torch.float32,
                                                       device=self.device)
        pending = self.group.post([send] if send else [],
                                  [(buffer, recv[1])] if buffer is not None else [])
        if send:
            self._sending.append(pending[0])
        if buffer is not None:
            pending[-1].wait()
        return buffer

    def flush(self) -> None:
        """Wait until every send of this batch has completed."""
        for request in self._sending:
            request.wait()
        self._sending.clear()
