"""The run directory: written where asked, or one error naming train.run_dir."""

import json
import os

import pytest

from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError
from hpctrain.train.rundir import RunDir, claim


def test_run_dir_is_made_and_filled(tmp_path):
    run = RunDir(str(tmp_path / "a" / "b"), JobConfig())
    run.log({"step": 1})
    run.write_json("summary.json", {"steps": 1})
    run.close()
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == [
        "config.toml", "metrics.jsonl", "summary.json"]


def test_a_resumed_run_drops_the_records_after_its_checkpoint(tmp_path):
    """A run killed after checkpoint 20 had logged steps 30 and 40 and was cut mid-record:
    resumed from step 20, it runs those steps again, so their records go and the curve
    goes on from step 20 with each step once."""
    path = tmp_path / "run"
    run = RunDir(str(path), JobConfig())
    for step in (10, 20, 20, 30, 40):  # step 20: a training record and a held-out one
        run.log({"step": step, "samples": step * 8})
    run.close()
    with open(path / "metrics.jsonl", "a") as f:
        f.write('{"step": 50, "sam')
    resumed = RunDir(str(path), JobConfig(), resumed_at=20)
    resumed.log({"step": 30, "samples": 240})
    resumed.close()
    lines = (path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [10, 20, 20, 30]
    fresh = RunDir(str(tmp_path / "new"), JobConfig(), resumed_at=5)  # no records yet: fine
    fresh.close()


def test_unwritable_run_dir_names_the_key(tmp_path):
    parent = tmp_path / "file.txt"
    parent.write_text("not a folder")
    path = str(parent / "run")
    for make in (lambda: RunDir(path, JobConfig()), lambda: claim(path, resume=False)):
        with pytest.raises(ConfigError) as err:
            make()
        assert str(err.value) == f"train.run_dir = {path!r}: cannot write there (Not a directory)"
    if os.geteuid() != 0:  # permission bits do not stop root
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot write there .Permission denied"):
            RunDir(str(locked / "run"), JobConfig())


def test_a_full_disk_under_the_metrics_is_one_line_naming_the_file(tmp_path):
    import errno

    run = RunDir(str(tmp_path / "run"), JobConfig())

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    run._metrics = Full()
    with pytest.raises(ConfigError) as err:
        run.log({"step": 1})
    assert str(err.value) == f"cannot write {tmp_path / 'run' / 'metrics.jsonl'}: No space " \
                             f"left on device"


def test_a_directory_holding_a_run_is_refused_unless_resumed(tmp_path):
    claim(str(tmp_path / "new"), resume=False)  # absent: fine
    (tmp_path / "empty").mkdir()
    claim(str(tmp_path / "empty"), resume=False)  # empty: fine
    run = RunDir(str(tmp_path / "old"), JobConfig())
    run.close()
    with pytest.raises(ConfigError, match=r"holds another run \(config.toml, metrics.jsonl\); "
                                          r"resume it with --resume"):
        claim(str(tmp_path / "old"), resume=False)
    claim(str(tmp_path / "old"), resume=True)


def test_default_names_differ_within_a_second_and_carry_the_job():
    from hpctrain.train.rundir import default_run_dir

    names = {default_run_dir({}) for _ in range(50)}
    assert len(names) == 50  # same second, different names
    slurm = default_run_dir({"SLURM_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"})
    assert "-4242_7-" in slurm and slurm.startswith("runs/")
    assert "-99.pbs01-" not in default_run_dir({"PBS_JOBID": "99.pbs01"})
    assert "-99-" in default_run_dir({"PBS_JOBID": "99.pbs01"})
