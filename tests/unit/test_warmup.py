"""The kernels' warm-up: one log line saying what it did, and nothing left to compile after."""

import logging
import subprocess
import sys

from embeddings.optim import SparseOptimizer
from hpctrain.train.warmup import prepare_kernels

KERNELS = [SparseOptimizer("adagrad"), SparseOptimizer("adagrad_values", eps=1e-10)]
EVERY_PART = {"tiering": True, "parameter_server": True, "all_to_all": True}


def test_prepare_kernels_logs_and_leaves_nothing_to_compile(caplog):
    with caplog.at_level(logging.INFO, logger="hpctrain.train.warmup"):
        seconds, _ = prepare_kernels(KERNELS, **EVERY_PART)
        again, compiled = prepare_kernels(KERNELS, **EVERY_PART)
    assert seconds >= 0 and again >= 0 and compiled == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("preparing the numba kernels")
    assert any(line.startswith(("compiled ", "numba kernels ready in")) for line in lines)
    assert lines[-1].startswith("numba kernels ready in ")


ONLY_THE_JOBS = """
from embeddings.optim import SparseOptimizer
from hpctrain.comm import alltoall
from hpctrain.train.warmup import prepare_kernels
prepare_kernels([SparseOptimizer("sgd")], tiering=False)
assert not alltoall._shm_exchange.signatures and not alltoall._cma_exchange.signatures
prepare_kernels([SparseOptimizer("sgd")], tiering=False, all_to_all=True)
assert alltoall._shm_exchange.signatures and alltoall._cma_exchange.signatures
"""


def test_a_job_without_the_all_to_all_store_loads_none_of_its_kernels():
    """Each loaded kernel stays resident (the all-to-all's took 5 MiB of every rank); a
    fresh process, so that no other test has loaded them."""
    run = subprocess.run([sys.executable, "-c", ONLY_THE_JOBS], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
