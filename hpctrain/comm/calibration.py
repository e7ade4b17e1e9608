"""The cost model's calibration file: measured :class:`~hpctrain.comm.types.CostParams`
as JSON (``hpctrain bench calibrate`` writes it, ``comm.calibration`` names it), and the
fit of a link's ``alpha`` and ``beta`` from measured points.

Its own module so that :class:`~hpctrain.comm.group.Group` can read the parameters without
importing the selector (and through it every algorithm).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from hpctrain.comm.types import CostParams, Link
from hpctrain.errors import CommError

__all__ = ["CALIBRATION_FORMAT", "read_params", "write_params", "fit"]

CALIBRATION_FORMAT = "hpctrain-comm-calibration"


def read_params(path: str | Path) -> CostParams:
    """Cost parameters from a calibration file; :class:`CommError` naming the file if it
    cannot be used."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CommError(f"{path}: cannot read the calibration file ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CommError(f"{path}: not a calibration file (invalid JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT or \
            not isinstance(data.get("params"), dict):
        raise CommError(f"{path}: not a calibration file (expected format = "
                        f"{CALIBRATION_FORMAT!r} and a params table)")
    return CostParams.from_dict(data["params"], str(path))


def write_params(path: str | Path, params: CostParams, facts: dict[str, object]) -> None:
    """Write ``params`` (and how they were measured) atomically as a calibration file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": CALIBRATION_FORMAT, "version": 1, **facts,
                               "params": params.to_dict()}, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def fit(small: tuple[float, float], large: Sequence[tuple[float, float]],
        latency_weight: float = 1.0) -> Link:
    """``alpha * latency_weight + beta * x`` from measured ``(x, seconds)`` points: alpha
    from the tiny message, beta the largest per-byte cost among the large ones (protocol
    switches make mid sizes dearer per byte than the largest)."""
    x0, t0 = small
    beta = max(max((t - t0) / (x - x0) for x, t in large), 1e-13)
    return Link(max((t0 - beta * x0) / latency_weight, 1e-8), beta)
