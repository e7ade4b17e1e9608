"""Straggler injection for experiments, deterministic by seed.

- persistent: the listed workers always take ``factor`` times as long per step;
- transient: each (worker, step) is delayed by ``factor`` with probability ``probability``.

A delayed step sleeps ``(factor - 1)`` times the step's own work so far: its reading,
lookups and forward/backward, that is its time less the time it spent blocked on others
(:func:`~hpctrain.runtime.waits.waited_s`; delaying waits would compound), so the worker
looks slower without stealing a core from the others (as a slow node would).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from hpctrain.runtime import rng

__all__ = ["Stragglers"]


class Stragglers:
    def __init__(self, worker: int, slow_workers: Sequence[int] = (), slow_factor: float = 1.0,
                 probability: float = 0.0, delay_factor: float = 1.0, seed: int = 0) -> None:
        self.worker = worker
        self.persistent = slow_factor if worker in slow_workers else 1.0
        self.probability = probability
        self.delay_factor = delay_factor
        self.seed = seed
        self.delayed_s = 0.0

    def factor(self, step: int) -> float:
        """How many times slower this worker's ``step`` is."""
        key = np.array([(self.worker << 40) + step], dtype=np.uint64)
        hit = rng.uniform(key, self.seed + 0x57A6)[0] < self.probability
        return self.persistent * (self.delay_factor if hit else 1.0)

    def delay(self, step: int, own_s: float) -> None:
        """Sleep so that ``own_s`` seconds of work take ``factor(step)`` times that."""
        extra = (self.factor(step) - 1.0) * own_s
        if extra > 0:
            time.sleep(extra)
            self.delayed_s += extra
