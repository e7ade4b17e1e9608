"""Point-to-point links of one pipeline stage to its neighbours.

Between two actions a stage sends what the finished action produced (an activation to the
next stage, or an input gradient to the previous one) and receives what the coming action
needs, as one batch (:meth:`~hpctrain.parallel.types.Group.post`): Megatron's
``send_forward_recv_backward`` / ``send_backward_recv_forward`` pairs fall out of this
rule, and on NCCL the pair is one group call so facing stages cannot deadlock. Receives
are waited for at once; sends complete in the background and are waited for by
:meth:`StageLinks.flush` at the end of the batch.

With a 16-bit ``wire`` (``parallel.wire_dtype``) a message carries the tensor's bf16 or fp16
bits (as int16, which every backend moves), float32 again on arrival: half the bytes. fp16
values are first multiplied by the power of two that puts the message's largest magnitude
just under 65504 (:func:`~hpctrain.comm.wire.fp16_scale`: loss scaling per message, so small
input gradients keep their digits), and that scale rides as two more int16 values.
"""

from __future__ import annotations

import torch

from hpctrain.comm.wire import fp16_scale
from hpctrain.parallel.types import Group, Pending

__all__ = ["StageLinks"]

_WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}


class StageLinks:
    """This stage's links over the pipeline ``group`` (stage = group rank)."""

    def __init__(self, group: Group, device: torch.device, wire: str = "float32") -> None:
        self.group, self.device, self.wire = group, device, wire
        self.stage, self.stages = group.rank, group.size
        self._sending: list[Pending] = []
        self.sent_bytes = 0
        """Bytes of the messages this stage has sent."""

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
        buffer = None
        if recv is not None:
            shape = recv[0]
            count = (torch.Size(shape).numel() + 2 * (self.wire == "fp16")
                     if self.wire in _WIRE else shape)
            buffer = torch.empty(count, dtype=torch.int16 if self.wire in _WIRE else
                                 torch.float32, device=self.device)
        message = None if send is None else (self._encode(send[0]), send[1])
        pending = self.group.post([message] if message else [],
                                  [(buffer, recv[1])] if buffer is not None else [])
        if message:
            self._sending.append(pending[0])
            self.sent_bytes += message[0].numel() * message[0].element_size()
        if buffer is None:
            return None
        pending[-1].wait()
        return self._decode(buffer, recv[0]) if self.wire in _WIRE else buffer

    def _encode(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the wire carries it (see the module doc)."""
        if self.wire not in _WIRE:
            return tensor
        flat = tensor.reshape(-1)
        if self.wire == "bf16":
            return flat.to(torch.bfloat16).view(torch.int16)
        scale = fp16_scale(float(flat.abs().max()) if flat.numel() else 0.0)
        bits = (flat * scale).to(torch.float16).view(torch.int16)
        return torch.cat([bits, torch.tensor([scale], dtype=torch.float32,
                                             device=flat.device).view(torch.int16)])

    def _decode(self, buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The float32 tensor of ``shape`` a message made by :meth:`_encode` holds."""
        if self.wire == "bf16":
            return buffer.view(torch.bfloat16).to(torch.float32).view(shape)
        scale = float(buffer[-2:].clone().view(torch.float32)[0])
        return (buffer[:-2].view(torch.float16).to(torch.float32) / scale).view(shape)

    def flush(self) -> None:
        """Wait until every send of this batch has completed."""
        for request in self._sending:
            request.wait()
        self._sending.clear()
