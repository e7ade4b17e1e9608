"""ZeRO stages 1 and 2 (``train.zero``): the dense optimizer state sharded over the
data-parallel workers, and with stage 2 the reduced gradient too.

The dense parameters, laid end to end in a flat order, form segments, and worker ``r`` owns
the balanced chunk ``r`` of every segment (:func:`~hpctrain.comm.types.chunk_bounds`). It
keeps optimizer state (moments, accumulators) for its chunks only: ``1/N`` of the memory.

- Stage 1: one segment, the parameters in order. The usual bucketed gradient allreduce
  gives every worker the whole reduced gradient; a worker updates its chunk.
- Stage 2: the segments are the buckets of
  :class:`~hpctrain.parallel.sharded.ShardedGradients`, which reduce-scatters each bucket
  during backward and keeps only this worker's chunks of the reduced gradient.

Then each worker updates its chunks, global-norm clipping first when asked (the norm summed
over the shards by one allreduce), and an in-place ``allgather`` per segment hands every
worker the others' chunks. Traffic is the gradient reduction plus that allgather: 1.5x plain
data parallelism at stage 1, 1.0x at stage 2 (a reduce-scatter instead of the allreduce).

The updates are element-wise, so the result equals the unsharded optimizer's to float
tolerance; LARS and LAMB need whole-layer norms and are refused (:mod:`hpctrain.config`).

A checkpoint holds the state unsharded, as the plain optimizer's (:meth:`gathered_state`,
one ``allgather`` per segment and state tensor group while it is written; :meth:`keep_shard`
on resume), so a ZeRO run resumes onto any number of workers, at any stage or without ZeRO.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hpctrain.comm import allgather
from hpctrain.comm.types import chunk_bounds
from hpctrain.config import TrainConfig
from hpctrain.parallel.data import DataParallel
from hpctrain.parallel.sharded import overlaps
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.checkpointing import read_dense, write_dense
from hpctrain.train.optim import DenseOptimizer, clip_grad_norm, empty_state, state_groups

__all__ = ["ZeroOptimizer", "save_dense", "restore_dense"]


class ZeroOptimizer:
    """:class:`~hpctrain.train.optim.DenseOptimizer`'s interface, state sharded over
    ``dp``'s group (and ``dp``'s gradient with stage 2); :meth:`step` is collective. The
    parameters' storage moves into one flat buffer (``p.data`` becomes a view of it)."""

    def __init__(self, dp: DataParallel, tc: TrainConfig) -> None:
        self.group = dp.group
        self.params = dp.params  # the plain optimizer's order, which checkpoints keep
        self.clip_norm = tc.clip_norm
        order, self.segments, shard_view = dp.shards()
        self.at: dict[int, int] = {}  # flat offset of each parameter
        offset = 0
        for p in order:
            self.at[id(p)] = offset
            offset += p.numel()
        # the parameters become views of one flat buffer, so the optimizer updates its
        # chunks in place and the allgathers fill the rest: no copies in or out
        self.flat = torch.empty(offset, dtype=torch.float32, device=self.params[0].device)
        with torch.no_grad():
            for p in order:
                view = self.flat[self.at[id(p)]: self.at[id(p)] + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        rank, size = self.group.rank, self.group.size
        self.pieces: list[torch.nn.Parameter] = []
        self.where: list[int] = []  # flat offset of each piece
        for lo, hi in self.segments:
            bounds = chunk_bounds(hi - lo, size)
            a, b = lo + int(bounds[rank]), lo + int(bounds[rank + 1])
            for p, x, y in overlaps(order, self.at, a, b):  # its elements in our chunk
                first = self.at[id(p)]
                piece = torch.nn.Parameter(p.detach().view(-1)[x - first: y - first])
                piece.grad = (shard_view(x, y) if shard_view else
                              p.grad.view(-1)[x - first: y - first])
                self.pieces.append(piece)
                self.where.append(x)
        self.inner = DenseOptimizer(self.pieces, tc.optimizer, momentum=tc.momentum,
                                    nesterov=tc.nesterov, weight_decay=tc.weight_decay,
                                    betas=tc.betas, eps=tc.eps)
        self.groups = state_groups(tc.optimizer, tc.momentum)
        self.kind, self.momentum = tc.optimizer, tc.momentum

    @property
    def state(self) -> list[torch.Tensor]:
        """This worker's shard of the optimizer state."""
        return self.inner.state

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Clip the reduced gradient (when asked), update this worker's chunks, and
        ``allgather`` each segment of the flat parameters over the group."""
        if self.clip_norm > 0:
            clip_grad_norm(self.pieces, self.clip_norm, self.group)
        self.inner.step(lr)  # this worker's chunks of ``flat``, in place
        for lo, hi in self.segments:
            allgather(self.flat[lo:hi], comm=self.group)

    def gathered_state(self) -> list[torch.Tensor]:
        """The plain optimizer's state over all the parameters, assembled from every
        worker's shard (collective over the group: one ``allgather`` per segment and
        tensor group)."""
        full = self.empty_full_state()
        n, count = len(self.pieces), len(self.params)
        for g in range(self.groups):
            flat = torch.zeros_like(self.flat)
            for t, x in zip(self.inner.state[g * n: (g + 1) * n], self.where, strict=True):
                flat[x: x + t.numel()].copy_(t.view(-1))
            for lo, hi in self.segments:
                allgather(flat[lo:hi], comm=self.group)
            for p, t in zip(self.params, full[g * count: (g + 1) * count], strict=True):
                t.copy_(flat[self.at[id(p)]: self.at[id(p)] + t.numel()].view_as(t))
        if len(full) > self.groups * count:  # the step count, the same everywhere
            full[-1].copy_(self.inner.state[-1])
        return full

    def empty_full_state(self) -> list[torch.Tensor]:
        """Zeros shaped as :meth:`gathered_state`'s result, for a checkpoint to fill."""
        return empty_state(self.params, self.kind, self.momentum)

    @torch.no_grad()
    def keep_shard(self, full: list[torch.Tensor]) -> None:
        """Take this worker's shard of the unsharded state ``full``."""
        n, count = len(self.pieces), len(self.params)
        for g in range(self.groups):
            flat = torch.empty_like(self.flat)
            for p, t in zip(self.params, full[g * count: (g + 1) * count], strict=True):
                flat[self.at[id(p)]: self.at[id(p)] + t.numel()].copy_(t.reshape(-1))
            for t, x in zip(self.inner.state[g * n: (g + 1) * n], self.where, strict=True):
                t.view(-1).copy_(flat[x: x + t.numel()])
        if len(full) > self.groups * count:
            self.inner.state[-1].copy_(full[-1])


def save_dense(path: Path, params: list[torch.Tensor], optimizer: DenseOptimizer | ZeroOptimizer,
               write: bool) -> list[ckpt.FileEntry]:
    """Write ``params`` and the optimizer's state to ``path`` where ``write``; ZeRO's state
    is assembled first, so every member of its group calls this."""
    state = (optimizer.gathered_state() if isinstance(optimizer, ZeroOptimizer)
             else optimizer.state)
    return [write_dense(path, params, state)] if write else []


def restore_dense(path: Path, params: list[torch.Tensor],
                  optimizer: DenseOptimizer | ZeroOptimizer) -> None:
    """Read what :func:`save_dense` wrote; ZeRO keeps its shard of the state."""
    if isinstance(optimizer, ZeroOptimizer):
        state = optimizer.empty_full_state()
        read_dense(path, params, state)
        optimizer.keep_shard(state)
    else:
        read_dense(path, params, optimizer.state)
