"""Data parallelism for the dense model: bucketed gradients, reduced while backward runs.

Each parameter's ``.grad`` is a view into flat buffers owned by
:class:`~hpctrain.comm.fusion.FusedGradients` (in the node's shared window when the workers
fit one node), so autograd accumulates in place and the reduction needs no copies. Two
extra slots (sample count, loss sum) ride in the first bucket, so the trainer divides by
the global sample count: an exact mean even when workers hold uneven slices.

With ``sharded`` (ZeRO-2) the gradients are reduce-scattered instead
(:class:`~hpctrain.parallel.sharded.ShardedGradients`): each worker keeps its shard of the sum,
and the statistics travel in their own small allreduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from hpctrain.comm import Group, broadcast
from hpctrain.comm.fusion import FusedGradients
from hpctrain.config import CommConfig
from hpctrain.parallel.sharded import ShardedGradients

__all__ = ["DataParallel"]


class DataParallel:
    """Gradient summation of ``module`` over ``group`` (every rank runs the same module)."""

    def __init__(self, module: nn.Module, group: Group, config: CommConfig,
                 extra: int = 2, tail: int = 0, sharded: bool = False) -> None:
        """``extra`` statistics ride in the first bucket, a ``tail`` of float32 values that
        are not gradients in the last bucket of the first buffer
        (:class:`~hpctrain.comm.fusion.FusedGradients`)."""
        self.group = group
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._broadcast_parameters()
        self.fused: FusedGradients | ShardedGradients
        if sharded:
            self.fused = ShardedGradients(self.params, group, config.bucket_kib * 1024, extra,
                                          overlap=config.overlap)
        else:
            self.fused = FusedGradients(self.params, group, config.bucket_kib * 1024, extra,
                                        resident=config.resident, overlap=config.overlap,
                                        wire=config.wire_dtype, tail=tail)

    def shards(self) -> tuple[list[nn.Parameter], list[tuple[int, int]],
                              Callable[[int, int], torch.Tensor] | None]:
        """How ZeRO cuts the parameters (:class:`~hpctrain.train.zero.ZeroOptimizer`): their
        flat order, its segments (worker ``r`` owns chunk ``r`` of each), and where the
        reduced gradient of a flat range of one's own is (``None``: in ``.grad``, whole)."""
        if isinstance(self.fused, ShardedGradients):  # (sharded, spelled for the type checker)
            return self.fused.order, self.fused.segments, self.fused.shard_view
        return self.params, [(0, sum(p.numel() for p in self.params))], None

    def named_gradients(self, module: nn.Module) -> list[tuple[str, object]]:
        """(name, an object whose ``.grad`` is that parameter's reduced gradient, or this
        worker's pieces of it when sharded), for the non-finite check to name one."""
        if not isinstance(self.fused, ShardedGradients):
            return list(module.named_parameters())
        return self.fused.named_shards({id(p): n for n, p in module.named_parameters()})

    @property
    def sharded(self) -> bool:
        """Whether each worker keeps only its shard of the reduced gradient (ZeRO-2)."""
        return isinstance(self.fused, ShardedGradients)

    @property
    def gradient_bytes(self) -> int:
        """Gradient bytes this worker keeps between steps."""
        if isinstance(self.fused, ShardedGradients):
            return self.fused.kept_bytes
        return sum(b.numel() * b.element_size() for b in self.fused.buffers)

    def _broadcast_parameters(self) -> None:
        """Broadcast of all parameters from rank 0 over ``group``, so replicas start
        identical."""
        if self.group.size == 1:
            return
        with torch.no_grad():
            packed = torch.cat([p.detach().reshape(-1).cpu() for p in self.params])
            broadcast(packed, 0, comm=self.group)
            offset = 0
            for p in self.params:
                p.copy_(packed[offset: offset + p.numel()].view_as(p))
                offset += p.numel()

    def arm(self, stats: Sequence[float]) -> None:
        """The next backward is the step's last: its gradient hooks start the bucket
        allreduces, and ``stats`` (sample count, loss sum) travel in the first bucket."""
        self.fused.arm(stats)

    def allreduce(self, stats: Sequence[float]) -> np.ndarray:
        """Finish summing gradients and ``stats`` over ``group``; returns the summed
        stats (``stats`` are ignored when :meth:`arm` already sent them)."""
        return self.fused.finish(stats)

    def finite(self) -> bool:
        """Whether every gradient is finite; False may also mean a sum that overflows
        (:meth:`FusedGradients.finite`)."""
        return self.fused.finite()

    def scale(self, factor: float) -> None:
        self.fused.scale(factor)

    def zero(self) -> None:
        self.fused.zero()

    def close(self) -> None:
        """Stop the buckets' comm thread (the group stays its owner's to free)."""
        self.fused.close()
