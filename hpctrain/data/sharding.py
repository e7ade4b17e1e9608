"""Which samples each worker reads at each step (pure; the same rule for every source).

Step ``s`` of an epoch reads global batch ``g = s mod batches_per_epoch``: samples
``[g*B, (g+1)*B)`` of the split, of which worker ``w`` of ``W`` takes the balanced slice
:func:`~hpctrain.runtime.topology.shard_range` ``(B, W, w)``. The last partial batch of an
epoch is dropped so that every step has the same global size.
"""

from __future__ import annotations

from hpctrain.runtime.topology import shard_range

__all__ = ["batches_per_epoch", "local_slice"]


def batches_per_epoch(num_samples: int, global_batch: int) -> int:
    """Full global batches in one pass over ``num_samples`` (at least one)."""
    return max(1, num_samples // global_batch)


def local_slice(step: int, num_samples: int, global_batch: int, worker: int,
                workers: int) -> tuple[int, int]:
    """Sample range ``[start, stop)`` that ``worker`` reads at ``step`` (wrapping epochs)."""
    batch = min(global_batch, num_samples)
    g = step % batches_per_epoch(num_samples, batch)
    lo, hi = shard_range(batch, workers, worker)
    return g * batch + lo, g * batch + hi
