"""Named step statistics: the few values every worker adds to the step's first gradient bucket.

The parts of a step that need a sum over the workers, and that can wait for the gradients'
allreduce, register a named slot here instead of sending a collective of their own: the
trainer the sample count and the loss sum, the non-finite guard its verdict, the tiered
store each worker's count of hot rows in the coming push. The registry lays the slots out
(in registration order) for :class:`~hpctrain.parallel.data.DataParallel`'s ``extra``
values, fills them from the step in progress, and hands the sums back by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

__all__ = ["StepStats", "Sums"]

W = TypeVar("W")


@dataclass(frozen=True)
class _Slot(Generic[W]):
    start: int
    size: int
    fill: Callable[[W], Sequence[float]]
    then: Callable[[np.ndarray], None] | None


class Sums:
    """The summed statistics of one step, read by name."""

    def __init__(self, values: np.ndarray, slots: dict[str, _Slot]) -> None:
        self._values, self._slots = values, slots

    def vector(self, name: str) -> np.ndarray:
        slot = self._slots[name]
        return self._values[slot.start: slot.start + slot.size]

    def __getitem__(self, name: str) -> float:
        """The sum of a one-value statistic."""
        return float(self.vector(name)[0])


class StepStats(Generic[W]):
    """Slots filled from the step record ``W`` (the trainer's step in progress)."""

    def __init__(self) -> None:
        self._slots: dict[str, _Slot[W]] = {}
        self.size = 0

    def add(self, name: str, fill: Callable[[W], Sequence[float]], size: int = 1,
            then: Callable[[np.ndarray], None] | None = None) -> None:
        """Register ``size`` values named ``name``, taken from ``fill(step)`` before the
        reduction; ``then`` receives their sums after it."""
        if name in self._slots:
            raise ValueError(f"step statistic {name!r} is registered twice")
        self._slots[name] = _Slot(self.size, size, fill, then)
        self.size += size

    def values(self, step: W) -> list[float]:
        """This worker's values of every slot, in layout order."""
        out: list[float] = []
        for name, slot in self._slots.items():
            part = list(slot.fill(step))
            if len(part) != slot.size:
                raise ValueError(f"step statistic {name!r}: {len(part)} values, "
                                 f"expected {slot.size}")
            out += part
        return out

    def read(self, summed: np.ndarray) -> Sums:
        """The sums of :meth:`values` over the workers; each slot's ``then`` is told its."""
        sums = Sums(np.asarray(summed, dtype=np.float64), self._slots)
        for name, slot in self._slots.items():
            if slot.then is not None:
                slot.then(sums.vector(name))
        return sums
