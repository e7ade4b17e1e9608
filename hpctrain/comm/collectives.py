"""The collective interface: numpy arrays and CPU torch tensors (zero-copy), in place.

Every function is collective over ``comm`` (a :class:`~hpctrain.comm.group.Group`) and
says which MPI or shared-memory operations it issues through the algorithm that serves it
(``algorithm="auto"`` picks by the cost model; ``comm.algorithm`` in the job forces one
for allreduce). Ops: sum, avg, max, min. Dtypes: float32, float64, float16 and bfloat16
(reduced with float32 accumulation), int32, int64. Any group size and buffer length.

Before any message, each call checks locally that the buffer is a contiguous, writable
array of a supported dtype and that op and root are valid, raising
:class:`~hpctrain.errors.CommError`. With ``comm.check`` on, ranks first agree (one small
``allgather``) on primitive, length, dtype, op and root, so a mismatch, or a local error on
one rank, raises the same error on every rank instead of hanging or corrupting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hpctrain.comm import alltoall as exchange
from hpctrain.comm import kernels, native, select, torchdist
from hpctrain.comm.algorithm import Algorithm
from hpctrain.comm.group import Group
from hpctrain.comm.types import DTYPES, OPS, DType, Request, chunk_bounds
from hpctrain.errors import CommError
from hpctrain.runtime.waiting import watching

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "gather",
           "scatter", "allgatherv", "alltoallv", "as_storage", "plan"]

Buffer = Any  # np.ndarray | torch.Tensor
_BY_NUM = {np.dtype(name).num: d for name, d in DTYPES.items() if name != "bfloat16"}
_CALL_CACHE = 64


def allreduce(buf: Buffer, op: str = "sum", *, comm: Group, algorithm: str = "auto") -> Buffer:
    """Reduce ``buf`` over every rank of ``comm`` and leave the result on all, in place;
    returns ``buf``."""
    return _run("allreduce", buf, op, 0, comm, algorithm)


def reduce_scatter(buf: Buffer, op: str = "sum", *, comm: Group,
                   algorithm: str = "auto") -> Buffer:
    """Reduce ``buf`` over ``comm``, keeping on rank ``r`` only its balanced chunk ``r``;
    returns that chunk (a view of ``buf``, whose other chunks are left undefined)."""
    _run("reduce_scatter", buf, op, 0, comm, algorithm)
    b = chunk_bounds(_numel(buf), comm.size)
    return buf.reshape(-1)[b[comm.rank]:b[comm.rank + 1]]


def allgather(buf: Buffer, *, comm: Group, algorithm: str = "auto") -> Buffer:
    """Fill every balanced chunk ``k`` of ``buf`` with rank ``k``'s chunk ``k``, in place
    (the inverse of :func:`reduce_scatter`); returns ``buf``."""
    return _run("allgather", buf, "sum", 0, comm, algorithm)


def broadcast(buf: Buffer, root: int = 0, *, comm: Group, algorithm: str = "auto") -> Buffer:
    """Copy ``root``'s ``buf`` into every rank's ``buf``; returns ``buf``."""
    return _run("broadcast", buf, "sum", root, comm, algorithm)


def reduce(buf: Buffer, op: str = "sum", root: int = 0, *, comm: Group,
           algorithm: str = "auto") -> Buffer:
    """Reduce ``buf`` over ``comm`` onto ``root`` in place (other ranks' ``buf`` is left
    undefined); returns ``buf``."""
    return _run("reduce", buf, op, root, comm, algorithm)


def gather(part: np.ndarray, root: int = 0, *, comm: Group) -> np.ndarray | None:
    """Concatenation of every rank's 1-D ``part`` on ``root`` (``None`` elsewhere):
    ``MPI_Gather`` of the lengths then ``MPI_Gatherv``."""
    _agree(comm, ("gather", -1, np.asarray(part).dtype.name, "", root), None)
    return native.gatherv(part, comm.comm, root)


def scatter(whole: np.ndarray | None, count: int, dtype: np.dtype | str, root: int = 0, *,
            comm: Group) -> np.ndarray:
    """Rank ``r``'s balanced chunk of ``root``'s 1-D ``whole`` of ``count`` elements:
    ``MPI_Scatterv``."""
    dtype = np.dtype(dtype)
    error = None
    if comm.rank == root and (whole is None or whole.size != count or whole.dtype != dtype):
        error = f"scatter: root {root} must pass {count} elements of {dtype}"
    _agree(comm, ("scatter", count, dtype.name, "", root), error)
    if error:
        raise CommError(error)
    return native.scatterv(None if whole is None else np.ascontiguousarray(whole), count,
                           dtype, comm.comm, root)


def allgatherv(part: np.ndarray, *, comm: Group) -> np.ndarray:
    """Concatenation in rank order of every rank's ``part`` (any leading length):
    ``MPI_Allgather`` of the lengths then ``MPI_Allgatherv``."""
    _agree(comm, ("allgatherv", -1, np.asarray(part).dtype.name, "", 0), None)
    return native.allgatherv(part, comm.comm)


def alltoallv(send: np.ndarray, counts: np.ndarray, *, comm: Group, algorithm: str = "auto"
              ) -> tuple[np.ndarray, np.ndarray]:
    """Send ``counts[i]`` rows of ``send`` (in rank order) to rank ``i``; returns the rows
    received, in source order, and the count from each source: ``MPI_Allgather`` of the
    counts, then the exchange the cost model picks (:mod:`hpctrain.comm.alltoall`)."""
    error = None
    if len(counts) != comm.size or int(np.sum(counts)) != len(send):
        error = (f"alltoallv: rank {comm.rank} passed {len(counts)} counts summing to "
                 f"{int(np.sum(counts))} for {len(send)} rows; need {comm.size} counts "
                 f"summing to the rows")
    _agree(comm, ("alltoallv", -1, np.asarray(send).dtype.name, "", 0), error)
    if error:
        raise CommError(error)
    return exchange.alltoallv(send, counts, comm=comm, algorithm=algorithm)


def as_storage(buf: Buffer, primitive: str) -> tuple[Any, DType, str]:
    """The array the kernels and MPI see for ``buf`` (a flat view, 16-bit floats as their
    ``uint16`` bits), its :class:`DType` and its device; :class:`CommError` otherwise."""
    if isinstance(buf, np.ndarray):
        dtype = _BY_NUM.get(buf.dtype.num) or DTYPES.get(buf.dtype.name)
        if dtype is not None and buf.flags.c_contiguous and buf.flags.writeable:
            arr = buf if buf.ndim == 1 else buf.reshape(-1)
            return (arr if dtype.kind == kernels.ARITH else arr.view(np.uint16)), dtype, "cpu"
        what, shape = f"numpy array of {buf.dtype}", buf.shape
        contiguous, writable = buf.flags.c_contiguous, buf.flags.writeable
    elif isinstance(buf, torch.Tensor):
        dtype = DTYPES.get(str(buf.dtype).removeprefix("torch."))
        contiguous, writable = buf.is_contiguous(), True
        if dtype is not None and contiguous:
            t = buf.detach().reshape(-1)
            if t.device.type != "cpu":
                return t, dtype, t.device.type
            if dtype.kind != kernels.ARITH:
                return t.view(torch.int16).numpy().view(np.uint16), dtype, "cpu"
            return t.numpy(), dtype, "cpu"
        what, shape = f"tensor of {buf.dtype}", buf.shape
    else:
        raise CommError(f"{primitive}: expected a numpy array or a torch tensor, got "
                        f"{type(buf).__name__}")
    if dtype is None:
        raise CommError(f"{primitive}: {what}: dtype not supported (supported: "
                        f"{', '.join(DTYPES)})")
    if not contiguous:
        raise CommError(f"{primitive}: {what} of shape {tuple(shape)} is not contiguous; "
                        f"pass a contiguous copy")
    raise CommError(f"{primitive}: {what} is read-only" if not writable else
                    f"{primitive}: {what} cannot be used")


def plan(group: Group, req: Request, algorithm: str) -> Algorithm:
    """The algorithm serving ``req`` (checked and chosen once per distinct call, cached)."""
    if req.op not in OPS:
        raise CommError(f"{req.primitive}: unknown op {req.op!r}; ops are: {', '.join(OPS)}")
    if req.op == "avg" and not req.dtype.floating:
        raise CommError(f"{req.primitive}: op 'avg' needs a floating dtype, got "
                        f"{req.dtype.name}")
    if not 0 <= req.root < group.size:
        raise CommError(f"{req.primitive}: root {req.root} outside [0, {group.size})")
    forced = algorithm
    if algorithm == "auto" and req.primitive == "allreduce":
        forced = group.config.algorithm
    try:
        return select.choose(req, group.layout, group.params, forced)
    except CommError as exc:
        if forced != algorithm:
            raise CommError(f"comm.algorithm = {forced!r}: {exc}") from None
        raise CommError(f"{req.primitive}: {exc}") from None


def _run(primitive: str, buf: Buffer, op: str, root: int, group: Group,
         algorithm: str) -> Buffer:
    if type(group) is not Group:
        raise CommError(f"{primitive}: comm must be an hpctrain.comm.Group, got "
                        f"{type(group).__name__}")
    if group.config.check:
        _precheck(primitive, buf, op, root, group, algorithm)
    # Repeated calls on the same buffer skip the checks and the choice: the entry holds
    # the buffer (so its id stays unique) and is valid while its memory is unchanged.
    entry = group.calls.get((id(buf), primitive, op, root, algorithm))
    if entry is None or entry[0] is not buf or entry[1] != _identity(buf):
        entry = _prepare(primitive, buf, op, root, group, algorithm)
        if entry is None:
            return buf
        if len(group.calls) >= _CALL_CACHE:
            group.calls.clear()
        group.calls[(id(buf), primitive, op, root, algorithm)] = entry
    with watching(primitive, group.comm):
        entry[2](entry[3])
    return buf


def _identity(buf: Buffer) -> Any:
    """What must not change for a cached call to stay valid."""
    if isinstance(buf, np.ndarray):
        return buf.dtype.num
    return buf.data_ptr(), buf.numel(), buf.dtype, buf.is_contiguous()


def _prepare(primitive: str, buf: Buffer, op: str, root: int, group: Group,
             algorithm: str) -> tuple[Any, ...] | None:
    """Check ``buf`` and choose the algorithm; ``None`` when the call was served by
    staging a CUDA tensor through host memory (without NCCL, or for a primitive NCCL's
    algorithm does not serve: ZeRO's allgather and reduce-scatter)."""
    arr, dtype, device = as_storage(buf, primitive)
    if device != "cpu" and (not torchdist.available("nccl")
                            or primitive not in torchdist.TorchDist.primitives):
        host = arr.cpu()
        _run(primitive, host, op, root, group, algorithm)
        arr.copy_(host)
        return None
    resident = device == "cpu" and group.has_residents and group.resident_of(arr) is not None
    count = arr.size if device == "cpu" else arr.numel()
    plan_key = (primitive, count, dtype.name, op, root, resident, device, algorithm)
    runner = group.plans.get(plan_key)
    if runner is None:
        req = Request(primitive, count, dtype, op, root, resident, device)
        runner = group.plans[plan_key] = _runner(req, plan(group, req, algorithm), group)
    return buf, _identity(buf), runner, arr


def _runner(req: Request, impl: Algorithm, group: Group) -> Callable[[Any], None]:
    """``impl`` bound to ``req`` (what is left to do per call), then ``avg``'s division."""
    if group.size == 1 or req.count == 0:
        return lambda arr: None
    run = impl.bind(req, group)
    if req.op != "avg":
        return run

    def run_and_average(arr: Any) -> None:
        run(arr)
        _average(req, arr, group)
    return run_and_average


def _precheck(primitive: str, buf: Buffer, op: str, root: int, group: Group,
              algorithm: str) -> None:
    """The checking mode: local checks on every rank, then agreement on the call."""
    error, meta = None, (primitive, -1, "?", op, root)
    try:
        arr, dtype, device = as_storage(buf, primitive)
        meta = (primitive, arr.size if device == "cpu" else arr.numel(), dtype.name, op, root)
        plan(group, Request(primitive, meta[1], dtype, op, root, False, device), algorithm)
    except CommError as exc:
        error = str(exc)
    _agree(group, meta, error)


def _agree(group: Group, meta: tuple[Any, ...], error: str | None) -> None:
    """With ``comm.check``: ``allgather`` of every rank's call and local error; raise the
    same :class:`CommError` on every rank when one failed or the calls differ."""
    if not group.config.check or group.size == 1:
        if error:
            raise CommError(error)
        return
    with watching("agree", group.comm):
        calls = group.comm.allgather((meta, error))
    failed = [(r, e) for r, (_, e) in enumerate(calls) if e]
    if failed:
        rank, message = failed[0]
        raise CommError(f"rank {rank}: {message}")
    if any(m != calls[0][0] for m, _ in calls):
        def show(m: tuple[Any, ...]) -> str:
            count = "" if m[1] < 0 else f"{m[1]} x "
            tail = f" {m[3]}" if m[3] else ""
            at = f" root {m[4]}" if m[0] in ("broadcast", "reduce", "gather", "scatter") else ""
            return f"{m[0]} of {count}{m[2]}{tail}{at}"

        raise CommError("ranks disagree on a collective: " + "; ".join(
            f"rank {r}: {show(m)}" for r, (m, _) in enumerate(calls)))


def _average(req: Request, arr: np.ndarray, group: Group) -> None:
    """Divide the summed part of ``arr`` by the group size (the ``avg`` op)."""
    if req.primitive == "reduce" and group.rank != req.root:
        return
    if req.primitive == "reduce_scatter":
        b = chunk_bounds(arr.size, group.size)
        arr = arr[b[group.rank]:b[group.rank + 1]]
    if req.device == "cpu":
        kernels.divide(arr, group.size, req.dtype.kind)
    else:
        arr.div_(group.size)


def _numel(buf: Buffer) -> int:
    return buf.size if isinstance(buf, np.ndarray) else buf.numel()

