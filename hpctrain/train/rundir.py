"""The run directory: the resolved config, per-step metrics, the final summary (rank 0 writes).

Files are replaced atomically (temporary file, then rename) so a crash never leaves a
half-written summary; ``metrics.jsonl`` is append-only, one JSON object per line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hpctrain.config import JobConfig, dump_toml
from hpctrain.errors import ConfigError

__all__ = ["RunDir", "default_run_dir", "write_text_atomic"]


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary file in the same folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


class RunDir:
    def __init__(self, path: str, config: JobConfig) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.write_text("config.toml", dump_toml(config))
            self._metrics = open(self.path / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise ConfigError(f"train.run_dir = {str(path)!r}: cannot write there "
                              f"({exc.strerror})") from None

    def log(self, record: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def write_text(self, name: str, text: str) -> None:
        """Atomically replace ``name`` in the run directory with ``text``."""
        write_text_atomic(self.path / name, text)

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        self.write_text(name, json.dumps(data, indent=2) + "\n")

    def close(self) -> None:
        self._metrics.close()
