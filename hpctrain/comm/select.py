"""Choosing an algorithm: an ordered candidate list, ``enabled`` predicates, predicted cost.

As in Horovod's ``OperationManager``, candidates are walked in order and the ones whose
predicate accepts the request are considered; ``auto`` runs the one with the lowest
predicted :class:`~hpctrain.comm.types.Cost` (the earlier one on a tie). A named
algorithm is run as asked, or refused with a :class:`~hpctrain.errors.CommError` that says
why. Cost parameters come from a calibration file (:mod:`hpctrain.comm.calibration`) or the
built-in defaults.
"""

from __future__ import annotations

from hpctrain.comm.algorithm import Algorithm
from hpctrain.comm.hierarchical import HIERARCHICAL
from hpctrain.comm.native import NATIVE
from hpctrain.comm.recursive import HALVING_DOUBLING, RECURSIVE_DOUBLING
from hpctrain.comm.ring import RING
from hpctrain.comm.shm import SHM
from hpctrain.comm.torchdist import TORCH
from hpctrain.comm.tree import TREE
from hpctrain.comm.types import Cost, CostParams, Layout, Request
from hpctrain.errors import CommError

__all__ = ["CANDIDATES", "ALGORITHMS", "choose", "ranking"]

CANDIDATES: tuple[Algorithm, ...] = (SHM, HIERARCHICAL, RECURSIVE_DOUBLING, HALVING_DOUBLING,
                                     RING, TREE, NATIVE, TORCH)
ALGORITHMS = ("auto", *(a.name for a in CANDIDATES))
_BY_NAME = {a.name: a for a in CANDIDATES}


def ranking(req: Request, layout: Layout, params: CostParams) -> list[tuple[Algorithm, Cost]]:
    """Enabled candidates for ``req`` with their predicted cost, in candidate order."""
    return [(a, a.cost(req, layout, params)) for a in CANDIDATES if a.enabled(req, layout)]


def choose(req: Request, layout: Layout, params: CostParams,
           algorithm: str = "auto") -> Algorithm:
    """The algorithm that serves ``req``: the cheapest enabled one, or the one named."""
    if algorithm != "auto":
        algo = _BY_NAME.get(algorithm)
        if algo is None:
            raise CommError(f"unknown algorithm {algorithm!r}; algorithms are: "
                            f"{', '.join(ALGORITHMS)}")
        if not algo.enabled(req, layout):
            raise CommError(f"algorithm {algorithm!r} cannot serve {req.primitive} of "
                            f"{req.dtype.name} on {req.device} over {layout.size} ranks on "
                            f"{layout.nodes} node(s){_why(algo, req, layout)}")
        return algo
    options = ranking(req, layout, params)
    if not options:
        raise CommError(f"no algorithm serves {req.primitive} of {req.dtype.name} on "
                        f"{req.device}")
    return min(options, key=lambda item: item[1].seconds)[0]


def _why(algo: Algorithm, req: Request, layout: Layout) -> str:
    if req.primitive not in algo.primitives:
        return f" ({algo.name} implements {', '.join(sorted(algo.primitives))})"
    if algo.name == "shm" and layout.nodes > 1:
        return " (shm needs all ranks on one node)"
    if algo.name == "hierarchical":
        return " (hierarchical needs two or more nodes of equal size)"
    return ""
