"""``hpctrain plan calc``: the worked examples of the background notes come out of the
commands, units parse, and bad input is one line with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpctrain.errors import ConfigError
from hpctrain.plan.cli import main
from hpctrain.plan.units import parse_quantity


def calc(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, float]:
    assert main(["calc", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_zero_7b(capsys):
    """7B model = 112 GB of state; ZeRO-3 over 64 GPUs = 1.75 GB each; ZeRO-1 ~4x, ZeRO-2 ~8x."""
    base = calc(capsys, "zero", "--params", "7B", "--stage", "0", "--dp", "64")
    assert base["per_rank_bytes"] == pytest.approx(112e9)
    assert base["bytes_per_param_per_rank"] == 16
    z3 = calc(capsys, "zero", "--params", "7e9", "--stage", "3", "--dp", "64")
    assert z3["per_rank_bytes"] == pytest.approx(1.75e9)
    z1 = calc(capsys, "zero", "--params", "7e9", "--stage", "1", "--dp", "64")
    z2 = calc(capsys, "zero", "--params", "7e9", "--stage", "2", "--dp", "64")
    assert 3.5 < z1["reduction"] < 4.0 and 7.0 < z2["reduction"] < 8.0
    assert z3["traffic_bytes_per_rank"] == pytest.approx(1.5 * z2["traffic_bytes_per_rank"])
    fp32 = calc(capsys, "zero", "--params", "1000", "--stage", "0", "--dp", "2",
                "--bytes-per-param", "4,4,8")
    assert fp32["per_rank_bytes"] == 16000


def test_bubble_examples(capsys):
    assert calc(capsys, "bubble", "--stages", "8", "--micro-batches", "32")[
        "bubble_fraction"] == pytest.approx(0.179, abs=5e-4)
    assert calc(capsys, "bubble", "--stages", "4", "--micro-batches", "8")[
        "bubble_fraction"] == pytest.approx(0.27, abs=5e-3)


def test_hybrid_175b(capsys):
    """TP8 x DP128: 350 GB -> 43.75 GB; TP8 x PP4 x DP32: 10.94 GB with a 3/35 bubble."""
    dp = calc(capsys, "hybrid", "--params", "175B", "--tp", "1", "--pp", "1", "--dp", "1024")
    assert dp["dp_allreduce_bytes_per_rank"] == pytest.approx(350e9)
    tp = calc(capsys, "hybrid", "--params", "175B", "--tp", "8", "--pp", "1", "--dp", "128")
    assert tp["dp_allreduce_bytes_per_rank"] == pytest.approx(43.75e9)
    three = calc(capsys, "hybrid", "--params", "175B", "--tp", "8", "--pp", "4", "--dp", "32",
                 "--micro-batches", "32")
    assert three["ranks"] == 1024
    assert three["dp_allreduce_bytes_per_rank"] == pytest.approx(10.94e9, rel=1e-3)
    assert three["bubble_fraction"] == pytest.approx(3 / 35)


def test_reliability_examples(capsys):
    yd = calc(capsys, "young-daly", "--write-minutes", "5", "--gpus", "1024",
              "--gpu-mtbf-hours", "50000")
    assert yd["mtbf_hours"] == pytest.approx(48.8, abs=0.05)
    assert yd["interval_minutes"] == pytest.approx(171, abs=1)
    assert yd["overhead"] == pytest.approx(0.058, abs=1e-3)
    direct = calc(capsys, "young-daly", "--write-minutes", "300s", "--mtbf-hours", "48.828125")
    assert direct["interval_minutes"] == pytest.approx(yd["interval_minutes"])
    assert calc(capsys, "mtbf", "--nodes", "1024", "--node-mtbf-hours", "50000")[
        "cluster_mtbf_hours"] == pytest.approx(48.8, abs=0.05)
    assert calc(capsys, "mtbf", "--nodes", "100", "--node-hour-survival", "0.999")[
        "cluster_failure_per_hour"] == pytest.approx(0.095, abs=5e-4)


def test_grad_accum_example(capsys):
    out = calc(capsys, "grad-accum", "--comm-ms", "11.7", "--steps", "4", "--compute-ms", "1800")
    assert out["overhead"] == pytest.approx(0.0016, abs=5e-5)


def test_allreduce_ring_and_tree(capsys):
    out = calc(capsys, "allreduce", "--bytes", "100MiB", "--ranks", "8", "--latency", "2us",
               "--bandwidth", "200Gb/s")
    m, p, a, b = 100 * 2**20, 8, 2e-6, 1 / 25e9
    assert out["ring_s"] == pytest.approx(2 * (p - 1) * (a + m / p * b))
    assert out["tree_s"] == pytest.approx(2 * 3 * (a + m * b))
    assert out["faster"] == "ring"
    small = calc(capsys, "allreduce", "--bytes", "8", "--ranks", "64", "--latency", "5us",
                 "--bandwidth", "10GB/s")
    assert small["faster"] == "tree"


def test_dp_efficiency_and_traffic(capsys):
    out = calc(capsys, "dp-efficiency", "--grad-bytes", "1GB", "--bandwidth", "10GB/s",
               "--compute-ms", "200")
    assert out["comm_s"] == pytest.approx(0.2) and out["efficiency"] == pytest.approx(0.5)
    hidden = calc(capsys, "dp-efficiency", "--grad-bytes", "1GB", "--bandwidth", "10GB/s",
                  "--compute-ms", "200", "--overlap", "100%")
    assert hidden["efficiency"] == pytest.approx(1.0)
    tp = calc(capsys, "tp-comm", "--batch", "4", "--seq", "2048", "--hidden", "4096",
              "--layers", "2", "--dtype-bytes", "2", "--tp", "8")
    msg = 4 * 2048 * 4096 * 2
    assert tp["message_bytes"] == msg and tp["allreduces_per_step"] == 8
    assert tp["bytes_sent_per_rank"] == pytest.approx(8 * 2 * 7 / 8 * msg)
    pb = calc(capsys, "pipeline-boundary", "--batch", "4", "--seq", "2048", "--hidden", "4096",
              "--dtype-bytes", "2")
    assert pb["forward_bytes"] == msg and pb["total_bytes"] == 2 * msg


def test_embedding_memory(capsys):
    out = calc(capsys, "embedding-memory", "--rows", "1M", "--dim", "16", "--dtype-bytes", "4",
               "--optimizer", "adagrad")
    assert out["weights_bytes"] == 64e6 and out["optimizer_bytes"] == 4e6
    adam = calc(capsys, "embedding-memory", "--rows", "10", "--dim", "16", "--optimizer", "adam")
    assert adam["optimizer_bytes"] == 10 * 33 * 4
    assert calc(capsys, "embedding-memory", "--rows", "4.1M", "--dim", "16")[
        "weights_bytes"] == 4_100_000 * 16 * 4  # float("4.1") * 1e6 is 4099999.9999999995


@pytest.mark.parametrize(("text", "kind", "value"), [
    ("200Gb/s", "bandwidth", 25e9), ("12GB/s", "bandwidth", 12e9), ("2us", "seconds", 2e-6),
    ("25MiB", "bytes", 25 * 2**20), ("1.5GB", "bytes", 1.5e9), ("175B", "count", 175e9),
    ("4096", "bytes", 4096.0), ("11.7ms", "seconds", 0.0117)])
def test_units(text, kind, value):
    assert parse_quantity(text, kind, "--x") == pytest.approx(value)


def test_units_reject():
    with pytest.raises(ConfigError, match="--bandwidth: expected a bandwidth"):
        parse_quantity("fast", "bandwidth", "--bandwidth")
    with pytest.raises(ConfigError, match="--latency"):
        parse_quantity("2GB", "seconds", "--latency")


@pytest.mark.parametrize("args", [
    ["bubble", "--stages", "4"],  # missing input
    ["bubble", "--stages", "four", "--micro-batches", "2"],  # not a number
    ["zero", "--params", "7B", "--stage", "5", "--dp", "8"],
    ["allreduce", "--bytes", "1MB", "--ranks", "8", "--latency", "2us", "--bandwidth", "0"],
    ["young-daly", "--write-minutes", "5"],
    ["mtbf", "--nodes", "10", "--node-hour-survival", "1.5"],
    ["nosuch"],
])
def test_bad_input_one_line_exit_2(capsys, args):
    with pytest.raises(SystemExit) as exc:  # argparse's own errors
        code = main(["calc", *args])
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err
    # the command's own checks say it as every hpctrain command does; argparse names it
    by_argparse = args in (["bubble", "--stages", "4"], ["nosuch"])
    assert err.startswith("hpctrain plan calc" if by_argparse else "hpctrain: error: ")


@pytest.mark.parametrize(("args", "words"), [
    (["young-daly", "--write-minutes", "5"], "young-daly: give --mtbf-hours, or --gpus"),
    (["zero", "--params", "7B", "--stage", "1", "--dp", "8", "--bytes-per-param", "2,2"],
     "--bytes-per-param: expected WEIGHTS,GRADIENTS,OPTIMIZER bytes (e.g. 2,2,12), got '2,2'"),
    (["embedding-memory", "--rows", "10", "--dim", "4", "--optimizer", "rmsprop"],
     "--optimizer: one of sgd, adagrad, adam, got 'rmsprop'"),
    (["allreduce", "--bytes=-1MB", "--ranks", "8", "--latency", "2us", "--bandwidth", "1GB/s"],
     "--bytes: must not be negative, got '-1MB'"),
    (["allreduce", "--bytes", "1MB", "--ranks", "8", "--latency", "2us", "--bandwidth", "0"],
     "--bandwidth: must be > 0, got 0"),
    (["zero", "--params", "7B", "--stage", "1", "--dp", "0"],
     "--dp: must be a whole number >= 1, got 0"),
    (["zero", "--params", "7B", "--stage", "1", "--dp", "2.5"],
     "--dp: must be a whole number, got '2.5'"),
    (["zero", "--params", "7B", "--stage", "5", "--dp", "8"],
     "--stage: ZeRO stages are 0, 1, 2 and 3, got 5"),
    (["dp-efficiency", "--grad-bytes", "1GB", "--bandwidth", "10GB/s", "--compute-ms", "200",
      "--overlap", "150%"], "--overlap: a fraction in [0, 1], got 1.5"),
    (["mtbf", "--nodes", "10", "--node-hour-survival", "1.5"],
     "--node-hour-survival: a probability in (0, 1), got 1.5"),
])
def test_bad_values_name_the_flag(capsys, args, words):
    """A count is not truncated (``--dp 2.5`` is not computed as 2): like every value it is
    refused with one line naming the flag."""
    assert main(["calc", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_registered_in_hpctrain_cli():
    proc = subprocess.run([sys.executable, "-m", "hpctrain.cli", "plan", "calc", "bubble",
                           "--stages", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--micro-batches" in proc.stderr
