"""Reading run directories: the resolved config, the curves, the summary and the meta facts.

A run directory (see :mod:`hpctrain.train.rundir`) holds ``config.toml``, ``metrics.jsonl``,
``meta.json`` (world layout, versions, job ids) and, once training ended, ``summary.json``.
A report reads these files and nothing else, so runs made on different days, nodes and
queues compare exactly like runs of one allocation.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.errors import ConfigError
from hpctrain.train.rundir import read_metrics

__all__ = ["Run", "find_runs", "read_run", "flatten"]


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    """Resolved config keys (``section.key``), plus ``world.ranks`` from meta.json."""
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def problem(self) -> str | None:
        """Why the run cannot be averaged (None when it finished with finite figures)."""
        if self.summary is None:
            return "unfinished (no summary.json)"
        loss = self.summary.get("eval", {}).get("log_loss")
        if not isinstance(loss, int | float) or not math.isfinite(loss):
            return "failed (final held-out log loss is not finite)"
        return None


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return out


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None


def read_run(path: Path) -> Run:
    """The run in ``path`` (a folder holding config.toml)."""
    try:
        config = flatten(tomllib.loads((path / "config.toml").read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path / 'config.toml'}: unreadable ({exc})") from None
    metrics = path / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []
    meta = _json(path / "meta.json") if (path / "meta.json").exists() else {}
    if "ranks" in meta.get("world", {}):
        config["world.ranks"] = meta["world"]["ranks"]
    summary = _json(path / "summary.json") if (path / "summary.json").exists() else None
    return Run(path, config, records, summary, meta)


def find_runs(paths: list[str]) -> list[Run]:
    """Every run directory at or below each of ``paths`` (checkpoint folders skipped)."""
    runs = []
    for text in paths:
        root = Path(text)
        if not root.is_dir():
            raise ConfigError(f"{text}: not a folder")
        found = sorted(p.parent for p in root.rglob("config.toml")
                       if "checkpoints" not in p.relative_to(root).parts)
        if not found:
            raise ConfigError(f"{text}: no run directory (a folder with config.toml) in it")
        runs.extend(read_run(p) for p in found)
    return runs
