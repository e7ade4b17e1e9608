"""The Slurm and PBS scripts' signal / checkpoint / requeue / resume flows, end to end, with
stand-in ``sbatch``, ``scontrol``, ``srun``, ``qsub``, ``qstat`` and ``qrerun`` shell scripts
on ``PATH`` (``srun`` runs mpiexec)."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from harness import ROOT, child_env, mpiexec

SBATCH = """#!/bin/bash
# stand-in sbatch: runs the batch script here as Slurm would (job 1234), sends the batch
# shell SIGUSR1 once steps run in the first attempt (what --signal=B:USR1@... does before
# the time limit), and runs it again while it requeues itself
script="$1"; shift
grep -q '^#SBATCH --signal=B:USR1@' "$script" || { echo "no --signal line"; exit 9; }
export SLURM_JOB_ID=1234 SLURM_SUBMIT_DIR="$PWD"
restarts=0
while :; do
    rm -f "$STATE/requeued"
    SLURM_RESTART_COUNT=$restarts bash "$script" "$@" &
    shell=$!
    if [ $restarts -eq 0 ]; then
        until [ "$(cat runs/slurm-1234/metrics.jsonl 2> /dev/null | wc -l)" -ge 5 ]; do
            kill -0 $shell 2> /dev/null || break
            sleep 0.1
        done
        kill -USR1 $shell
    fi
    code=0
    wait $shell || code=$?
    echo "sbatch: attempt $restarts exited with $code"
    [ -f "$STATE/requeued" ] || exit $code
    restarts=$((restarts + 1))
done
"""
SCONTROL = """#!/bin/bash
# stand-in scontrol: records 'requeue JOBID'
[ "$1" = requeue ] && echo "$2" >> "$STATE/requeues" && touch "$STATE/requeued"
"""
SRUN = """#!/bin/bash
# stand-in srun: drops srun's own options, runs the tasks under mpiexec
while [[ "$1" == --* ]]; do shift; done
exec "$MPIEXEC" -n 2 "$@"
"""


def stand_ins(tmp_path: Path, scripts: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """``bin/`` holding the stand-in ``scripts`` and an ``hpctrain`` command, an empty
    ``state/`` folder for them, and the environment that puts ``bin/`` first on ``PATH``."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    hpctrain = f'#!/bin/bash\nexec "{sys.executable}" -m hpctrain.cli "$@"\n'
    for name, text in {**scripts, "hpctrain": hpctrain}.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return state, dict(child_env(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                       STATE=str(state), MPIEXEC=mpiexec(), PYTHONPATH=str(ROOT))


def test_slurm_script_signals_checkpoints_requeues_and_resumes(tmp_path):
    state, env = stand_ins(tmp_path, {"sbatch": SBATCH, "scontrol": SCONTROL, "srun": SRUN})
    work = tmp_path / "work"
    work.mkdir()
    job = ["--set", "data.train_samples=8000", "--set", "data.eval_samples=200",
           "--set", "train.batch_size=32", "--set", "train.steps=120",
           "--set", "train.log_every=1", "--set", "train.progress=false",
           "--set", "data.table_sizes=[50, 200, 1000]"]
    result = subprocess.run(["sbatch", str(ROOT / "jobs/slurm/train.sbatch"), *job],
                            cwd=work, env=env, capture_output=True, text=True, timeout=400)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "sbatch: attempt 0 exited with 75" in out, out
    assert "requeueing job 1234" in out and "sbatch: attempt 1 exited with 0" in out, out
    assert (state / "requeues").read_text().split() == ["1234"]
    run_dir = work / "runs/slurm-1234"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 120, summary
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines() if '"train_loss"' in line]
    assert steps[-1] == 120 and len(set(steps)) == len(steps), steps  # resumed, not restarted
    assert Path(run_dir / "checkpoints").is_dir()


QRERUN = """#!/bin/bash
# stand-in qrerun: refused, as at sites where it needs operator privilege
echo "qrerun: Unauthorized Request  $1" >&2
exit 1
"""
QSTAT = """#!/bin/bash
# stand-in qstat -f: the job's resources
echo "    Resource_List.select = 1:ncpus=2:mpiprocs=2"
echo "    Resource_List.walltime = 00:30:00"
"""
QSUB = """#!/bin/bash
# stand-in qsub: queues the request (one argument a line) for the test to run, prints an id
printf '%s\\n' "$@" > "$STATE/queued"
echo 78.pbs01
"""
MPIEXEC_STANDIN = """#!/bin/bash
exec "$MPIEXEC" "$@"
"""


def test_pbs_script_stops_with_a_checkpoint_and_a_new_job_resumes_it(tmp_path):
    """PBS's SIGTERM before the walltime: the ranks stop with a checkpoint (exit 75);
    qrerun is refused (operator privilege), so the script submits a new job of itself with
    the same select, walltime and run directory, which resumes and finishes the run."""
    import signal
    import time

    state, env = stand_ins(tmp_path, {"qrerun": QRERUN, "qstat": QSTAT, "qsub": QSUB,
                                      "mpiexec": MPIEXEC_STANDIN})
    work = tmp_path / "work"
    (work / "jobs" / "pbs").mkdir(parents=True)
    script = work / "jobs" / "pbs" / "train.pbs"
    script.write_text((ROOT / "jobs/pbs/train.pbs").read_text())
    (work / "job.toml").write_text(
        "[data]\ntrain_samples = 8000\neval_samples = 200\ntable_sizes = [50, 200, 1000]\n"
        "[train]\nbatch_size = 32\nsteps = 120\nlog_every = 1\nprogress = false\n")
    (work / "nodes").write_text("vm\nvm\n")
    env.update(PBS_O_WORKDIR=str(work), PBS_NODEFILE=str(work / "nodes"), PBS_JOBID="77.pbs01",
               JOB="job.toml")
    first = subprocess.Popen(["bash", str(script)], cwd=work, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = work / "runs/pbs-77/metrics.jsonl"
    deadline = time.monotonic() + 200
    while first.poll() is None and time.monotonic() < deadline and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)  # what PBS sends before the walltime
    out, _ = first.communicate(timeout=200)
    assert first.returncode == 75, out
    assert "qrerun refused, submitted 78.pbs01 to resume runs/pbs-77" in out, out
    queued = (state / "queued").read_text().splitlines()
    assert queued == ["-v", "JOB=job.toml,HPCTRAIN_RUN_DIR=runs/pbs-77,HPCTRAIN_MAX_REQUEUES=3",
                      "-l", "select=1:ncpus=2:mpiprocs=2", "-l", "walltime=00:30:00",
                      "jobs/pbs/train.pbs"], queued
    again = dict(env, PBS_JOBID="78.pbs01", **dict(kv.split("=", 1)
                                                  for kv in queued[1].split(",")))
    second = subprocess.run(["bash", queued[-1]], cwd=work, env=again, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    run_dir = work / "runs/pbs-77"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 120
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines() if '"train_loss"' in line]
    assert steps[-1] == 120 and len(set(steps)) == len(steps), steps  # resumed
    assert (run_dir / ".requeues").read_text().strip() == "1"


ECHO_MPIEXEC = """#!/bin/bash
# stand-in mpiexec: records its arguments, one a line
printf '%s\\n' "$@" > "$STATE/mpiexec-args"
"""


def test_pbs_array_subjob_resumes_its_run_dir_whose_name_holds_brackets(tmp_path):
    """A subjob of ``qsub -J`` has PBS_JOBID ``77[3].pbs01``, so its run directory is
    ``runs/pbs-77[3]``: the script must find its checkpoint there (the name taken literally,
    not as a glob pattern whose ``[3]`` matches ``3``) and resume it; the Slurm script alike
    with such an HPCTRAIN_RUN_DIR."""
    state, env = stand_ins(tmp_path, {"mpiexec": ECHO_MPIEXEC, "srun": SRUN})
    work = tmp_path / "work"
    run_dir = work / "runs" / "pbs-77[3]"
    (run_dir / "checkpoints" / "step-00000010").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000010" / "manifest.h5").write_bytes(b"")
    (work / "nodes").write_text("vm\nvm\n")
    env.update(PBS_O_WORKDIR=str(work), PBS_NODEFILE=str(work / "nodes"),
               PBS_JOBID="77[3].pbs01", JOB="job.toml", MPIEXEC="mpiexec")
    slurm = dict(env, SLURM_SUBMIT_DIR=str(work), SLURM_JOB_ID="5",
                 HPCTRAIN_RUN_DIR="runs/pbs-77[3]")
    for script, args, script_env in (("jobs/pbs/train.pbs", [], env),
                                     ("jobs/slurm/train.sbatch", ["job.toml"], slurm)):
        result = subprocess.run(["bash", str(ROOT / script), *args], cwd=work, env=script_env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (script, result.stdout + result.stderr)
        launched = (state / "mpiexec-args").read_text().splitlines()
        assert launched[-4:] == ["train", "--resume", "runs/pbs-77[3]", "job.toml"], \
            (script, launched)
