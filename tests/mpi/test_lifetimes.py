"""Several trainings in one process free everything each made: compare-sync over three
sync models ends with as many shared-memory windows and threads as after one training, and
with no collectives' group left over (the job's owner, :mod:`hpctrain.comm.owner`)."""

import os

import pytest
from mpi4py import MPI

from hpctrain.comm.owner import communicators
from hpctrain.comm.window import open_windows
from hpctrain.config import load_config
from hpctrain.runtime.world import build_topology
from hpctrain.train.compare import compare_sync
from hpctrain.train.job import run_training

WORLD = MPI.COMM_WORLD


def threads() -> int:
    """Threads of this process, native ones included (what ``/proc/self/task`` lists)."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.mpi(ranks=(3,), timeout=400)
def test_compare_sync_of_three_models_leaks_no_windows_or_threads(tmp_path):
    out = WORLD.bcast(str(tmp_path), root=0)
    config = load_config(overrides=[
        "ps.servers=1", "ps.mode='full'", "data.table_sizes=[30, 200, 7]",
        "data.train_samples=2000", "data.eval_samples=200", "model.embedding_dim=4",
        "model.bottom_mlp=[8, 4]", "model.top_mlp=[8, 1]", "train.steps=4",
        "train.batch_size=30", "train.progress=false", "comm.overlap=true",
        f"train.run_dir={out + '/warm'!r}"])
    topo = build_topology(config)
    windows = open_windows()
    run_training(config, topo)  # the first training starts torch's and numba's pools
    after_one = threads()
    assert open_windows() == windows
    compare_sync(config, topo, "bsp,ssp:1,asp", out + "/compare", None)
    facts = WORLD.allgather((open_windows() - windows, threads() - after_one,
                             communicators(topo).live))
    topo.free()
    assert facts == [(0, 0, 0)] * WORLD.Get_size()
