"""The run directory: the resolved config, per-step metrics, the final summary (rank 0 writes).

Files are replaced atomically (temporary file, then rename) so a crash never leaves a
half-written summary; ``metrics.jsonl`` is append-only, one JSON object per line, except
that a resumed run first drops the records of the steps after its checkpoint.

A run directory belongs to one run (:func:`claim`): a new run refuses a directory that holds
another run's files unless it resumes it, so a reused name never overwrites a config, appends
to another run's metrics or lets ``prune`` delete the new run's checkpoints. Default names
(:func:`default_run_dir`) carry the launch time, the batch job id and array index when there
are some, and a random suffix, so array tasks started in the same second never share one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from hpctrain.config import JobConfig, dump_toml
from hpctrain.errors import ConfigError

__all__ = ["RunDir", "default_run_dir", "claim", "read_metrics", "unwritable", "RUN_FILES",
           "write_text_atomic"]

log = logging.getLogger(__name__)

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "plan.json", "checkpoints")
"""What marks a directory as holding a run."""

_JOB_ID = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
_ARRAY_INDEX = ("SLURM_ARRAY_TASK_ID", "PBS_ARRAY_INDEX", "PBS_ARRAYID", "LSB_JOBINDEX")


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary file in the same folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, in order. Each record is one write, so only the
    last line can be cut short by a crash: it ends the records. A bad line elsewhere is
    damage: a ``ConfigError`` naming the file and line."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ConfigError(f"{path}:{number}: not a JSON record") from None
    return records


def default_run_dir(env: dict[str, str] | None = None) -> str:
    """``runs/<time>[-<job id>[_<array index>]]-<random>``: unique across concurrent
    launches (the random part alone makes two launches in one second differ)."""
    env = os.environ if env is None else env
    name = time.strftime("%Y%m%d-%H%M%S")
    job = next((env[k] for k in _JOB_ID if env.get(k)), "")
    index = next((env[k] for k in _ARRAY_INDEX if env.get(k)), "")
    if job:
        name += "-" + job.split(".")[0] + (f"_{index}" if index else "")
    return os.path.join("runs", f"{name}-{secrets.token_hex(3)}")


def claim(path: str, resume: bool) -> None:
    """Check that a new run may use ``path`` and create it (world rank 0, before anything is
    written): unless resuming, a directory holding another run's files is refused, and so
    is a path that cannot be made a directory (``ConfigError``, nothing changed)."""
    folder = Path(path)
    if not resume and folder.is_dir():
        found = [name for name in RUN_FILES if (folder / name).exists()]
        if found:
            raise ConfigError(f"train.run_dir = {path!r} holds another run "
                              f"({', '.join(found)}); resume it with --resume {path}, or "
                              f"choose a new directory")
    _make(folder)


def unwritable(run_dir: str | Path, exc: OSError) -> ConfigError:
    """The one line for a run directory that cannot be made or written (read-only, not a
    folder, no permission)."""
    return ConfigError(f"train.run_dir = {str(run_dir)!r}: cannot write there "
                       f"({exc.strerror})")


def _make(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise unwritable(folder, exc) from None


def _cannot_write(path: Path, exc: OSError) -> ConfigError:
    """One line for a write that failed in the run directory (a full disk, a quota)."""
    return ConfigError(f"cannot write {path}: {os.strerror(exc.errno) if exc.errno else exc}")


class RunDir:
    def __init__(self, path: str, config: JobConfig, resumed_at: int | None = None) -> None:
        """``resumed_at``: the step of the checkpoint a resumed run starts from."""
        self.path = Path(path)
        _make(self.path)
        try:
            self.write_text("config.toml", dump_toml(config))
            if resumed_at is not None:
                self._keep_through(resumed_at)
            self._metrics = open(self.path / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise unwritable(path, exc) from None

    def _keep_through(self, step: int) -> None:
        """Keep the records of steps up to ``step`` only: the run goes on from its checkpoint
        there, so records logged after it (before a crash or a kill) would repeat their steps,
        and a line the crash cut short would end the readable curve."""
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return
        records = read_metrics(path)
        kept = [record for record in records if record["step"] <= step]
        if len(kept) < len(records):
            log.info("metrics.jsonl: %d record(s) of steps after %d dropped (the run goes on "
                     "from its checkpoint there)", len(records) - len(kept), step)
        write_text_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))

    def log(self, record: dict[str, Any]) -> None:
        try:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
        except OSError as exc:
            raise _cannot_write(self.path / "metrics.jsonl", exc) from None

    def write_text(self, name: str, text: str) -> None:
        """Atomically replace ``name`` in the run directory with ``text``."""
        try:
            write_text_atomic(self.path / name, text)
        except OSError as exc:
            raise _cannot_write(self.path / name, exc) from None

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        self.write_text(name, json.dumps(data, indent=2) + "\n")

    def close(self) -> None:
        self._metrics.close()
