"""The Slurm script's signal / checkpoint / requeue / resume flow, end to end, with stand-in
``sbatch``, ``scontrol`` and ``srun`` shell scripts on ``PATH`` (``srun`` runs mpiexec)."""

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


def test_slurm_script_signals_checkpoints_requeues_and_resumes(tmp_path):
    bin_dir, state, work = tmp_path / "bin", tmp_path / "state", tmp_path / "work"
    for folder in (bin_dir, state, work):
        folder.mkdir()
    for name, text in (("sbatch", SBATCH), ("scontrol", SCONTROL), ("srun", SRUN)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    hpctrain = bin_dir / "hpctrain"
    hpctrain.write_text(f'#!/bin/bash\nexec "{sys.executable}" -m hpctrain.cli "$@"\n')
    hpctrain.chmod(hpctrain.stat().st_mode | stat.S_IEXEC)
    env = dict(child_env(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               STATE=str(state), MPIEXEC=mpiexec(), PYTHONPATH=str(ROOT))
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
