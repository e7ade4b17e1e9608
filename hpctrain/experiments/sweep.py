"""``hpctrain sweep``: a file of points becomes resolved job files and queue job arrays.

A sweep file (TOML)::

    [sweep]
    job = "../configs/default.toml"  # base job, relative to this file ("": embedded default)
    repeats = 3                       # runs per point; repeat r adds r to train.seed and
    ranks = 4                         # sync.straggler_seed; world size unless a point says
    [set]                             # keys every run gets
    "train.steps" = 200
    [grid]                            # every combination of these values ...
    "sync.model" = ["bsp", "ssp:4"]
    "world.ranks" = [4]               # the world size is a key too
    # ... or, instead of [grid], a list of points:
    # [[points]]
    # "sync.model" = "bsp"

``hpctrain sweep SWEEP.toml --out DIR`` checks every key and every point as ``hpctrain
train`` would, then writes ``DIR/jobs/<run>.toml`` (resolved, ``train.run_dir`` =
``DIR/runs/<run>``), ``DIR/sweep.json`` (the runs in task order: repeats outermost, so
points interleave and the machine's drift spreads over all of them), and per world size W
a task list ``tasks-W.txt`` with a Slurm array script ``slurm-W.sbatch`` (``sbatch
--array``) and a PBS one ``pbs-W.pbs`` (``qsub -J``). Each array task runs
``hpctrain sweep --task DIR W INDEX``, which launches its run (``srun -n W`` or ``mpiexec -n
W``) unless it finished, resuming it from its newest checkpoint if it was interrupted.
``hpctrain sweep --run DIR`` runs every task here, one after another, the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.config import dump_toml, load_config
from hpctrain.errors import CheckpointError, ConfigError
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.rundir import RUN_FILES, write_text_atomic

__all__ = ["Task", "expand", "write_sweep", "read_tasks", "task_of", "run_task", "run_all"]

WORLD_KEY = "world.ranks"
SEED_KEYS = ("train.seed", "sync.straggler_seed")
_TABLES = {"sweep", "set", "grid", "points"}
_SWEEP_KEYS = {"job", "repeats", "ranks"}


@dataclass(frozen=True)
class Task:
    index: int
    name: str
    point: int
    repeat: int
    ranks: int
    values: dict[str, Any]
    job: str
    run_dir: str


def _line(lines: list[str], key: str) -> str:
    """``:N`` of the line setting (or opening the table) ``key``, or ''."""
    pattern = re.compile(rf'^\s*(("{re.escape(key)}"|{re.escape(key)})\s*=|\[+{re.escape(key)}\]+)')
    return next((f":{n}" for n, text in enumerate(lines, 1) if pattern.match(text)), "")


def _literal(value: Any) -> str:
    return json.dumps(value)  # JSON scalars and lists are TOML literals too


def expand(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int, str, dict]:
    """The sweep file's points (key -> value, world size included), its repeats, its base
    job path ("" for the embedded default) and its fixed keys; every key and point checked
    (one ConfigError naming file, line and key)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        table = tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the sweep file ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    lines = text.splitlines()

    def fail(key: str, why: str) -> ConfigError:
        return ConfigError(f"{path}{_line(lines, key)}: {key}: {why}")

    for name in table:
        if name not in _TABLES:
            raise fail(name, f"unknown table; a sweep file has {', '.join(sorted(_TABLES))}")
    head = table.get("sweep", {})
    for name in head:
        if name not in _SWEEP_KEYS:
            raise fail(name, f"unknown key of [sweep]; keys are {', '.join(sorted(_SWEEP_KEYS))}")
    job = head.get("job", "")
    repeats, ranks = head.get("repeats", 1), head.get("ranks", 1)
    for key, value in (("repeats", repeats), ("ranks", ranks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise fail(key, f"expected an integer >= 1, got {value!r}")
    if not isinstance(job, str):
        raise fail("job", f"expected a path, got {job!r}")
    job = str(path.parent / job) if job else ""
    fixed = table.get("set", {})
    if "grid" in table and "points" in table:
        raise fail("points", "give a [grid] or [[points]], not both")
    if "grid" in table:
        grid = table["grid"]
        if not grid:
            raise fail("grid", "empty grid: no key to vary")
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise fail(key, f"a grid key needs a non-empty list of values, got {values!r}")
        points = [dict(zip(grid, combo, strict=True))
                  for combo in itertools.product(*grid.values())]
    else:
        points = table.get("points", [])
        if not points:
            raise fail("points", "no [grid] and no [[points]]: nothing to sweep")
    for key, value in [*fixed.items(), *(kv for p in points for kv in p.items())]:
        _check_key(job, key, value, fail)
    for point in points:
        world = point.get(WORLD_KEY, fixed.get(WORLD_KEY, ranks))
        config = _point_config(job, fixed, point, 0, fail)
        if config.ps.servers >= world:
            raise fail(next((k for k in (WORLD_KEY, "ps.servers") if k in point), "ranks"),
                       f"ps.servers = {config.ps.servers} leaves no worker in a world of "
                       f"{world} ranks")
        point[WORLD_KEY] = world
    return points, repeats, job, fixed


def _check_key(job: str, key: str, value: Any, fail) -> None:
    if key == WORLD_KEY:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise fail(key, f"expected an integer >= 1, got {value!r}")
        return
    try:
        load_config(job or None, [f"{key}={_literal(value)}"])
    except ConfigError as exc:
        raise fail(key, str(exc)) from None


def _point_config(job: str, fixed: dict, point: dict, repeat: int, fail):
    keys = {k: v for k, v in {**fixed, **point}.items() if k != WORLD_KEY}
    try:
        base = load_config(job or None, [f"{k}={_literal(v)}" for k, v in keys.items()])
        seeds = [f"{k}={_seed(base, k) + repeat}" for k in SEED_KEYS if k not in keys]
        return load_config(job or None, [f"{k}={_literal(v)}" for k, v in keys.items()]
                           + seeds + ["train.progress=false"])
    except ConfigError as exc:
        raise fail(next(iter(point), "set"), f"this point does not make a valid job: {exc}"
                   ) from None


def _seed(config, key: str) -> int:
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def write_sweep(sweep_file: str, out: str) -> list[Task]:
    """Check the sweep file and write the job files, task lists and array scripts."""
    points, repeats, job, fixed = expand(sweep_file)
    root = Path(out).resolve()
    (root / "jobs").mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)

    def fail(key: str, why: str) -> ConfigError:
        return ConfigError(f"{sweep_file}: {key}: {why}")

    tasks = []
    for repeat in range(repeats):
        for p, point in enumerate(points):
            name = f"p{p:02d}-r{repeat}"
            run_dir = root / "runs" / name
            config = _point_config(job, fixed, point, repeat, fail)
            config = dataclasses.replace(config, train=dataclasses.replace(
                config.train, run_dir=str(run_dir)))
            job_file = root / "jobs" / f"{name}.toml"
            write_text_atomic(job_file, dump_toml(config))
            tasks.append(Task(len(tasks), name, p, repeat, point[WORLD_KEY], point,
                              str(job_file), str(run_dir)))
    write_text_atomic(root / "sweep.json", json.dumps(
        {"sweep": str(Path(sweep_file).resolve()), "repeats": repeats,
         "points": points, "tasks": [t.__dict__ for t in tasks]}, indent=1) + "\n")
    for ranks in sorted({t.ranks for t in tasks}):
        mine = [t for t in tasks if t.ranks == ranks]
        write_text_atomic(root / f"tasks-{ranks}.txt",
                          "".join(f"{t.index} {t.name}\n" for t in mine))
        write_text_atomic(root / f"slurm-{ranks}.sbatch", _slurm(root, ranks, len(mine)))
        write_text_atomic(root / f"pbs-{ranks}.pbs", _pbs(root, ranks, len(mine)))
        for script in (f"slurm-{ranks}.sbatch", f"pbs-{ranks}.pbs"):
            os.chmod(root / script, 0o755)
    return tasks


def _python() -> str:
    return shlex.quote(sys.executable)


def _slurm(root: Path, ranks: int, count: int) -> str:
    return f"""#!/bin/bash
# Slurm job array of an hpctrain sweep: task i runs line i of tasks-{ranks}.txt on {ranks} ranks.
#   sbatch {root}/slurm-{ranks}.sbatch
#SBATCH --job-name=hpctrain-sweep
#SBATCH --array=0-{count - 1}
#SBATCH --ntasks={ranks}
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --output={root}/logs/slurm-%A_%a.out
set -euo pipefail
exec {_python()} -m hpctrain.cli sweep --task {shlex.quote(str(root))} {ranks} \\
    "${{SLURM_ARRAY_TASK_ID}}" --launcher srun
"""


def _pbs(root: Path, ranks: int, count: int) -> str:
    return f"""#!/bin/bash
# PBS job array of an hpctrain sweep: subjob i runs line i of tasks-{ranks}.txt on {ranks} ranks.
#   qsub {root}/pbs-{ranks}.pbs
#PBS -N hpctrain-sweep
#PBS -J 0-{count - 1}
#PBS -l select={ranks}:ncpus=1:mpiprocs=1
#PBS -l walltime=00:30:00
#PBS -j oe
#PBS -o {root}/logs/
set -euo pipefail
exec {_python()} -m hpctrain.cli sweep --task {shlex.quote(str(root))} {ranks} \\
    "${{PBS_ARRAY_INDEX}}" --launcher mpiexec
"""


def read_tasks(out: str) -> list[Task]:
    path = Path(out) / "sweep.json"
    if not path.exists():
        raise ConfigError(f"{out}: no sweep.json (write it with hpctrain sweep SWEEP.toml "
                          f"--out {out})")
    return [Task(**t) for t in json.loads(path.read_text(encoding="utf-8"))["tasks"]]


def run_task(task: Task, launcher: str = "mpiexec") -> str:
    """Run ``task`` unless it finished: resumed from its newest complete checkpoint when it
    has one, else from the start (a partial curve is cleared first). Returns what it did."""
    run_dir = Path(task.run_dir)
    if (run_dir / "summary.json").exists():
        return "finished already"
    command = [_launcher(launcher), "-n", str(task.ranks), sys.executable, "-m",
               "hpctrain.cli", "train", task.job]
    try:
        manifest = ckpt.latest(run_dir)
        command += ["--resume", str(run_dir)]
        did = f"resumed from step {manifest.step}"
    except CheckpointError:  # whatever the interrupted run left: the folder is the task's
        for name in (*RUN_FILES, "meta.json"):
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        did = "trained"
    code, caught = _run_forwarding(command)
    if caught is not None:
        raise Stopped(f"{task.name}: stopped by {signal.Signals(caught).name} (the run exited "
                      f"{code}); hpctrain sweep --run or --task resumes it",
                      75 if code in (0, 75) else code)
    if code != 0:
        return f"failed (exit {code}; see {run_dir})"
    return did


class Stopped(Exception):
    """The sweep itself got SIGTERM, SIGHUP or SIGUSR1 (``kill``, a batch system's stop):
    passed on to the run, which stops with a checkpoint; the sweep starts nothing more."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


_FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def _run_forwarding(command: list[str]) -> tuple[int, int | None]:
    """Run ``command``, passing the stop signals this process gets on to it (so that
    killing the sweep stops its run, instead of orphaning a launcher that trains on);
    returns its exit code and the last signal passed on (None: none)."""
    proc: subprocess.Popen | None = None
    caught: list[int] = []

    def forward(signum, frame) -> None:
        caught.append(signum)
        if proc is not None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    try:
        proc = subprocess.Popen(command)
        for signum in caught:  # arrived while it started
            proc.send_signal(signum)
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, caught[-1] if caught else None


def _launcher(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent),
                                                     os.environ.get("PATH", "")]))
    if found is None:
        raise ConfigError(f"--launcher {name}: not found on PATH")
    return found


def task_of(out: str, ranks: int, index: int) -> Task:
    """Task ``index`` of the ``ranks``-rank task list (what an array task runs)."""
    path = Path(out) / f"tasks-{ranks}.txt"
    if not path.exists():
        raise ConfigError(f"{path}: no such task list")
    lines = path.read_text(encoding="utf-8").split("\n")
    lines = [line for line in lines if line.strip()]
    if not 0 <= index < len(lines):
        raise ConfigError(f"{path}: task {index} out of range (0-{len(lines) - 1})")
    return read_tasks(out)[int(lines[index].split()[0])]


def run_all(out: str, launcher: str = "mpiexec", echo=print) -> int:
    """Run every task here in task order; returns how many failed."""
    tasks = read_tasks(out)
    failed = 0
    for task in tasks:
        did = run_task(task, launcher)
        failed += did.startswith("failed")
        echo(f"[{task.index + 1}/{len(tasks)}] {task.name} "
             f"({', '.join(f'{k}={v}' for k, v in task.values.items())}): {did}")
    return failed
