"""Checkpoint files without MPI: atomic writes, manifests, damage, compatibility, cadence."""

import errno

import h5py
import numpy as np
import pytest

from embeddings.tables import TableLayout
from hpctrain.config import load_config
from hpctrain.errors import CheckpointError
from hpctrain.train import checkpoint as ckpt
from hpctrain.train import checkpointing


def make(tmp_path, step=5, rows=100):
    folder = ckpt.step_dir(tmp_path, step)
    weight = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    entry = ckpt.write_rows(folder / "tables.h5", np.arange(rows), weight,
                            np.ones((rows, 1), np.float32))
    config = load_config()
    layout = TableLayout.from_sizes([rows], 4)
    manifest = checkpointing.new_manifest(config, layout, step, 2, 0, "", 1.5 * step, 10 * step)
    manifest.files = [entry]
    ckpt.write_manifest(folder, manifest)
    return folder, weight


def test_round_trip_and_latest(tmp_path):
    make(tmp_path, step=5)
    folder, weight = make(tmp_path, step=9)
    found = ckpt.latest(tmp_path)
    assert found.step == 9 and found.path == str(folder) and found.workers == 2
    assert (found.clock_s, found.samples) == (13.5, 90)  # where a resumed curve goes on
    rows, w, state = next(ckpt.read_rows(folder, found.row_files()))
    np.testing.assert_array_equal(w, weight)
    assert state.shape == (100, 1) and (rows == np.arange(100)).all()
    assert not list(tmp_path.rglob("*.tmp*"))


def test_damaged_newest_falls_back_and_names_the_file(tmp_path, caplog):
    older, _ = make(tmp_path, step=5)
    folder, _ = make(tmp_path, step=9)
    data = (folder / "tables.h5").read_bytes()
    (folder / "tables.h5").write_bytes(data[: len(data) // 2])  # truncated
    with caplog.at_level("WARNING", logger="hpctrain.train.checkpoint"):
        assert ckpt.latest(tmp_path).step == 5
    # the steps after 5 are lost: a warning says which checkpoint was passed over and why
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping a damaged checkpoint: checkpoint file {folder / 'tables.h5'} is missing or "
        f"does not match its checksum in {folder / 'manifest.h5'}; resuming from the older "
        f"{older}"]
    with pytest.raises(CheckpointError, match="tables.h5 is missing or does not match"):
        ckpt.read_manifest(folder)


def test_truncated_foreign_and_missing_manifests(tmp_path):
    folder, _ = make(tmp_path, step=3)
    manifest = folder / "manifest.h5"
    manifest.write_bytes(manifest.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="missing, truncated or not a checkpoint"):
        ckpt.read_manifest(folder)
    with h5py.File(manifest, "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(CheckpointError, match="is not an hpctrain checkpoint manifest"):
        ckpt.read_manifest(folder)
    manifest.write_text("not hdf5 at all")
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        ckpt.latest(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        ckpt.latest(tmp_path / "elsewhere")


def test_a_manifest_without_the_runs_clock_still_reads(tmp_path):
    """Checkpoints written before the clock was saved resume with the clock at zero."""
    folder, _ = make(tmp_path, step=3)
    with h5py.File(folder / "manifest.h5", "a") as f:
        del f.attrs["clock_s"], f.attrs["samples"]
    manifest = ckpt.read_manifest(folder)
    assert manifest.step == 3 and (manifest.clock_s, manifest.samples) == (None, None)


def test_a_manifest_of_another_format_version_is_refused(tmp_path):
    """A checkpoint another hpctrain version wrote may lay its files out differently."""
    folder, _ = make(tmp_path, step=3)
    with h5py.File(folder / "manifest.h5", "a") as f:
        f.attrs["version"] = 99
    with pytest.raises(CheckpointError, match=r"manifest.h5: checkpoint format version 99 is "
                                              r"not \d+$"):
        ckpt.read_manifest(folder)


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    make(tmp_path, step=4)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    folder = ckpt.step_dir(tmp_path, 8)
    monkeypatch.setattr(h5py.File, "create_dataset", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device; earlier "
                                              "checkpoints are untouched"):
        ckpt.write_rows(folder / "tables.h5", np.arange(3), np.zeros((3, 4), np.float32),
                        np.zeros((3, 0), np.float32))
    monkeypatch.undo()
    assert ckpt.latest(tmp_path).step == 4
    assert not list(tmp_path.rglob("*.tmp*"))


_FAILED_WRITE = """
import resource, signal, sys
import numpy as np
from hpctrain.errors import CheckpointError
from hpctrain.train import checkpoint as ckpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write(2) fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    ckpt.write_rows(ckpt.step_dir(sys.argv[1], 8) / "tables.h5", np.arange(100_000),
                    np.ones((100_000, 4), np.float32), np.zeros((100_000, 1), np.float32))
except CheckpointError as exc:
    print("MESSAGE", exc)
"""


def test_a_real_hdf5_write_error_is_one_line_naming_the_cause(tmp_path):
    """h5py's OSError carries HDF5's multi-line record (time, file, descriptor, buffer,
    offset) as its strerror; the message gives the errno's text instead, on one line. A
    file size limit makes the write fail for real (EFBIG), as a full disk does (ENOSPC);
    in a process of its own, since a failed HDF5 close leaves the library's state unsafe."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    make(tmp_path, step=4)
    root = str(Path(__file__).resolve().parents[2])  # this checkout's packages
    result = subprocess.run([sys.executable, "-c", _FAILED_WRITE, str(tmp_path)],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=root))
    folder = ckpt.step_dir(tmp_path, 8)
    lines = [line for line in result.stdout.splitlines() if line.startswith("MESSAGE")]
    assert lines == [f"MESSAGE cannot write checkpoint file {folder / 'tables.h5'}: File too "
                     f"large; earlier checkpoints are untouched"], result.stdout + result.stderr
    assert ckpt.latest(tmp_path).step == 4
    assert not list(tmp_path.rglob("*.tmp*"))


def test_incompatible_configs_are_named(tmp_path):
    make(tmp_path, step=5, rows=100)
    manifest = ckpt.latest(tmp_path)
    layout = TableLayout.from_sizes([100], 4)
    checkpointing.check_compatible(manifest, load_config(), layout)
    checkpointing.check_compatible(manifest, load_config(overrides=["ps.servers=1"]), layout)
    with pytest.raises(CheckpointError, match=r"model.top_mlp = \(128, 64, 1\); this job "
                                              r"has \(32, 1\)"):
        checkpointing.check_compatible(manifest, load_config(overrides=["model.top_mlp=[32, 1]"]),
                                       layout)
    with pytest.raises(CheckpointError, match=r"table_sizes = \[100\]; this job has \[50\]"):
        checkpointing.check_compatible(manifest, load_config(), TableLayout.from_sizes([50], 4))
    with pytest.raises(CheckpointError, match="ps.mode = replicated; this job has full"):
        checkpointing.check_compatible(manifest, load_config(overrides=[
            "ps.servers=1", "ps.mode='full'"]), layout)


def test_prune_keeps_the_newest_complete(tmp_path):
    for step in (2, 4, 6):
        make(tmp_path, step=step)
    ckpt.step_dir(tmp_path, 7).mkdir()  # an incomplete, newer one stays
    ckpt.prune(tmp_path, keep=2)
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step-00000004", "step-00000006", "step-00000007"]


def test_cadence_and_young_daly():
    # 5-minute writes, 1,024 GPUs of 50,000 h MTBF each: about 171 minutes (BACKGROUND.md)
    assert abs(ckpt.young_daly_s(300.0, 50_000 / 1024) / 60 - 171.2) < 0.1
    config = load_config(overrides=["checkpoint.every_steps=3", "checkpoint.every_minutes=0",
                                    "checkpoint.at_end=false"]).checkpoint
    cadence = checkpointing.Cadence(config)
    assert [d for d in range(1, 10) if cadence.due(d, final=False)] == [3, 6, 9]
    assert not cadence.due(10, final=True)
    at_end = checkpointing.Cadence(load_config(overrides=["checkpoint.every_minutes=0"]).checkpoint)
    assert at_end.due(10, final=True) and not at_end.due(9, final=False)
    daly = checkpointing.Cadence(load_config(overrides=["checkpoint.mtbf_hours=1.0"]).checkpoint)
    assert daly.interval_s() == 0.0  # measure a write first
    daly.saved(2.0)
    assert abs(daly.interval_s() - (2 * 2.0 * 3600) ** 0.5) < 1e-9


def test_prune_keeps_a_verified_checkpoint_when_the_newest_is_damaged(tmp_path):
    for step in (2, 4, 6):
        make(tmp_path, step=step)
    damaged = ckpt.step_dir(tmp_path, 6)
    victim = next(p for p in damaged.iterdir() if p.name != "manifest.h5")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    victim.write_bytes(bytes(data))
    ckpt.prune(tmp_path, keep=1)
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step-00000004", "step-00000006"]  # the intact 4 stays; damaged 6 too
    assert ckpt.latest(tmp_path).step == 4
    ckpt.prune(tmp_path, keep=3)  # fewer verified than asked: nothing deleted
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2


def test_a_commit_fails_when_rank_0_cannot_see_a_file(tmp_path):
    """A node-local run directory: another rank's file is not where rank 0 looks."""
    from mpi4py import MPI

    folder, _ = make(tmp_path, step=3)
    manifest = ckpt.read_manifest(folder)
    absent = ckpt.FileEntry("shard-1.h5", 10, "0" * 64, 5)
    with pytest.raises(CheckpointError, match=r"shard-1.h5, written by rank 0, is not visible "
                                              r"to rank 0; train.run_dir must be on a file "
                                              r"system every node shares"):
        checkpointing.commit(MPI.COMM_SELF, ckpt.step_dir(tmp_path, 4), [absent], manifest, 1)
    assert not ckpt.step_dir(tmp_path, 4).exists()


def test_a_commit_fails_when_rank_0_reads_other_bytes(tmp_path):
    """A file system whose nodes see different contents would restore another rank's
    rows: rank 0 checks each file's size and SHA-256 before committing."""
    from mpi4py import MPI

    folder, _ = make(tmp_path, step=3)
    manifest = ckpt.read_manifest(folder)
    step = ckpt.step_dir(tmp_path, 4)
    step.mkdir()
    (step / "shard-1.h5").write_bytes(b"x" * 10)
    stale = ckpt.FileEntry("shard-1.h5", 10, "0" * 64, 5)
    with pytest.raises(CheckpointError, match=r"shard-1.h5, written by rank 0, does not match "
                                              r"its size or SHA-256 as rank 0 reads it"):
        checkpointing.commit(MPI.COMM_SELF, step, [stale], manifest, 1)
    assert not (step / "manifest.h5").exists()


def test_a_dense_file_without_the_jobs_optimizer_state_is_named(tmp_path):
    """A dense file whose optimizer state does not fit the job (the shape check refuses it
    first, except in checkpoints written before the shape held train.momentum) is one
    CheckpointError."""
    import torch

    param = torch.zeros(3)
    checkpointing.write_dense(tmp_path / "dense.h5", [param], [])
    with pytest.raises(CheckpointError, match=r"dense.h5 does not fit this model"):
        checkpointing.read_dense(tmp_path / "dense.h5", [param], [torch.zeros(3)])


def test_resume_refuses_what_would_shift_the_data_position(tmp_path):
    folder, _ = make(tmp_path, step=3)
    manifest = ckpt.read_manifest(folder)
    layout = TableLayout.from_sizes([100], 4)
    for override, words in (("train.batch_size=64", "train.batch_size = 512; this job has 64"),
                            ("train.accumulate=2", "train.accumulate = 1; this job has 2"),
                            ("data.train_samples=10", "data.train_samples = 400000; this job "
                                                      "has 10")):
        with pytest.raises(CheckpointError, match=words):
            checkpointing.check_compatible(manifest, load_config(overrides=[override]), layout)


def test_resume_refuses_turning_momentum_on_or_off():
    """The dense file would lack the buffers, or hold ones the job drops without a word; the
    momentum's value may change."""
    layout = TableLayout.from_sizes([100], 4)

    def sgd(momentum: float):
        return load_config(overrides=["train.optimizer='sgd'", f"train.momentum={momentum}"])

    with_buffers = checkpointing.new_manifest(sgd(0.9), layout, 3, 2, 0, "", 1.0, 96)
    checkpointing.check_compatible(with_buffers, sgd(0.5), layout)
    with pytest.raises(CheckpointError, match=r"train.momentum = > 0 \(momentum buffers\); "
                                              r"this job has 0 \(no momentum buffers\)$"):
        checkpointing.check_compatible(with_buffers, sgd(0), layout)
    without = checkpointing.new_manifest(sgd(0), layout, 3, 2, 0, "", 1.0, 96)
    with pytest.raises(CheckpointError, match=r"train.momentum = 0 \(no momentum buffers\); "
                                              r"this job has > 0"):
        checkpointing.check_compatible(without, sgd(0.9), layout)


def test_checkpoints_are_on_by_default():
    """A queue job checkpoints without being asked: every 30 minutes and at the end."""
    cadence = checkpointing.Cadence(load_config().checkpoint)
    assert cadence.enabled and cadence.interval_s() == 1800.0
    assert cadence.due(7, final=True) and not cadence.due(7, final=False)
    assert not cadence.time_due()
    cadence.last -= 1800.0
    assert cadence.time_due()


def test_a_time_based_checkpoint_is_asked_for_once_however_late_the_agreement(monkeypatch):
    """The workers agree on a due checkpoint ``lag`` steps later (with parameter servers the
    staleness bound + 2): the steps in between must not ask again, or each would write one
    more checkpoint. One step is a second here, the interval 7.5 s, the agreement 3 steps
    late: due after step 8, written after step 11, due again after 19."""
    now = [0.0]
    monkeypatch.setattr(checkpointing.time, "monotonic", lambda: now[0])
    cadence = checkpointing.Cadence(load_config(overrides=["checkpoint.every_minutes=0.125",
                                                           "checkpoint.at_end=false"]).checkpoint)
    in_flight, saved_at = [], []
    for step in range(1, 40):
        now[0] = float(step)
        in_flight.append(cadence.time_due())
        if len(in_flight) > 3 and in_flight.pop(0):
            saved_at.append(step)
            cadence.saved(0.1)
    assert saved_at == [11, 22, 33]
