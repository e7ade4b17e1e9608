"""ZeRO stage 1 (``train.zero = 1``): the dense optimizer state sharded over the
data-parallel workers.

The dense parameters, laid end to end, are cut into the balanced chunks of
:func:`~hpctrain.comm.types.chunk_bounds`, one per worker. Each worker keeps optimizer state
(moments, accumulators) for its chunk only, so that state takes ``1/N`` of the memory. After
the usual bucketed gradient allreduce (every worker holds the whole reduced gradient, so
global-norm clipping is applied to it first), a worker updates its chunk and an in-place
``allgather`` of the flat parameters hands every worker the others' chunks. Traffic is the
allreduce plus one allgather of the parameters (1.5x plain data parallel: the gradient
reduction is not yet a reduce-scatter, which ZeRO-2 would make it).

The updates are element-wise, so the result equals the unsharded optimizer's to float
tolerance; LARS and LAMB need whole-layer norms and are refused (:mod:`hpctrain.config`).

A checkpoint holds the state unsharded, as the plain optimizer's (:meth:`gathered_state`,
one ``allgather`` per state tensor group while it is written; :meth:`keep_shard` on
resume), so a ZeRO run resumes onto any number of workers, with or without ZeRO.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hpctrain.comm import allgather
from hpctrain.comm.types import chunk_bounds
from hpctrain.config import TrainConfig
from hpctrain.parallel.data import DataParallel
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.checkpointing import read_dense, write_dense
from hpctrain.train.optim import DenseOptimizer, clip_grad_norm, empty_state, state_groups

__all__ = ["ZeroOptimizer", "save_dense", "restore_dense"]


class ZeroOptimizer:
    """:class:`~hpctrain.train.optim.DenseOptimizer`'s interface, state sharded over
    ``dp``'s group; :meth:`step` is collective over it."""

    def __init__(self, dp: DataParallel, tc: TrainConfig) -> None:
        self.group = dp.group
        self.params = dp.params
        self.clip_norm = tc.clip_norm
        self.last_norm = float("nan")
        total = sum(p.numel() for p in self.params)
        bounds = chunk_bounds(total, self.group.size)
        lo, hi = int(bounds[self.group.rank]), int(bounds[self.group.rank + 1])
        self.shard = (lo, hi)
        pieces, offset = [], 0
        for p in self.params:
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:  # this parameter's elements [a, b) of the flat order are ours
                piece = torch.nn.Parameter(p.detach().view(-1)[a - offset: b - offset])
                piece.grad = p.grad.view(-1)[a - offset: b - offset]
                pieces.append(piece)
            offset += p.numel()
        self.inner = DenseOptimizer(pieces, tc.optimizer, momentum=tc.momentum,
                                    nesterov=tc.nesterov, weight_decay=tc.weight_decay,
                                    betas=tc.betas, eps=tc.eps)
        self.flat = torch.empty(total, dtype=torch.float32, device=self.params[0].device)
        self.pieces = pieces
        self.groups = state_groups(tc.optimizer, tc.momentum)
        self.kind, self.momentum = tc.optimizer, tc.momentum

    @property
    def state(self) -> list[torch.Tensor]:
        """This worker's shard of the optimizer state."""
        return self.inner.state

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Clip the reduced gradient (when asked), update this worker's chunk, and
        ``allgather`` the flat parameters over the group."""
        if self.clip_norm > 0:
            self.last_norm = clip_grad_norm(self.params, self.clip_norm)
        self.inner.step(lr)
        lo, hi = self.shard
        offset = 0
        for p in self.params:  # only our chunk is read by the allgather; copy just that
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                self.flat[a:b].copy_(p.view(-1)[a - offset: b - offset])
            offset += p.numel()
        allgather(self.flat, comm=self.group)
        offset = 0
        for p in self.params:
            p.copy_(self.flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()

    def gathered_state(self) -> list[torch.Tensor]:
        """The plain optimizer's state over all the parameters, assembled from every
        worker's shard (collective over the group: one ``allgather`` per tensor group)."""
        full = self.empty_full_state()
        lo, hi = self.shard
        n = len(self.pieces)
        for g in range(self.groups):
            flat = torch.zeros_like(self.flat)
            if n:
                flat[lo:hi].copy_(torch.cat([t.view(-1) for t in self.inner.state[g * n:
                                                                                  (g + 1) * n]]))
            allgather(flat, comm=self.group)
            offset = 0
            for t in full[g * len(self.params): (g + 1) * len(self.params)]:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
        if len(full) > self.groups * len(self.params):  # the step count, the same everywhere
            full[-1].copy_(self.inner.state[-1])
        return full

    def empty_full_state(self) -> list[torch.Tensor]:
        """Zeros shaped as :meth:`gathered_state`'s result, for a checkpoint to fill."""
        return empty_state(self.params, self.kind, self.momentum)

    @torch.no_grad()
    def keep_shard(self, full: list[torch.Tensor]) -> None:
        """Take this worker's shard of the unsharded state ``full``."""
        lo, _ = self.shard
        n, count = len(self.pieces), len(self.params)
        for g in range(self.groups):
            flat = torch.cat([t.reshape(-1) for t in full[g * count: (g + 1) * count]])
            offset = lo
            for t in self.inner.state[g * n: (g + 1) * n]:
                t.view(-1).copy_(flat[offset: offset + t.numel()])
                offset += t.numel()
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
