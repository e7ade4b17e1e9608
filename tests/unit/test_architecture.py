"""The layer rules of DESIGN.md and the style are checked, not just written."""

import shutil
import subprocess
import sys
from pathlib import Path

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
