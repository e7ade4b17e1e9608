import dataclasses
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.config import JobConfig, doc_table, dump_toml, load_config
from hpctrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_embedded_job():
    assert load_config() == JobConfig()
    assert load_config().source == "embedded default"


@pytest.mark.parametrize("override, words", [
    ("no.such_key=1", ["no.such_key", "no section 'no'"]),
    ("train.nokey=2", ["train.nokey", "keys of train", "batch_size"]),
    ("train.batch_size=-3", ["train.batch_size", ">= 1", "-3"]),
    ("train.batch_size=2.5", ["train.batch_size", "an integer"]),
    ("train.progress=1", ["train.progress", "true or false"]),
    ("train.optimizer=rmsprop", ["train.optimizer", "'sgd', 'adagrad', 'adam'"]),
    ("train.lr=nan", ["train.lr", "nan"]),
    ("data.table_sizes=[3, 0]", ["data.table_sizes[1]", ">= 1"]),
    ("data.table_sizes=5", ["data.table_sizes", "expected a list of int, got 5"]),
    ("data.eval_fraction=0.95", ["data.eval_fraction", "[0.0, 0.9]"]),
    ("model.top_mlp=[8, 2]", ["model.top_mlp", "must be 1"]),
    ("model.bottom_mlp=[8, 4]", ["model.bottom_mlp", "embedding_dim=16"]),
    ("data.source=criteo", ["data.paths", "needs at least one"]),
    ("train", ["section.key=value"]),
    ("parallel.schedule=zb", ["parallel.schedule", "'gpipe', '1f1b'"]),
    ("parallel.backend=nccl", ["parallel.backend", "'auto', 'mpi', 'torch'"]),
    ("parallel.pp=5", ["parallel.pp = 5", "at most 4 stages"]),
])
def test_bad_overrides_name_the_key(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    for word in words:
        assert word in str(info.value)


def test_file_errors_name_file_and_line(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[train]\nlr = 0.1\nbatch_size = \"big\"\n")
    with pytest.raises(ConfigError, match=r"train.batch_size \(.*job.toml:3\)"):
        load_config(job)
    job.write_text("[train\nlr = 0.1\n")
    with pytest.raises(ConfigError, match="job.toml: invalid TOML"):
        load_config(job)
    with pytest.raises(ConfigError, match="cannot read the job file"):
        load_config(tmp_path / "missing.toml")
    job.write_bytes(b"[train]\nlr = 0.1  # \xff\n")
    with pytest.raises(ConfigError, match="job.toml: not a UTF-8 text file"):
        load_config(job)
    job.write_text("train = 3\n")
    with pytest.raises(ConfigError, match="must be a table"):
        load_config(job)


@pytest.mark.parametrize("env, words", [
    ({"HPCTRAIN_TRAIN__BATCH_SIZE": "big"},
     ["train.batch_size ($HPCTRAIN_TRAIN__BATCH_SIZE)", "an integer", "'big'"]),
    ({"HPCTRAIN_TRAIN__BATCHSIZE": "8"},
     ["'train.batchsize' ($HPCTRAIN_TRAIN__BATCHSIZE)", "keys of train"]),
    ({"HPCTRAIN_TRIAN__LR": "0.1"}, ["'trian.lr' ($HPCTRAIN_TRIAN__LR)", "no section"]),
    ({"HPCTRAIN_TRAIN__ON_NONFINITE": "ignore"},
     ["train.on_nonfinite ($HPCTRAIN_TRAIN__ON_NONFINITE)", "'stop', 'skip'"]),
])
def test_bad_environment_names_the_variable(env, words):
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    for word in words:
        assert word in str(info.value)


def test_a_key_below_a_value_is_refused():
    """``--set train.lr.x=1`` after ``train.lr`` has a value cannot be merged into the job."""
    with pytest.raises(ConfigError, match=r"^--set train.lr.x: key 'train.lr.x' nests inside "
                                          r"a value$"):
        load_config(overrides=["train.lr=0.5", "train.lr.x=1"], env={})


def test_unknown_key_in_a_file_names_file_and_line(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[train]\nlr = 0.1\n\n[model]\nembedding_dim = 16\nlayers = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'model.layers' \(.*job.toml:6\); "
                                          r"keys of model are: bottom_mlp"):
        load_config(job)


def test_precedence_cli_over_file_over_env(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[train]\nlr = 0.5\nsteps = 7\n")
    env = {"HPCTRAIN_TRAIN__LR": "0.25", "HPCTRAIN_TRAIN__BATCH_SIZE": "64"}
    cfg = load_config(job, ["train.steps=9"], env=env)
    assert (cfg.train.lr, cfg.train.steps, cfg.train.batch_size) == (0.5, 9, 64)
    assert load_config(None, [], env=env).train.lr == 0.25


def test_data_paths_are_relative_to_the_job_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[data]\nsource = "criteo"\npaths = ["day_0.txt"]\n')
    assert load_config(job).data.paths == (str(tmp_path / "day_0.txt"),)


def test_dump_round_trips(tmp_path):
    cfg = load_config(overrides=["train.lr=0.02", "data.table_sizes=[5, 6]",
                                 'train.run_dir="a \\"b\\""'])
    path = tmp_path / "resolved.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(path) == cfg


def test_every_key_is_documented_in_readme():
    readme = (ROOT / "README.md").read_text()
    table = doc_table()
    defaults = JobConfig()
    for section in dataclasses.fields(defaults):
        if section.metadata.get("internal"):
            continue
        for f in dataclasses.fields(getattr(defaults, section.name)):
            key = f"`{section.name}.{f.name}`"
            assert key in table
            assert key in readme, f"README.md does not document {key}"
    # and the table README carries is the one `hpctrain config --doc` prints, row for row
    assert table in readme, "README.md's configuration table differs from doc_table()"


def test_config_doc_prints_the_table(capsys):
    assert main(["config", "--doc"]) == 0
    assert capsys.readouterr().out == doc_table()


def test_default_job_file_matches_embedded_default():
    assert load_config(ROOT / "jobs" / "configs" / "default.toml") == JobConfig()


@pytest.mark.parametrize("overrides, words", [
    (["parallel.pp=3", "parallel.stage_cuts=[1]"], ["parallel.stage_cuts", "need 2 cuts"]),
    (["parallel.pp=3", "parallel.stage_cuts=[2, 1]"], ["must increase"]),
    (["parallel.pp=2", "parallel.stage_cuts=[3]"], ["below the 3 layers"]),
])
def test_stage_cuts_are_checked(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    for word in words:
        assert word in str(info.value)
    assert load_config(overrides=["parallel.pp=3", "parallel.stage_cuts=[0, 2]"])


@pytest.mark.parametrize("overrides, words", [
    (["model.bottom_mlp=[]"], ["model.bottom_mlp = []", "at least one layer width"]),
    (["model.top_mlp=[]"], ["model.top_mlp = []", "at least one layer width"]),
    (["data.table_sizes=[]"], ["data.table_sizes = []", "at least one table"]),
    (["data.source='hdf5'", "data.paths=['a.h5', './a.h5']"],
     ["data.paths[1] = './a.h5' is also data.paths[0]", "read twice"]),
    (["data.source='hdf5'", "data.paths=['a.h5']", "data.eval_paths=['a.h5']"],
     ["data.eval_paths[0] = 'a.h5' is also data.paths[0]", "held-out data"]),
    (["data.table_sizes=[10, 3000000000]"],
     ["data.table_sizes[1] = 3,000,000,000", "exact up to 2,147,483,648 rows"]),
    (["data.source='criteo'", "data.paths=['a.txt']", "data.eval_fraction=0.0"],
     ["data.eval_fraction = 0 with no data.eval_paths", "no held-out samples"]),
])
def test_inputs_that_would_crash_or_leak_are_refused(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    for word in words:
        assert word in str(info.value)


def test_more_synthetic_tables_than_the_generator_has_fields():
    from hpctrain.data.synthetic import SyntheticClicks

    with pytest.raises(ConfigError, match="data.table_sizes: 40 tables; the synthetic "
                                          "generator supports at most 37"):
        SyntheticClicks([5] * 40, 10, 10, 1.0, 0)


@pytest.mark.parametrize("overrides, sums", [
    (["ps.mode='full'"], True),
    (["ps.mode='full'", "sync.model='ssp:0'"], True),
    (["ps.mode='full'", "sync.model='ssp:4'"], False),
    (["ps.mode='full'", "sync.table_models=['dense=asp']"], False),
    (["ps.mode='full'", "ps.prefetch=true"], False),
    ([], False),  # hybrid: each push applied on arrival unless asked
    (["sync.deterministic=true"], True),
])
def test_servers_sum_a_steps_pushes_in_full_mode_under_staleness_0(overrides, sums):
    assert load_config(overrides=["ps.servers=1", *overrides]).sums_pushes is sums


def test_a_pipeline_wire_without_a_pipeline_is_one_line():
    with pytest.raises(ConfigError, match="parallel.wire_dtype = 'bf16' .* parallel.pp = 1"):
        load_config(overrides=["parallel.wire_dtype='bf16'"], env={})


@pytest.mark.parametrize("overrides, words", [
    (["train.zero=1", "sync.dense='local:4'"],
     ["train.zero = 1", "gradient reductions", "not with sync.dense = local:H"]),
    (["train.zero=2", "train.optimizer='lars'"],
     ["train.zero = 2", "whole-layer norms", "not built for lars"]),
])
def test_zero_with_local_sgd_or_lars_is_one_line(overrides, words):
    """ZeRO shards the dense update over gradient reductions, which local SGD does not run,
    and LARS needs whole-layer norms, which a shard does not hold: both are refused with one
    line, naming why (the other ZeRO refusals are in tests/unit/test_dense_optim.py)."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, env={})
    assert "\n" not in str(info.value)
    for word in words:
        assert word in str(info.value)


def unused(*overrides: str) -> list[str]:
    return load_config(None, list(overrides)).unused_keys()


def test_keys_the_jobs_mode_does_not_read_are_named_one_line_each():
    """A key accepted and then ignored is a warning that says so: a replicated run under
    sync.model = 'asp' was silently BSP."""
    assert unused() == []
    assert unused("ps.servers=1", "sync.model='asp'", "ps.prefetch=true") == []
    assert unused("sync.model='ssp:4'", "ps.prefetch=true", "embeddings.mode='alltoall'") == [
        "sync.model, ps.prefetch are not used: for parameter-server tables only; "
        "ps.servers = 0 (tables alltoall, every step synchronous)"]
    assert unused("sync.table_models=['t3=asp']")[0].startswith("sync.table_models is not used")
    assert unused("tiering.policy='lru'", "tiering.interval=5") == [
        "tiering.policy, tiering.interval are not used: tiering.budget = 0 (no hot tier)"]
    assert unused("parallel.micro_batches=8", "parallel.schedule='gpipe'") == [
        "parallel.micro_batches, parallel.schedule are not used: parallel.tp = parallel.pp = 1 "
        "(no tensor or pipeline parallelism)"]
    assert unused("parallel.pp=2", "parallel.micro_batches=8") == []
    assert unused("data.eval_fraction=0.3") == [
        "data.eval_fraction is not used: data.source = 'synthetic' reads no files"]
    criteo = ["data.source='criteo'", "data.paths=['a.txt']"]
    assert unused(*criteo, "data.eval_fraction=0.3") == []
    assert unused(*criteo, "data.eval_paths=['b.txt']", "data.eval_fraction=0.3",
                  "data.train_samples=50") == [
        "data.train_samples is not used: for synthetic data only; data.source = 'criteo'",
        "data.eval_fraction is not used: data.eval_paths holds the held-out data"]
    hdf5 = ["data.source='hdf5'", "data.paths=['a.h5']"]
    assert unused(*hdf5, "data.eval_fraction=0.3", "data.eval_paths=['b.txt']") == [
        "data.eval_fraction is not used: an hdf5 file holds its own eval group, checked when "
        "it was written",
        "data.eval_paths is not read with data.source = 'hdf5': the file's own eval group is "
        "the held-out data (hpctrain preprocess wrote data.eval_paths into it)"]
