"""torch.distributed as one more algorithm family: gloo on CPU, NCCL for CUDA tensors.

The group's process group (:meth:`~hpctrain.comm.group.Group.torch_group`) comes from the
toolkit's one rendezvous, :func:`hpctrain.runtime.torchdist.process_group`; collectives then
run on the process group, not on MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hpctrain.comm.algorithm import Algorithm
from hpctrain.comm.native import library_cost
from hpctrain.comm.types import Cost, CostParams, Layout, Request
from hpctrain.errors import CommError

if TYPE_CHECKING:
    from hpctrain.comm.group import Group

__all__ = ["TorchDist", "TORCH", "available", "as_tensor"]

_TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}


def available(backend: str) -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    return dist.is_gloo_available() if backend == "gloo" else (
        dist.is_nccl_available() and torch.cuda.is_available())


def as_tensor(arr: np.ndarray | torch.Tensor, dtype_name: str) -> torch.Tensor:
    """The tensor a process group reduces: ``arr`` itself, or a zero-copy view of it."""
    if isinstance(arr, torch.Tensor):
        return arr
    if dtype_name in ("float16", "bfloat16"):
        return torch.from_numpy(arr.view(np.int16)).view(_TORCH_DTYPES[dtype_name])
    return torch.from_numpy(arr)


class TorchDist(Algorithm):
    """``allreduce`` and ``broadcast`` through a torch.distributed process group made over
    ``group.comm`` (gloo for host memory, NCCL for CUDA tensors). 16-bit floats are
    reduced in their own precision, as the backend does."""

    name = "torch"
    primitives = frozenset({"allreduce", "broadcast"})

    def enabled(self, req: Request, layout: Layout) -> bool:
        if req.primitive not in self.primitives:
            return False
        if req.device == "cpu":
            return available("gloo")
        return req.device == "cuda" and available("nccl")

    def cost(self, req: Request, layout: Layout, params: CostParams) -> Cost:
        return library_cost(params.torch, req, layout, params)

    def run(self, req: Request, arr: np.ndarray | torch.Tensor, group: Group) -> None:
        import torch.distributed as dist

        pg = group.torch_group("nccl" if req.device == "cuda" else "gloo")
        tensor = as_tensor(arr, req.dtype.name)
        if req.primitive == "broadcast":
            opts = dist.BroadcastOptions()
            opts.rootRank = req.root
            pg.broadcast([tensor], opts).wait()
            return
        ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}
        opts = dist.AllreduceOptions()
        opts.reduceOp = ops[req.op]
        work = pg.allreduce([tensor], opts)
        if not work.wait():
            raise CommError(f"torch.distributed allreduce failed on rank {group.rank}")


TORCH = TorchDist()
