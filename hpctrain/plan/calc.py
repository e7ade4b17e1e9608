"""``hpctrain plan calc FORMULA --input VALUE ...``: the formulas of :mod:`.formulas` as
commands. Every input is named; values take readable units (:mod:`.units`); ``--json``
prints the results as one JSON object instead of a table."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpctrain.errors import ConfigError
from hpctrain.plan import formulas
from hpctrain.plan.units import parse_quantity

__all__ = ["FORMULAS", "add_calc_parsers", "run_calc", "format_results"]


@dataclass(frozen=True)
class Input:
    """One named input: its flag, its kind of quantity and what a bare number counts."""

    flag: str
    kind: str  # count, bytes, seconds, bandwidth, fraction, choice
    help: str
    bare: float = 1.0
    default: Any = None  # None: required
    choices: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Formula:
    help: str
    inputs: tuple[Input, ...]
    compute: Callable[[dict[str, Any]], dict[str, float]]


def _young_daly(v: dict[str, Any]) -> dict[str, float]:
    if v["mtbf_hours"]:
        return formulas.young_daly(v["write_minutes"], v["mtbf_hours"])
    if not (v["gpus"] and v["gpu_mtbf_hours"]):
        raise ConfigError("young-daly: give --mtbf-hours, or --gpus and --gpu-mtbf-hours")
    cluster = formulas.mtbf(int(v["gpus"]), node_mtbf_hours=v["gpu_mtbf_hours"] / 3600.0)
    return formulas.young_daly(v["write_minutes"], cluster["cluster_mtbf_hours"] * 3600.0)


def _bytes_per_param(text: str) -> tuple[float, float, float]:
    parts = [p for p in str(text).replace("+", ",").split(",") if p.strip()]
    if len(parts) != 3:
        raise ConfigError(f"--bytes-per-param: expected WEIGHTS,GRADIENTS,OPTIMIZER bytes "
                          f"(e.g. 2,2,12), got {text!r}")
    w, g, o = (parse_quantity(p.strip(), "bytes", "--bytes-per-param") for p in parts)
    return w, g, o


_MS, _MIN, _H = 1e-3, 60.0, 3600.0
FORMULAS: dict[str, Formula] = {
    "zero": Formula(
        "per-rank model state of ZeRO stages 0-3 (mixed-precision Adam: 2+2+12 bytes)",
        (Input("--params", "count", "parameters (7e9, 7B)"),
         Input("--stage", "count", "ZeRO stage 0, 1, 2 or 3"),
         Input("--dp", "count", "data-parallel ranks"),
         Input("--bytes-per-param", "triple", "weights,gradients,optimizer bytes per "
               "parameter", default="2,2,12")),
        lambda v: formulas.zero(v["params"], int(v["stage"]), int(v["dp"]),
                                *v["bytes_per_param"])),
    "bubble": Formula(
        "pipeline bubble (p-1)/(m+p-1)",
        (Input("--stages", "count", "pipeline stages p"),
         Input("--micro-batches", "count", "micro-batches m per batch")),
        lambda v: formulas.bubble(int(v["stages"]), int(v["micro_batches"]))),
    "allreduce": Formula(
        "ring and tree allreduce time in the alpha-beta model",
        (Input("--bytes", "bytes", "message size (4096, 25MiB)"),
         Input("--ranks", "count", "ranks p"),
         Input("--latency", "seconds", "alpha per message (2us)"),
         Input("--bandwidth", "bandwidth", "link bandwidth 1/beta (200Gb/s, 25GB/s)")),
        lambda v: formulas.allreduce(v["bytes"], int(v["ranks"]), v["latency"],
                                     v["bandwidth"])),
    "dp-efficiency": Formula(
        "data-parallel scaling efficiency from gradient size, bandwidth and compute",
        (Input("--grad-bytes", "bytes", "gradient bytes per step"),
         Input("--bandwidth", "bandwidth", "per-rank link bandwidth"),
         Input("--compute-ms", "seconds", "compute time per step (ms)", bare=_MS),
         Input("--overlap", "fraction", "share of the communication hidden under compute",
               default=0.0),
         Input("--ranks", "count", "ranks N (default: the large-N limit)", default=0)),
        lambda v: formulas.dp_efficiency(v["grad_bytes"], v["bandwidth"], v["compute_ms"],
                                         v["overlap"], int(v["ranks"]))),
    "tp-comm": Formula(
        "Megatron tensor-parallel allreduce traffic per step",
        (Input("--batch", "count", "micro-batch size B"), Input("--seq", "count", "sequence S"),
         Input("--hidden", "count", "hidden size h"), Input("--layers", "count", "layers L"),
         Input("--dtype-bytes", "bytes", "bytes per activation value", default=2.0),
         Input("--tp", "count", "tensor-parallel ranks t")),
        lambda v: formulas.tp_comm(int(v["batch"]), int(v["seq"]), int(v["hidden"]),
                                   int(v["layers"]), v["dtype_bytes"], int(v["tp"]))),
    "pipeline-boundary": Formula(
        "bytes crossing a pipeline boundary per micro-batch",
        (Input("--batch", "count", "micro-batch size B"), Input("--seq", "count", "sequence S"),
         Input("--hidden", "count", "hidden size h"),
         Input("--dtype-bytes", "bytes", "bytes per activation value", default=2.0)),
        lambda v: formulas.pipeline_boundary(int(v["batch"]), int(v["seq"]), int(v["hidden"]),
                                             v["dtype_bytes"])),
    "embedding-memory": Formula(
        "bytes of an embedding table and its sparse optimizer state",
        (Input("--rows", "count", "rows"), Input("--dim", "count", "row width"),
         Input("--dtype-bytes", "bytes", "bytes per value", default=4.0),
         Input("--optimizer", "choice", "sparse optimizer", default="sgd",
               choices=("sgd", "adagrad", "adam"))),
        lambda v: formulas.embedding_memory(int(v["rows"]), int(v["dim"]), v["dtype_bytes"],
                                            v["optimizer"])),
    "young-daly": Formula(
        "Young-Daly checkpoint interval sqrt(2 x write x MTBF) and its overhead",
        (Input("--write-minutes", "seconds", "checkpoint write time (minutes)", bare=_MIN),
         Input("--mtbf-hours", "seconds", "the job's MTBF (hours)", bare=_H, default=0.0),
         Input("--gpus", "count", "devices (with --gpu-mtbf-hours)", default=0),
         Input("--gpu-mtbf-hours", "seconds", "one device's MTBF (hours)", bare=_H,
               default=0.0)),
        _young_daly),
    "mtbf": Formula(
        "cluster failure rate from node survival (or node MTBF)",
        (Input("--nodes", "count", "nodes N"),
         Input("--node-hour-survival", "fraction", "chance a node survives an hour",
               default=0.0),
         Input("--node-mtbf-hours", "seconds", "one node's MTBF (hours)", bare=_H,
               default=0.0)),
        lambda v: formulas.mtbf(int(v["nodes"]), v["node_hour_survival"],
                                v["node_mtbf_hours"] / _H)),
    "grad-accum": Formula(
        "synchronisation overhead with gradient accumulation",
        (Input("--comm-ms", "seconds", "allreduce time (ms)", bare=_MS),
         Input("--steps", "count", "micro-steps accumulated per allreduce"),
         Input("--compute-ms", "seconds", "compute per micro-step (ms)", bare=_MS)),
        lambda v: formulas.grad_accum(v["comm_ms"], int(v["steps"]), v["compute_ms"])),
    "hybrid": Formula(
        "memory and data-parallel traffic per rank of dp x pp x tp",
        (Input("--params", "count", "parameters"), Input("--tp", "count", "tensor parallel"),
         Input("--pp", "count", "pipeline stages"), Input("--dp", "count", "data parallel"),
         Input("--micro-batches", "count", "micro-batches (adds the bubble)", default=0),
         Input("--bytes-per-param", "bytes", "model-state bytes per parameter", default=16.0),
         Input("--grad-bytes", "bytes", "gradient bytes per parameter", default=2.0)),
        lambda v: formulas.hybrid(v["params"], int(v["tp"]), int(v["pp"]), int(v["dp"]),
                                  int(v["micro_batches"]), v["bytes_per_param"],
                                  v["grad_bytes"])),
}


def add_calc_parsers(sub: argparse._SubParsersAction) -> None:
    """One sub-command per formula; values stay text until :func:`run_calc` parses them."""
    for name, formula in FORMULAS.items():
        p = sub.add_parser(name, help=formula.help, description=formula.help)
        for inp in formula.inputs:
            default = "" if inp.default is None else f" (default {inp.default})"
            p.add_argument(inp.flag, required=inp.default is None, default=inp.default,
                           help=inp.help + default, metavar="VALUE")
        p.add_argument("--json", action="store_true", help="print the results as JSON")


def _value(inp: Input, raw: Any) -> Any:
    if inp.kind == "triple":
        return _bytes_per_param(raw)
    if inp.kind == "choice":
        if raw not in inp.choices:
            raise ConfigError(f"{inp.flag}: one of {', '.join(inp.choices)}, got {raw!r}")
        return raw
    if inp.kind == "fraction":
        text = str(raw).strip()
        if text.endswith("%"):
            return parse_quantity(text[:-1], "count", inp.flag) / 100.0
        return parse_quantity(raw, "count", inp.flag)
    value = parse_quantity(raw, inp.kind, inp.flag, inp.bare)
    if value < 0:
        raise ConfigError(f"{inp.flag}: must not be negative, got {raw!r}")
    if inp.kind == "count":  # the formulas take int(): 2.5 must not become 2, nor 4.1M 4099999
        if not (math.isfinite(value) and math.isclose(value, round(value), rel_tol=1e-9)):
            raise ConfigError(f"{inp.flag}: must be a whole number, got {raw!r}")
        value = float(round(value))
    return value


def run_calc(name: str, args: argparse.Namespace) -> dict[str, float]:
    """Parse the inputs of formula ``name`` from ``args`` and compute it."""
    formula = FORMULAS[name]
    return formula.compute({i.dest: _value(i, getattr(args, i.dest)) for i in formula.inputs})


def format_results(results: dict[str, Any], as_json: bool) -> str:
    """A two-column table with readable units, or JSON."""
    if as_json:
        return json.dumps(results, indent=2)
    return "\n".join(f"{k:<32} {_readable(k, v)}" for k, v in results.items())


def _readable(name: str, value: Any) -> str:
    if not isinstance(value, float):
        return str(value)
    if name.endswith("bytes") or name.endswith("bytes_per_rank") or "_bytes_" in name:
        for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(value) >= scale:
                return f"{value / scale:.4g} {unit}  ({value:.6g} B)"
        return f"{value:.6g} B"
    if name.endswith("_s"):
        return f"{value * 1e3:.6g} ms"
    if name.endswith(("fraction", "overhead", "efficiency", "per_hour", "accumulation")):
        return f"{value * 100:.4g} %"
    if name.endswith("bandwidth"):
        return f"{value / 1e9:.4g} GB/s"
    return f"{value:.6g}"
