"""``hpctrain plan --validate`` under a real 2-rank launch: the job's own layout and the best
predicted one run briefly, each printed with predicted and measured time and memory."""

import re
import sys

from harness import run_mpi

HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]


def test_validate_two_ranks():
    result = run_mpi([*HPCTRAIN, "plan", "jobs/configs/criteo_sample.toml", "--validate",
                      "--steps", "3", "--runs", "2"], ranks=2, timeout=240)
    assert result.returncode == 0, result.stdout
    rows = [line for line in result.stdout.splitlines()
            if re.match(r"^(replicated|ps\d|a2a-)\S*/dp", line)]
    assert len(rows) == 2, result.stdout
    assert rows[0].startswith("replicated/dp2/")  # the job's own layout comes first
    for row in rows:
        pred_ms, meas_ms, _, cpu_ms, _, pred_mib, meas_mib, _ = row.split()[1:]
        assert float(pred_ms) > 0 and float(meas_ms) > 0 and cpu_ms
        assert float(pred_mib) > 100 and float(meas_mib) > 100
    assert "fastest of these" in result.stdout


def test_validate_a_pipelined_job_with_its_own_cuts_and_wire():
    """The world the plan is made over drops the job's stage cuts and pipeline wire with its
    stages (a bare pp = 1 kept them, and every rank stopped on the config check)."""
    result = run_mpi([*HPCTRAIN, "plan", "jobs/configs/criteo_sample.toml", "--validate",
                      "--steps", "2", "--runs", "1", "--set", "parallel.pp=2",
                      "--set", "parallel.stage_cuts=[1]", "--set", "parallel.wire_dtype='bf16'"],
                     ranks=2, timeout=240)
    assert result.returncode == 0, result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("replicated/")]
    assert len(rows) == 1 and "xpp2-" in rows[0] and "-cuts1" in rows[0], result.stdout
