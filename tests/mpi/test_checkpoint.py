"""Kill-and-resume and N->M resharding through real launches of the command line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import child_env, mpiexec, run_mpi

from hpctrain.train import checkpoint as ckpt

HPCTRAIN = [sys.executable, "-m", "hpctrain.cli", "train"]
JOB = ["--set", "data.table_sizes=[50, 200, 1000, 7]", "--set", "data.train_samples=4000",
       "--set", "data.eval_samples=200", "--set", "model.embedding_dim=8",
       "--set", "model.bottom_mlp=[16, 8]", "--set", "model.top_mlp=[16, 1]",
       "--set", "train.batch_size=32", "--set", "train.steps=8", "--set", "train.lr=0.05",
       "--set", "train.progress=false", "--set", "sync.deterministic=true",
       "--set", "checkpoint.every_steps=4", "--set", "checkpoint.at_end=true",
       "--set", "checkpoint.keep=5", "--set", "ps.sharding='row_hash'",
       "--set", "ps.table_wise_below=100"]


def servers(n: int) -> list[str]:
    return ["--set", f"ps.servers={n}"]


def train(run_dir: Path, ranks: int, *extra: str) -> None:
    result = run_mpi([*HPCTRAIN, *JOB, *servers(ranks - 2), "--set",
                      f"train.run_dir={str(run_dir)!r}", *extra], ranks=ranks, timeout=180)
    assert result.returncode == 0, result.stdout


def resume(run_dir: Path, ranks: int) -> str:
    result = run_mpi([*HPCTRAIN, "--resume", str(run_dir), *servers(ranks - 2), "--set",
                      "sync.straggle_probability=0.0"], ranks=ranks, timeout=180)
    assert result.returncode == 0, result.stdout
    return result.stdout


def final_state(run_dir: Path, step: int = 8, dense: bool = True) -> dict[str, np.ndarray]:
    """Every row (sorted by global id) with its state, and the dense parameters (of
    ``dense.h5``, when ``dense``)."""
    manifest = ckpt.read_manifest(ckpt.step_dir(run_dir, step))
    state = sorted_rows(manifest, manifest.row_files())
    if not dense:
        return state
    with h5py.File(Path(manifest.path) / "dense.h5") as f:
        for name, item in f["param"].items():
            state[f"param/{name}"] = item[()]
        for name, item in (f["optim"].items() if "optim" in f else ()):  # none: full mode
            state[f"optim/{name}"] = item[()]
    return state


def sorted_rows(manifest: ckpt.Manifest, names: list[str]) -> dict[str, np.ndarray]:
    parts = list(ckpt.read_rows(Path(manifest.path), names))
    rows = np.concatenate([p[0] for p in parts])
    order = np.argsort(rows)
    return {"rows": rows[order], "weight": np.concatenate([p[1] for p in parts])[order],
            "state": np.concatenate([p[2] for p in parts])[order]}


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def training_curve(run_dir: Path) -> list[tuple[int, int, float]]:
    """(step, samples, time_s) of the training records in ``run_dir``'s metrics.jsonl."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["samples"], r["time_s"]) for r in records if "train_loss" in r]


def assert_continuous(curve: list[tuple[int, int, float]], steps: int) -> None:
    """Each step once, in order, at 32 samples a step (the global batch), the clock never
    going back: a resumed run's curve goes on from its checkpoint."""
    assert [(step, samples) for step, samples, _ in curve] == \
        [(step, 32 * step) for step in range(1, steps + 1)], curve
    times = [t for _, _, t in curve]
    assert times == sorted(times), times


def kill_after_checkpoint(run_dir: Path, step: int) -> None:
    """Launch a slowed-down 3-rank run, logging every step, and SIGKILL it once checkpoint
    ``step`` commits."""
    slow = ["--set", "sync.straggle_probability=1.0", "--set", "sync.straggle_factor=40",
            "--set", "train.log_every=1"]
    proc = subprocess.Popen([mpiexec(), "-n", "3", *HPCTRAIN, *JOB, *servers(1), *slow, "--set",
                             f"train.run_dir={str(run_dir)!r}"], env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    manifest = ckpt.step_dir(run_dir, step) / "manifest.h5"
    deadline = time.monotonic() + 150
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert manifest.exists() and proc.returncode != 0
    assert ckpt.latest(run_dir).step in (step, 2 * step)


def test_kill_resume_and_reshard_give_bitwise_the_same_model(tmp_path):
    straight, killed, grown, shrunk = (tmp_path / n for n in ("a", "b", "c", "d"))
    train(straight, 3)
    reference = final_state(straight)
    assert ckpt.latest(straight).servers == 1 and len(reference["rows"]) == 1257

    kill_after_checkpoint(killed, 4)
    # The kill may come after checkpoint 8 too: drop it, so both resumes start from step 4.
    shutil.rmtree(killed / "checkpoints" / "step-00000008", ignore_errors=True)
    shutil.copytree(killed, grown)
    out = resume(killed, 3)  # 3 -> 3 after a SIGKILL
    assert "resuming from" in out and "(step 4)" in out, out
    assert ckpt.latest(killed).step == 8
    assert_identical(final_state(killed), reference)
    assert_continuous(training_curve(killed), 8)  # steps 5+ logged before the kill: once

    out = resume(grown, 4)  # 1 server + 2 workers -> 2 servers + 2 workers
    assert "resuming from" in out and "(step 4)" in out, out
    assert ckpt.latest(grown).servers == 2
    assert_identical(final_state(grown), reference)

    train(shrunk, 4, "--set", "train.steps=4")  # 2 servers -> 1 server
    result = run_mpi([*HPCTRAIN, "--resume", str(shrunk), *servers(1), "--set",
                      "train.steps=8"], ranks=3, timeout=180)
    assert result.returncode == 0, result.stdout
    assert_identical(final_state(shrunk), reference)


def test_full_mode_resumes_its_dense_table_bitwise_onto_another_server_count(tmp_path):
    """Full mode: the dense table (per-value Adagrad state, ``dense-table-<s>.h5``) and the
    tables after 4 steps on 2 servers and 4 more on 1 equal 8 straight steps on 1 server."""
    full = ("--set", "ps.mode='full'")
    straight, moved = tmp_path / "a", tmp_path / "b"
    train(straight, 3, *full)
    train(moved, 4, *full, "--set", "train.steps=4")
    result = run_mpi([*HPCTRAIN, "--resume", str(moved), *servers(1), "--set",
                      "train.steps=8"], ranks=3, timeout=180)
    assert result.returncode == 0, result.stdout
    assert "(step 4)" in result.stdout, result.stdout
    tables = {}
    for run in (straight, moved):
        manifest = ckpt.read_manifest(ckpt.step_dir(run, 8))
        tables[run] = sorted_rows(manifest, manifest.dense_table_files())
    rows, dim = tables[straight]["weight"].shape
    assert tables[straight]["state"].shape == (rows, 2 * dim)  # per value: accumulator, round
    assert tables[straight]["state"].any()
    assert_identical(tables[moved], tables[straight])
    assert_identical(final_state(moved), final_state(straight))


def test_resume_refuses_what_it_cannot_restore(tmp_path):
    missing = run_mpi([*HPCTRAIN, "--resume", str(tmp_path / "nowhere")], ranks=2, timeout=60)
    assert missing.returncode == 2 and "no config.toml there" in missing.stdout
    train(tmp_path / "run", 2, "--set", "train.steps=4", "--set", "ps.servers=0")
    other = run_mpi([*HPCTRAIN, "--resume", str(tmp_path / "run"), "--set",
                     "model.top_mlp=[8, 1]"], ranks=2, timeout=60)
    assert other.returncode == 2, other.stdout
    assert "was made with model.top_mlp = (16, 1); this job has (8, 1)" in other.stdout
    # replicated tables resume onto a parameter server (hybrid), not into full mode
    full = run_mpi([*HPCTRAIN, "--resume", str(tmp_path / "run"), *servers(1), "--set",
                    "ps.mode='full'"], ranks=3, timeout=60)
    assert full.returncode == 2 and "ps.mode" in full.stdout, full.stdout
    hybrid = run_mpi([*HPCTRAIN, "--resume", str(tmp_path / "run"), *servers(1), "--set",
                      "train.steps=6"], ranks=3, timeout=120)
    assert hybrid.returncode == 0 and "(step 4)" in hybrid.stdout, hybrid.stdout
    rows = final_state(tmp_path / "run", step=6)["rows"]
    np.testing.assert_array_equal(rows, np.arange(50 + 200 + 1000 + 7))  # all, from the server


def alltoall(sharding: str) -> list[str]:
    return ["--set", "embeddings.mode='alltoall'", "--set", f"embeddings.sharding='{sharding}'",
            "--set", "comm.node_size=2"]


def test_alltoall_resume_onto_other_worker_counts_and_shardings(tmp_path):
    """All-to-all shards resume 3 -> 4 and 4 -> 3 workers (and into another sharding)
    with the rows re-partitioned by the new plan: the same model as an uninterrupted run,
    up to the summation order of the different batch slicing."""
    job = JOB[:-4]  # without the servers' sharding keys
    straight, grown, shrunk = (tmp_path / n for n in ("a", "b", "c"))

    def launch(run_dir: Path, ranks: int, *extra: str, resume: bool = False) -> None:
        args = ["--resume", str(run_dir)] if resume else [*job, "--set",
                                                           f"train.run_dir={str(run_dir)!r}"]
        result = run_mpi([*HPCTRAIN, *args, *extra], ranks=ranks, timeout=180)
        assert result.returncode == 0, result.stdout

    launch(straight, 4, *alltoall("table_wise"))
    reference = final_state(straight)
    assert len(reference["rows"]) == 1257 and reference["state"].shape[1] == 1
    launch(grown, 3, *alltoall("column_wise"), "--set", "train.steps=4")
    launch(grown, 4, *alltoall("row_wise"), "--set", "train.steps=8", resume=True)
    launch(shrunk, 4, *alltoall("table_row_wise"), "--set", "train.steps=4")
    launch(shrunk, 3, *alltoall("table_wise"), "--set", "train.steps=8", resume=True)
    for run, workers in ((grown, 4), (shrunk, 3)):
        files = ckpt.read_manifest(ckpt.step_dir(run, 8)).row_files()
        assert sorted(files) == [f"shard-w{w}.h5" for w in range(workers)]
        got = final_state(run)
        assert got.keys() == reference.keys()
        np.testing.assert_array_equal(got["rows"], reference["rows"])
        for key in reference:
            np.testing.assert_allclose(got[key], reference[key], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{run.name} {key}")


def test_adam_state_resumes_bitwise(tmp_path):
    """Dense AdamW (moments and step count in dense.h5) and lazy-Adam tables, replicated on
    two workers: resuming from step 4 ends where the straight run ends."""
    adam = ["--set", "train.optimizer='adamw'", "--set", "train.weight_decay=0.01",
            "--set", "train.clip_norm=0.5", "--set", "train.lr=0.01"]
    straight, resumed = tmp_path / "a", tmp_path / "b"
    train(straight, 2, *adam)
    reference = final_state(straight)
    assert len([k for k in reference if k.startswith("optim/")]) > 2  # m, v and the count
    assert reference["state"].shape[1] == 2 * 8 + 1  # lazy Adam rows: m, v, count
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000008")
    resume(resumed, 2)
    assert_identical(final_state(resumed), reference)


def test_a_run_directory_belongs_to_one_run(tmp_path):
    """Without --resume, a directory holding a run is refused: one line, exit 2, every file
    byte-identical."""
    run_dir = tmp_path / "run"
    train(run_dir, 2)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    result = run_mpi([*HPCTRAIN, *JOB, "--set", f"train.run_dir={str(run_dir)!r}"], ranks=2,
                     timeout=180)
    assert result.returncode == 2, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("hpctrain")]
    assert len(lines) == 1 and "holds another run" in lines[0], result.stdout
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.parametrize("signum, ranks, who", [(signal.SIGUSR1, 2, "every rank"),
                                               (signal.SIGTERM, 3, "every rank"),
                                               (signal.SIGTERM, 3, "the server")])
def test_a_signal_stops_with_a_checkpoint_and_the_resumed_run_is_bitwise_equal(tmp_path,
                                                                               signum, ranks,
                                                                               who):
    """SIGUSR1 (replicated tables, 2 workers) or SIGTERM (a server and 2 workers: the server
    outlives it until the workers' checkpoint is written) to every rank mid-run, or to the
    server only (its replies carry it to the workers): the workers agree on a step,
    checkpoint it and every rank exits with 75; the resumed run ends with the parameters of
    an uninterrupted one."""
    import re

    from harness import rank_pids

    from hpctrain.runtime.preempt import EXIT_STOPPED

    steps = 60
    longer = ["--set", f"train.steps={steps}", "--set", "train.log_every=1"]
    train(tmp_path / "whole", ranks, *longer)
    run_dir = tmp_path / "cut"
    proc = subprocess.Popen([mpiexec(), "-n", str(ranks), *HPCTRAIN, *JOB, *servers(ranks - 2),
                             *longer, "--set", f"train.run_dir={str(run_dir)!r}"],
                            env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and (
                not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
            time.sleep(0.05)
        pids = rank_pids(proc.pid)
        assert len(pids) == ranks
        for pid in pids.values() if who == "every rank" else [pids[ranks - 1]]:
            os.kill(pid, signum)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_STOPPED, out
    stopped = int(re.search(r"stopped by a signal after step (\d+) with a checkpoint", out)[1])
    assert 5 <= stopped < steps, out
    assert ckpt.latest(run_dir).step == stopped
    # the grace period goes to the checkpoint and the exit, not to a final evaluation
    assert "not run (stopped before the last step" in out, out
    assert "eval_log_loss" not in (run_dir / "metrics.jsonl").read_text()
    assert not (run_dir / "summary.json").exists()  # not finished: a sweep resumes it
    resume(run_dir, ranks)
    assert_identical(final_state(run_dir, steps), final_state(tmp_path / "whole", steps))
    assert_continuous(training_curve(run_dir), steps)


def dense_files(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    """Every dense dataset of checkpoint ``step``, keyed by file and name."""
    out = {}
    for path in sorted(ckpt.step_dir(run_dir, step).glob("dense*.h5")):
        with h5py.File(path) as f:
            f.visititems(lambda name, item, p=path: out.__setitem__(
                f"{p.name}/{name}", item[()]) if isinstance(item, h5py.Dataset) else None)
    return out


def test_tensor_and_pipeline_parallel_runs_resume_bitwise(tmp_path):
    """pp = 3 over 3 ranks and tp = 2 over 2: one dense file per (stage, tensor shard); a
    run resumed from step 4 ends bitwise where the straight run ends; another grid is
    refused, naming it."""
    job = [*JOB[:-4], "--set", "train.optimizer='adam'", "--set", "train.lr=0.01"]
    for ranks, grid, files in ((3, "parallel.pp=3", 3), (2, "parallel.tp=2", 2)):
        straight, cut = tmp_path / f"a{ranks}", tmp_path / f"b{ranks}"
        for run_dir, steps in ((straight, 8), (cut, 4)):
            result = run_mpi([*HPCTRAIN, *job, "--set", grid, "--set", f"train.steps={steps}",
                              "--set", f"train.run_dir={str(run_dir)!r}"], ranks=ranks,
                             timeout=180)
            assert result.returncode == 0, result.stdout
        result = run_mpi([*HPCTRAIN, "--resume", str(cut), "--set", "train.steps=8"],
                         ranks=ranks, timeout=180)
        assert result.returncode == 0 and "(step 4)" in result.stdout, result.stdout
        reference = dense_files(straight, 8)
        assert len({key.split("/")[0] for key in reference}) == files
        assert_identical(dense_files(cut, 8), reference)
        assert_identical(final_state(cut, 8, dense=False), final_state(straight, 8, dense=False))
    other = run_mpi([*HPCTRAIN, "--resume", str(tmp_path / "b2"), "--set", "parallel.tp=1",
                     "--set", "parallel.pp=2", "--set", "train.steps=12"], ranks=2, timeout=60)
    assert other.returncode == 2, other.stdout
    assert "dense layout = parallel.tp = 2, parallel.pp = 1" in other.stdout, other.stdout


def test_zero_checkpoints_hold_the_unsharded_state(tmp_path):
    """ZeRO-1 writes the plain optimizer's state: a 2-worker run resumed from step 4 ends
    bitwise as the straight run, and the same checkpoint resumes onto 3 ZeRO workers, onto
    3 ZeRO-2 workers (whose own checkpoint, written the same way, holds the final state)
    and onto plain data parallelism, close to it."""
    adam = ["--set", "train.optimizer='adamw'", "--set", "train.lr=0.01", "--set",
            "train.weight_decay=0.01", "--set", "ps.servers=0"]
    zero = [*adam, "--set", "train.zero=1"]
    straight, cut = tmp_path / "a", tmp_path / "b"
    train(straight, 2, *zero)
    train(cut, 2, *zero, "--set", "train.steps=4")
    plain, wider, stage2 = tmp_path / "plain", tmp_path / "wider", tmp_path / "stage2"
    for copy in (plain, wider, stage2):
        shutil.copytree(cut, copy)
    reference = final_state(straight)
    with h5py.File(ckpt.step_dir(cut, 4) / "dense.h5") as f:
        assert len(f["optim"]) == 2 * len(f["param"]) + 1  # unsharded m, v and the count
    for run_dir, ranks, extra in ((cut, 2, ()), (wider, 3, ()), (stage2, 3, ("train.zero=2",)),
                                  (plain, 2, ("train.zero=0",))):
        result = run_mpi([*HPCTRAIN, "--resume", str(run_dir), "--set", "train.steps=8",
                          *(a for key in extra for a in ("--set", key))], ranks=ranks,
                         timeout=180)
        assert result.returncode == 0 and "(step 4)" in result.stdout, result.stdout
    assert_identical(final_state(cut), reference)
    for run_dir in (wider, stage2, plain):
        got = final_state(run_dir)
        for key in reference:
            np.testing.assert_allclose(got[key], reference[key], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{run_dir.name} {key}")


SLOW_SAVES = """
import sys, time
from hpctrain.cli import main
from hpctrain.train import checkpointing
commit = checkpointing.commit
def slow(*args):
    time.sleep(4.0)
    commit(*args)
checkpointing.commit = slow
sys.exit(main(sys.argv[1:]))
"""


def test_checkpoint_writes_stay_out_of_the_run_clock(tmp_path):
    """Two saves slowed by 4 s each: the clock (time_s, wall_s) leaves them out; the phase
    table has them."""
    run = tmp_path / "run"
    result = run_mpi([sys.executable, "-c", SLOW_SAVES, "train", *JOB, "--set",
                      "train.steps=4", "--set", "checkpoint.every_steps=2", "--set",
                      "train.log_every=4", "--set", f"train.run_dir={str(run)!r}"], ranks=1,
                     timeout=180)
    assert result.returncode == 0, result.stdout
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "train_loss" in r][-1]
    assert summary["phase_s"]["checkpoint"] >= 8.0
    assert summary["wall_s"] < 8.0 and last["time_s"] < 8.0, (summary, last)


@pytest.mark.mpi(ranks=(2, 3))
def test_workers_whose_clocks_come_due_in_different_steps_write_one_checkpoint():
    """With parameter servers the workers agree on a time-based checkpoint ``lag`` steps
    late; worker r's clock comes due at step 5 + r, so requests of several steps are in
    flight. The first agreement writes the checkpoint, which satisfies them all (before,
    each later request wrote one more, a step apart: step-00000380 and step-00000381)."""
    from mpi4py import MPI

    from hpctrain.runtime.preempt import Preemption

    comm = MPI.COMM_WORLD
    preemption = Preemption(lag=3)
    saved = []
    try:
        for step in range(1, 21):
            if preemption.after_step(comm, step == 5 + comm.Get_rank()).save:
                saved.append(step)
                preemption.saved()  # what the trainer does after writing it
        preemption.drain(comm)
    finally:
        preemption.uninstall()
    assert saved == [8], saved


def test_resuming_a_finished_run_is_refused_and_keeps_its_summary(tmp_path):
    """A second submission of a job script whose run directory finished (its checkpoint at
    the last step, summary.json): resuming it would train nothing and overwrite the summary
    with 0 samples/s and a NaN loss, which a report then averages. One line, exit 2,
    nothing changed; more steps extend it."""
    run_dir = tmp_path / "done"
    train(run_dir, 2)
    before = (run_dir / "summary.json").read_text()
    again = run_mpi([*HPCTRAIN, "--resume", str(run_dir)], ranks=2, timeout=180)
    assert again.returncode == 2, again.stdout
    assert (f"--resume {run_dir}: the run finished at step 8 (summary.json); nothing is left "
            f"to train up to train.steps = 8: set more steps to extend it") in again.stdout
    assert (run_dir / "summary.json").read_text() == before
    assert "resumes" not in json.loads((run_dir / "meta.json").read_text())
    longer = run_mpi([*HPCTRAIN, "--resume", str(run_dir), "--set", "train.steps=12"], ranks=2,
                     timeout=180)
    assert longer.returncode == 0, longer.stdout
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12
