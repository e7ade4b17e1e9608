"""The run directory: written where asked, or one error naming train.run_dir."""

import os

import pytest

from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError
from hpctrain.train.rundir import RunDir


def test_run_dir_is_made_and_filled(tmp_path):
    run = RunDir(str(tmp_path / "a" / "b"), JobConfig())
    run.log({"step": 1})
    run.write_json("summary.json", {"steps": 1})
    run.close()
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == [
        "config.toml", "metrics.jsonl", "summary.json"]


def test_unwritable_run_dir_names_the_key(tmp_path):
    parent = tmp_path / "file.txt"
    parent.write_text("not a folder")
    path = str(parent / "run")
    with pytest.raises(ConfigError) as err:
        RunDir(path, JobConfig())
    assert str(err.value) == f"train.run_dir = {path!r}: cannot write there (Not a directory)"
    if os.geteuid() != 0:  # permission bits do not stop root
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot write there .Permission denied"):
            RunDir(str(locked / "run"), JobConfig())
