"""The layer rules of DESIGN.md and the style are checked, not just written."""

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is missing: pip install -e '.[test]'"
    return found


def test_import_layers_hold():
    result = subprocess.run([tool("lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_is_clean():
    result = subprocess.run([tool("ruff"), "check", "hpctrain", "embeddings", "ps", "tests"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_comm_imports_are_acyclic():
    """No import circle inside the collective layer, type-checking imports included (the
    old one ran group -> select -> every algorithm -> types -> group); the same check finds
    that circle when its first import is put back."""
    graph = grimp.build_graph("hpctrain", exclude_type_checking_imports=False)
    assert graph.nominate_cycle_breakers("hpctrain.comm") == set()
    graph.add_import(importer="hpctrain.comm.group", imported="hpctrain.comm.select")
    assert graph.nominate_cycle_breakers("hpctrain.comm")
