"""Launching MPI jobs from tests: ``run_mpi`` with a hard timeout, and the child marker."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHILD_ENV = "HPCTRAIN_TEST_MPI_CHILD"
DEFAULT_TIMEOUT_S = 180


def in_mpi_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail("mpiexec not found: install an MPI (pip install mpich) next to mpi4py")
    return found


def child_env(child: bool = False) -> dict[str, str]:
    """Environment of spawned ranks: one thread each (ranks share the cores), collectives
    in checking mode (ranks agree on each call first); ``child`` marks a pytest child that
    runs an ``mpi``-marked test body."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.setdefault("HPCTRAIN_COMM__CHECK", "true")
    if child:
        env[CHILD_ENV] = "1"
    return env


def run_mpi(args: list[str], ranks: int, timeout: float = DEFAULT_TIMEOUT_S,
            env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n ranks ARGS`` in its own session; kill the group on timeout."""
    proc = subprocess.Popen([mpiexec(), "-n", str(ranks), *args], cwd=cwd,
                            env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"`mpiexec -n {ranks} {' '.join(args)}` timed out after {timeout:.0f} s "
                    f"(deadlock?); its output:\n{out[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def rank_pids(launcher: int) -> dict[int, int]:
    """``{PMI rank: pid}`` of the processes below ``launcher`` (read from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    ranks, todo = {}, [launcher]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            python = b"python" in f.read()
        if b"PMI_RANK" in env and python:
            ranks[int(env[b"PMI_RANK"])] = pid
    return ranks
