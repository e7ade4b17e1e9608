"""Every benchmark's output, written one way: text tables, JSON files and line plots.

Runners (the other modules of :mod:`hpctrain.bench`) measure and turn their rows into cells
and series; this module lays cells out as a right-aligned table (:func:`format_table`),
writes JSON atomically, to a temporary file then renamed (:func:`write_json`), and draws
series as a PNG line plot (:func:`line_plot`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpctrain.stats import PAIRED_METHOD

__all__ = ["format_table", "print_rows", "write_json", "line_plot", "mean_row", "interval_note"]


def _cell(value: Any) -> str:
    if value is None:  # not defined, e.g. the interval of a single run
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def format_table(columns: Sequence[str], cells: Sequence[Sequence[str]],
                 left: int = 0) -> str:
    """``cells`` under ``columns``, two spaces apart; the first ``left`` columns are
    left-aligned, the others right-aligned."""
    table = [list(columns), *(list(row) for row in cells)]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) if i < left else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                     .rstrip() for row in table)


def mean_row(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row for repeated runs of a case: each float the mean over ``runs``, any other
    value (a name, a count) the first run's."""
    return {key: sum(run[key] for run in runs) / len(runs) if isinstance(value, float)
            else value for key, value in runs[0].items()}


def interval_note(what: str, count: int, unit: str, columns: str) -> str:
    """The line under a table of paired ratios: how ``what`` was made from ``count`` pairs
    (``unit``: "pair" or "round"), its interval's ``columns``; or that one gives none."""
    if count < 2:
        return f"{what} from a single {unit} of runs, no interval (--repeat N for one)"
    return f"{what}: {PAIRED_METHOD} over {count} {unit}s of runs (95%: {columns})"


def print_rows(rows: Sequence[dict[str, Any]], columns: Sequence[str],
               json_path: str | None = None) -> None:
    """Print ``rows`` (dicts) as a table of ``columns``; with ``json_path``, write them."""
    print(format_table(columns, [[_cell(r.get(c, "")) for c in columns] for r in rows]))
    if json_path:
        write_json(json_path, list(rows))
        print(f"wrote {len(rows)} rows to {json_path}")


def write_json(path: str | Path, doc: Any) -> None:
    """``doc`` as indented JSON, written to a temporary file and renamed over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def line_plot(path: str | Path, series: dict[str, Sequence[tuple[float, float]]], title: str,
              xlabel: str, ylabel: str, log_x: bool = False, log_y: bool = False,
              bold: Sequence[str] = (), hlines: Sequence[tuple[float, str]] = ()) -> None:
    """One line per series (names in ``bold`` drawn thicker), dashed horizontal references
    ``(y, label)``, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in series.items():
        ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=name,
                linewidth=2.5 if name in bold else 1.2)
    for y, label in hlines:
        ax.axhline(y, color="grey", linestyle="--", linewidth=1, label=label)
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
