"""ZeRO-2's gradient reduction (``train.zero = 2``): each bucket reduce-scattered during the
last backward, only this worker's shard of the summed gradient kept.

The parameters are laid end to end and cut into buckets (:func:`cut`): first those of at
least 1/16 of ``bucket_bytes`` or of this worker's shard, whichever is less, in reverse order
(backward produces the last layers' gradients first), each cut into pieces of at most
``bucket_bytes``, each piece its own bucket; then the smaller ones, grouped into buckets of up
to that 1/16. Worker ``r`` owns the balanced chunk ``r`` of every bucket
(:func:`~hpctrain.comm.types.chunk_bounds`, the chunk
:func:`~hpctrain.comm.collectives.reduce_scatter` leaves it); its shard is those chunks end to
end, ``1/N`` of the gradient.

Autograd accumulates into ordinary ``.grad`` tensors (over all of a step's micro-batches).
During the last backward, once every parameter of the next bucket in order is final, the
bucket is reduce-scattered there and then, from the gradient hook: a piece of one parameter
straight from its gradient, a group of small parameters packed into the staging buffer (one,
the size of the largest group, kept for the run as DeepSpeed keeps its reduce bucket:
allocating it afresh each step cost 1.3 ms of page faults a step for the reference-shaped
MLPs). This worker's chunk is copied into the shard, and a parameter's gradient is set to
``None`` (freed) after its last bucket. (A communication thread, as
:class:`~hpctrain.comm.fusion.FusedGradients` uses for buckets outside the shared window, cost
more than it hid here: 10.4 against 9.0 ms a step at 2 ranks on one node.) So between steps a
worker keeps ``1/N`` of the gradient and the staging buffer, at most 1/16 of the shard, and
during backward also the gradients of the parameters not yet sent. The step statistics and
the verdict on the shards' finiteness travel in one small allreduce in
:meth:`ShardedGradients.finish`. Traffic is a reduce-scatter of the gradients here, and ZeRO's
allgather of the updated parameters: plain data parallelism's allreduce in bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import SimpleNamespace

import numpy as np
import torch

from hpctrain.comm.collectives import allreduce, reduce_scatter
from hpctrain.comm.group import Group
from hpctrain.comm.types import chunk_bounds
from hpctrain.errors import CommError
from hpctrain.runtime import trace
from hpctrain.runtime.finite import all_finite

__all__ = ["ShardedGradients", "cut", "overlaps"]


def overlaps(order: Sequence[torch.nn.Parameter], offset: dict[int, int], lo: int,
             hi: int) -> Iterator[tuple[torch.nn.Parameter, int, int]]:
    """(parameter, x, y) for each parameter of ``order`` (at flat offsets ``offset``, by
    ``id``) with elements in the flat range ``[lo, hi)``: they are its ``[x, y)``."""
    for p in order:
        first = offset[id(p)]
        x, y = max(lo, first), min(hi, first + p.numel())
        if x < y:
            yield p, x, y


def cut(sizes: Sequence[int], bucket: int, workers: int) -> list[list[tuple[int, int, int]]]:
    """Buckets over parameters of ``sizes`` values (in backward order), sharded over
    ``workers``: each a list of (parameter index, first, last) pieces, in the order the flat
    layout lays them end to end. With ``small`` 1/16 of a bucket or of a shard, whichever is
    less, a parameter of at least ``small`` values is cut into balanced pieces of at most
    ``bucket`` values, each a bucket of its own (reduced straight from its gradient), in
    order; the smaller ones follow, grouped into buckets of up to ``small`` values (packed
    into the staging buffer, so it stays small; a model's biases and small layers are
    usually one such bucket, sent as backward ends, rather than one between each pair of
    large weights)."""
    small = max(1, min(bucket, sum(sizes) // workers) // 16)
    buckets: list[list[tuple[int, int, int]]] = []
    for i, n in enumerate(sizes):
        if n >= small:
            bounds = chunk_bounds(n, -(-n // bucket))
            buckets += [[(i, int(a), int(b))]
                        for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    run: list[tuple[int, int, int]] = []
    filled = 0
    for i, n in enumerate(sizes):
        if n < small:
            if run and filled + n > small:
                buckets.append(run)
                run, filled = [], 0
            run.append((i, 0, n))
            filled += n
    if run:
        buckets.append(run)
    return buckets


class _Bucket:
    def __init__(self, pieces: list[tuple[torch.nn.Parameter, int, int]], lo: int,
                 hi: int) -> None:
        self.pieces = pieces  # (parameter, first, last) values of it, in flat order
        self.lo, self.hi = lo, hi
        self.params = {id(p) for p, _, _ in pieces}
        self.pending = 0


class ShardedGradients:
    """Bucketed, overlapped reduce-scatter (sum) of ``params``' gradients over ``group``."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: Group, bucket_bytes: int,
                 extra: int = 0, overlap: bool = True) -> None:
        self.group = group
        self.params = [p for p in params if p.requires_grad]
        if not self.params or any(p.dtype != torch.float32 for p in self.params):
            raise CommError("ShardedGradients: ZeRO-2 needs float32 parameters")
        backward = list(reversed(self.params))
        cuts = cut([p.numel() for p in backward], max(1, bucket_bytes // 4), group.size)
        self.order = list(dict.fromkeys(backward[i] for pieces in cuts for i, _, _ in pieces))
        self.offset: dict[int, int] = {}
        offset = 0
        for p in self.order:
            self.offset[id(p)] = offset
            offset += p.numel()
        self.buckets = [_Bucket([(backward[i], a, b) for i, a, b in pieces],
                                self.offset[id(backward[pieces[0][0]])] + pieces[0][1],
                                self.offset[id(backward[pieces[-1][0]])] + pieces[-1][2])
                        for pieces in cuts]
        self._buckets_of: dict[int, list[_Bucket]] = {id(p): [] for p in self.params}
        for b in self.buckets:
            for key in b.params:
                self._buckets_of[key].append(b)
        self._last = {key: bs[-1] for key, bs in self._buckets_of.items()}
        rank, size = group.rank, group.size
        self.owned: list[tuple[int, int]] = []
        for b in self.buckets:
            bounds = chunk_bounds(b.hi - b.lo, size)
            self.owned.append((b.lo + int(bounds[rank]), b.lo + int(bounds[rank + 1])))
        device = self.params[0].device
        self.shard = torch.zeros(sum(hi - lo for lo, hi in self.owned), dtype=torch.float32,
                                 device=device)
        packed = [b.hi - b.lo for b in self.buckets if len(b.pieces) > 1]
        self._staging = torch.empty(max(packed, default=0), dtype=torch.float32, device=device)
        self._shard_at = np.concatenate([[0], np.cumsum([hi - lo for lo, hi in self.owned])])
        self.extra = extra
        self._stats = np.zeros(extra + 1, dtype=np.float64)  # the statistics, then the verdict
        self._finite = True
        self.reduced_bytes = 0
        self.reductions = 0
        self._armed = False
        self._launched = 0
        if overlap and size > 1:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._hook)

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Each bucket's range of the flat order (chunk ``r`` of each is worker ``r``'s)."""
        return [(b.lo, b.hi) for b in self.buckets]

    def shard_view(self, lo: int, hi: int) -> torch.Tensor:
        """The shard's values of flat range ``[lo, hi)``, inside one owned chunk."""
        for k, (a, b) in enumerate(self.owned):
            if a <= lo and hi <= b:
                start = int(self._shard_at[k]) + lo - a
                return self.shard[start: start + hi - lo]
        raise CommError(f"ShardedGradients: [{lo}, {hi}) is not in this worker's shard")

    def named_shards(self, names: dict[int, str]) -> list[tuple[str, SimpleNamespace]]:
        """(parameter name, an object whose ``.grad`` is its part of the shard) for every
        parameter with elements in this worker's chunks."""
        return [(names[id(p)], SimpleNamespace(grad=self.shard_view(x, y)))
                for lo, hi in self.owned for p, x, y in overlaps(self.order, self.offset, lo, hi)]

    @property
    def staging_bytes(self) -> int:
        """The staging buffer's bytes (the largest group of small parameters)."""
        return self._staging.numel() * self._staging.element_size()

    @property
    def kept_bytes(self) -> int:
        """Gradient bytes kept between steps: the shard and the staging buffer."""
        return self.shard.numel() * self.shard.element_size() + self.staging_bytes

    # -- the step ----------------------------------------------------------------------------

    def arm(self, stats: Sequence[float] = ()) -> None:
        """Keep ``stats`` for :meth:`finish`'s allreduce and let the next backward's hooks
        launch buckets (call it before the last backward of a step)."""
        self._stats[: self.extra] = stats if len(stats) else 0.0
        for b in self.buckets:
            b.pending = len(b.params)
        self._armed = True
        self._launched = 0

    def _hook(self, p: torch.nn.Parameter) -> None:
        if self._armed:
            for bucket in self._buckets_of[id(p)]:
                bucket.pending -= 1
            while self._launched < len(self.buckets) and \
                    self.buckets[self._launched].pending <= 0:
                self._launch(self.buckets[self._launched])

    def _launch(self, bucket: _Bucket) -> None:
        """Reduce-scatter the bucket (from the gradient itself when it is one parameter's
        piece, else packed into the staging buffer), keep this worker's chunk in the shard,
        and free the gradients this was the last bucket of."""
        index = self._launched
        self._launched += 1
        if len(bucket.pieces) == 1:
            p, a, b = bucket.pieces[0]
            packed = (torch.zeros(b - a, dtype=torch.float32, device=self.shard.device)
                      if p.grad is None else p.grad.reshape(-1)[a:b])  # None: not in this step
        else:
            packed = self._staging[: bucket.hi - bucket.lo]
            for p, a, b in bucket.pieces:
                at = self.offset[id(p)] + a - bucket.lo
                if p.grad is None:
                    packed[at: at + b - a].zero_()
                else:
                    packed[at: at + b - a].copy_(p.grad.reshape(-1)[a:b])
        self.reduced_bytes += packed.numel() * packed.element_size()
        with trace.span("reduce_scatter", bucket=index):
            lo, hi = self.owned[index]
            mine = reduce_scatter(packed, comm=self.group) if self.group.size > 1 else packed
            start = int(self._shard_at[index])
            self.shard[start: start + hi - lo].copy_(mine)
        for p, _, _ in bucket.pieces:
            if self._last[id(p)] is bucket:
                p.grad = None

    def finish(self, stats: Sequence[float] = ()) -> np.ndarray:
        """Reduce the buckets not sent yet, then sum the statistics (``stats`` unless
        :meth:`arm` already took them) and the shards' verdicts in one allreduce; returns
        the summed statistics."""
        if not self._armed:
            self.arm(stats)
        while self._launched < len(self.buckets):
            self._launch(self.buckets[self._launched])
        self._stats[-1] = 0.0 if all_finite(self.shard) else 1.0
        summed = self._stats.copy()
        if self.group.size > 1:
            allreduce(summed, comm=self.group)
        self._finite = summed[-1] == 0.0
        self._armed = False
        self.reductions += 1
        return summed[: self.extra]

    def finite(self) -> bool:
        """Whether the summed gradient is finite on every worker (agreed by
        :meth:`finish`)."""
        return self._finite

    def scale(self, factor: float) -> None:
        self.shard.mul_(factor)

    def zero(self) -> None:
        """Drop what is left of the full gradients (a skipped step's, the non-finite check's)."""
        for p in self.params:
            p.grad = None

    def close(self) -> None:
        """Nothing to stop (no communication thread)."""
