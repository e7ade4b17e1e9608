"""The kernels' warm-up: one log line saying what it did, and nothing left to compile after."""

import logging

from embeddings.optim import SparseOptimizer
from hpctrain.train.warmup import prepare_kernels

KERNELS = [SparseOptimizer("adagrad"), SparseOptimizer("adagrad_values", eps=1e-10)]


def test_prepare_kernels_logs_and_leaves_nothing_to_compile(caplog):
    with caplog.at_level(logging.INFO, logger="hpctrain.train.warmup"):
        seconds, _ = prepare_kernels(KERNELS, tiering=True, parameter_server=True)
        again, compiled = prepare_kernels(KERNELS, tiering=True, parameter_server=True)
    assert seconds >= 0 and again >= 0 and compiled == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("preparing the numba kernels")
    assert any(line.startswith(("compiled ", "numba kernels ready in")) for line in lines)
    assert lines[-1].startswith("numba kernels ready in ")
