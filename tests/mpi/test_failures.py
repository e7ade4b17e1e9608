"""A failing rank ends the whole job with a message that names it, never a hang."""

import sys
import textwrap
import time

from harness import run_mpi

SETUP = textwrap.dedent("""
    import sys
    import numpy as np
    from embeddings.optim import SparseOptimizer
    from embeddings.tables import TableLayout
    from hpctrain.config import load_config
    from hpctrain.runtime.abort import run_guarded
    from hpctrain.runtime.world import build_topology
    from hpctrain.sync.bsp import BSP
    from ps.service import PSJob
    from ps.types import TAG_REQUEST, Op, encode_request

    def body():
        config = load_config(overrides=["ps.servers=1"])
        topo = build_topology(config)
        layout = TableLayout.from_sizes([10, 10], 4)
        job = PSJob.create(topo.world, topo.roles, layout, config.ps, 0)
        if not topo.is_worker:
            job.serve(SparseOptimizer(), 0, [BSP] * 2)
            return
        client = job.client()
        client.pull(np.arange(20))
        if sys.argv[1] == "server" and topo.worker_rank == 1:
            ids = np.array([99])  # a corrupt push: the server must stop the job
            buf = encode_request(Op.PUSH, 0, 1, 0, np.array([0]), np.array([1]), ids,
                                 np.zeros((1, 4), np.float32))
            job.comm.Send(buf, dest=2, tag=TAG_REQUEST)
        if sys.argv[1] == "worker" and topo.worker_rank == 1:
            raise RuntimeError("worker gave up on purpose")
        client.pull(np.arange(20))
        client.push(np.arange(20), np.zeros((20, 4), np.float32), 0.1)
        client.pull(np.arange(20))
        client.close()

    run_guarded(body)
""")


def test_a_failing_server_or_worker_ends_the_job(tmp_path):
    script = tmp_path / "ps_failure.py"
    script.write_text(SETUP)
    for who, code, words in (("server", 2, ["rank 2", "bad push from rank 1", "id 99"]),
                             ("worker", 1, ["rank 1 failed", "worker gave up on purpose"])):
        start = time.monotonic()
        result = run_mpi([sys.executable, str(script), who], ranks=3, timeout=60)
        assert time.monotonic() - start < 60
        assert result.returncode == code, result.stdout
        for word in words:
            assert word in result.stdout, (word, result.stdout)


NO_TORCH_ON_RANK_1 = textwrap.dedent("""
    import sys
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 1:
        sys.modules["torch"] = None  # this rank's node has a broken install
    from hpctrain.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_rank_that_cannot_import_ends_the_job(tmp_path):
    """One rank fails to import torch while the other waits for it in the world's set-up:
    the job ends with that rank's traceback, it does not hang (it did: the failing rank sat
    in MPI_Finalize, the others in the world's Dup)."""
    result = run_mpi([sys.executable, "-c", NO_TORCH_ON_RANK_1, "train", "--set",
                      "train.steps=2", "--set", f"train.run_dir={str(tmp_path / 'run')!r}"],
                     ranks=2, timeout=60)
    assert result.returncode == 1, result.stdout
    assert "hpctrain: rank 1 failed, aborting the job" in result.stdout
    assert "import of torch halted" in result.stdout
