"""The interface every collective family implements (one module per family: ``ring``,
``tree``, ``recursive``, ``shm``, ``hierarchical``, ``native``, ``torchdist``;
:mod:`hpctrain.comm.select` picks among them).

It sits above :mod:`hpctrain.comm.group` rather than in :mod:`hpctrain.comm.types`
because ``run`` and ``bind`` take the :class:`~hpctrain.comm.group.Group` whose state they
use, and the group is built from the value types: this order keeps the imports acyclic
(``tests/unit/test_architecture.py`` checks it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from hpctrain.comm.types import Cost, CostParams, Layout, Request

if TYPE_CHECKING:
    from hpctrain.comm.group import Group

__all__ = ["Algorithm"]


class Algorithm(ABC):
    """One family of collective algorithms. ``run`` is collective over ``group.comm`` (or
    the sub-communicators the family documents) and works in place on ``arr``."""

    name: ClassVar[str]
    primitives: ClassVar[frozenset[str]]

    def enabled(self, req: Request, layout: Layout) -> bool:
        """Whether this family can serve ``req`` on ``layout`` (host memory by default)."""
        return req.primitive in self.primitives and req.device == "cpu"

    @abstractmethod
    def cost(self, req: Request, layout: Layout, params: CostParams) -> Cost:
        """Predicted time of ``req`` on ``layout``."""

    @abstractmethod
    def run(self, req: Request, arr: np.ndarray, group: Group) -> None:
        """Perform ``req`` on the contiguous storage array ``arr`` (see :class:`DType`)."""

    def bind(self, req: Request, group: Group) -> Callable[[np.ndarray], None]:
        """``run`` for ``req`` on ``group`` as a one-argument callable; a family whose
        per-call decisions depend only on ``req`` makes them here, once."""
        return lambda arr: self.run(req, arr, group)
