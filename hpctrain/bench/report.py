"""Printing benchmark rows as a table, and writing them as JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["print_rows"]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def print_rows(rows: Sequence[dict[str, Any]], columns: Sequence[str],
               json_path: str | None = None) -> None:
    table = [list(columns)] + [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(list(rows), f, indent=1)
        print(f"wrote {len(rows)} rows to {json_path}")
