"""Ranks agree on their inputs before training: the resolved config and the data they see.

Ranks launched with different environments (an ``HPCTRAIN_*`` variable set on one node), or
reading an input file that grows while the job starts, would compute different step counts
and hang in the first collective that one of them skips. Each rank describes its inputs as
a *view* (every resolved config key; on workers also each data file's size and the samples
per split); the ranks compare a digest of it (one ``allgather`` of 32 bytes), and only when
digests differ the views themselves, so that the error names the key or file and the ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence

from mpi4py import MPI

from hpctrain.config import JobConfig
from hpctrain.data import Dataset
from hpctrain.errors import ConfigError
from hpctrain.runtime.abort import AgreedError
from hpctrain.runtime.waits import Wait
from hpctrain.train.optim import sparse_optimizer

__all__ = ["rank_view", "disagreement", "agree_on_inputs", "table_bytes", "check_memory",
           "available_memory"]


def rank_view(config: JobConfig, dataset: Dataset | None) -> dict[str, str]:
    """This rank's inputs as ``{what: value}`` (``dataset`` is ``None`` on servers)."""
    view = {}
    for section, fields in dataclasses.asdict(config).items():
        items = fields.items() if isinstance(fields, dict) else [("", fields)]
        for key, value in items:
            name = f"{section}.{key}" if key else section
            view[f"config key {name}"] = json.dumps(value, sort_keys=True)
    if dataset is not None:
        for path in (*config.data.paths, *config.data.eval_paths):
            try:
                size = f"{os.stat(path).st_size} bytes"
            except OSError as exc:
                size = f"unreadable ({exc.strerror})"
            view[f"data file {path}"] = size
        for split in ("train", "eval"):
            view[f"the {split} split's sample count"] = str(dataset.num_samples(split))
    return view


def disagreement(views: Sequence[dict[str, str]]) -> str | None:
    """The first input that ranks see differently, with each value's ranks, or ``None``.
    An entry some ranks do not have (data on servers) is compared among those that do."""
    for what in sorted(set().union(*views)):
        holders: dict[str, list[int]] = {}
        for rank, view in enumerate(views):
            if what in view:
                holders.setdefault(view[what], []).append(rank)
        if len(holders) > 1:
            seen = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in holders.items())
            return f"ranks disagree on {what}: {seen} (same launch, environment and files " \
                   f"on every rank?)"
    return None


def agree_on_inputs(world: MPI.Intracomm, config: JobConfig, dataset: Dataset | None) -> None:
    """Raise the same :class:`AgreedError` on every rank of ``world`` when their views
    differ (collective over ``world``: one or two watched ``allgather``)."""
    view = rank_view(config, dataset)
    parts = ({k: v for k, v in view.items() if k.startswith("config ")},
             {k: v for k, v in view.items() if not k.startswith("config ")})
    digest = tuple(hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()
                   for p in parts)
    with Wait("agree", world):
        digests = world.allgather(digest if dataset is not None else (digest[0], None))
        if len({c for c, _ in digests}) == 1 and len({d for _, d in digests} - {None}) <= 1:
            return  # servers see no data: their config alone is compared
        message = disagreement(world.allgather(view))
    if message:
        raise AgreedError(message, world)


def table_bytes(config: JobConfig, sizes: Sequence[int], workers: int) -> int:
    """Bytes of embedding rows (float32 weights and the tables' optimizer state) one
    holder keeps: every worker when tables are replicated, one server's share on parameter
    servers, one worker's share when ``workers`` shard them (all-to-all)."""
    dim = config.model.embedding_dim
    row = dim + sparse_optimizer(config.train).state_width(dim)
    total = sum(int(n) for n in sizes) * row * 4
    if config.ps.servers:
        return total // config.ps.servers
    return total // workers if config.embeddings.layout(0) == "alltoall" else total


def check_memory(config: JobConfig, sizes: Sequence[int], workers: int, ranks_on_node: int,
                 available: int) -> None:
    """Refuse, before allocating, tables that cannot fit the node's available memory
    shared by its ``ranks_on_node`` holders (an OOM kill later ends the job without a
    message)."""
    need = table_bytes(config, sizes, workers) * ranks_on_node
    if need > available:
        raise ConfigError(f"data.table_sizes: {len(sizes)} tables of {sum(sizes):,} rows x "
                          f"model.embedding_dim = {config.model.embedding_dim} need "
                          f"{need / 2**30:.1f} GiB on this node ({ranks_on_node} holding ranks), "
                          f"{available / 2**30:.1f} GiB available; add parameter servers "
                          f"(ps.servers), shard the tables over the workers "
                          f"(embeddings.mode = 'alltoall') or shrink the tables")


def available_memory() -> int:
    """``MemAvailable`` of this node in bytes (the physical memory when not reported)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        "ranks " + ", ".join(str(r) for r in ranks)
