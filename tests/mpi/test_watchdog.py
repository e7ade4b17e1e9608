"""A stopped rank is named by the watchdog; a killed rank ends the job."""

import os
import re
import signal
import sys
import textwrap
import time

from harness import rank_pids, run_mpi

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


ABORT_S = 8


def _stop_one_rank_of_a_training_run(tmp_path, ranks: int, stop: int, extra: list[str]):
    """Start ``hpctrain train`` (warn 2 s, abort 8 s: a loaded machine's first steps can
    keep a rank computing for seconds), SIGSTOP rank ``stop`` once steps run;
    returns (seconds from the stop to the job's end, return code, output)."""
    import subprocess

    from harness import child_env, mpiexec

    run_dir = tmp_path / "run"
    args = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "hpctrain.cli", "train",
            "--set", "runtime.watchdog_warn_s=2", "--set", f"runtime.watchdog_abort_s={ABORT_S}",
            "--set", "data.train_samples=5000000", "--set", "train.log_every=1",
            "--set", f"train.run_dir={run_dir}", *[a for kv in extra for a in ("--set", kv)]]
    proc = subprocess.Popen(args, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and (
                not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0]
        pids = rank_pids(proc.pid)
        assert len(pids) == ranks, pids
        os.kill(pids[stop], signal.SIGSTOP)
        stopped = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        return time.monotonic() - stopped, proc.returncode, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_a_stopped_rank_of_a_training_run_ends_the_job(tmp_path):
    """Data-parallel worker, all-to-all tables' worker, pipeline-stage worker,
    tensor-parallel worker on gloo, parameter server, and a tiered worker re-tiering every
    other step (a planning thread in flight much of the time): each stopped rank is named
    with the wait, and the job ends within abort_s + 15 s."""
    for case, ranks, stop, extra in (
            ("dp", 2, 1, []),
            ("alltoall", 2, 1, ["embeddings.mode='alltoall'"]),
            ("pp", 2, 1, ["parallel.pp=2"]),
            ("tp over torch.distributed", 2, 1, ["parallel.tp=2", "parallel.backend='torch'"]),
            ("ps", 3, 2, ["ps.servers=1"]),
            ("tiered", 3, 1, ["ps.servers=1", "tiering.budget=0.1", "tiering.interval=2"])):
        took, code, out = _stop_one_rank_of_a_training_run(tmp_path / case, ranks, stop, extra)
        assert code != 0, (case, out[-3000:])
        assert took < ABORT_S + 15, (case, took, out[-3000:])
        lines = [line for line in out.splitlines() if line.startswith("hpctrain: watchdog:")]
        assert len(lines) >= 1 and lines[0].endswith("aborting the job"), (case, out[-3000:])
        assert re.search(r"has waited \d+ s in \w+ #\d+ on hpctrain\.\w+", lines[0]), lines
        # the first watchdog to fire may be a rank waiting on a rank that waits on the
        # stopped one: some line of the job names it
        assert any(f"rank {stop} (stopped by a signal)" in line for line in lines), lines
        print(case, f"{took:.1f} s:", lines[0])


STOP_AT = textwrap.dedent("""
    import os, signal, sys
    from mpi4py import MPI
    from hpctrain.cli import main
    from hpctrain.train.job import TrainingJob
    from ps.service import PSJob

    where, rank = sys.argv.pop(1), int(sys.argv.pop(1))
    owner, name = {"worker": (TrainingJob, "worker"), "ps": (PSJob, "create")}[where]
    before = getattr(owner, name)

    def stopped(*args, **kwargs):
        if MPI.COMM_WORLD.Get_rank() == rank:
            os.kill(os.getpid(), signal.SIGSTOP)
        return before(*args, **kwargs)

    setattr(owner, name, stopped)
    sys.exit(main(sys.argv[1:]))
""")


def test_a_rank_stopped_during_start_up_is_named(tmp_path):
    """A rank stopped before its worker makes the workers' communicators (Dup/Split), or
    before the parameter servers' plan is broadcast (the root sends eagerly and waits in
    the ``Dup`` after it): the waiting ranks name it."""
    for where, ranks, stop, op, comm in (("worker", 2, 1, "create", "hpctrain.workers"),
                                         ("ps", 3, 2, "(?:bcast|create)", "hpctrain.world")):
        result = run_mpi([sys.executable, "-c", STOP_AT, where, str(stop), "train",
                          "--set", "runtime.watchdog_warn_s=1",
                          "--set", "runtime.watchdog_abort_s=4", "--set", "train.steps=5",
                          "--set", f"ps.servers={ranks - 2}",
                          "--set", f"train.run_dir={str(tmp_path / where)!r}"],
                         ranks=ranks, timeout=120)
        assert result.returncode != 0, result.stdout
        assert re.search(rf"hpctrain: watchdog: rank \d has waited \d+ s in {op} #\d+ on "
                         rf"{comm}; not arrived: rank {stop} \(stopped by a signal\); aborting "
                         rf"the job", result.stdout), result.stdout[-3000:]
