"""Dense parameters on the parameter servers (``ps.mode = "full"``, the Petuum setting).

The model's parameters, flattened, become one more table ("dense") of rows as wide as the
embeddings, so the sync model governs them exactly as it governs the embedding tables:
every step a worker pulls all dense rows, computes, and pushes their gradients with its
embedding gradients in the same push (one push per step is one clock tick). The servers
update them with ``train.optimizer`` per value (:func:`~hpctrain.train.optim.dense_table_optimizer`:
Adagrad with one accumulator per parameter, as in hybrid mode, not the tables' one per row).
Workers never allreduce: they meet only through the servers.

:class:`ServerDense` is the dense engine of this mode. Each worker divides its gradients by
the global batch's exact sample count, which every worker knows without a message (the
global batch is always whole: :func:`~hpctrain.data.sharding.local_slice`), and judges its
own contribution alone (:mod:`hpctrain.train.nonfinite`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from mpi4py import MPI

from embeddings.tables import TableLayout
from embeddings.types import TableSpec
from hpctrain.models.dlrm import DLRM
from hpctrain.runtime.waits import Wait, wait_all
from hpctrain.train.dense_dp import LocalDense
from hpctrain.train.engine import Reduced, StepWork
from hpctrain.train.nonfinite import NonFiniteGuard
from ps.client import PSClient

__all__ = ["DenseOnServers", "ServerDense", "with_dense_table"]

DENSE_TABLE = "dense"


def with_dense_table(layout: TableLayout, numel: int) -> TableLayout:
    """``layout`` plus a last table holding ``numel`` dense values in rows of its width."""
    rows = max(1, math.ceil(numel / layout.dim))
    return TableLayout([*layout.specs, TableSpec(DENSE_TABLE, rows, layout.dim)])


class DenseOnServers:
    def __init__(self, params: list[torch.nn.Parameter], client: PSClient,
                 layout: TableLayout) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.client = client
        first = int(layout.offsets[-1])
        self.rows = np.arange(first, first + int(layout.sizes[-1]), dtype=np.int64)
        self.dim = layout.dim

    def place_initial(self, comm: MPI.Intracomm) -> None:
        """Worker 0 writes the initial parameters to the servers; the workers' barrier
        (``Ibarrier`` over ``comm``) keeps everyone from reading them earlier."""
        if comm.Get_rank() == 0:
            flat = torch.cat([p.detach().reshape(-1).cpu() for p in self.params]).numpy()
            self.client.write(self.rows, self._as_rows(flat))
        wait_all([comm.Ibarrier()], Wait("barrier", comm))

    def pull(self) -> None:
        """Copy the servers' current dense values into the model."""
        flat = torch.from_numpy(self.client.pull(self.rows).reshape(-1)[: self.numel])
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()

    def gradients(self, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """(rows, gradient rows) of the dense table, multiplied by ``scale``."""
        flat = torch.cat([p.grad.detach().reshape(-1).cpu() for p in self.params]).numpy()
        flat *= np.float32(scale)
        return self.rows, self._as_rows(flat)

    def _as_rows(self, flat: np.ndarray) -> np.ndarray:
        rows = np.zeros((len(self.rows), self.dim), dtype=np.float32)
        rows.reshape(-1)[: len(flat)] = flat
        return rows


class ServerDense(LocalDense):
    """The dense model pulled from the servers before every step, its gradients pushed with
    the embedding rows. ``samples`` is the global sample count of one step."""

    reduce_phase = update_phase = "push"  # the reduction is the servers' work

    def __init__(self, model: DLRM, guard: NonFiniteGuard, accumulate: int,
                 comm: MPI.Intracomm, dense: DenseOnServers, samples: int,
                 device: torch.device) -> None:
        super().__init__(model, guard, accumulate, comm.Get_rank(), comm.Get_size(), device)
        self.dense, self.samples = dense, samples
        self._pending: tuple[np.ndarray, np.ndarray] | None = None

    def begin(self) -> None:
        self.dense.pull()

    def reduce(self, work: StepWork) -> Reduced:
        """Nothing to sum: this worker's own verdict, the known global count."""
        self.guard.gradients(self.module.named_parameters())
        return Reduced(self.samples, work.loss_sum / max(work.count, 1), self.guard.flag)

    def update(self, lr: float, skip: bool, scale: float) -> None:
        """The servers apply the step: keep the scaled gradient rows for the push (none
        when this worker's share is dropped)."""
        self._pending = None if skip else self.dense.gradients(scale)
        self.module.zero_grad()

    def outgoing(self, rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._pending is None:
            return rows, grads
        (dense_rows, dense_grads), self._pending = self._pending, None
        return np.concatenate([rows, dense_rows]), np.concatenate([grads, dense_grads])

    def state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The parameters as last pulled; the optimizer state lives on the servers."""
        return self.dense.params, []
