"""``hpctrain report`` on synthetic run directories with known figures: the interval
arithmetic (hand-computed t quantiles), targets, ratios and verdicts, and the refusals."""

import json
import math
import subprocess
import sys

import pytest
from scipy import stats as scipy_stats

from hpctrain import stats
from hpctrain.cli import main
from hpctrain.config import dump_toml, load_config
from hpctrain.errors import ConfigError
from hpctrain.experiments.report import build_report, format_report, write_report
from hpctrain.experiments.rundirs import find_runs

T_975_2 = 4.302653  # Student t 97.5% quantile, 2 degrees of freedom (printed tables)
T_975_4 = 2.776445


def make_run(path, rate, sets=(), loss_end=0.4, finished=True, seed=0):
    """A run whose held-out loss falls linearly from 0.6 to ``loss_end`` over 1000 samples
    at ``rate`` samples/s."""
    path.mkdir(parents=True)
    config = load_config(None, [*sets, f"train.seed={seed}", f"train.run_dir='{path}'"])
    (path / "config.toml").write_text(dump_toml(config))
    lines = []
    for samples in range(0, 1001, 100):
        loss = 0.6 - (0.6 - loss_end) * samples / 1000
        lines.append({"step": samples // 10, "samples": samples, "time_s": samples / rate,
                      "heldout_log_loss": loss, "train_loss": loss + 0.01})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "meta.json").write_text(json.dumps({"world": {"ranks": 3}}))
    if finished:
        summary = {"eval": {"log_loss": loss_end, "auc": 0.7}, "samples_per_s": float(rate),
                   "staleness": {"t0": {"reads": 10, "mean": 1.0, "p99": 2, "max": 2}}}
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def sweep(tmp_path):
    for i, rate in enumerate((50 / 3, 20, 25)):
        make_run(tmp_path / f"bsp-{i}", rate, ["sync.model='bsp'"], seed=i)
    for i, rate in enumerate((40, 50, 50)):
        make_run(tmp_path / f"ssp-{i}", rate, ["sync.model='ssp:4'"], seed=i)
    return find_runs([str(tmp_path)])


def test_t_interval_matches_hand_computed_numbers():
    interval = stats.mean_interval([1.0, 2.0, 3.0])
    assert interval.estimate == 2.0 and interval.df == 2
    half = T_975_2 * 1.0 / math.sqrt(3)
    assert interval.lo == pytest.approx(2.0 - half, abs=1e-5)
    assert interval.hi == pytest.approx(2.0 + half, abs=1e-5)
    five = stats.mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert five.hi - five.estimate == pytest.approx(T_975_4 * math.sqrt(2.5 / 5), abs=1e-5)
    assert stats.mean_interval([7.0]).lo is None
    assert stats.trimmed_mean([50.0, 25.0, 20.0]) == 25.0
    assert stats.trimmed_mean([1.0, 2.0]) is None


def test_fieller_interval_solves_its_defining_equation():
    # a baseline without spread: the interval is the t interval of the other mean over it
    r = stats.ratio_interval([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])
    half = T_975_2 / math.sqrt(3)
    assert r.estimate == 1.0 and r.df == pytest.approx(2.0)
    assert (r.lo, r.hi) == (pytest.approx((2 - half) / 2, abs=1e-5),
                            pytest.approx((2 + half) / 2, abs=1e-5))
    a, b = [12.5, 10.0, 10.0], [30.0, 25.0, 20.0]
    r = stats.ratio_interval(a, b)
    ma, mb = sum(a) / 3, sum(b) / 3
    va = sum((x - ma) ** 2 for x in a) / 2 / 3
    vb = sum((x - mb) ** 2 for x in b) / 2 / 3
    df = (va + r.estimate ** 2 * vb) ** 2 / (va ** 2 / 2 + r.estimate ** 4 * vb ** 2 / 2)
    q = scipy_stats.t.ppf(0.975, df)
    assert r.df == pytest.approx(df)
    for end in (r.lo, r.hi):
        assert (ma - end * mb) ** 2 == pytest.approx(q ** 2 * (va + end ** 2 * vb))
    assert r.lo < r.estimate < r.hi
    # a baseline whose mean may be zero gives no (bounded) interval
    assert stats.ratio_interval([1.0, 2.0], [-1.0, 1.5]).lo is None


def test_paired_ratio_interval_is_a_t_interval_of_the_log_ratios():
    # ratios 2, 4 and 8: logs ln2 * (1, 2, 3), geometric mean 4
    r = stats.paired_ratio_interval([2.0, 8.0, 24.0], [1.0, 2.0, 3.0])
    half = T_975_2 * math.log(2) / math.sqrt(3)
    assert r.estimate == pytest.approx(4.0) and r.n == 3 and r.df == 2
    assert r.lo == pytest.approx(4.0 * math.exp(-half), rel=1e-5)
    assert r.hi == pytest.approx(4.0 * math.exp(half), rel=1e-5)
    # pairing removes what both runs of a pair share: the same 10% gain on a machine whose
    # speed swings 2x between pairs has a zero-width interval
    same = stats.paired_ratio_interval([11.0, 22.0, 5.5], [10.0, 20.0, 5.0])
    assert same.lo == pytest.approx(1.1) and same.hi == pytest.approx(1.1)
    assert stats.verdict(same, "slower", "faster") == "faster"
    one = stats.paired_ratio_interval([3.0], [2.0])
    assert one.estimate == pytest.approx(1.5) and one.lo is None
    with pytest.raises(ValueError, match="pairs"):
        stats.paired_ratio_interval([1.0, 2.0], [1.0])


def test_report_groups_runs_and_computes_known_figures(tmp_path):
    report = build_report(sweep(tmp_path), target=0.5)
    assert report["group_keys"] == ["sync.model"]
    bsp, ssp = report["groups"]
    assert (bsp["name"], bsp["n"], ssp["name"]) == ("sync.model=bsp", 3, "sync.model=ssp:4")
    times = bsp["metrics"]["time_to_target_s"]
    assert times["values"] == pytest.approx([30.0, 25.0, 20.0])  # 500 samples at 16.7-25/s
    mean, sd = 25.0, 5.0
    assert times["estimate"] == pytest.approx(mean)
    assert times["hi"] - mean == pytest.approx(T_975_2 * sd / math.sqrt(3), abs=1e-4)
    assert times["trimmed_mean"] == pytest.approx(25.0)
    assert bsp["metrics"]["samples_to_target"]["values"] == pytest.approx([500.0] * 3)
    assert bsp["metrics"]["staleness_mean"]["estimate"] == 1.0
    ratio = ssp["vs_baseline"]["time_to_target_s"]
    assert ratio["estimate"] == pytest.approx((32.5 / 3) / mean)
    assert ratio["hi"] < 1 and ratio["verdict"] == "faster"
    assert ssp["vs_baseline"]["samples_per_s"]["verdict"] == "faster"
    assert ssp["vs_baseline"]["samples_to_target"]["verdict"].startswith(
        "no significant difference")
    text = format_report(report)
    assert "Student t" in text and "Fieller" in text and "faster" in text
    written = write_report(report, tmp_path / "out")
    assert {p.name for p in written} == {"report.json", "report.md", "curves.png",
                                         "time_to_target.png"}
    assert json.loads((tmp_path / "out" / "report.json").read_text())["baseline"] == bsp["name"]


def test_default_target_is_reached_by_every_run_and_baseline_is_chosen(tmp_path):
    runs = sweep(tmp_path)
    report = build_report(runs, baseline="sync.model=ssp:4")
    assert report["target_loss"] == pytest.approx(0.44)  # the loss at 80% of 1000 samples
    assert report["baseline"] == "sync.model=ssp:4"
    bsp = report["groups"][0]
    assert bsp["metrics"]["samples_to_target"]["values"] == pytest.approx([800.0] * 3)
    assert bsp["vs_baseline"]["time_to_target_s"]["verdict"] == "slower"
    train = build_report(runs, metric="train", target=0.5)  # smoothed training loss
    assert train["groups"][0]["metrics"]["samples_to_target"]["missing"] == 0
    never = build_report(runs, target=0.1)
    assert never["groups"][0]["metrics"]["time_to_target_s"]["missing"] == 3
    assert "not comparable" in never["groups"][1]["vs_baseline"]["time_to_target_s"]["verdict"]
    with pytest.raises(ConfigError, match="matches 0 groups"):
        build_report(runs, baseline="sync.model=asp")
    for path in tmp_path.glob("*/summary.json"):  # runs without a parameter server
        summary = json.loads(path.read_text())
        path.write_text(json.dumps({**summary, "staleness": {}}))
    verdict = build_report(find_runs([str(tmp_path)]))["groups"][1]["vs_baseline"][
        "staleness_mean"]["verdict"]
    assert verdict == "not measured (3 of 3 and 3 of 3 runs read no parameter-server rows)"
    table = format_report(build_report(find_runs([str(tmp_path)])))
    assert "3 not measured" in table and "3 missing" not in table


def test_small_groups_warn_and_unfinished_runs_are_listed_not_averaged(tmp_path):
    make_run(tmp_path / "a", 10, seed=1)
    make_run(tmp_path / "b", 20, seed=2)
    make_run(tmp_path / "c", 30, seed=3, finished=False)
    report = build_report(find_runs([str(tmp_path)]), target=0.5)
    assert [g["n"] for g in report["groups"]] == [2]
    assert report["excluded"] == [{"run": str(tmp_path / "c"),
                                   "why": "unfinished (no summary.json)"}]
    assert "fewer than 3" in report["warnings"][0]
    # a resume that continued the run's clock is no concern; one that restarted it (from a
    # checkpoint written before the clock was saved) makes its times to target meaningless
    (tmp_path / "b" / "meta.json").write_text(json.dumps({"world": {"ranks": 3}, "resumes": [{}]}))
    assert len(build_report(find_runs([str(tmp_path)]), target=0.5)["warnings"]) == 1
    records = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    restarted = {**json.loads(records[-1]), "time_s": 1.0}
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write(json.dumps(restarted) + "\n")
    again = build_report(find_runs([str(tmp_path)]), target=0.5)
    assert "b was resumed from a checkpoint that did not save the run's clock" in \
        again["warnings"][1]


def test_refusals_are_one_line_and_exit_2(tmp_path, capsys):
    make_run(tmp_path / "d16", 10)
    make_run(tmp_path / "d8", 10, ["model.embedding_dim=8", "model.bottom_mlp=[64, 32, 8]"])
    (tmp_path / "empty").mkdir()
    make_run(tmp_path / "left" / "x", 10, finished=False)
    cases = ((tmp_path, "model.bottom_mlp differs"),
             (tmp_path / "empty", "no run directory"),
             (tmp_path / "left", "no finished run to report among 1"))
    for path, words in cases:
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    make_run(tmp_path / "nocurve", 10)
    (tmp_path / "nocurve" / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no held-out curve"):
        build_report(find_runs([str(tmp_path / "nocurve")]))


@pytest.mark.parametrize(("damage", "words"), [
    (lambda run: (run / "config.toml").write_text("[train\n"), "config.toml: unreadable"),
    (lambda run: (run / "summary.json").write_text("{"), "summary.json: unreadable"),
    (lambda run: (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "sa\n'),
     "metrics.jsonl:2: not a JSON record"),
    (lambda run: (run / "metrics.jsonl").write_text('{"step": 1, "x\n{"step": 2}'),
     "metrics.jsonl:1: not a JSON record"),
])
def test_a_damaged_run_file_is_named(tmp_path, damage, words):
    """A report over many runs names the one file it cannot read, and where."""
    damage(make_run(tmp_path / "a", 10))
    with pytest.raises(ConfigError, match=words):
        find_runs([str(tmp_path)])


def test_a_record_cut_short_by_a_crash_ends_the_curve(tmp_path):
    """Only the last line can be cut (each record is one write): the curve ends before it,
    and a run left that way does not stop the report of a whole sweep."""
    run = make_run(tmp_path / "a", 10)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 101, "sam')
    [found] = find_runs([str(tmp_path)])
    assert len(found.records) == 11 and found.records[-1]["step"] == 100


def test_report_arguments_that_name_nothing_usable(tmp_path):
    """A path that is no folder, a baseline without a key, a training curve without
    training losses: each is one error saying what to change."""
    run = make_run(tmp_path / "a", 10)
    with pytest.raises(ConfigError, match="meta.json: not a folder"):
        find_runs([str(run / "meta.json")])
    with pytest.raises(ConfigError, match=r"--baseline 'bsp': expected KEY=VALUE\[,KEY=VALUE"):
        build_report(find_runs([str(tmp_path)]), baseline="bsp")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "samples": 10, "time_s": 1.0,
                                                   "heldout_log_loss": 0.5}) + "\n")
    with pytest.raises(ConfigError, match="a: no training loss records in metrics.jsonl"):
        build_report(find_runs([str(tmp_path)]), metric="train")


def test_report_command_writes_its_files(tmp_path, capsys):
    sweep(tmp_path)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "sync.model=ssp:4" in out and "ratio" in out
    assert (tmp_path / "r" / "curves.png").stat().st_size > 5_000


def test_baseline_names_a_group_by_several_keys(tmp_path):
    """Groups differing in two keys: one key matches two groups (refused, naming them all);
    both keys, joined by a comma, name one."""
    for model in ("bsp", "ssp:4"):
        for zero in (0, 1):
            for seed in range(2):
                make_run(tmp_path / f"{model}-{zero}-{seed}", 20 + 5 * zero + seed,
                         [f"sync.model='{model}'", f"train.zero={zero}"], seed=seed)
    runs = find_runs([str(tmp_path)])
    with pytest.raises(ConfigError, match="matches 2 groups"):
        build_report(runs, baseline="train.zero=1")
    report = build_report(runs, baseline="sync.model=ssp:4, train.zero=1")
    assert report["baseline"] == "sync.model=ssp:4, train.zero=1"
    assert len([g for g in report["groups"] if "vs_baseline" in g]) == 3


def test_the_default_baseline_is_the_first_runs_group_even_when_that_run_failed(tmp_path):
    """compare-sync's first model is the baseline: a failed first repeat of it must not
    make the next model's group the baseline (the ratios would flip)."""
    make_run(tmp_path / "a-bsp-0", 20, ["sync.model='bsp'"], seed=0, finished=False)
    for i in range(3):
        make_run(tmp_path / f"b-asp-{i}", 40, ["sync.model='asp'"], seed=i)
    for i in range(1, 4):
        make_run(tmp_path / f"c-bsp-{i}", 20, ["sync.model='bsp'"], seed=i)
    report = build_report(find_runs([str(tmp_path)]), target=0.5)
    assert report["baseline"] == "sync.model=bsp"
    asp = next(g for g in report["groups"] if g["name"] == "sync.model=asp")
    assert asp["vs_baseline"]["samples_per_s"]["verdict"] == "faster"
    for i in range(1, 4):  # no bsp run finished: the first group is the baseline, said so
        (tmp_path / f"c-bsp-{i}" / "summary.json").unlink()
        make_run(tmp_path / f"d-ssp-{i}", 30, ["sync.model='ssp:4'"], seed=i)
    alone = build_report(find_runs([str(tmp_path)]), target=0.5)
    assert alone["baseline"] == "sync.model=asp"
    assert "the first run's group has no finished run" in alone["warnings"][0]


def test_a_training_process_does_not_import_scipy_stats():
    """A bench command's parser imports the benchmarks, which share the interval code;
    SciPy's stats (about 46 MiB resident per rank) is imported only when an interval is
    computed, so their training ranks do not carry it."""
    code = ("import sys\n"
            "from hpctrain import cli\n"
            "cli._parser()\n"
            "import hpctrain.train.job\n"
            "sys.exit(int('scipy.stats' in sys.modules))\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    assert stats.t_quantile(4) == pytest.approx(T_975_4, abs=1e-6)
