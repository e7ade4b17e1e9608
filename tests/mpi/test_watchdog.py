"""A stopped rank is named by the watchdog; a killed rank ends the job."""

import os
import signal
import sys
import textwrap
import time

from harness import run_mpi

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from embeddings.optim import SparseOptimizer
    from embeddings.tables import TableLayout
    from hpctrain.config import load_config
    from hpctrain.runtime.abort import run_guarded
    from hpctrain.runtime.waits import Wait, wait_all
    from hpctrain.runtime.world import build_topology
    from hpctrain.sync.bsp import BSP
    from ps.service import PSJob

    def body():
        mode, folder = sys.argv[1], sys.argv[2]
        config = load_config(overrides=["ps.servers=1", "runtime.watchdog_warn_s=1",
                                        "runtime.watchdog_abort_s=4"])
        topo = build_topology(config)
        with open(os.path.join(folder, f"pid-{topo.rank}"), "w") as f:
            f.write(str(os.getpid()))
        if mode == "barrier":
            if topo.rank == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            wait_all([topo.world.Ibarrier()], Wait("barrier", topo.world))
        elif mode == "pull":
            job = PSJob.create(topo.world, topo.roles, TableLayout.from_sizes([10], 4),
                               config.ps, 0)
            if not topo.is_worker:
                os.kill(os.getpid(), signal.SIGSTOP)
            job.client().pull(np.arange(10))
        else:  # "kill": collectives until a rank disappears
            for _ in range(6000):
                wait_all([topo.world.Ibarrier()], Wait("barrier", topo.world))
                time.sleep(0.01)

    run_guarded(body)
""")


def test_the_watchdog_names_a_stopped_rank(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(SCRIPT)
    for mode, words in (("barrier", ["in barrier #1 on hpctrain.world",
                                     "not arrived: rank 2 (stopped by a signal)"]),
                        ("pull", ["in pull #1 on hpctrain.ps",
                                  "not arrived: rank 2 (stopped by a signal)"])):
        result = run_mpi([sys.executable, str(script), mode, str(tmp_path)], ranks=3,
                         timeout=90)
        assert result.returncode != 0, result.stdout
        assert "watchdog:" in result.stdout and "aborting the job" in result.stdout
        for word in words:
            assert word in result.stdout, (word, result.stdout)


def test_a_killed_rank_ends_the_job_within_a_minute(tmp_path):
    import subprocess

    from harness import child_env, mpiexec

    script = tmp_path / "kill.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([mpiexec(), "-n", "3", sys.executable, str(script), "kill",
                             str(tmp_path)], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        pid_file = tmp_path / "pid-1"
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        assert time.monotonic() - killed < 60
        assert proc.returncode != 0 and "KILLED" in out.upper(), out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
