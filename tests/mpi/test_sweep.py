"""``hpctrain sweep``: bad sweep files, the Slurm array script under a stand-in ``srun``,
the local runner (skip finished, resume interrupted, clear a partial curve) and
``hpctrain report`` over it."""

import json
import os
import subprocess
import sys

import pytest
from harness import ROOT, child_env, mpiexec

from hpctrain.cli import main
from hpctrain.config import load_config

TINY = """
[sweep]
repeats = 2
ranks = 1

[set]
"data.train_samples" = 3000
"data.eval_samples" = 400
"data.table_sizes" = [100, 1000, 30]
"train.batch_size" = 100
"train.log_every" = 5
"train.eval_every" = 6
"train.eval_subset" = 200

[grid]
"train.lr" = [0.05, 0.1]
"""


@pytest.mark.parametrize("body, where, words", [
    ('[grid]\n"sync.modle" = ["bsp"]\n', ":2: sync.modle", "unknown key 'sync.modle'"),
    ('[grid]\n"sync.model" = ["bsp", "fast"]\n', ":2: sync.model", "unknown sync model"),
    ('[set]\n"train.lr" = -1\n[grid]\n"sync.model" = ["bsp"]\n', ":2: train.lr", ">= 0.0"),
    ('[grid]\n"sync.model" = []\n', ":2: sync.model", "non-empty list"),
    ('[grid]\n', ":1: grid", "empty grid: no key to vary"),
    ('[sweep]\nranks = 3\n[grid]\n"ps.servers" = [3]\n', ":4: ps.servers", "leaves no worker"),
    ('[sweep]\nrepeats = 3\n', ": points", "nothing to sweep"),
    ('[grid\n', ": invalid TOML", "invalid TOML"),
    ('[gird]\n"train.lr" = [0.1]\n', ":1: gird", "unknown table; a sweep file has grid"),
    ('[sweep]\nrepeat = 2\n', ":2: repeat", "unknown key of [sweep]; keys are job"),
    ('[sweep]\nrepeats = 0\n', ":2: repeats", "expected an integer >= 1, got 0"),
    ('[sweep]\njob = 3\n', ":2: job", "expected a path, got 3"),
    ('[grid]\n"train.lr" = [0.1]\n[[points]]\n"train.lr" = 0.2\n', ":3: points",
     "give a [grid] or [[points]], not both"),
    ('[grid]\n"world.ranks" = [0]\n', ":2: world.ranks", "expected an integer >= 1, got 0"),
    ('[grid]\n"parallel.pp" = [2]\n"ps.servers" = [1]\n', ":2: parallel.pp",
     "this point does not make a valid job: parallel.tp/pp > 1 keeps the tables"),
])
def test_a_bad_sweep_file_is_one_line_naming_file_line_and_key(tmp_path, capsys, body, where,
                                                               words):
    path = tmp_path / "s.toml"
    path.write_text(body)
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}{where}" in err[0] and words in err[0], err


def test_sweep_commands_without_their_files_are_one_line(tmp_path, capsys, monkeypatch):
    """What an array task or a local run needs is named when it is not there, before any
    launch."""
    sweep_file = tmp_path / "s.toml"
    sweep_file.write_text('[sweep]\nranks = 1\n[grid]\n"train.lr" = [0.05, 0.1]\n')
    out = tmp_path / "out"
    assert main(["sweep", str(sweep_file), "--out", str(out)]) == 0
    capsys.readouterr()
    monkeypatch.setenv("PATH", str(tmp_path))
    for argv, words in (
            ([str(tmp_path / "nope.toml"), "--out", str(out)],
             "nope.toml: cannot read the sweep file"),
            ([str(sweep_file)], "hpctrain sweep: give SWEEP.toml --out DIR, --run DIR or --task"),
            (["--run", str(tmp_path)], f"{tmp_path}: no sweep.json (write it with hpctrain "
                                       f"sweep SWEEP.toml --out {tmp_path})"),
            (["--task", str(out), "2", "0"], "tasks-2.txt: no such task list"),
            (["--task", str(out), "1", "5"], "tasks-1.txt: task 5 out of range (0-1)"),
            (["--task", str(out), "x", "0"], "x 0: RANKS and INDEX must be integers >= 0"),
            (["--task", str(out), "1", "0", "--launcher", "srun"],
             "--launcher srun: not found on PATH")):
        assert main(["sweep", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


def test_shipped_sweep_expands_to_interleaved_seeded_runs(tmp_path):
    main(["sweep", str(ROOT / "jobs" / "sweeps" / "sync_stragglers.toml"), "--out",
          str(tmp_path)])
    tasks = json.loads((tmp_path / "sweep.json").read_text())["tasks"]
    assert len(tasks) == 18 and [t["point"] for t in tasks[:7]] == [0, 1, 2, 3, 4, 5, 0]
    last = load_config(tasks[-1]["job"])
    assert (last.sync.model, last.sync.straggle_probability, last.train.seed) == ("asp", 0.1, 2)
    assert "#SBATCH --array=0-17" in (tmp_path / "slurm-3.sbatch").read_text()
    assert "#PBS -J 0-17" in (tmp_path / "pbs-3.pbs").read_text()


def test_dense_sync_sweep_puts_bf16_and_local_sgd_beside_the_float32_baseline(tmp_path):
    main(["sweep", str(ROOT / "jobs" / "sweeps" / "dense_sync.toml"), "--out", str(tmp_path)])
    tasks = json.loads((tmp_path / "sweep.json").read_text())["tasks"]
    jobs = [load_config(t["job"]) for t in tasks]
    assert [(j.sync.dense, j.comm.wire_dtype, j.train.seed) for j in jobs[:4]] == [
        ("bsp", "float32", 0), ("bsp", "bf16", 0), ("local:4", "float32", 0),
        ("bsp", "float32", 1)]
    assert len(jobs) == 9 and "#SBATCH --array=0-8" in (tmp_path / "slurm-2.sbatch").read_text()


def test_full_mode_plateau_sweep_is_ten_seeds_of_bsp_and_ssp(tmp_path):
    main(["sweep", str(ROOT / "jobs" / "sweeps" / "full_mode_plateau.toml"), "--out",
          str(tmp_path)])
    jobs = [load_config(t["job"]) for t in json.loads((tmp_path / "sweep.json").read_text())[
        "tasks"]]
    assert {(j.ps.mode, j.ps.servers) for j in jobs} == {("full", 1)}
    assert sorted((j.sync.model, j.train.seed) for j in jobs) == sorted(
        (m, s) for m in ("bsp", "ssp:4") for s in range(10))
    assert "#SBATCH --array=0-19" in (tmp_path / "slurm-4.sbatch").read_text()


def test_zero_stages_sweep_is_five_seeds_of_each_stage_and_bucket_size_on_the_reference_shape(
        tmp_path):
    main(["sweep", str(ROOT / "jobs" / "sweeps" / "zero_stages.toml"), "--out", str(tmp_path)])
    jobs = [load_config(t["job"]) for t in json.loads((tmp_path / "sweep.json").read_text())[
        "tasks"]]
    assert [(j.train.zero, j.comm.bucket_kib) for j in jobs[:7]] == [
        (0, 25600), (0, 512), (1, 25600), (1, 512), (2, 25600), (2, 512), (0, 25600)]
    assert {(j.train.optimizer, j.train.steps, j.data.table_sizes[0]) for j in jobs} == {
        ("adam", 400, 100_000)}
    assert len(jobs) == 30 and "#SBATCH --array=0-29" in (tmp_path / "slurm-2.sbatch").read_text()


def test_embedding_layouts_sweep_puts_all_to_all_beside_replicated_on_the_reference_shape(
        tmp_path):
    main(["sweep", str(ROOT / "jobs" / "sweeps" / "embedding_layouts.toml"), "--out",
          str(tmp_path)])
    jobs = [load_config(t["job"]) for t in json.loads((tmp_path / "sweep.json").read_text())[
        "tasks"]]
    assert [j.embeddings.mode for j in jobs[:4]] == ["replicated", "alltoall"] * 2
    assert {(j.embeddings.sharding, j.train.steps, j.runtime.threads, j.data.table_sizes[0])
            for j in jobs} == {("table_wise", 600, 1, 100_000)}
    assert len(jobs) == 10 and "#SBATCH --array=0-9" in (tmp_path / "slurm-2.sbatch").read_text()


def test_slurm_array_task_runs_its_point_then_run_and_report_finish_the_sweep(tmp_path):
    sweep_file = tmp_path / "tiny.toml"
    sweep_file.write_text(TINY)
    out = tmp_path / "sweep"
    assert main(["sweep", str(sweep_file), "--out", str(out)]) == 0
    tasks = json.loads((out / "sweep.json").read_text())["tasks"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f"#!/bin/sh\necho srun-stand-in \"$@\"\nexec {mpiexec()} \"$@\"\n")
    srun.chmod(0o755)
    env = dict(child_env(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               SLURM_ARRAY_TASK_ID="1")
    result = subprocess.run(["bash", str(out / "slurm-1.sbatch")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "srun-stand-in -n 1" in result.stdout
    ran = out / "runs" / tasks[1]["name"]
    assert load_config(ran / "config.toml").train.lr == tasks[1]["values"]["train.lr"] == 0.1
    assert (ran / "summary.json").exists() and not (out / "runs" / tasks[0]["name"]).exists()
    meta = json.loads((ran / "meta.json").read_text())
    assert meta["job"]["SLURM_ARRAY_TASK_ID"] == "1" and meta["world"]["ranks"] == 1
    assert any("heldout_log_loss" in json.loads(line)
               for line in (ran / "metrics.jsonl").read_text().splitlines())

    partial = out / "runs" / tasks[2]["name"]  # an interrupted run without a checkpoint
    partial.mkdir(parents=True)
    (partial / "metrics.jsonl").write_text('{"step": 999, "time_s": 1.0}\n')
    (partial / "config.toml").write_text("# written when its trainer started\n")
    (partial / "checkpoints" / "step-00000004").mkdir(parents=True)  # never completed
    stopped = out / "runs" / tasks[3]["name"]  # interrupted after its checkpoint at step 10
    first = subprocess.run([sys.executable, "-m", "hpctrain.cli", "train", tasks[3]["job"],
                            "--set", "train.steps=10"], env=child_env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stdout + first.stderr
    (stopped / "summary.json").unlink()
    local = subprocess.run([sys.executable, "-m", "hpctrain.cli", "sweep", "--run", str(out),
                            "--launcher", "srun"], env=dict(child_env(), PATH=env["PATH"]),
                           cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert local.returncode == 0, local.stdout + local.stderr
    assert local.stdout.count("srun-stand-in -n 1") == 3  # the runs not finished already
    assert f"{tasks[1]['name']} (train.lr=0.1, world.ranks=1): finished already" in \
        local.stdout
    assert local.stdout.count(": trained") == 2
    assert f"{tasks[3]['name']} (train.lr=0.1, world.ranks=1): resumed from step 10" in \
        local.stdout
    assert json.loads((stopped / "summary.json").read_text())["steps"] == 30
    assert '"step": 999' not in (partial / "metrics.jsonl").read_text()

    report = subprocess.run([sys.executable, "-m", "hpctrain.cli", "report", str(out / "runs"),
                             "--out", str(out)], env=child_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    assert "train.lr=0.1" in report.stdout and "fewer than 3" in report.stdout
    summary = json.loads((out / "report.json").read_text())
    assert [g["n"] for g in summary["groups"]] == [2, 2]
    assert (out / "curves.png").exists() and (out / "report.md").exists()


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_a_stop_signal_to_the_sweep_stops_its_run_with_a_checkpoint_and_nothing_after(tmp_path):
    """``kill`` of ``hpctrain sweep --run`` (SIGTERM to it alone): the run it launched gets
    the signal and stops with a checkpoint (before, its launcher was orphaned and trained
    on, and a second ``--run`` resumed the same run directory beside it); the sweep starts
    no further task and exits 75."""
    import signal
    import time

    sweep_file = tmp_path / "long.toml"
    sweep_file.write_text(TINY.replace('"data.train_samples" = 3000',
                                       '"data.train_samples" = 3000000')
                          .replace("repeats = 2", "repeats = 1"))
    out = tmp_path / "sweep"
    assert main(["sweep", str(sweep_file), "--out", str(out)]) == 0
    tasks = json.loads((out / "sweep.json").read_text())["tasks"]
    log = tmp_path / "sweep.log"
    with open(log, "w") as sink:  # a file: an orphaned launcher would hold a pipe open
        proc = subprocess.Popen([sys.executable, "-m", "hpctrain.cli", "sweep", "--run",
                                 str(out)], env=child_env(), cwd=ROOT, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        metrics = out / "runs" / tasks[0]["name"] / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and (
                not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)  # to the sweep only, not its process group
        proc.wait(timeout=120)
        time.sleep(1)
        leftovers = _processes_naming(tasks[0]["job"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _processes_naming(tasks[0]["job"]):  # an orphaned run trains on: end it
            os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert not leftovers, (leftovers, text[-3000:])
    assert proc.returncode == 75, text[-3000:]
    assert f"{tasks[0]['name']}: stopped by SIGTERM (the run exited 75)" in text, text
    run_dir = out / "runs" / tasks[0]["name"]
    assert list((run_dir / "checkpoints").glob("step-*/manifest.h5")), text[-3000:]
    assert not (run_dir / "summary.json").exists()
    assert not (out / "runs" / tasks[1]["name"]).exists()  # nothing started after the stop
