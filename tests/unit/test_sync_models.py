import pytest

from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.experiments.compare import compare_sync, straggler_overrides
from hpctrain.sync.asp import ASP
from hpctrain.sync.bsp import BSP
from hpctrain.sync.models import parse_model, parse_models, table_models
from hpctrain.sync.ssp import ssp
from hpctrain.sync.stragglers import Stragglers


def test_the_clock_rule():
    assert BSP.ready(5, 5) and not BSP.ready(5, 4)
    assert BSP.ready(5, 4, slack=1)  # a prefetch may lack one step
    assert ssp(2).ready(5, 3) and not ssp(2).ready(5, 2)
    assert ASP.ready(100, 0)
    assert ssp(3).staleness(7, 5) == 2 and BSP.staleness(3, 9) == 0


def test_model_names():
    assert parse_model("bsp") is BSP and parse_model("ASP") is ASP
    assert parse_model("ssp:4") == ssp(4) and parse_model("ssp:0").bound == 0
    assert [m.name for m in parse_models("bsp, ssp:2,asp")] == ["bsp", "ssp:2", "asp"]
    for bad, words in (("ssp", "non-negative"), ("ssp:-1", "non-negative"),
                       ("ssp:x", "non-negative"), ("bsp:1", "unknown"), ("fast", "unknown")):
        with pytest.raises(ConfigError, match=words):
            parse_model(bad)
    with pytest.raises(ConfigError, match="no sync model"):
        parse_models(" , ")


def test_per_table_models():
    models = table_models("ssp:2", ["t1=asp", "dense=bsp"], ["t0", "t1", "dense"])
    assert [m.name for m in models] == ["ssp:2", "asp", "bsp"]
    with pytest.raises(ConfigError, match="no table named 't9'"):
        table_models("bsp", ["t9=asp"], ["t0", "t1"])


def test_config_checks_sync_keys():
    with pytest.raises(ConfigError, match="sync.model: unknown sync model"):
        load_config(overrides=["sync.model='eventual'"])
    with pytest.raises(ConfigError, match=r"sync.table_models\[0\]: expected 'TABLE=MODEL'"):
        load_config(overrides=["sync.table_models=['asp']"])
    with pytest.raises(ConfigError, match="sync.deterministic needs staleness 0"):
        load_config(overrides=["sync.deterministic=true", "sync.model='ssp:1'"])
    with pytest.raises(ConfigError, match="sync.slow_factor"):
        load_config(overrides=["sync.slow_factor=0.5"])


def test_stragglers_are_deterministic_and_have_the_asked_rate():
    a = Stragglers(1, probability=0.1, delay_factor=3.0, seed=4)
    b = Stragglers(1, probability=0.1, delay_factor=3.0, seed=4)
    factors = [a.factor(s) for s in range(5000)]
    assert factors == [b.factor(s) for s in range(5000)]
    assert set(factors) == {1.0, 3.0}
    assert 0.08 < factors.count(3.0) / 5000 < 0.12
    slow = Stragglers(2, slow_workers=[2], slow_factor=2.0)
    assert slow.factor(7) == 2.0 and Stragglers(0, slow_workers=[2], slow_factor=2.0).factor(7) == 1


def test_straggler_flags():
    assert straggler_overrides("none") == []
    assert straggler_overrides("transient:0.1:3") == ["sync.straggle_probability=0.1",
                                                      "sync.straggle_factor=3.0"]
    assert straggler_overrides("persistent:1+2:4") == ["sync.slow_workers=[1, 2]",
                                                       "sync.slow_factor=4.0"]
    with pytest.raises(ConfigError, match="--stragglers"):
        straggler_overrides("transient:often:3")


def test_repeated_comparisons_of_a_real_data_job_need_an_evaluation_cadence():
    """Repeats compare held-out curves; a text job has no sample count to space them by."""
    config = load_config(overrides=["data.source='criteo'", "data.paths=['day_0.txt']"],
                         env={})
    with pytest.raises(ConfigError, match=r"compare-sync --repeats > 1 needs train.eval_every "
                                          r"or train.steps for a non-synthetic job"):
        compare_sync(config, None, "bsp,asp", "never", None, repeats=2)


def test_ssp_learning_rate_rule():
    from hpctrain.sync.models import lr_factor

    assert lr_factor("ssp:3", "sqrt") == 0.5 and lr_factor("bsp", "sqrt") == 1.0
    assert lr_factor("ssp:8", "constant") == 1.0
    assert load_config(overrides=["ps.servers=1", "sync.model='ssp:4'",
                                  "sync.ssp_lr='sqrt'"]).sync.ssp_lr == "sqrt"
    for sets in (["ps.servers=1", "sync.model='asp'"], ["sync.model='ssp:4'"]):
        with pytest.raises(ConfigError, match="sync.ssp_lr = 'sqrt' scales"):
            load_config(overrides=[*sets, "sync.ssp_lr='sqrt'"])
