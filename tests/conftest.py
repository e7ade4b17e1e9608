"""Test harness: ``@pytest.mark.mpi(ranks=(2, 3))`` runs a test body under ``mpiexec -n N``.

The parent pytest never initialises MPI. For each N it launches
``mpiexec -n N python -m pytest NODEID`` in a new process session with a hard timeout and
kills the whole process group on expiry, so a deadlock fails the test instead of hanging CI.
In the child every rank runs the body; a failure on any rank prints its report and aborts
the job, so ranks blocked in a collective do not wait for a peer that already failed. The
ranks share one ``tmp_path`` (a folder in the parent's), as the ranks of a job share a run
directory: every rank's checkpoint file must be where rank 0 verifies it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from harness import DEFAULT_TIMEOUT_S, child_env, in_mpi_child, run_mpi


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("mpi")
    if marker is not None:
        ranks = tuple(marker.kwargs.get("ranks", (2,)))
        metafunc.parametrize("mpi_ranks", ranks, ids=[f"np{n}" for n in ranks],
                             indirect=True)


@pytest.fixture(autouse=True)
def mpi_ranks(request: pytest.FixtureRequest) -> int | None:
    """World size of an ``mpi``-marked test (``None`` for plain tests)."""
    return getattr(request, "param", None)


_SHARED_TMP = "HPCTRAIN_TEST_SHARED_TMP"


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """pytest's own, except in an ``mpi`` child: the folder every rank of the job shares."""
    shared = os.environ.get(_SHARED_TMP)
    if shared and in_mpi_child():
        return Path(shared)
    return tmp_path_factory.mktemp(request.node.name[:30], numbered=True)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("mpi")
    if marker is None or in_mpi_child():
        return None
    ranks = pyfuncitem.callspec.params["mpi_ranks"]
    timeout = marker.kwargs.get("timeout", DEFAULT_TIMEOUT_S)
    env = child_env(child=True)
    if "tmp_path" in pyfuncitem.funcargs:
        env[_SHARED_TMP] = str(pyfuncitem.funcargs["tmp_path"])
    result = run_mpi([sys.executable, "-m", "pytest", "-q", "-x", "--no-header",
                      "-p", "no:cacheprovider", pyfuncitem.nodeid], ranks, timeout, env=env)
    if result.returncode != 0:
        pytest.fail(f"failed under `mpiexec -n {ranks}` (exit {result.returncode}):\n"
                    f"{result.stdout[-8000:]}", pytrace=False)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if in_mpi_child() and report.failed:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            rank = MPI.COMM_WORLD.Get_rank()
            print(f"\n[rank {rank}] {item.nodeid} failed:\n{report.longreprtext}",
                  file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(1)
