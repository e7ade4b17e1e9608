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
import math
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
    "EmbeddingsConfig",
    "SyncConfig",
    "CheckpointConfig",
    "ParallelConfig",
    "TieringConfig",
    "CommConfig",
    "JobConfig",
    "load_config",
    "staleness_bound",
    "emulated_network",
    "local_period",
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
    threads: int = option(0, "torch intra-op threads per rank; 0: the rank's cores (its "
                             "affinity mask), divided among the node's ranks that share them; "
                             "on a parameter-server rank, the threads that share each big "
                             "request's row passes (see the Parameter server section)",
                          min=0)
    device: str = option("auto", "dense compute device; auto takes CUDA (device = local rank) "
                                 "when available", choices=("auto", "cpu", "cuda"))
    log_level: str = option("info", "log level of rank 0 (other ranks log warnings and up)",
                            choices=("debug", "info", "warning", "error"))
    watchdog_warn_s: float = option(60.0, "a wait (collective, pull, push) this long logs "
                                          "which ranks have not arrived (0: off)", min=0.0)
    watchdog_abort_s: float = option(300.0, "a wait this long aborts the job with that "
                                            "message; 4x as long when the missing ranks "
                                            "are alive and computing (0: off)", min=0.0)
    trace: str = option("", "write a per-rank timeline of the run (Chrome trace / Perfetto "
                            "JSON, merged by rank 0) to this path; empty: off (see "
                            "`hpctrain trace summarize`)")


@dataclass(frozen=True)
class DataConfig:
    source: str = option("synthetic", "synthetic Zipf click log, Criteo text files, or an "
                                      "HDF5 file from `hpctrain preprocess`",
                         choices=("synthetic", "criteo", "hdf5"))
    paths: tuple[str, ...] = option((), "input files for criteo/hdf5 (relative to the job "
                                        "file's folder)")
    eval_paths: tuple[str, ...] = option((), "criteo: held-out files; empty holds out the "
                                             "last eval_fraction of the samples instead (an "
                                             "hdf5 file has its own eval group)")
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
    lr: float = option(0.05, "learning rate (dense and embedding)", min=0.0)
    optimizer: str = option("adagrad", "dense optimizer (hpctrain.train.optim); also picks "
                                       "the tables' one when sparse_optimizer is auto",
                            choices=("sgd", "adagrad", "adam", "adamw", "lars", "lamb"))
    sparse_optimizer: str = option("auto", "embedding tables' optimizer: sgd, row-wise "
                                           "adagrad or lazy adam; auto pairs sgd and lars with "
                                           "sgd, adagrad with adagrad, adam, adamw and lamb "
                                           "with adam", choices=("auto", "sgd", "adagrad",
                                                                 "adam"))
    momentum: float = option(0.0, "momentum of sgd and lars", min=0.0, max=0.999)
    nesterov: bool = option(False, "Nesterov momentum (sgd with momentum > 0)")
    weight_decay: float = option(0.0, "dense parameters only: L2 for sgd, adagrad and adam, "
                                      "decoupled for adamw, inside the trust ratio for lars "
                                      "and lamb", min=0.0)
    betas: tuple[float, ...] = option((0.9, 0.999), "Adam moment decays (adam, adamw, lamb, "
                                                    "lazy adam tables)", min=0.0, max=0.9999)
    eps: float = option(1e-8, "Adam epsilon (adam, adamw, lamb, lazy adam tables)", min=0.0)
    clip_norm: float = option(0.0, "clip the reduced dense gradient to this global L2 norm "
                                   "(0: off)", min=0.0)
    lr_scaling: str = option("none", "scale lr to the global batch (batch_size x accumulate) "
                                     "against lr_base_batch: linearly or by the square root",
                             choices=("none", "linear", "sqrt"))
    lr_base_batch: int = option(512, "global batch at which lr is the given value "
                                     "(lr_scaling linear or sqrt)", min=1)
    zero: int = option(0, "ZeRO stage over the data-parallel workers: 0 off, 1 shards the "
                          "dense optimizer state, 2 also reduce-scatters the gradients and "
                          "keeps a shard of them (3 is not built)", min=0, max=3)
    warmup_steps: int = option(30, "linear learning-rate warm-up steps", min=0)
    accumulate: int = option(1, "micro-batches accumulated per optimizer step", min=1)
    eval_every: int = option(0, "steps between held-out evaluations; 0 evaluates at the end",
                             min=0)
    eval_subset: int = option(8192, "held-out samples of the periodic evaluations (the first "
                                    "ones of the eval split, the same every time; 0: all), "
                                    "recorded as the heldout_* curve", min=0)
    eval_batch_size: int = option(2048, "global batch of the evaluation pass", min=1)
    log_every: int = option(50, "steps between metrics.jsonl records", min=1)
    run_dir: str = option("", "run directory for config.toml and metrics.jsonl; empty makes "
                              "runs/<date-time>[-<job id>[_<array index>]]-<random>")
    seed: int = option(0, "seed of the model initialisation", min=0)
    progress: bool = option(True, "tqdm progress bar on rank 0")
    on_nonfinite: str = option("stop", "a step with a NaN or Inf in its dense features, loss or "
                                       "gradients: stop naming step, rank and tensor, or skip "
                                       "it on every worker", choices=("stop", "skip"))

    @property
    def table_optimizer(self) -> str:
        """The tables' optimizer: ``sparse_optimizer``, or its pair of ``optimizer``."""
        if self.sparse_optimizer != "auto":
            return self.sparse_optimizer
        return {"sgd": "sgd", "lars": "sgd", "adagrad": "adagrad"}.get(self.optimizer, "adam")

    def __post_init__(self) -> None:
        if self.momentum and self.optimizer not in ("sgd", "lars"):
            raise ConfigError(f"train.momentum = {self.momentum}: momentum applies to "
                              f"train.optimizer sgd or lars, not {self.optimizer!r}")
        if self.nesterov and (self.optimizer != "sgd" or not self.momentum):
            raise ConfigError("train.nesterov needs train.optimizer = 'sgd' and "
                              "train.momentum > 0")
        adam = self.optimizer in ("adam", "adamw", "lamb") or self.table_optimizer == "adam"
        if len(self.betas) != 2:
            raise ConfigError(f"train.betas: expected two values, got {list(self.betas)}")
        if not adam and (self.betas != (0.9, 0.999) or self.eps != 1e-8):
            raise ConfigError("train.betas/train.eps apply to adam, adamw, lamb and lazy adam "
                              f"tables; this job uses {self.optimizer!r} and "
                              f"{self.table_optimizer!r} tables")
        if self.lr_scaling == "none" and self.lr_base_batch != 512:
            raise ConfigError("train.lr_base_batch applies with train.lr_scaling = 'linear' "
                              "or 'sqrt'")


@dataclass(frozen=True)
class PSConfig:
    servers: int = option(0, "ranks that act as parameter servers (the last ranks of the "
                             "world); 0 keeps every table on every worker", min=0)
    sharding: str = option("auto", "placement of table rows on the servers; auto: tables "
                                   "under table_wise_below rows whole on one server, larger "
                                   "ones row_hash", choices=("auto", "table", "row_range",
                                                             "row_hash"))
    table_wise_below: int = option(100_000, "auto sharding: tables with fewer rows stay whole",
                                   min=1)
    prefetch: bool = option(False, "pull the next batch's rows while the current one "
                                   "computes (reads become one step stale)")
    mode: str = option("hybrid", "hybrid: dense layers data parallel by allreduce, tables on "
                                 "the servers; full: dense parameters on the servers too, as "
                                 "one more table, so the sync model governs everything",
                       choices=("hybrid", "full"))
    wire_dtype: str = option("float32", "format of pulled rows and pushed gradients on the "
                                        "wire; bf16/fp16 halve them (rows and optimizer state "
                                        "stay float32 on the servers; fp16 scaled per "
                                        "message)", choices=("float32", "bf16", "fp16"))


@dataclass(frozen=True)
class EmbeddingsConfig:
    mode: str = option("auto", "where the tables live: replicated on every worker, on the "
                               "parameter servers (ps), or sharded over the workers and "
                               "reached by all-to-all (alltoall); auto follows ps.servers",
                       choices=("auto", "replicated", "ps", "alltoall"))
    sharding: str = option("table_wise", "alltoall: tables whole on one worker each, rows "
                                         "hashed over all workers, columns split over all "
                                         "workers, or table_row_wise (tables on nodes, rows "
                                         "over the node's workers)",
                           choices=("table_wise", "row_wise", "column_wise",
                                    "table_row_wise"))

    def layout(self, servers: int) -> str:
        """The layout in effect: ``mode``, with ``auto`` resolved by ``ps.servers``."""
        if self.mode == "auto":
            return "ps" if servers else "replicated"
        return self.mode


@dataclass(frozen=True)
class SyncConfig:
    model: str = option("bsp", "consistency model of the parameter-server tables: bsp, "
                               "ssp:S (staleness bound S) or asp")
    table_models: tuple[str, ...] = option((), "per-table overrides 'TABLE=MODEL'; TABLE is "
                                               "t0, t1, ... or dense (full mode)")
    deterministic: bool = option(False, "servers apply each step's pushes together, in worker "
                                        "order, once all have arrived: bitwise reproducible; "
                                        "needs staleness 0 and ps.prefetch off (full mode does "
                                        "so whenever these hold)")
    slow_workers: tuple[int, ...] = option((), "straggler injection: workers that are always "
                                               "slow_factor times slower", min=0)
    slow_factor: float = option(1.0, "persistent straggler slowdown", min=1.0)
    straggle_probability: float = option(0.0, "transient stragglers: chance that a worker's "
                                              "step is slowed", min=0.0, max=1.0)
    straggle_factor: float = option(1.0, "transient straggler slowdown", min=1.0)
    straggler_seed: int = option(0, "seed of the transient straggler draws", min=0)
    dense: str = option("bsp", "sync model of the dense part in data-parallel mode: bsp (a "
                               "gradient reduction every step) or local:H (local SGD: H local "
                               "steps between parameter averages)")
    ssp_lr: str = option("constant", "learning rate under a staleness bound S (ssp:S): "
                                     "constant, or sqrt: train.lr / sqrt(1 + S)",
                         choices=("constant", "sqrt"))


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = option(0, "checkpoint every N optimizer steps (0: off)", min=0)
    every_minutes: float = option(30.0, "checkpoint every T minutes of training, a cadence "
                                        "that bounds the work a node failure loses on a "
                                        "queue (0: off)", min=0.0)
    mtbf_hours: float = option(0.0, "the allocation's mean time between failures; when set, "
                                    "checkpoint at the Young-Daly interval sqrt(2 x measured "
                                    "write time x MTBF) (0: off)", min=0.0)
    at_end: bool = option(True, "also checkpoint when training ends (a requeued or "
                                "extended run resumes from it)")
    keep: int = option(2, "verified checkpoints kept (only older ones and incomplete "
                          "leftovers are deleted)", min=1)


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = option(1, "tensor-parallel ranks per MLP (Megatron column/row pairs, one "
                        "allreduce each way per pair); kept inside a node when it can", min=1)
    pp: int = option(1, "pipeline stages: stage 0 runs embeddings, bottom MLP, interaction "
                        "and the first top-MLP layers, the others the rest of the top MLP",
                     min=1)
    dp: int = option(0, "data-parallel replicas; 0 takes workers / (tp * pp)", min=0)
    micro_batches: int = option(4, "micro-batches each replica's batch is split into when "
                                   "tp or pp > 1", min=1)
    schedule: str = option("1f1b", "pipeline schedule: all forwards then all backwards, or "
                                   "one-forward-one-backward", choices=("gpipe", "1f1b"))
    stage_cuts: tuple[int, ...] = option((), "top-MLP layer index at which each stage after "
                                             "the first begins (pp - 1 increasing values); "
                                             "empty balances layer counts", min=0)
    backend: str = option("auto", "tensor/pipeline traffic over MPI or torch.distributed "
                                  "(NCCL on CUDA, gloo on CPU); auto takes torch on CUDA",
                          choices=("auto", "mpi", "torch"))
    wire_dtype: str = option("float32", "format of the activations and input gradients "
                                        "between pipeline stages; bf16/fp16 halve them "
                                        "(fp16 scaled per message)",
                             choices=("float32", "bf16", "fp16"))


@dataclass(frozen=True)
class TieringConfig:
    budget: float = option(0.0, "hot tier: rows replicated on every worker, in budget_unit; 0 "
                                "is off, a budget above the tables makes every row hot "
                                "(needs ps.servers >= 1, where the cold rows stay)", min=0.0)
    budget_unit: str = option("fraction", "unit of tiering.budget: a share of all rows, rows, "
                                          "or bytes per worker (id, values and optimizer "
                                          "state per hot row)",
                              choices=("fraction", "rows", "bytes"))
    policy: str = option("lfu", "hot set: the rows with the highest decayed lookup counts, or "
                                "the most recently seen", choices=("lfu", "lru"))
    admission: float = option(2.0, "decayed lookups a row needs before it may become hot",
                              min=0.0)
    interval: int = option(50, "steps between re-tierings (after warm-up ones at steps 1, 2, "
                               "4, ...); each installs the hot set planned in the background "
                               "from the counts up to the one before", min=1)
    prescan: int = option(0, "training samples whose ids are counted before the first step to "
                             "seed the hot set (the split's first; 0 learns it online only)",
                          min=0)
    decay: float = option(0.9, "factor on every lookup count at each re-tiering, so the hot "
                               "set follows drift", min=0.0, max=1.0)
    exact_below: int = option(1_000_000, "tables with fewer rows count lookups exactly (4 "
                                         "bytes a row); larger ones in a count-min sketch",
                              min=1)
    sketch_width: int = option(1 << 16, "counters per hash row of a table's count-min sketch",
                               min=1)
    sketch_depth: int = option(4, "hash rows of a count-min sketch (overcount probability "
                                  "exp(-depth))", min=1)


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
    wire_dtype: str = option("float32", "message format of the dense gradient reduction; "
                                        "bf16/fp16 halve its bytes (float32 accumulation and "
                                        "master copy; fp16 scaled per bucket to fit)",
                             choices=("float32", "bf16", "fp16"))
    emulate: str = option("", "emulated network 'LATENCY_US,GBPS' (e.g. '20,10'): messages "
                              "between ranks of different nodes (comm.node_size; each "
                              "parameter server its own node) arrive latency + bytes / "
                              "bandwidth late; empty: off")

    def __post_init__(self) -> None:
        network = emulated_network(self.emulate)
        if network is not None and self.algorithm == "torch":
            raise ConfigError("comm.emulate: comm.algorithm = 'torch' reduces through "
                              "gloo/NCCL, whose messages the emulated network cannot delay; "
                              "use auto or one of the toolkit's algorithms")
        if self.wire_dtype != "float32" and self.algorithm in ("native", "torch"):
            raise ConfigError(f"comm.wire_dtype = {self.wire_dtype!r}: comm.algorithm = "
                              f"{self.algorithm!r} cannot carry it (MPI has no 16-bit float "
                              f"sum and widens to float32); use auto or one of the toolkit's "
                              f"algorithms (ring, tree, ...)")


@dataclass(frozen=True)
class JobConfig:
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tiering: TieringConfig = field(default_factory=TieringConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    source: str = field(default="", compare=False, metadata={"internal": True})
    """Where the job came from (file path or ``embedded default``), for messages."""

    def staleness_bounds(self) -> list[int | None]:
        """Staleness bounds of ``sync.model`` and of every ``sync.table_models`` override."""
        bounds = [staleness_bound(self.sync.model)]
        for i, item in enumerate(self.sync.table_models):
            table, sep, name = item.partition("=")
            if not sep or not table.strip():
                raise ConfigError(f"sync.table_models[{i}]: expected 'TABLE=MODEL', got {item!r}")
            bounds.append(staleness_bound(name, f"sync.table_models[{i}]"))
        return bounds

    @property
    def sums_pushes(self) -> bool:
        """Whether the servers sum each step's pushes before applying them: asked for
        (``sync.deterministic``), or full mode under staleness 0 everywhere without
        prefetch. There, a push applied on arrival would move the dense values about
        ``sqrt(workers)`` times as far as one summed Adagrad update (each of Adagrad's
        early steps is about ``lr``), which left some runs on a plateau."""
        return self.sync.deterministic or (
            self.ps.mode == "full" and bool(self.ps.servers) and not self.ps.prefetch
            and all(b == 0 for b in self.staleness_bounds()))

    def unused_keys(self) -> list[str]:
        """Keys set away from their defaults that this job's mode does not read, one line
        each for a warning. Warned, not refused: ``compare-sync`` and the planner load a job
        before they add the servers it is then run with."""
        notes: list[str] = []

        def changed(section: str, keys: Sequence[str]) -> list[str]:
            ours = getattr(self, section)
            default = type(ours)()
            return [f"{section}.{k}" for k in keys if getattr(ours, k) != getattr(default, k)]

        def note(keys: list[str], why: str) -> None:
            if keys:
                notes.append(f"{', '.join(keys)} {'is' if len(keys) == 1 else 'are'} not "
                             f"used: {why}")

        if not self.ps.servers:
            note(changed("sync", ("model", "table_models", "deterministic"))
                 + changed("ps", ("prefetch", "sharding", "table_wise_below")),
                 f"for parameter-server tables only; ps.servers = 0 (tables "
                 f"{self.embeddings.layout(0)}, every step synchronous)")
        if not self.tiering.budget:
            note(changed("tiering", [f.name for f in dataclasses.fields(TieringConfig)
                                     if f.name != "budget"]),
                 "tiering.budget = 0 (no hot tier)")
        if self.parallel.tp * self.parallel.pp == 1:
            note(changed("parallel", ("micro_batches", "schedule")),
                 "parallel.tp = parallel.pp = 1 (no tensor or pipeline parallelism)")
        d = self.data
        if d.source == "synthetic":
            note(changed("data", ("paths", "eval_paths", "eval_fraction", "on_bad_line")),
                 "data.source = 'synthetic' reads no files")
        else:
            note(changed("data", ("zipf", "train_samples", "eval_samples", "seed")),
                 f"for synthetic data only; data.source = {d.source!r}")
        if d.source == "hdf5":
            note(changed("data", ("eval_fraction", "on_bad_line")),
                 "an hdf5 file holds its own eval group, checked when it was written")
            if d.eval_paths:
                notes.append("data.eval_paths is not read with data.source = 'hdf5': the "
                             "file's own eval group is the held-out data (hpctrain "
                             "preprocess wrote data.eval_paths into it)")
        elif d.source == "criteo" and d.eval_paths:
            note(changed("data", ("eval_fraction",)),
                 "data.eval_paths holds the held-out data")
        return notes

    def __post_init__(self) -> None:
        _check_inputs(self)
        m = self.model
        if m.bottom_mlp[-1] != m.embedding_dim:
            raise ConfigError(f"model.bottom_mlp: the last width must equal "
                              f"model.embedding_dim={m.embedding_dim}, got {m.bottom_mlp[-1]}")
        if m.top_mlp[-1] != 1:
            raise ConfigError(f"model.top_mlp: the last width must be 1 (the logit), "
                              f"got {m.top_mlp[-1]}")
        bounds = self.staleness_bounds()
        if self.sync.ssp_lr == "sqrt" and (bounds[0] is None or not self.ps.servers):
            raise ConfigError(f"sync.ssp_lr = 'sqrt' scales by the staleness bound of "
                              f"sync.model on parameter servers; sync.model = "
                              f"{self.sync.model!r} with ps.servers = {self.ps.servers} has none")
        if self.sync.deterministic and (self.ps.prefetch or any(b != 0 for b in bounds)):
            raise ConfigError("sync.deterministic needs staleness 0 everywhere (bsp or ssp:0) "
                              "and ps.prefetch = false")
        if self.parallel.wire_dtype != "float32" and self.parallel.pp == 1:
            raise ConfigError(f"parallel.wire_dtype = {self.parallel.wire_dtype!r} formats "
                              f"the messages between pipeline stages; parallel.pp = 1 has none")
        if self.parallel.tp * self.parallel.pp > 1 and self.ps.servers:
            raise ConfigError("parallel.tp/pp > 1 keeps the tables on pipeline stage 0; it does "
                              "not combine with ps.servers > 0")
        cuts = self.parallel.stage_cuts
        if self.parallel.pp > len(m.top_mlp) + 1:
            raise ConfigError(f"parallel.pp = {self.parallel.pp}: the dense model has at most "
                              f"{len(m.top_mlp) + 1} stages (the features part and "
                              f"{len(m.top_mlp)} top-MLP layers)")
        if cuts and len(cuts) != self.parallel.pp - 1:
            raise ConfigError(f"parallel.stage_cuts: pp = {self.parallel.pp} stages need "
                              f"{self.parallel.pp - 1} cuts, got {list(cuts)}")
        if any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)) or (
                cuts and cuts[-1] >= len(m.top_mlp)):
            raise ConfigError(f"parallel.stage_cuts: {list(cuts)} must increase and stay "
                              f"below the {len(m.top_mlp)} layers of model.top_mlp")
        if self.tiering.budget > 0 and self.ps.servers == 0:
            raise ConfigError(f"tiering.budget = {self.tiering.budget}: the cold tier lives on "
                              f"the parameter servers; set ps.servers >= 1 or the budget to 0")
        if self.tiering.budget > 0 and self.ps.mode != "hybrid":
            raise ConfigError("tiering.budget > 0 needs ps.mode = 'hybrid' (the hot tier's "
                              "counts ride in the dense allreduce)")
        e = self.embeddings
        if (e.mode == "ps") != (self.ps.servers > 0) and e.mode != "auto":
            raise ConfigError(f"embeddings.mode = {e.mode!r} with ps.servers = "
                              f"{self.ps.servers}: " + ("'ps' needs ps.servers >= 1"
                              if e.mode == "ps" else "parameter servers need mode 'ps'"))
        if e.sharding != "table_wise" and e.layout(self.ps.servers) != "alltoall":
            raise ConfigError(f"embeddings.sharding = {e.sharding!r} applies to "
                              f"embeddings.mode = 'alltoall' only")
        if e.mode == "alltoall" and self.parallel.tp * self.parallel.pp > 1:
            raise ConfigError("embeddings.mode = 'alltoall' does not combine with "
                              "parallel.tp/pp > 1 (tables on pipeline stage 0)")
        self._check_optimizer()
        if local_period(self.sync.dense):
            if self.ps.servers and self.ps.mode == "full":
                raise ConfigError("sync.dense = local:H: with ps.mode = 'full' the dense "
                                  "parameters live on the servers; use hybrid mode")
            if self.parallel.tp * self.parallel.pp > 1:
                raise ConfigError("sync.dense = local:H is not built for parallel.tp or pp > 1")
        if self.ps.wire_dtype != "float32" and not self.ps.servers:
            raise ConfigError("ps.wire_dtype applies to parameter-server traffic; this job has "
                              "ps.servers = 0")
        if self.comm.wire_dtype != "float32" and self.ps.servers and self.ps.mode == "full":
            raise ConfigError("comm.wire_dtype: with ps.mode = 'full' there is no dense "
                              "reduction (dense gradients travel in the push: see "
                              "ps.wire_dtype)")
        if self.data.source != "synthetic" and not self.data.paths:
            raise ConfigError(f"data.paths: data.source = {self.data.source!r} needs at least "
                              f"one input file")

    def _check_optimizer(self) -> None:
        """Optimizer settings the mode cannot honour (full PS, tensor/pipeline parallel)."""
        tc = self.train
        if self.ps.servers and self.ps.mode == "full":
            if tc.optimizer not in ("sgd", "adagrad", "adam"):
                raise ConfigError(f"train.optimizer = {tc.optimizer!r}: with ps.mode = 'full' "
                                  f"the servers run the dense optimizer, and they run sgd, "
                                  f"adagrad and adam only")
            for key in ("momentum", "weight_decay", "clip_norm"):
                if getattr(tc, key):
                    raise ConfigError(f"train.{key}: with ps.mode = 'full' the servers run "
                                      f"the dense optimizer, which has no {key}")
        if tc.on_nonfinite == "skip" and self.tiering.budget > 0 and tc.table_optimizer == "adam":
            raise ConfigError("train.on_nonfinite = 'skip' with tiering: a skipped step still "
                              "sums zero gradients into the hot rows, which lazy adam tables "
                              "would move (train.sparse_optimizer sgd or adagrad, or stop)")
        grid = self.parallel.tp * self.parallel.pp
        if tc.zero:
            why = ("is not built (ZeRO-1 and 2 only)" if tc.zero > 2 else
                   "reduce-scatters float32 gradients; comm.wire_dtype must be float32"
                   if tc.zero == 2 and self.comm.wire_dtype != "float32" else
                   "does not combine with ps.mode = 'full' (the dense state is on the servers)"
                   if self.ps.servers and self.ps.mode == "full" else
                   f"needs whole-layer norms: not built for {tc.optimizer}"
                   if tc.optimizer in ("lars", "lamb") else
                   "runs the dense part by gradient reductions; not with sync.dense = local:H"
                   if local_period(self.sync.dense) else "")
            if why:
                raise ConfigError(f"train.zero = {tc.zero} {why}")
        if grid > 1 and tc.clip_norm:
            raise ConfigError("train.clip_norm: global-norm clipping is not built for "
                              "parallel.tp or pp > 1 (the norm spans the grid's shards)")
        if self.parallel.tp > 1 and tc.optimizer in ("lars", "lamb"):
            raise ConfigError(f"train.optimizer = {tc.optimizer!r}: per-layer trust ratios "
                              f"are not built for parallel.tp > 1 (layers are sharded)")



def local_period(dense: str) -> int:
    """H of ``local:H``; 0 for ``bsp`` (a reduction every step)."""
    name, _, arg = dense.strip().lower().partition(":")
    if name == "bsp" and not arg:
        return 0
    if name == "local" and arg.isdigit() and int(arg) >= 1:
        return int(arg)
    raise ConfigError(f"sync.dense: {dense!r}: expected 'bsp' or 'local:H' with H >= 1 local "
                      f"steps between parameter averages, as in 'local:4'")


_SYNTHETIC_ROWS = 1 << 31  # row * multiplier (both below the table size) stays below 2**63


def _check_inputs(job: JobConfig) -> None:
    """Inputs that would crash later (an empty list) or train on the wrong data."""
    m, d = job.model, job.data
    for key, widths in (("bottom_mlp", m.bottom_mlp), ("top_mlp", m.top_mlp)):
        if not widths:
            raise ConfigError(f"model.{key} = []: needs at least one layer width")
    if not d.table_sizes:
        raise ConfigError("data.table_sizes = []: needs at least one table (one per "
                          "categorical feature)")
    too_big = [i for i, n in enumerate(d.table_sizes) if n > _SYNTHETIC_ROWS]
    if d.source == "synthetic" and too_big:
        raise ConfigError(f"data.table_sizes[{too_big[0]}] = {d.table_sizes[too_big[0]]:,}: the "
                          f"synthetic generator shuffles rows by a multiplication in int64, "
                          f"exact up to {_SYNTHETIC_ROWS:,} rows a table")
    if d.source == "criteo" and not d.eval_paths and d.eval_fraction == 0:
        raise ConfigError("data.eval_fraction = 0 with no data.eval_paths leaves no held-out "
                          "samples to evaluate; hold some out or name eval files")
    seen: dict[str, str] = {}
    for key in ("paths", "eval_paths"):
        for i, path in enumerate(getattr(d, key)):
            real = os.path.realpath(path)
            if real in seen:
                raise ConfigError(f"data.{key}[{i}] = {path!r} is also {seen[real]}: a file "
                                  f"read twice, or in both training and held-out data")
            seen[real] = f"data.{key}[{i}]"


def emulated_network(text: str, key: str = "comm.emulate") -> tuple[float, float] | None:
    """``"LATENCY_US,GBPS"`` as (latency in seconds, bandwidth in bytes per second), or
    ``None`` when empty; :class:`ConfigError` naming ``key`` otherwise."""
    if not text.strip():
        return None
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        latency_us, gbps = float(parts[0]), float(parts[1])
    except ValueError:
        raise ConfigError(f"{key}: expected 'LATENCY_US,GBPS' (two numbers, e.g. '20,10'), "
                          f"got {text!r}") from None
    if not (math.isfinite(latency_us) and latency_us >= 0):
        raise ConfigError(f"{key}: the latency must be a finite number >= 0 (microseconds), "
                          f"got {parts[0].strip()!r}")
    if not (math.isfinite(gbps) and gbps > 0):
        raise ConfigError(f"{key}: the bandwidth must be a finite number > 0 (Gb/s), "
                          f"got {parts[1].strip()!r}")
    return latency_us * 1e-6, gbps * 1e9 / 8


def staleness_bound(model: str, where: str = "sync.model") -> int | None:
    """Staleness bound of a sync model name: ``bsp`` 0, ``ssp:S`` S, ``asp`` None."""
    name, _, arg = model.strip().lower().partition(":")
    if name in ("bsp", "asp") and not arg:
        return 0 if name == "bsp" else None
    if name == "ssp":
        if not arg.isdigit():
            raise ConfigError(f"{where}: {model!r}: SSP needs a non-negative integer staleness "
                              f"bound, as in 'ssp:4'")
        return int(arg)
    raise ConfigError(f"{where}: unknown sync model {model!r}; expected bsp, ssp:S or asp")


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
