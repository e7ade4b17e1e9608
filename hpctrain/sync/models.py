"""Naming sync models: ``bsp``, ``ssp:S`` and ``asp`` (config values and CLI lists)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hpctrain.config import staleness_bound
from hpctrain.errors import ConfigError
from hpctrain.sync.asp import ASP
from hpctrain.sync.bsp import BSP
from hpctrain.sync.ssp import ssp
from hpctrain.sync.types import SyncModel

__all__ = ["parse_model", "parse_models", "table_models", "lr_factor"]


def parse_model(text: str, where: str = "sync.model") -> SyncModel:
    """The model named ``text``; ``where`` names the key or flag in an error."""
    bound = staleness_bound(text, where)
    return ASP if bound is None else BSP if text.strip().lower() == "bsp" else ssp(bound)


def parse_models(text: str, where: str = "--models") -> list[SyncModel]:
    models = [parse_model(part, where) for part in text.split(",") if part.strip()]
    if not models:
        raise ConfigError(f"{where}: no sync model given")
    return models


def table_models(default: str, overrides: Sequence[str], names: Sequence[str]) -> list[SyncModel]:
    """The model of each table: ``default``, unless ``overrides`` ('TABLE=MODEL') names it."""
    models = [parse_model(default)] * len(names)
    for i, item in enumerate(overrides):
        table, _, model = item.partition("=")
        if table.strip() not in names:
            raise ConfigError(f"sync.table_models[{i}]: no table named {table.strip()!r}; the "
                              f"tables are {', '.join(names)}")
        models[names.index(table.strip())] = parse_model(model, f"sync.table_models[{i}]")
    return models


def lr_factor(model: str, rule: str) -> float:
    """Learning-rate multiplier of ``sync.ssp_lr``: 1, or ``1 / sqrt(1 + S)`` for a
    staleness bound S (``bsp`` is S = 0), so stale gradients take smaller steps."""
    if rule == "constant":
        return 1.0
    return 1.0 / math.sqrt(1 + staleness_bound(model))
