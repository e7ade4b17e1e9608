"""The cluster a plan is made for: nodes, ranks, memory, links, and the device's rates.

A cluster file (TOML; every key optional, units readable as in :mod:`.units`)::

    nodes = 2                      # machines
    ranks_per_node = 8             # MPI ranks on each
    cores_per_node = 64            # ranks above this share cores (default: this machine's)
    memory_per_rank = "80GiB"      # capacity a layout must fit in (default: RAM / ranks)
    base_memory = "450MiB"         # resident memory of a rank before the job's tensors
                                   # (default: probed, the libraries and kernels loaded)
    calibration = "comm.json"      # `hpctrain bench calibrate` output: every link's alpha-beta
    [intra]                        # a message between ranks of a node (overrides calibration)
    latency = "2us"
    bandwidth = "300GB/s"
    [inter]                        # a message between nodes
    latency = "5us"
    bandwidth = "200Gb/s"
    [device]                       # dense compute (default: a short probe on this machine)
    flops = "50T"                  # sustained matmul FLOP/s per rank
    memory_bandwidth = "2TB/s"     # copy bandwidth per rank
    op_latency = "10us"            # fixed cost of one framework op (kernel launch, dispatch)
    id_latency = "50ns"            # per id of the lookups' de-duplication (unique rows)

Without a file (``--nodes N --ranks-per-node R``) the links come from ``--calibration`` or
the cost model's built-in defaults (calibrated on this project's 2-core machine) and the
device from the probe.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import math
import os
import resource
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embeddings.collection import unique_rows
from hpctrain.comm.calibration import read_params
from hpctrain.comm.types import CostParams, Link
from hpctrain.config import DataConfig
from hpctrain.data import open_dataset
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.plan.units import parse_quantity

__all__ = ["Device", "Cluster", "probe_device", "probe_base_memory", "probe_reader",
           "load_cluster", "machine_cluster"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Device:
    """What one rank computes with: sustained FLOP/s, copy bytes/s, cost of one framework
    op, and cost per id of the lookups' de-duplication (their unique rows)."""

    flops: float
    memory_bandwidth: float
    op_latency: float
    id_latency: float
    source: str = "typed in"


@dataclass(frozen=True)
class Cluster:
    """Sizes and rates the model predicts from (see the module docstring for the keys)."""

    nodes: int
    ranks_per_node: int
    cores_per_node: int
    memory_per_rank: float
    base_memory: float
    comm: CostParams  # p2p = intra-node link, net = inter-node link
    device: Device
    source: str = field(default="", compare=False)

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def oversubscribed(self) -> bool:
        """More ranks than cores on a node: ranks share cores, times stretch."""
        return self.ranks_per_node > self.cores_per_node

    @property
    def core_share(self) -> float:
        """Cores per rank, at most 1 (the compute-rate factor of oversubscription)."""
        return min(1.0, self.cores_per_node / self.ranks_per_node)


def _best(fn: Any, calls: int, reps: int = 9) -> float:
    """Fastest of a few samples of this thread's CPU time, seconds per call: CPU time leaves
    out the time the thread waits for a core, so other load on the machine counts little."""
    fn()
    best = math.inf
    for _ in range(reps):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best


def probe_device() -> Device:
    """Time a 512^3 float32 matmul, an 8 MiB copy, a tiny op and the unique rows of 64 Ki ids
    on one thread (~1 s);
    each the fastest of several samples of CPU time (:func:`_best`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's share: launched ranks run one thread per core
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        flops = 2 * 512**3 / _best(lambda: a @ b, 3)
        # a step sweeps working sets of a few MiB (activations, dense parameters and
        # gradients), and at that size the rate is also steady: 29.0-29.6 GB/s across
        # processes here, where a 64 MiB copy gave 15.6-22 GB/s (a shared L3)
        src = np.ones(2 << 20, np.float32)
        dst = np.empty_like(src)
        bandwidth = 2 * src.nbytes / _best(lambda: np.copyto(dst, src), 8)  # read + write
        x = torch.ones(4, 4)
        op = _best(lambda: x.add(x), 200)
        # the lookups' own de-duplication on Zipf ids: steady across processes (9.0-9.1 ns
        # here; 16.1-16.6 with the hash table it replaced), where np.unique's sort flipped
        # between 18 and 30 ns
        ids = (np.random.default_rng(0).zipf(1.05, 1 << 16) % (1 << 20)).astype(np.int64)
        per_id = _best(lambda: unique_rows(ids), 8) / ids.size
    finally:
        torch.set_num_threads(threads)
    return Device(flops, bandwidth, op, per_id, source="probe")


def probe_base_memory() -> float:
    """Peak resident memory of this process once it holds what a training rank loads before
    the job's tensors: the trainer's modules, the numba kernels (loaded from their cache,
    which maps the JIT's code and runtime) and torch's autograd engine after one tiny step."""
    import hpctrain.train.trainer  # noqa: F401  (its imports are the rank's libraries)
    from embeddings.optim import SparseOptimizer, coalesce
    from hpctrain.comm import kernels

    weight, state = np.zeros((4, 4), np.float32), np.zeros((4, 1), np.float32)
    rows, grads = np.array([0, 1]), np.ones((2, 4), np.float32)
    SparseOptimizer("adagrad").apply(weight, state, *coalesce(rows, grads), 0.1)
    kernels.reduce_pair(weight[0], weight[1], kernels.SUM, kernels.ARITH)
    layer = torch.nn.Linear(4, 4)
    layer(torch.ones(2, 4)).sum().backward()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def probe_reader(data: DataConfig, samples: int, budget_s: float = 0.1) -> float:
    """Seconds per sample of the job's own reader on this machine, reading consecutive
    batches of ``samples`` for about ``budget_s`` of this thread's CPU time (a Criteo text
    job reads a copy of the first lines of its first file, so that a large day file is not
    indexed whole). 0.0, with a warning, when the data cannot be read here."""
    samples = max(1, samples)
    with tempfile.TemporaryDirectory(prefix="hpctrain-probe-") as tmp:
        try:
            if data.source == "criteo":
                data = dataclasses.replace(data, paths=(_head(data.paths[0], tmp, 8 * samples
                                                              + 64),), eval_paths=())
            dataset = open_dataset(data)
            total = dataset.num_samples("train")
            n = min(samples, total)
            read = 0
            start = time.thread_time()
            while read < 2 * n or time.thread_time() - start < budget_s:
                lo = read % max(total - n + 1, 1)
                dataset.read("train", lo, lo + n)
                read += n
            return (time.thread_time() - start) / read
        except (HpctrainError, OSError) as exc:
            _log.warning("hpctrain plan: cannot read the job's data (%s): step times leave "
                         "reading out", exc)
            return 0.0


def _head(path: str, folder: str, lines: int) -> str:
    """A copy of the first ``lines`` lines of ``path`` in ``folder`` (gzip stays gzip)."""
    gz = path.endswith(".gz")
    out = os.path.join(folder, "head.txt.gz" if gz else "head.txt")
    opener = gzip.open if gz else open
    with opener(path, "rb") as src, opener(out, "wb") as dst:
        for _, line in zip(range(lines), src, strict=False):
            dst.write(line)
    return out


def _machine_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 8.0 * 2**30


_TOP = {"nodes", "ranks_per_node", "cores_per_node", "memory_per_rank", "base_memory",
        "calibration", "intra", "inter", "device"}
_LINK = {"latency", "bandwidth"}
_DEVICE = {"flops", "memory_bandwidth", "op_latency", "id_latency"}


def machine_cluster(nodes: int, ranks_per_node: int, calibration: str | None = None,
                    device: Device | None = None) -> Cluster:
    """This machine's own description, ``nodes x ranks_per_node`` of it."""
    return load_cluster(None, {"nodes": nodes, "ranks_per_node": ranks_per_node,
                               **({"calibration": calibration} if calibration else {})},
                        device=device)


def load_cluster(path: str | os.PathLike[str] | None, table: dict[str, Any] | None = None,
                 device: Device | None = None) -> Cluster:
    """A :class:`Cluster` from a TOML file (or an already parsed ``table``); keys it leaves
    out come from this machine. :class:`ConfigError` naming the file and key otherwise."""
    where = str(path) if path is not None else "cluster"
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the cluster file ({exc.strerror})") from None
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    table = dict(table or {})
    _known(table, _TOP, where, "")
    for section, keys in (("intra", _LINK), ("inter", _LINK), ("device", _DEVICE)):
        if not isinstance(table.get(section, {}), dict):
            raise ConfigError(f"{where}: {section} must be a table [{section}]")
        _known(table.get(section, {}), keys, where, f"{section}.")

    def number(key: str, kind: str, default: float, section: str = "",
               positive: bool = True) -> float:
        node = table.get(section, {}) if section else table
        name = f"{section}.{key}" if section else key
        if key not in node:
            return default
        value = parse_quantity(node[key], kind, f"{where}: {name}")
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ConfigError(f"{where}: {name} must be {'> 0' if positive else '>= 0'}, "
                              f"got {node[key]!r}")
        return value

    def whole(key: str, default: int) -> int:
        value = number(key, "count", default)
        if value != int(value):
            raise ConfigError(f"{where}: {key} must be a whole number, got {table[key]!r}")
        return int(value)

    comm = CostParams()
    if "calibration" in table:
        cal = table["calibration"]
        if not isinstance(cal, str) or not cal:
            raise ConfigError(f"{where}: calibration must be a file name, got {cal!r}")
        base = Path(path).parent if path is not None else Path()
        comm = read_params(base / cal)
    links = {}
    for section, default in (("intra", comm.p2p), ("inter", comm.net)):
        alpha = number("latency", "seconds", default.alpha, section)
        bandwidth = number("bandwidth", "bandwidth", 1.0 / default.beta, section)
        links[section] = Link(alpha, 1.0 / bandwidth)
    comm = dataclasses.replace(comm, p2p=links["intra"], net=links["inter"])
    nodes, rpn = whole("nodes", 1), whole("ranks_per_node", 1)
    cores = whole("cores_per_node", os.cpu_count() or 1)
    memory = number("memory_per_rank", "bytes", _machine_memory() / rpn)
    base_memory = number("base_memory", "bytes", 0.0, positive=False) \
        if "base_memory" in table else probe_base_memory()
    if base_memory >= memory:
        raise ConfigError(f"{where}: base_memory ({base_memory / 2**20:.0f} MiB) leaves nothing "
                          f"of memory_per_rank ({memory / 2**20:.0f} MiB)")
    dev = table.get("device", {})
    if not set(dev) >= _DEVICE:
        probed = device or probe_device()
        dev_source = "probe" if not dev else "probe + typed in"
    else:
        probed, dev_source = Device(1.0, 1.0, 1.0, 1.0), "typed in"
    device = Device(number("flops", "count", probed.flops, "device"),
                    number("memory_bandwidth", "bandwidth", probed.memory_bandwidth, "device"),
                    number("op_latency", "seconds", probed.op_latency, "device"),
                    number("id_latency", "seconds", probed.id_latency, "device"),
                    source=dev_source)
    return Cluster(nodes, rpn, cores, memory, base_memory, comm, device,
                   source=where if path is not None else "this machine")


def _known(table: dict[str, Any], keys: set[str], where: str, prefix: str) -> None:
    for key in table:
        if key not in keys:
            raise ConfigError(f"{where}: unknown key '{prefix}{key}'; keys are: "
                              f"{', '.join(sorted(keys))}")
