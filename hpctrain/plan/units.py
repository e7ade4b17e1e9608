"""Readable quantities: ``200Gb/s``, ``2us``, ``25MiB``, ``7e9``: the one parser of the planner.

A bare number is taken in the unit its flag names (``--compute-ms``), else the base unit of
its kind (bytes, seconds, bytes/s, a plain count); a suffix names another unit. Bits (``b``)
and bytes (``B``) differ in sizes and bandwidths; decimal prefixes (k, M, G, T) are powers
of 1000, binary ones (Ki, Mi, Gi, Ti) of 1024. Counts take k, M, G or B (billion) and T
as multipliers (``7B`` parameters).
"""

from __future__ import annotations

import re

from hpctrain.errors import ConfigError

__all__ = ["KINDS", "parse_quantity"]

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60.0, "h": 3600.0}
_COUNT = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12}
KINDS = ("count", "bytes", "seconds", "bandwidth")
_NUMBER = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*$")


def _size(unit: str) -> float | None:
    """Bytes in one ``unit`` of size (``B``, ``KiB``, ``Gb`` ...), or None."""
    m = re.fullmatch(r"(|k|K|M|G|T|Ki|Mi|Gi|Ti)(B|b|bit)", unit)
    if not m:
        return None
    return _PREFIX[m.group(1)] * (1.0 if m.group(2) == "B" else 0.125)


def parse_quantity(text: str | float, kind: str, where: str, bare: float = 1.0) -> float:
    """``text`` as a number of the base unit of ``kind``; a bare number counts ``bare`` base
    units (``--compute-ms 1800``: 1e-3). :class:`ConfigError` naming ``where`` (a flag or a
    file key) when it is not a quantity of that kind."""
    if isinstance(text, bool):
        raise ConfigError(f"{where}: expected a {kind} quantity, got {text!r}")
    if isinstance(text, int | float):
        return float(text) * bare
    m = _NUMBER.match(str(text))
    scale = None
    if m:
        unit = m.group(2)
        if kind == "count":
            scale = _COUNT.get(unit) if unit else bare
        elif kind == "seconds":
            scale = bare if unit == "" else _TIME.get(unit)
        elif kind == "bytes":
            scale = bare if unit == "" else _size(unit)
        elif kind == "bandwidth":
            per = re.fullmatch(r"(.+?)(?:/s|ps)", unit)
            scale = bare if unit == "" else (_size(per.group(1)) if per else None)
    if scale is None:
        examples = {"count": "7e9, 175B", "bytes": "4096, 25MiB, 1.5GB",
                    "seconds": "0.002, 2us, 11.7ms", "bandwidth": "25e9, 200Gb/s, 12GB/s"}[kind]
        raise ConfigError(f"{where}: expected a {kind} quantity (e.g. {examples}), "
                          f"got {text!r}")
    return float(m.group(1)) * scale
