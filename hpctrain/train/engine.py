"""The dense side of a training step, as one protocol with one implementation per layout.

A :class:`DenseEngine` keeps the dense model in one way: data parallel by allreduce
(:class:`~hpctrain.train.dense_dp.ReplicatedDense`), on the parameter servers
(:class:`~hpctrain.train.dense_ps.ServerDense`), or tensor/pipeline parallel over the
grid (:class:`~hpctrain.train.dense_grid.GridDense`). The trainer runs every step the same
way: ``begin``, ``forward_backward`` over the step's micro-batches, ``reduce`` (gradients
and the step statistics), the verdict on non-finite values, ``update``, then the embedding
push (through ``outgoing``); evaluation calls ``predict`` per chunk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from embeddings.collection import Lookup
from hpctrain.data.types import Batch
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.checkpointing import read_dense, write_dense

__all__ = ["DenseEngine", "DenseTraffic", "Embed", "Reduced", "Rider", "StepWork"]

Embed = Callable[[Batch], torch.Tensor]
"""The embeddings ``[B, T, dim]`` of a batch's sparse ids (recording the lookup)."""


@dataclass
class StepWork:
    """This worker's share of one optimizer step, as the forward/backward leaves it."""

    step: int
    count: int = 0
    loss_sum: float = 0.0
    lookups: list[Lookup] = field(default_factory=list)
    compute_s: float = 0.0
    """Seconds of forward and backward (without the lookups)."""
    lookup_s: float = 0.0


class Rider(Protocol):
    """Float32 values that ride in the step's gradient reduction (the tiered store's hot-row
    gradients, :class:`~embeddings.hotsum.HotRider`): written after the backward, summed
    with the gradients, used with the dense update."""

    size: int
    """Values it carries (the same on every worker)."""

    def fill(self, lookups: list[Lookup], out: torch.Tensor) -> None:
        """Write this worker's values of the step into ``out`` (zeros)."""

    def apply(self, summed: torch.Tensor, lr: float, scale: float) -> None:
        """Use the sums over the workers (``scale`` is 1 / the step's samples) and leave
        ``summed`` zero."""


@dataclass(frozen=True)
class Reduced:
    """A step after its reduction: the samples its update is a mean over, the mean loss and
    the summed non-finite flags (0 when no worker that shares the update found one)."""

    samples: int
    loss: float
    flagged: float


@dataclass(frozen=True)
class DenseTraffic:
    """This rank's dense synchronisation so far, for the summary."""

    reduced_bytes: int = 0
    """Bytes handed to the dense gradient reductions (``comm.wire_dtype`` halves them)."""
    syncs: int = 0
    """Dense synchronisations: gradient reductions, or local SGD's parameter averages."""
    pipeline_bytes: int = 0
    """Bytes sent to neighbouring pipeline stages (``parallel.wire_dtype`` halves them)."""


class DenseEngine(ABC):
    """This rank's dense parameters and how a step updates them."""

    module: nn.Module
    """This rank's dense parameters (the whole DLRM, or one stage's shard)."""
    device: torch.device
    replica: int
    replicas: int
    """This rank's data-parallel position: it reads share ``replica`` of ``replicas``."""
    reduce_phase = "dense_sync"
    update_phase = "optimizer"
    """The phases :meth:`reduce` and :meth:`update` are timed as."""
    scores_here = True
    """Whether :meth:`predict` returns this rank's scores (else None, on ranks that only
    relay a pipeline)."""

    def begin(self) -> None:  # noqa: B027 - optional hook
        """Before a step or an evaluation: bring the dense parameters up to date."""

    @abstractmethod
    def forward_backward(self, work: StepWork, batches: Iterator[Batch], embed: Embed) -> None:
        """Forward and backward over the step's micro-batches, accumulating into ``work``."""

    @abstractmethod
    def reduce(self, work: StepWork) -> Reduced:
        """Sum gradients and statistics where the layout needs it; the dense gradients are
        then the mean over :attr:`Reduced.samples`, unless :meth:`update` scales them."""

    @abstractmethod
    def update(self, lr: float, skip: bool, scale: float) -> None:
        """Apply the step (not when ``skip``) and zero the gradients; ``scale`` is
        1 / :attr:`Reduced.samples`."""

    def outgoing(self, rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step's push to the embedding store: ``rows``, plus any dense rows."""
        return rows, grads

    @abstractmethod
    def predict(self, batch: Batch, embed: Embed) -> np.ndarray | None:
        """Probabilities of ``batch`` (None where :attr:`scores_here` is false)."""

    @abstractmethod
    def state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's (parameters, optimizer state)."""

    def save(self, folder: Path, lead: bool) -> list[ckpt.FileEntry]:
        """Write the dense part of the checkpoint in ``folder``: here worker 0 (``lead``)
        writes ``dense.h5``, the state being the same on every worker. Collective over the
        workers where a layout shards its state."""
        return [write_dense(folder / "dense.h5", *self.state())] if lead else []

    def restore(self, folder: Path) -> None:
        """Read the dense part of the checkpoint in ``folder`` (as :meth:`save` wrote it)."""
        read_dense(folder / "dense.h5", *self.state())

    def buckets(self) -> int:
        """Buckets the gradients are allreduced in (0 where they are not)."""
        return 0

    def gradient_bytes(self) -> int:
        """Bytes of dense gradient this rank keeps between steps."""
        return sum(p.grad.numel() * p.grad.element_size() for p in self.state()[0]
                   if p.grad is not None)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop the engine's comm thread and free the groups it made (collective over
        them)."""

    def traffic(self) -> DenseTraffic:
        """What the dense synchronisation moved (nothing where the layout has none)."""
        return DenseTraffic()

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)
