"""Splitting a sequential model into pipeline stages (pure: no communication).

A *layer* is a module with parameters together with the parameter-free modules after it
(``Linear, ReLU`` is one layer), so a cut never separates an activation from its layer.
Stages are contiguous runs of layers, balanced by count or placed at given cuts.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.runtime.topology import shard_range

__all__ = ["layers_of", "balanced_cuts", "split_sequential"]


def layers_of(model: nn.Sequential) -> list[nn.Sequential]:
    """``model``'s layers: each parametrised module with the parameter-free ones after it."""
    layers: list[list[nn.Module]] = []
    for module in model:
        if any(True for _ in module.parameters()) or not layers:
            layers.append([module])
        else:
            layers[-1].append(module)
    return [nn.Sequential(*modules) for modules in layers]


def balanced_cuts(layers: int, stages: int) -> list[int]:
    """Where stages ``1 .. stages-1`` begin when ``layers`` are shared by count (the first
    ``layers % stages`` stages take one more)."""
    if not 1 <= stages <= layers:
        raise ConfigError(f"cannot split {layers} layers into {stages} pipeline stages")
    return [shard_range(layers, stages, s)[0] for s in range(1, stages)]


def split_sequential(model: nn.Sequential, stages: int,
                     cuts: Sequence[int] = ()) -> list[nn.Sequential]:
    """``model`` as ``stages`` sequential stages; stage ``s`` begins at layer ``cuts[s-1]``
    (balanced by layer count when ``cuts`` is empty)."""
    layers = layers_of(model)
    cuts = list(cuts) or balanced_cuts(len(layers), stages)
    bounds = [0, *cuts, len(layers)]
    if len(cuts) != stages - 1 or any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ConfigError(f"stage cuts {list(cuts)} do not split {len(layers)} layers into "
                          f"{stages} non-empty stages")
    return [nn.Sequential(*(m for layer in layers[lo:hi] for m in layer))
            for lo, hi in zip(bounds, bounds[1:], strict=False)]
