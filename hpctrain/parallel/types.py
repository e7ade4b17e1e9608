"""Interfaces of the parallel package: the group of ranks on one grid axis.

Tensor-parallel layers and pipeline stages talk to their peers only through a
:class:`Group`, so the same layer or schedule runs over MPI (CPU) or torch.distributed
(NCCL on CUDA, gloo on CPU); :mod:`hpctrain.parallel.groups` holds both implementations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["Group", "Pending"]


class Pending(Protocol):
    """A posted point-to-point transfer; ``wait`` returns once its buffer may be used."""

    def wait(self) -> object: ...


class Group(ABC):
    """Ranks ``0 .. size-1`` of one axis of the grid (this rank is ``rank``).

    Collectives are called by every member with tensors of the same shape and dtype; they
    work in place on ``tensor`` and return it.
    """

    rank: int
    size: int

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Elementwise ``sum`` or ``max`` of ``tensor`` over the group, in place."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Concatenation along the last dimension of every member's ``tensor``, whose last
        dimension is ``sizes[rank]`` (sizes may differ by member)."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """``root``'s ``tensor`` on every member, in place."""

    @abstractmethod
    def post(self, sends: Sequence[tuple[torch.Tensor, int]],
             recvs: Sequence[tuple[torch.Tensor, int]]) -> list[Pending]:
        """Start sending each ``(tensor, peer)`` of ``sends`` and receiving into each of
        ``recvs`` together (one batch, so neighbours exchanging both ways cannot deadlock);
        returns the sends' handles, then the receives'."""
