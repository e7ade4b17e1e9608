"""A machine's first run: one rank per machine compiles the step's kernels, the others load
them from numba's cache after it (not every rank compiling the same kernels on the same
cores)."""

import json
import sys

from harness import child_env, run_mpi

PREPARE = """
import json
from mpi4py import MPI
from embeddings.optim import SparseOptimizer
from hpctrain.train.warmup import prepare_kernels
world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
_, compiled = prepare_kernels([SparseOptimizer("sgd")], tiering=False, node=node)
_, again = prepare_kernels([SparseOptimizer("sgd")], tiering=False, node=node)
counts = world.gather((compiled, again))
if world.Get_rank() == 0:
    print("COMPILED", json.dumps(counts))
"""


def test_one_rank_per_machine_compiles_the_kernels_on_a_first_run(tmp_path):
    env = dict(child_env(), NUMBA_CACHE_DIR=str(tmp_path / "cache"))  # empty: a first run
    result = run_mpi([sys.executable, "-c", PREPARE], ranks=3, env=env, timeout=300)
    assert result.returncode == 0, result.stdout
    [line] = [x for x in result.stdout.splitlines() if x.startswith("COMPILED ")]
    (first, first_again), *others = json.loads(line.split(" ", 1)[1])
    assert first > 0 and first_again == 0, line
    assert others == [[0, 0], [0, 0]], line  # loaded what rank 0 compiled
