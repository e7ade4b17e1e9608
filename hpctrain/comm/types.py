"""Interfaces and small value types of the collective layer.

Values only: element types, requests, the alpha-beta-gamma :class:`Cost` and its
:class:`CostParams` (``hpctrain bench calibrate`` measures them), the group's
:class:`Layout`. The :class:`~hpctrain.comm.algorithm.Algorithm` interface lives in its own
module because its methods take a :class:`~hpctrain.comm.group.Group`, which is built from
these values: keeping the two apart keeps the package's imports acyclic.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from hpctrain.comm import kernels
from hpctrain.errors import CommError
from hpctrain.runtime.topology import shard_range

__all__ = ["OPS", "DType", "DTYPES", "Cost", "Link", "CostParams", "Layout",
           "Request", "chunk_bounds"]

OPS = ("sum", "avg", "max", "min")
OP_KERNEL = {"sum": kernels.SUM, "avg": kernels.SUM, "max": kernels.MAX, "min": kernels.MIN}
"""``avg`` reduces as a sum; the dispatcher divides by the group size afterwards."""


@dataclass(frozen=True)
class DType:
    """A supported element type: its name, what the kernels see, and how to read it."""

    name: str
    storage: np.dtype  # the array the kernels and MPI see (16-bit floats as uint16 bits)
    kind: int  # kernels.ARITH, HALF or BHALF
    floating: bool

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize


DTYPES = {d.name: d for d in (
    DType("float32", np.dtype(np.float32), kernels.ARITH, True),
    DType("float64", np.dtype(np.float64), kernels.ARITH, True),
    DType("float16", np.dtype(np.uint16), kernels.HALF, True),
    DType("bfloat16", np.dtype(np.uint16), kernels.BHALF, True),
    DType("int32", np.dtype(np.int32), kernels.ARITH, False),
    DType("int64", np.dtype(np.int64), kernels.ARITH, False),
)}


@dataclass(frozen=True)
class Cost:
    """Predicted seconds of one collective, split by where they go (TorchRec's ``Perf``)."""

    latency_s: float = 0.0  # alpha terms: messages, synchronisations, calls
    transfer_s: float = 0.0  # beta terms: bytes moved
    compute_s: float = 0.0  # gamma terms: bytes reduced

    @property
    def seconds(self) -> float:
        return self.latency_s + self.transfer_s + self.compute_s

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.latency_s + other.latency_s, self.transfer_s + other.transfer_s,
                    self.compute_s + other.compute_s)


@dataclass(frozen=True)
class Link:
    """``alpha`` seconds per message (or synchronisation) plus ``beta`` seconds per byte."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class CostParams:
    """Machine parameters of the cost model (defaults: medians of three ``hpctrain bench
    calibrate`` runs on two ranks of this project's 2-core VM with the MPICH wheel,
    ``shm`` again once the copies into the shared window became streaming stores, the
    ``exchange_*`` lines all on one day, 2026-12-06, when the single-copy exchange came,
    ``single_copy`` later that day;
    ``net`` is a guess for a cluster network).

    ``p2p`` is a step of the point-to-point algorithms between ranks of a node (ring, tree,
    recursive: the message and the algorithm's Python), ``net`` a message between nodes,
    ``shm`` a synchronisation of the node's shared window (as an allreduce pays it) and a
    memory copy into it, ``gamma`` the reduction time per input byte. ``native``
    and ``torch`` fit the whole library allreduce as ``alpha * ceil(log2 p) +
    beta * 2 (p-1)/p * bytes``, since their internal algorithm is not ours to model
    (across nodes they are taken to be no faster than ``net``).
    ``exchange_*`` price the all-to-all's exchanges, timed whole through
    :func:`~hpctrain.comm.alltoall.alltoallv` on 8 bytes and 64 KiB-4 MiB (Python's share
    included, which at small sizes is most of it; across nodes ``net`` is a floor):
    ``shm`` per call and per byte through the busiest rank (in and out, its own segment
    once), ``cma`` (single copy) per call and per byte the busiest rank sends or receives
    to or from the others plus the largest own segment, ``p2p`` (pairwise, one node) per
    round and per byte of the rounds' messages and the rank's own copy, ``native``
    (``MPI_Alltoallv``) per peer and per byte to or from the busiest rank.
    ``single_copy`` prices the shared window's single-copy allreduce
    (:func:`~hpctrain.comm.window.allreduce_single_copy`), timed whole at 1 and 4 MiB: per call
    and per byte of ``2 (p-1)/p * bytes``, its reduction included. Its ``alpha`` is less a
    latency than the fit of where it loses: reading another process's pages costs more per
    byte than the window path's second copy while that copy stays in cache (it measured
    1.2-2x the window path's time from 64 KiB to 1 MiB at 2 ranks and to 2 MiB at 4, and
    0.65-0.95x at 4-8 MiB).
    ``oversubscribed`` multiplies every latency when more ranks than cores share a node
    (waiting for a descheduled peer dominates there): the median ratio of a 4-rank
    calibration's latencies on the same VM to these (3.9, of 1.8-10 over the seven links,
    2026-12-06; it was 20, which kept the single-copy paths off at 4 ranks to 256 KiB
    all-to-all and 4.7 MB allreduce, where they measured faster from 64-256 KiB).
    """

    p2p: Link = Link(4.9e-6, 1.33e-10)
    net: Link = Link(2e-5, 1.0e-9)
    shm: Link = Link(2.8e-6, 4.75e-11)
    gamma: float = 7.5e-11
    native: Link = Link(5.2e-6, 1.74e-10)
    torch: Link = Link(2.5e-4, 2.0e-9)
    exchange_shm: Link = Link(3.05e-6, 8.45e-11)
    exchange_cma: Link = Link(4.17e-6, 7.97e-11)
    exchange_p2p: Link = Link(1.29e-5, 8.73e-11)
    exchange_native: Link = Link(7.51e-6, 2.16e-10)
    single_copy: Link = Link(5.44e-5, 8.47e-11)
    oversubscribed: float = 4.0
    source: str = field(default="built-in defaults", compare=False)

    def latency(self, alpha: float, layout: Layout) -> float:
        """``alpha`` as ``layout``'s ranks pay it: times ``oversubscribed`` where they
        outnumber the cores."""
        return alpha * (self.oversubscribed if layout.oversubscribed else 1.0)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("source")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> CostParams:
        """Parameters from a calibration file's ``params`` table (missing keys: defaults)."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "source" or f.name not in data:
                continue
            value = data[f.name]
            try:
                kwargs[f.name] = Link(float(value["alpha"]), float(value["beta"])) \
                    if isinstance(f.default, Link) else float(value)
            except (TypeError, KeyError, ValueError):
                raise CommError(f"{source}: params.{f.name} must be "
                                f"{'{alpha, beta}' if isinstance(f.default, Link) else 'a number'}"
                                f", got {value!r}") from None
        return cls(**kwargs, source=source)


@dataclass(frozen=True)
class Layout:
    """Ranks of a group and how they sit on nodes (possibly a layout forced for tests)."""

    size: int
    rank: int
    local_size: int
    local_rank: int
    nodes: int
    uniform: bool  # every node holds local_size ranks
    oversubscribed: bool = False  # more ranks than cores on this rank's machine
    single_copy: bool = False  # a rank can read its node's other ranks' memory (hpctrain.comm.cma)

    @property
    def log2(self) -> int:
        return math.ceil(math.log2(self.size)) if self.size > 1 else 0


@dataclass(frozen=True)
class Request:
    """One collective call as the selector sees it (also the key of the plan cache)."""

    primitive: str
    count: int
    dtype: DType
    op: str = "sum"
    root: int = 0
    resident: bool = False  # the buffer lies in the group's shared window
    device: str = "cpu"

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


@functools.lru_cache(maxsize=256)
def chunk_bounds(count: int, parts: int) -> tuple[int, ...]:
    """Boundaries of the ``parts`` balanced chunks of ``range(count)``
    (:func:`~hpctrain.runtime.topology.shard_range`): chunk ``i`` is
    ``[bounds[i], bounds[i+1])``. Every primitive splits buffers this way."""
    return (*(shard_range(count, parts, i)[0] for i in range(parts)), count)
