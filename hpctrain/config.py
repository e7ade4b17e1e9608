"""Job configuration: frozen dataclasses loaded from TOML.

One precedence rule: ``--set section.key=value`` on the command line over the TOML job file
over ``HPCTRAIN_SECTION__KEY`` environment variables over the defaults below. The defaults
are the embedded default job (``hpctrain train`` with no file).

Every field is declared with :func:`option`, which carries its help text and its allowed
values; :func:`load_config` checks keys, types and ranges once and raises
:class:`~hpctrain.errors.ConfigError` naming the key path, where it came from (file and line,
flag or variable) and what is allowed. ``hpctrain config --doc`` prints the key table that
README.md carries.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.errors import ConfigError

__all__ = [
    "option",
    "RuntimeConfig",
    "DataConfig",
    "ModelConfig",
    "TrainConfig",
    "PSConfig",
    "CommConfig",
    "JobConfig",
    "load_config",
    "dump_toml",
    "doc_table",
    "NUM_DENSE",
]

NUM_DENSE = 13
"""Dense (integer count) features per sample, as in the Criteo layout."""

ENV_PREFIX = "HPCTRAIN_"


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None,
           min: float | None = None, max: float | None = None) -> Any:
    """Declare a config field with its documentation and allowed values.

    ``min``/``max`` bound a number, or every item of a tuple; ``choices`` lists the allowed
    values of a scalar, or of every item of a tuple.
    """
    meta = {"help": help, "choices": tuple(choices) if choices else None, "min": min, "max": max}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RuntimeConfig:
    threads: int = option(0, "torch intra-op threads per rank; 0 divides the node's cores "
                             "among the ranks on it", min=0)
    device: str = option("auto", "dense compute device; auto takes CUDA (device = local rank) "
                                 "when available", choices=("auto", "cpu", "cuda"))
    log_level: str = option("info", "log level of rank 0 (other ranks log warnings and up)",
                            choices=("debug", "info", "warning", "error"))


@dataclass(frozen=True)
class DataConfig:
    source: str = option("synthetic", "synthetic Zipf click log, Criteo text files, or an "
                                      "HDF5 file from `hpctrain preprocess`",
                         choices=("synthetic", "criteo", "hdf5"))
    paths: tuple[str, ...] = option((), "input files for criteo/hdf5 (relative to the job "
                                        "file's folder)")
    eval_paths: tuple[str, ...] = option((), "held-out files; empty holds out the last "
                                             "eval_fraction of the samples instead")
    eval_fraction: float = option(0.1, "share of samples held out when eval_paths is empty",
                                  min=0.0, max=0.9)
    table_sizes: tuple[int, ...] = option(
        (1000, 20000, 50000, 5000, 300, 20, 10000, 600, 3, 50000, 5000, 40000, 3000,
         27, 10000, 40000, 10, 5000, 2000, 4, 40000, 15, 15, 20000, 80, 30000),
        "rows per embedding table (one table per categorical feature); criteo ids are hashed "
        "into these ranges", min=1)
    zipf: float = option(1.05, "synthetic: Zipf exponent of the categorical ids", min=0.0,
                         max=4.0)
    train_samples: int = option(400_000, "synthetic: training samples", min=1)
    eval_samples: int = option(40_000, "synthetic: held-out samples", min=1)
    seed: int = option(1234, "synthetic: seed of the generator and of the hidden model", min=0)
    on_bad_line: str = option("error", "criteo: stop on a malformed line, or skip and count it",
                              choices=("error", "skip"))


@dataclass(frozen=True)
class ModelConfig:
    embedding_dim: int = option(16, "embedding row width (shared by all tables)", min=1)
    bottom_mlp: tuple[int, ...] = option((64, 32, 16), "bottom MLP layer widths after the 13 "
                                                       "dense inputs; the last equals "
                                                       "embedding_dim", min=1)
    top_mlp: tuple[int, ...] = option((128, 64, 1), "top MLP layer widths after the "
                                                    "interaction; the last is 1", min=1)


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = option(512, "global mini-batch, split over the workers", min=1)
    steps: int = option(0, "optimizer steps; 0 runs one pass over the training split", min=0)
    lr: float = option(0.1, "learning rate (dense and embedding)", min=0.0)
    optimizer: str = option("adagrad", "sgd, or adagrad (row-wise for embedding tables)",
                            choices=("sgd", "adagrad"))
    warmup_steps: int = option(0, "linear learning-rate warm-up steps", min=0)
    accumulate: int = option(1, "micro-batches accumulated per optimizer step", min=1)
    eval_every: int = option(0, "steps between held-out evaluations; 0 evaluates at the end",
                             min=0)
    eval_batch_size: int = option(8192, "global batch of the evaluation pass", min=1)
    log_every: int = option(50, "steps between metrics.jsonl records", min=1)
    run_dir: str = option("", "run directory for config.toml and metrics.jsonl; empty makes "
                              "runs/<date-time>")
    seed: int = option(0, "seed of the model initialisation", min=0)
    progress: bool = option(True, "tqdm progress bar on rank 0")


@dataclass(frozen=True)
class PSConfig:
    servers: int = option(0, "ranks that act as parameter servers (the last ranks of the "
                             "world); 0 keeps every table on every worker", min=0)


@dataclass(frozen=True)
class CommConfig:
    algorithm: str = option("auto", "allreduce algorithm; auto runs the cheapest by the cost "
                                    "model", choices=("auto", "shm", "hierarchical",
                                                      "recursive_doubling", "halving_doubling",
                                                      "ring", "tree", "native", "torch"))
    check: bool = option(False, "before each collective, agree across ranks on size, dtype "
                                "and op (one small allgather) so a mismatch raises the same "
                                "error on every rank")
    bucket_kib: int = option(25600, "gradient bucket size for tensor fusion (KiB); smaller "
                                    "buckets start reducing earlier in backward, larger ones "
                                    "synchronise less", min=1)
    overlap: bool = option(True, "start a bucket's allreduce during backward as soon as its "
                                 "last gradient is ready")
    resident: bool = option(True, "keep fused gradients in the node's shared window when the "
                                  "workers fit one node (zero-copy allreduce)")
    calibration: str = option("", "cost-model file from `hpctrain bench calibrate` (relative "
                                  "to the job file's folder); empty uses built-in defaults")
    node_size: int = option(0, "ranks per node; 0 detects nodes, n > 0 treats each n "
                               "consecutive ranks as one node (exercises the inter-node "
                               "phase on one machine)", min=0)


@dataclass(frozen=True)
class JobConfig:
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    source: str = field(default="", compare=False, metadata={"internal": True})
    """Where the job came from (file path or ``embedded default``), for messages."""

    def __post_init__(self) -> None:
        m = self.model
        if m.bottom_mlp[-1] != m.embedding_dim:
            raise ConfigError(f"model.bottom_mlp: the last width must equal "
                              f"model.embedding_dim={m.embedding_dim}, got {m.bottom_mlp[-1]}")
        if m.top_mlp[-1] != 1:
            raise ConfigError(f"model.top_mlp: the last width must be 1 (the logit), "
                              f"got {m.top_mlp[-1]}")
        if self.data.source != "synthetic" and not self.data.paths:
            raise ConfigError(f"data.paths: data.source = {self.data.source!r} needs at least "
                              f"one input file")


# ---------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> JobConfig:
    """Build the job config from defaults, environment, a TOML file and ``--set`` overrides.

    Relative data paths in a file are resolved against the file's folder.
    """
    layers: dict[str, Any] = {}
    origins: dict[str, str] = {}
    env = os.environ if env is None else env
    for name, value in sorted(env.items()):
        if name.startswith(ENV_PREFIX) and "__" in name:
            section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
            _put(layers, origins, f"{section}.{key}", _parse_value(value), f"${name}")
    source = "embedded default"
    if path is not None:
        path = Path(path)
        table = _read_toml(path)
        _resolve_paths(table, path.parent)
        for key, value in _flatten(table):
            _put(layers, origins, key, value, f"{path}{_line_of(path, key)}")
        source = str(path)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        _put(layers, origins, key.strip(), _parse_value(raw.strip()), f"--set {key.strip()}")
    return _build(JobConfig, layers, "", origins, source)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the job file ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def _resolve_paths(table: dict[str, Any], folder: Path) -> None:
    data = table.get("data")
    if isinstance(data, dict):
        for key in ("paths", "eval_paths"):
            if isinstance(data.get(key), list):
                data[key] = [str(folder / p) if isinstance(p, str) else p for p in data[key]]
    comm = table.get("comm")
    if isinstance(comm, dict) and isinstance(comm.get("calibration"), str) and \
            comm["calibration"]:
        comm["calibration"] = str(folder / comm["calibration"])


def _flatten(table: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in table.items():
        if isinstance(value, dict):
            items.extend(_flatten(value, f"{prefix}{key}."))
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _line_of(path: Path, key: str) -> str:
    """`:LINE` of ``key`` (section.name) in a TOML file, or '' when it cannot be found."""
    section, _, name = key.rpartition(".")
    current = ""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return ""
    for number, line in enumerate(lines, 1):
        header = re.match(r"\s*\[([^\]]+)\]", line)
        if header:
            current = header.group(1).strip()
        elif current == section and re.match(rf"\s*{re.escape(name)}\s*=", line):
            return f":{number}"
    return ""


def _parse_value(raw: str) -> Any:
    """A value from the command line or the environment: TOML syntax, or else a bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _put(layers: dict[str, Any], origins: dict[str, str], key: str, value: Any,
         origin: str) -> None:
    parts = key.split(".")
    node = layers
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: key {key!r} nests inside a value")
        node = child
    node[parts[-1]] = value
    origins[key] = origin


def _build(cls: type, data: Mapping[str, Any], prefix: str, origins: Mapping[str, str],
           source: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            full = key if key in origins else next(
                (k for k in origins if k.startswith(key + ".")), key)
            where = origins.get(full, source)
            if prefix:
                raise ConfigError(f"unknown key {full!r} ({where}); keys of {prefix[:-1]} are: "
                                  f"{', '.join(sorted(fields))}")
            raise ConfigError(f"unknown key {full!r} ({where}): no section {name!r}; sections "
                              f"are: {', '.join(sorted(fields))}")
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key!r} ({origins.get(key, source)}) must be a table "
                                  f"[{key}], got {value!r}")
            kwargs[name] = _build(hint, value, f"{key}.", origins, source)
        else:
            kwargs[name] = _check(key, value, hint, fields[name].metadata,
                                  origins.get(key, source))
    if cls is JobConfig:
        kwargs["source"] = source
    return cls(**kwargs)


def _check(key: str, value: Any, hint: Any, meta: Mapping[str, Any], origin: str) -> Any:
    if typing.get_origin(hint) is tuple:
        item_type = typing.get_args(hint)[0]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} ({origin}): expected a list of {item_type.__name__}, "
                              f"got {value!r}")
        return tuple(_check_scalar(f"{key}[{i}]", v, item_type, meta, origin)
                     for i, v in enumerate(value))
    return _check_scalar(key, value, hint, meta, origin)


def _check_scalar(key: str, value: Any, kind: type, meta: Mapping[str, Any],
                  origin: str) -> Any:
    ok = (isinstance(value, kind) and not (kind is int and isinstance(value, bool))) or (
        kind is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{key} ({origin}): expected {_describe(kind, meta)}, got {value!r}")
    if kind is float:
        value = float(value)
        if value != value:
            raise ConfigError(f"{key} ({origin}): expected {_describe(kind, meta)}, got nan")
    choices, lo, hi = meta.get("choices"), meta.get("min"), meta.get("max")
    if (choices and value not in choices) or (lo is not None and value < lo) or (
            hi is not None and value > hi):
        raise ConfigError(f"{key} ({origin}): expected {_describe(kind, meta)}, got {value!r}")
    return value


def _describe(kind: type, meta: Mapping[str, Any]) -> str:
    if meta.get("choices"):
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    name = {int: "an integer", float: "a number", bool: "true or false",
            str: "a string"}[kind]
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{name} in [{lo}, {hi}]"
    if lo is not None:
        return f"{name} >= {lo}"
    return name


# ---------------------------------------------------------------------------------------
# Writing and documenting


def dump_toml(config: JobConfig) -> str:
    """The resolved config as a TOML job file that :func:`load_config` reads back."""
    out = [f"# resolved hpctrain job (from {config.source or 'embedded default'})"]
    for section in _sections(config):
        out.append(f"\n[{section.name}]")
        for f in dataclasses.fields(getattr(config, section.name)):
            out.append(f"{f.name} = {_toml_value(getattr(getattr(config, section.name), f.name))}")
    return "\n".join(out) + "\n"


def _sections(config_or_cls: Any) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(config_or_cls) if not f.metadata.get("internal")]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def doc_table() -> str:
    """Markdown table of every config key, its default and its help (README carries it)."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    defaults = JobConfig()
    for section in _sections(JobConfig):
        for f in dataclasses.fields(getattr(defaults, section.name)):
            value = _toml_value(getattr(getattr(defaults, section.name), f.name))
            if len(value) > 40:
                value = value[:37] + "..."
            allowed = f.metadata.get("choices")
            text = f.metadata["help"] + (f" ({' / '.join(map(str, allowed))})" if allowed else "")
            rows.append(f"| `{section.name}.{f.name}` | `{value}` | {text} |")
    return "\n".join(rows) + "\n"
