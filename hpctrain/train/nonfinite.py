"""NaN and Inf in a training step: find them, agree, then stop or skip (``train.on_nonfinite``).

Each worker checks its own share of a step and keeps the first finding: the dense features
it read and its loss before the last backward, so that its flag (1 when it found something)
rides in the step's gradient all-reduce beside the sample count and the loss sum (the first
bucket leaves during that backward); then the summed dense gradients, the same on every
worker, so their verdict needs no message. On the tensor/pipeline path, which reduces after
the backward, the flag also covers the dense and embedding gradients and rides in the
pipeline group's loss all-reduce, plus one 1-value all-reduce over the tensor group when
``tp > 1``. Then, on every worker alike:

- ``stop``: :func:`~hpctrain.runtime.abort.agree` over the workers (an allgather, on this
  path only) ends the job with one line naming the step, the ranks and the tensor;
- ``skip``: nobody applies the step: the dense optimizer does not step and the embedding
  push is empty (still the same collective on replicated tables, still a clock tick on the
  parameter servers), so the model is exactly as before the step.

Embedding-row gradients are each worker's own and are checked last, after the verdict:
a non-finite one stops the job from that worker alone, or (``skip``) drops only that
worker's rows from the push; either way the replicas and servers stay consistent.

In full parameter-server mode workers share no collective and no step: each checks its own
contribution and either stops the job (reporting alone) or drops that contribution (an empty
push that still ticks its clock) while the other workers' gradients of the step are applied.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import numpy as np
import torch
from mpi4py import MPI

from embeddings.collection import Lookup
from embeddings.tables import TableLayout
from hpctrain.data.types import Batch
from hpctrain.errors import NonFiniteError
from hpctrain.runtime.abort import agree
from hpctrain.runtime.finite import all_finite
from hpctrain.train.stats import StepStats

__all__ = ["NonFiniteGuard", "finite_samples"]

log = logging.getLogger(__name__)


class NonFiniteGuard:
    """One worker's findings for the current step, and the verdict on them.

    ``comm`` holds the workers that agree on every step (``None`` in full parameter-server
    mode, where each worker decides for its own contribution).
    """

    def __init__(self, mode: str, comm: MPI.Intracomm | None) -> None:
        if mode not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {mode!r}")
        self.mode, self.comm = mode, comm
        self.finding: str | None = None
        self.skipped = 0

    @property
    def flag(self) -> float:
        """1.0 when this worker found a non-finite value in the current step."""
        return float(self.finding is not None)

    def register(self, stats: StepStats) -> None:
        """Let this worker's flag ride in the step's reduction as ``nonfinite``."""
        stats.add("nonfinite", lambda _step: [self.flag])

    def features(self, dense: np.ndarray, first: int) -> None:
        """Check dense features ``[n, 13]`` of train samples ``first``, ``first + 1``, ..."""
        if self.finding is None and not np.isfinite(dense).all():
            r, c = np.argwhere(~np.isfinite(dense))[0]
            self.finding = f"dense features: train sample {first + r}, I{c + 1} = {dense[r, c]}"

    def loss(self, value: float) -> None:
        """Check this worker's summed loss of the step."""
        if self.finding is None and not math.isfinite(value):
            self.finding = f"loss = {value}"

    def gradients(self, named: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Check the ``.grad`` of the named dense parameters."""
        if self.finding is None:
            self.finding = next((f"gradient of {name}" for name, p in named
                                 if p.grad is not None and not bool(torch.isfinite(p.grad).all())),
                                None)

    def embedding_gradients(self, lookups: list[Lookup], layout: TableLayout) -> None:
        """Check the gradients of the rows ``lookups`` pulled (global rows of ``layout``)."""
        for lookup in lookups:
            grad = lookup.values.grad
            if self.finding is not None or grad is None or all_finite(grad):
                continue
            row = int(lookup.rows[int(torch.nonzero(~torch.isfinite(grad))[0, 0])])
            table = int(layout.table_of(np.array([row]))[0])
            self.finding = (f"embedding gradient of table {layout.specs[table].name!r}, "
                            f"row {row - int(layout.offsets[table])}")

    def embedding_share(self, step: int, lookups: list[Lookup], layout: TableLayout) -> bool:
        """After the step's verdict: whether this worker's embedding-row gradients may be
        pushed (see the module doc; a non-finite one raises in ``stop`` mode)."""
        self.embedding_gradients(lookups, layout)
        finding, self.finding = self.finding, None
        if finding is None:
            return True
        _report(step, finding) if self.mode == "stop" else log.warning(
            "step %d: this worker's embedding rows skipped: non-finite %s", step, finding)
        return False

    def settle(self, step: int, flagged: float) -> bool:
        """The verdict on step ``step`` once ``flagged`` (the summed flags, the same on
        every worker of ``comm``; this worker's own without one) is known: ``True`` to
        skip the step. In ``stop`` mode raises instead, collectively over ``comm``."""
        finding, self.finding = self.finding, None
        if flagged <= 0:
            return False
        if self.mode == "skip":
            self.skipped += 1
            if finding:
                say = log.warning if self.skipped == 1 else log.debug
                say("step %d skipped: non-finite %s", step, finding)
            return True
        if self.comm is None:
            _report(step, finding)
        else:
            agree(self.comm, lambda: _report(step, finding))
        raise AssertionError(f"step {step} was flagged non-finite, but no rank found why")


def _report(step: int, finding: str | None) -> None:
    if finding:
        raise NonFiniteError(f"step {step}: non-finite {finding}; set train.on_nonfinite = "
                             f"\"skip\" to skip such steps")


def finite_samples(batch: Batch) -> tuple[Batch, int]:
    """``batch`` without the samples whose dense features hold a NaN or Inf, and how many
    were left out (evaluation scores only finite samples)."""
    good = np.isfinite(batch.dense).all(axis=1)
    if good.all():
        return batch, 0
    return Batch(batch.dense[good], batch.sparse[good], batch.labels[good]), int((~good).sum())
