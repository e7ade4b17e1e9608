"""The command line's parser: the benchmarks' flags, and what a command that runs no
benchmark imports."""

import subprocess
import sys

import pytest

from hpctrain import cli

CONFIG_THEN_IMPORTS = """
import sys
from hpctrain.cli import main
code = main(["config"])
heavy = [m for m in ("torch", "numba", "hpctrain.bench.ps") if m in sys.modules]
sys.exit(f"imported {heavy}" if heavy else code)
"""


def test_a_command_that_needs_no_world_imports_neither_torch_nor_the_benchmarks():
    """`hpctrain config` (as `report`, `sweep`, `trace` and `--help`) runs on a login node,
    whose Python may import torch from a parallel file system: it took 1.1 s here."""
    run = subprocess.run([sys.executable, "-c", CONFIG_THEN_IMPORTS], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert "[train]" in run.stdout


def test_a_bench_command_has_its_modules_flags():
    args = cli._parser(bench_flags=True).parse_args(["bench", "ps", "--tables", "3"])
    assert args.tables == 3 and args.servers == 1
    with pytest.raises(SystemExit):  # built without them, the flag is unknown
        cli._parser(bench_flags=False).parse_args(["bench", "ps", "--tables", "3"])
