"""Data parallelism for the dense model: all gradients in one flat buffer, one allreduce.

Each parameter's ``.grad`` is a view into a single contiguous buffer, so autograd
accumulates into it in place and a step needs one allreduce with no copies in or out. The
buffer carries ``extra`` trailing slots for step statistics (sample count, loss sum) that
ride along with the gradients for free.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from hpctrain.comm.native import allreduce_sum

__all__ = ["DataParallel"]


class DataParallel:
    """Gradient averaging of ``module`` over ``comm`` (every rank runs the same module)."""

    def __init__(self, module: nn.Module, comm: MPI.Intracomm, extra: int = 2) -> None:
        self.comm = comm
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.extra = extra
        device = self.params[0].device
        self.flat = torch.zeros(self.numel + extra, dtype=torch.float32, device=device)
        self._host = self.flat.numpy() if device.type == "cpu" else None
        offset = 0
        for p in self.params:
            p.grad = self.flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self._broadcast_parameters()

    def _broadcast_parameters(self) -> None:
        """``MPI_Bcast`` of all parameters from rank 0, so replicas start identical."""
        if self.comm.Get_size() == 1:
            return
        with torch.no_grad():
            packed = torch.cat([p.detach().reshape(-1).cpu() for p in self.params]).numpy()
            self.comm.Bcast(packed, root=0)
            offset = 0
            for p in self.params:
                p.copy_(torch.from_numpy(packed[offset: offset + p.numel()]).view_as(p))
                offset += p.numel()

    def allreduce(self, stats: list[float]) -> np.ndarray:
        """Sum gradients and ``stats`` over ``comm`` (one ``MPI_Allreduce``); returns the
        summed stats."""
        tail = self.flat[self.numel:]
        tail.copy_(torch.tensor(stats, dtype=torch.float32))
        if self._host is not None:
            allreduce_sum(self._host, self.comm)
        else:
            host = self.flat.cpu().numpy()
            allreduce_sum(host, self.comm)
            self.flat.copy_(torch.from_numpy(host))
        return tail.cpu().numpy().astype(np.float64)

    def scale(self, factor: float) -> None:
        self.flat[: self.numel].mul_(factor)

    def zero(self) -> None:
        self.flat.zero_()
