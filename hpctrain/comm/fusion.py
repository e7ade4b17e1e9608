"""Tensor fusion with overlap: gradients as views into bucketed flat buffers, each bucket's
allreduce started by autograd hooks as soon as its last gradient is ready.

Parameters are grouped by dtype and device; each group gets one flat buffer and every
parameter's ``.grad`` is a view into it, so autograd accumulates in place and no copy
into a fusion buffer is ever made. Parameters are laid out in reverse order (backward
produces the last layers' gradients first) and cut into buckets of about ``bucket_bytes``
contiguous bytes. Optional ``extra`` float32 slots at the start of the first bucket carry
step statistics (sample count, loss sum) in the same reduction, and an optional ``tail`` of
float32 slots at the end of the first buffer carries values that are not parameters' gradients
(the tiered store's hot-row gradients, :mod:`embeddings.tiered`): its bucket also waits for
:meth:`FusedGradients.tail_ready`. Its owner writes and clears it; :meth:`~FusedGradients.scale`,
:meth:`~FusedGradients.zero` and :meth:`~FusedGradients.finite` leave it alone.

Protocol of one step: :meth:`FusedGradients.arm` before the last backward of the step
enables the hooks (earlier micro-batches only accumulate); a parameter's
post-accumulate-grad hook counts it done; a bucket whose parameters are all done is
launched once every earlier bucket has been (the same order on every rank, as the
collectives require); later hooks advance launched buckets; :meth:`FusedGradients.finish`
launches what is left and waits for everything.

How a bucket is reduced: when the workers fit one node (or, hierarchically, one node per
slice) and the buffer is float32/float64 on the CPU, it lives in the node's shared window
(:meth:`Group.resident`) and a :class:`~hpctrain.comm.window.ResidentAllreduce` reduces it
with no copy, advanced from the hooks without blocking. Otherwise a single communication
thread runs each bucket's :func:`~hpctrain.comm.collectives.allreduce` in launch order
(needs ``MPI_THREAD_MULTIPLE``; without it buckets are reduced at launch). Over one rank
there is nothing to sum: no hook is registered and a launch only marks the bucket done. With
a 16-bit ``wire`` (``comm.wire_dtype``) each bucket travels as bf16/fp16 through a
:class:`~hpctrain.comm.wire.WireAllreduce` (the extra slots stay float32) and the buffers
stay out of the shared window. :attr:`FusedGradients.reduced_bytes` counts the bytes handed
to the collectives.

With ``runtime.trace`` on, each bucket's reduction is a span ``reduce`` from its launch to
the moment its completion is seen, on a track of its own (``bucket N``), and the comm
thread's work a span on that thread (:mod:`hpctrain.runtime.trace`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.comm import ring, window
from hpctrain.comm.collectives import allreduce, as_storage
from hpctrain.comm.group import Group
from hpctrain.comm.types import OP_KERNEL
from hpctrain.comm.wire import WireAllreduce
from hpctrain.errors import CommError
from hpctrain.runtime import trace
from hpctrain.runtime.waiting import watching

__all__ = ["FusedGradients", "Bucket"]


@dataclass
class Bucket:
    """Contiguous range ``[lo, hi)`` of one flat buffer and the parameters inside it."""

    buffer: int
    lo: int
    hi: int
    params: list[torch.nn.Parameter] = field(default_factory=list)
    pending: int = 0
    tail: bool = False
    """Whether the buffer's tail ends this bucket (one more input to wait for)."""
    handle: Any = None
    resident_op: window.ResidentAllreduce | None = None
    wire_op: WireAllreduce | None = None
    launched_at: float | None = None
    """When the bucket's reduction was launched, while tracing and until its end is seen."""


class FusedGradients:
    """Bucketed, overlapped gradient allreduce (sum) of ``params`` over ``group.comm``."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: Group, bucket_bytes: int,
                 extra: int = 0, resident: bool = True, overlap: bool = True,
                 wire: str = "float32", tail: int = 0) -> None:
        self.group = group
        self.reduced_bytes = 0
        self.reductions = 0  # steps reduced (finish calls)
        resident = resident and wire == "float32"
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise CommError("FusedGradients: no parameter requires a gradient")
        self.extra = extra
        self.tail_size = tail
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in reversed(self.params):
            groups.setdefault((p.dtype, p.device), []).append(p)
        first = next(iter(groups))[0]
        if extra and first not in (torch.float32, torch.float64):
            raise CommError(f"FusedGradients: extra slots need float32 or float64 "
                            f"parameters first, got {first}")
        if tail and (first != torch.float32 or wire != "float32"):
            raise CommError(f"FusedGradients: a tail travels as float32, in float32 parameters' "
                            f"buffer; got {first} parameters first, wire {wire}")
        self.buckets: list[Bucket] = []
        for index, ps in enumerate(groups.values()):
            offset = extra if index == 0 else 0
            bucket = Bucket(index, 0, offset)
            for p in ps:
                offset += p.numel()
                bucket.params.append(p)
                bucket.hi = offset
                if (bucket.hi - bucket.lo) * p.element_size() >= bucket_bytes:
                    self.buckets.append(bucket)
                    bucket = Bucket(index, offset, offset)
            if bucket.params:
                self.buckets.append(bucket)
            if index == 0 and tail:
                self.buckets[-1].hi += tail
                self.buckets[-1].tail = True
        self._agree_on_layout(groups)
        self.buffers: list[torch.Tensor] = []
        self.residents: list[window.Resident | None] = []
        for index, ((dtype, device), ps) in enumerate(groups.items()):
            offset = extra if index == 0 else 0
            flat = self._allocate(offset + sum(p.numel() for p in ps)
                                  + (tail if index == 0 else 0), dtype, device,
                                  resident, len(self.buckets))
            self.buffers.append(flat)
            for p in ps:
                p.grad = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
        self._bucket_of: dict[int, Bucket] = {}
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[id(p)] = b
        self._grad_ptrs = {id(p): p.grad.data_ptr() for p in self.params}
        for index, b in enumerate(self.buckets):
            b.resident_op = self._resident_op(index, b)
            view = self.buffers[b.buffer][b.lo: b.hi]
            if wire != "float32" and view.dtype == torch.float32:
                b.wire_op = WireAllreduce(view, group, wire, extra if b is self.buckets[0]
                                          else 0)
        self._ordered = group.layout.nodes > 1
        self._alone = group.size == 1  # a sum over one rank is the buffer itself
        self._armed = False
        self._launched = 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-comm") if \
            MPI.Query_thread() == MPI.THREAD_MULTIPLE else None
        if overlap and not self._alone:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._hook)

    def _agree_on_layout(self, groups: dict[Any, list[torch.nn.Parameter]]) -> None:
        """``allgather`` of the bucket layout: ranks that would reduce different buffers
        raise the same error instead of corrupting each other's gradients."""
        mine = (tuple((str(dtype), str(device), sum(p.numel() for p in ps))
                      for (dtype, device), ps in groups.items()), self.tail_size,
                tuple((b.buffer, b.lo, b.hi) for b in self.buckets))
        with watching("agree", self.group.comm):
            layouts = self.group.comm.allgather(mine)
        if any(layout != layouts[0] for layout in layouts):
            raise CommError("FusedGradients: ranks disagree on the gradient layout ((dtype, "
                            "device, elements) per buffer): " + "; ".join(
                                f"rank {r}: {layout[0]}" for r, layout in enumerate(layouts)))

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device, resident: bool,
                  slots: int) -> torch.Tensor:
        layout = self.group.layout
        if resident and device.type == "cpu" and dtype in (torch.float32, torch.float64) and \
                (layout.nodes == 1 or layout.uniform):
            array = self.group.resident(numel, str(dtype).removeprefix("torch."), slots)
            self.residents.append(self.group.resident_of(array))
            return torch.from_numpy(array)
        self.residents.append(None)
        return torch.zeros(numel, dtype=dtype, device=device)

    # -- the step ----------------------------------------------------------------------------

    @property
    def stats(self) -> torch.Tensor:
        """The ``extra`` slots (at the start of the first buffer)."""
        return self.buffers[0][: self.extra]

    @property
    def tail(self) -> torch.Tensor:
        """The ``tail`` slots (at the end of the first buffer), summed in place by
        :meth:`finish` once :meth:`tail_ready` said they are written."""
        flat = self.buffers[0]
        return flat[flat.numel() - self.tail_size:]

    def _grads(self, index: int) -> torch.Tensor:
        """Buffer ``index`` without the extra slots and the tail."""
        flat = self.buffers[index]
        return flat[self.extra: flat.numel() - self.tail_size] if index == 0 else flat

    def arm(self, stats: Sequence[float] = ()) -> None:
        """Write ``stats`` into the extra slots and let the next backward's hooks launch
        buckets (call it before the last backward of a step)."""
        if stats:
            self.stats.copy_(torch.as_tensor(stats, dtype=self.stats.dtype))
        for b in self.buckets:
            b.pending = len(b.params) + b.tail
        self._armed = True
        self._launched = 0

    def _hook(self, p: torch.nn.Parameter) -> None:
        if self._armed:
            self.ready(p)

    def ready(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient is final for this step (what its autograd hook reports): launch
        the buckets that became ready, in order, and advance the launched ones."""
        if p.grad is None or p.grad.data_ptr() != self._grad_ptrs[id(p)]:
            raise CommError("FusedGradients: a parameter's .grad was replaced (set_to_none?); "
                            "zero gradients with FusedGradients.zero() instead")
        self._done(self._bucket_of[id(p)])

    def tail_ready(self) -> None:
        """The tail is written for this step (after :meth:`arm`): its bucket may launch."""
        if not self.tail_size or not self._armed:
            raise CommError("FusedGradients: tail_ready() needs a tail and an armed step")
        self._done(next(b for b in self.buckets if b.tail))

    def _done(self, bucket: Bucket) -> None:
        """One input of ``bucket`` is final: launch the buckets that became ready, in order,
        and advance the launched ones."""
        bucket.pending -= 1
        while self._launched < len(self.buckets) and \
                self.buckets[self._launched].pending <= 0:
            self._launch(self.buckets[self._launched])
        self._progress()

    def _resident_op(self, index: int, bucket: Bucket) -> window.ResidentAllreduce | None:
        """The reusable in-place allreduce of a resident bucket (flag slot ``index + 1``),
        with the ring across nodes as its middle step when there are several nodes."""
        resident = self.residents[bucket.buffer]
        if resident is None:
            return None
        arr, dtype, _ = as_storage(self.buffers[bucket.buffer][bucket.lo: bucket.hi],
                                   "allreduce")
        between = None
        if self.group.layout.nodes > 1:
            cross, kind = self.group.cross_link, dtype.kind
            scratch = np.empty(arr.size // self.group.layout.local_size + 1, arr.dtype)

            def between(part: np.ndarray) -> None:
                with watching("allreduce", cross.comm):  # may run in a gradient hook
                    ring.allreduce(part, cross, OP_KERNEL["sum"], kind, scratch)
        return window.ResidentAllreduce(arr, resident, index + 1, OP_KERNEL["sum"], dtype.kind,
                                     between)

    def _launch(self, bucket: Bucket) -> None:
        self._launched += 1
        if trace.enabled():
            bucket.launched_at = trace.now()
        if self._alone:
            bucket.handle = None
            self._traced(bucket)
            return
        view = self.buffers[bucket.buffer][bucket.lo: bucket.hi]
        self.reduced_bytes += (bucket.wire_op.bytes if bucket.wire_op else
                               view.numel() * view.element_size())
        if bucket.resident_op is not None:
            bucket.handle = bucket.resident_op.start()
        elif self._thread is not None:
            run = bucket.wire_op or (lambda: allreduce(view, comm=self.group))
            bucket.handle = self._thread.submit(self._reduce, run, self._launched - 1)
            if bucket.launched_at is not None:
                bucket.handle.add_done_callback(lambda _, b=bucket: self._traced(b))
        else:
            if bucket.wire_op:
                bucket.wire_op()
            else:
                allreduce(view, comm=self.group)
            bucket.handle = None
            self._traced(bucket)

    def _reduce(self, run: Callable[[], object], index: int) -> None:
        """A bucket's allreduce (``run``) on the comm thread."""
        with trace.span("comm thread: allreduce", bucket=index):
            run()

    def _traced(self, bucket: Bucket) -> None:
        """Record ``bucket``'s reduction as ending now (once; nothing when not tracing)."""
        if bucket.launched_at is not None:
            index = self.buckets.index(bucket)
            trace.record("reduce", bucket.launched_at, trace.now(), f"bucket {index}",
                         bucket=index, bytes=(bucket.hi - bucket.lo) *
                         self.buffers[bucket.buffer].element_size())
            bucket.launched_at = None

    def _progress(self) -> None:
        """Advance the launched resident buckets; across nodes in order, stopping at the
        first unfinished one (a later bucket's inter-node messages must not overtake an
        earlier one's)."""
        for b in self.buckets[: self._launched]:
            if isinstance(b.handle, window.ResidentAllreduce):
                if b.handle.test():
                    self._traced(b)
                elif self._ordered:
                    return

    def finish(self, stats: Sequence[float] = ()) -> np.ndarray:
        """Launch the buckets not launched yet, wait for all, and return the summed extra
        slots. ``stats`` are written first unless :meth:`arm` already sent them."""
        if not self._armed:
            self.arm(stats)
        while self._launched < len(self.buckets):
            self._launch(self.buckets[self._launched])
        resident = [b.handle for b in self.buckets if isinstance(b.handle,
                                                                window.ResidentAllreduce)]
        with trace.span("reduction wait"), watching("allreduce", self.group.comm):
            if self._ordered:
                for op in resident:
                    op.wait()
            else:
                window.complete(resident)
            for b in self.buckets:
                if isinstance(b.handle, Future):
                    b.handle.result()
                elif b.handle is not None:
                    self._traced(b)
                b.handle = None
        self._armed = False
        self.reductions += 1
        return self.stats.cpu().numpy().astype(np.float64)

    def finite(self) -> bool:
        """Whether every gradient (not the extra slots) is finite, by one sum per buffer (a
        NaN or Inf makes it non-finite). May say False for finite gradients whose sum
        overflows: callers then look parameter by parameter."""
        return all(bool(torch.isfinite(self._grads(index).sum()))
                   for index in range(len(self.buffers)))

    def scale(self, factor: float) -> None:
        for index in range(len(self.buffers)):
            self._grads(index).mul_(factor)

    def zero(self) -> None:
        """Zero the gradients and the extra slots (the tail is its owner's)."""
        for index, flat in enumerate(self.buffers):
            (flat[: flat.numel() - self.tail_size] if index == 0 else flat).zero_()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown()
