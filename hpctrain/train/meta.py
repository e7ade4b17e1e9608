"""``meta.json`` of a run directory: the facts a later comparison needs besides the config.

hpctrain version and git commit (when the package sits in a git checkout), world layout
(ranks, roles, nodes and hostnames), MPI library, batch-system job ids and the start time.
A report reads it to group runs by world size and to tell where and when each ran.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from hpctrain.runtime.env import allocation, mpi_library
from hpctrain.runtime.waits import Wait
from hpctrain.runtime.world import Topology
from hpctrain.train.rundir import unwritable, write_text_atomic

__all__ = ["collect_meta", "write_meta", "git_commit"]

JOB_VARS = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "PBS_JOBID",
            "PBS_ARRAY_INDEX")


def git_commit() -> str | None:
    """The commit of the checkout holding this package, or None (not a checkout, no git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def collect_meta(topo: Topology) -> dict[str, Any] | None:
    """Every rank's host and role gathered on world rank 0 (``gather`` over the world),
    which returns the meta facts; other ranks get None."""
    with Wait("gather", topo.world):
        hosts = topo.world.gather((topo.hostname, topo.role), root=0)
    if topo.rank != 0:
        return None
    try:
        version = importlib.metadata.version("hpctrain")
    except importlib.metadata.PackageNotFoundError:
        version = None
    names = sorted({h for h, _ in hosts})
    return {"hpctrain_version": version, "git_commit": git_commit(),
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world": {"ranks": len(hosts), "workers": sum(r == "worker" for _, r in hosts),
                      "servers": sum(r != "worker" for _, r in hosts), "nodes": len(names),
                      "hostnames": names, "rank_hosts": [h for h, _ in hosts]},
            "mpi": mpi_library(),
            "job": {k: os.environ[k] for k in JOB_VARS if k in os.environ},
            "allocation": allocation()}


def write_meta(run_dir: str, meta: dict[str, Any]) -> None:
    """Write ``meta.json``; a resumed run keeps its first facts and lists each resume."""
    path = Path(run_dir) / "meta.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            first = json.loads(path.read_text(encoding="utf-8"))
            first.setdefault("resumes", []).append(meta)
            meta = first
        write_text_atomic(path, json.dumps(meta, indent=2) + "\n")
    except OSError as exc:
        raise unwritable(run_dir, exc) from None
