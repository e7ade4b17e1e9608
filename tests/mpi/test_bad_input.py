"""Bad input across ranks: NaN/Inf steps skipped or stopped alike in every training mode, and
errors found on some or all ranks ending real ``mpiexec`` launches with one line and exit 2."""

import json
import math
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from harness import run_mpi
from mpi4py import MPI
from poisoned import Poisoned

from hpctrain.config import DataConfig, load_config
from hpctrain.data import open_dataset
from hpctrain.data.preprocess import preprocess
from hpctrain.runtime.abort import AgreedError
from hpctrain.runtime.world import Topology, build_topology
from hpctrain.train.job import TrainingJob
from hpctrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]
SIZES = [50, 200, 1000, 7]
SMALL = [f"data.table_sizes={SIZES}", "data.train_samples=3000", "data.eval_samples=300",
         "model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]",
         "train.progress=false", "train.warmup_steps=0", "train.lr=0.02",
         "train.on_nonfinite='skip'"]


def state(trainer: Trainer) -> list[np.ndarray]:
    """Everything a step may change on this worker: dense parameters and optimizer state,
    and the embedding rows (with their optimizer state where the worker holds them)."""
    rows = trainer.table_rows()
    return trainer.dense_state() + ([] if rows is None else [rows])


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def evaluated(trainer: Trainer) -> int:
    """Held-out samples scored, the same on every worker (worker 0 gets the metrics)."""
    return MPI.COMM_WORLD.bcast(trainer.evaluate().get("samples"))


def skip_then_stop(trainer: Trainer, gate: list[bool], full: bool = False) -> str | None:
    """Steps 0-2 skipping the poisoned step 1, then (not in full PS mode, where workers do
    not agree) step 3, also poisoned, in stop mode: the agreed error's text on every worker.
    ``gate[0]`` is true during the poisoned steps."""
    batches, ahead = trainer.micro_batches(), []
    trainer.step(0, batches, ahead)
    before = state(trainer)
    gate[0] = True
    samples, loss = trainer.step(1, batches, ahead)
    gate[0] = False
    assert samples > 0 and math.isnan(loss) == (trainer.guard.skipped == 1)
    if not full:  # every worker skipped: nothing changed anywhere
        assert trainer.guard.skipped == 1 and same(state(trainer), before)
    trainer.step(2, batches, ahead)
    assert not same(state(trainer), before)
    assert all(np.isfinite(a).all() for a in state(trainer))
    if full:
        return None
    trainer.guard.mode = "stop"
    gate[0] = True
    with pytest.raises(AgreedError) as err:
        trainer.step(3, batches, ahead)
    gate[0] = False
    return str(err.value)


@pytest.mark.mpi(ranks=(4,))
def test_nonfinite_steps_are_skipped_or_stopped_alike_in_every_mode(tmp_path):
    world = MPI.COMM_WORLD
    def run_dir(name: str) -> str:  # a run directory holds one run
        return f"train.run_dir={str(tmp_path / name)!r}"

    gate = [False]

    # Replicated data parallel, 4 workers of 25 samples: worker 2 reads samples 160 and 360
    # in steps 1 and 3.
    config = load_config(overrides=[*SMALL, run_dir("replicated"), "train.batch_size=100"])
    data = open_dataset(config.data)

    def replicated(trainer: Trainer) -> None:
        message = skip_then_stop(trainer, gate)
        assert message.startswith("[rank 2] step 3: non-finite dense features: train sample "
                                  "360, I4 = nan; set train.on_nonfinite"), message
        mine = state(trainer)
        assert all(same(mine, other) for other in world.allgather(mine))  # replicas agree
        assert evaluated(trainer) == 299  # eval sample 160 is left out

    TrainingJob(config, build_topology(config), dataset=Poisoned(data, {160, 360})).run(
        replicated)

    # All-to-all shards over the same 4 workers (column-wise: a block of every row on each).
    for sharding in ("row_wise", "column_wise"):
        config = load_config(overrides=[*SMALL, run_dir(sharding), "train.batch_size=100",
                                        "embeddings.mode='alltoall'",
                                        f"embeddings.sharding={sharding!r}"])
        trainer = Trainer(config, build_topology(config), Poisoned(data, {160, 360}))
        message = skip_then_stop(trainer, gate)
        assert message.startswith("[rank 2] step 3: non-finite dense features: train sample "
                                  "360"), message
        assert evaluated(trainer) == 299

    # Parameter servers, hybrid and full mode: 3 workers of 30 samples + 1 server; worker 1
    # reads sample 130 in step 1 and 310 in step 3.
    # "tiered": hybrid with 300 rows hot, whose gradients a dropped share still joins (as zeros).
    for mode in ("hybrid", "full", "tiered"):
        config = load_config(overrides=[*SMALL, run_dir(mode), "ps.servers=1",
                                        "train.batch_size=90",
                                        f"ps.mode={'full' if mode == 'full' else 'hybrid'!r}",
                                        f"tiering.budget={300 if mode == 'tiered' else 0}",
                                        "tiering.budget_unit='rows'"])
        topo = build_topology(config)

        def with_servers(trainer: Trainer, mode: str = mode, topo: Topology = topo) -> None:
            message = skip_then_stop(trainer, gate, full=mode == "full")
            assert trainer.server_clock() == 3  # a skipped step (or share) still ticks it
            assert (trainer.counters().tiering is not None) == (mode == "tiered")
            if mode != "full":
                assert message.startswith("[rank 1] step 3: non-finite dense features: train "
                                          "sample 310"), message
            else:  # only worker 1 dropped its share of step 1
                assert trainer.guard.skipped == (topo.worker_rank == 1)

        TrainingJob(config, topo, dataset=Poisoned(data, {130, 310})).run(with_servers)

    # tp = 2 x pp = 2: only world rank 3 (stage 1, tensor shard 1) sees a NaN gradient.
    config = load_config(overrides=[*SMALL, run_dir("grid"), "train.batch_size=64", "parallel.tp=2",
                                    "parallel.pp=2", "parallel.backend='mpi'",
                                    "parallel.micro_batches=2"])

    def grid(trainer: Trainer) -> None:
        if world.Get_rank() == 3:
            weight = next(trainer.parameters())
            weight.register_hook(lambda g: torch.full_like(g, math.nan) if gate[0] else None)
        message = skip_then_stop(trainer, gate)
        assert message.startswith("[rank 3] step 3: non-finite gradient of ") and \
            "(stage 1, tensor shard 1)" in message, message
        assert evaluated(trainer) == 299

    TrainingJob(config, build_topology(config), dataset=Poisoned(data, {290})).run(grid)


SAMPLE = ROOT / "tests" / "data" / "criteo_kaggle_sample.txt"
QUIET = ["--set", "train.progress=false", "--set", "train.steps=3"]


def train(args: list[str], ranks: int) -> tuple[int, list[str], str]:
    """Exit code, the toolkit's own output lines and the whole output of a training launch."""
    result = run_mpi([*HPCTRAIN, "train", *QUIET, *args], ranks=ranks, timeout=120)
    ours = [line for line in result.stdout.splitlines() if line.startswith("hpctrain")]
    assert "Traceback" not in result.stdout, result.stdout
    return result.returncode, ours, result.stdout


def test_bad_input_ends_real_launches_with_one_line_and_exit_2(tmp_path):
    lines = SAMPLE.read_bytes().split(b"\n")[:40]
    lines[30] = b"7" + lines[30][1:]  # read by rank 1 alone (step 1: lines 21-40)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    criteo = ["--set", "data.source='criteo'", "--set", "data.eval_fraction=0",
              "--set", f"data.eval_paths=[{str(SAMPLE)!r}]", "--set", "train.batch_size=20"]
    code, ours, out = train([*criteo, "--set", f"data.paths=[{str(bad)!r}]", "--set",
                             f"train.run_dir={str(tmp_path / 'r1')!r}"], ranks=2)
    assert code == 2 and ours == [f"hpctrain: error: [rank 1] {bad}:31: label: expected 0 or "
                                  f"1, got '7'"], out

    # Found by every rank when opening the data: agreed, printed once, no abort.
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    code, _, out = train([*criteo, "--set", f"data.paths=[{str(empty)!r}]", "--set",
                          f"train.run_dir={str(tmp_path / 'r2')!r}"], ranks=2)
    assert code == 2 and out.strip() == f"hpctrain: error: [ranks 0-1] {empty}: empty file"

    # A run directory below a file: refused before anything is written.
    below_a_file = str(empty / "run")
    code, ours, out = train(["--set", f"train.run_dir={below_a_file!r}"], ranks=2)
    assert code == 2 and ours == [f"hpctrain: error: [rank 0] train.run_dir = "
                                  f"{below_a_file!r}: cannot write there (Not a directory)"], out

    # A NaN feature read by worker 1 (samples 60-79 of step 1) beside a parameter server;
    # in full mode the workers share no collective, so worker 1 ends the job alone.
    h5 = tmp_path / "nan.h5"
    preprocess(DataConfig(source="criteo", paths=(str(SAMPLE),)), str(h5))
    with h5py.File(h5, "a") as f:
        f["train/dense"][70, 3] = np.nan
    for mode in ("hybrid", "full"):
        code, ours, out = train(["--set", "data.source='hdf5'", "--set",
                                 f"data.paths=[{str(h5)!r}]", "--set", "train.batch_size=40",
                                 "--set", "ps.servers=1", "--set", f"ps.mode={mode!r}",
                                 "--set", f"train.run_dir={str(tmp_path / mode)!r}"], ranks=3)
        assert code == 2 and ours == [
            "hpctrain: error: [rank 1] step 1: non-finite dense features: train sample 70, I4 = "
            "nan; set train.on_nonfinite = \"skip\" to skip such steps"], (mode, out)


def test_ranks_that_see_different_configs_stop_before_training(tmp_path):
    """One rank launched with another environment: one line naming the key and the ranks."""
    import subprocess

    from harness import child_env, mpiexec

    train = [*HPCTRAIN, "train", *[a for kv in SMALL for a in ("--set", kv)],
             "--set", f"train.run_dir={str(tmp_path / 'run')!r}"]
    result = subprocess.run([mpiexec(), "-n", "1", *train, ":", "-n", "1", "-env",
                             "HPCTRAIN_TRAIN__SEED", "7", *train], env=child_env(),
                            capture_output=True, text=True, timeout=180)
    lines = [line for line in (result.stdout + result.stderr).splitlines()
             if line.startswith("hpctrain")]
    assert result.returncode == 2, result.stdout + result.stderr
    seed = load_config().train.seed
    assert lines == [f"hpctrain: error: ranks disagree on config key train.seed: {seed} on "
                     f"rank 0; 7 on rank 1 (same launch, environment and files on every "
                     f"rank?)"], lines


def test_a_skipped_line_is_counted_once_however_many_ranks_read_it(tmp_path):
    """Both pipeline stages of one replica read the same lines: the summary counts a
    skipped line once, not once per rank."""
    lines = SAMPLE.read_bytes().split(b"\n")[:40]
    lines[30] = b"7" + lines[30][1:]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    code, _, out = train(["--set", "data.source='criteo'", "--set", "data.eval_fraction=0",
                          "--set", f"data.eval_paths=[{str(SAMPLE)!r}]", "--set",
                          "train.batch_size=20", "--set", f"data.paths=[{str(bad)!r}]",
                          "--set", "data.on_bad_line='skip'", "--set", "parallel.pp=2",
                          "--set", f"train.run_dir={str(tmp_path / 'run')!r}"], ranks=2)
    assert code == 0, out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_lines"] == 1
