"""``mpiexec -n N hpctrain plan JOB --validate``: run the job's own layout and the top
predicted ones briefly on the launched ranks and print predicted against measured step time
and peak memory.

World rank 0 plans (probe included) and broadcasts the plan, as TorchRec's
``collective_plan`` does; then every layout trains ``--steps`` steps through
:func:`hpctrain.train.job.run_training`, after a one-step warm-up run of that layout
(numba compiles its kernels there on a machine's first run). Measured step time is the
slowest worker's median step (the trainer's ``p50``: warm-up and load spikes fall outside
it) and, less sensitive to other load on the machine, the busiest rank's CPU time per step
(a one-step run's CPU time subtracted from the full run's, so setup and evaluation drop
out); measured peak memory is the largest rank's
resident high-water mark during that run (reset before it, ``/proc/self/clear_refs``).
The runs use one torch thread per rank, as the probe does: on a machine shared with other
work a second intra-op thread waits for a core at every op and makes the step many times
slower than either thread count predicts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence

from hpctrain.config import JobConfig, load_config
from hpctrain.errors import ConfigError
from hpctrain.plan.types import Prediction, Proposal
from hpctrain.runtime.env import peak_rss_bytes
from hpctrain.runtime.world import Topology, build_topology
from hpctrain.train.job import run_training

__all__ = ["run_validate", "validation_rows", "format_validation"]

MIB = 2.0**20


def _reset_peak() -> None:
    """Start a new resident-memory high-water mark (Linux; elsewhere the peak carries)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(peak_rss_bytes())


def _short(config: JobConfig, steps: int) -> list[str]:
    """Keys that make a run brief and quiet; the evaluation at the end stays small."""
    keys = [f"train.steps={steps}", "train.progress=false", "train.eval_every=0",
            f"train.log_every={max(steps, 1)}", "checkpoint.every_steps=0",
            "checkpoint.every_minutes=0.0", "checkpoint.mtbf_hours=0.0",
            "checkpoint.at_end=false", "runtime.log_level='warning'", "runtime.threads=1"]
    if config.data.source == "synthetic":
        keys.append(f"data.eval_samples={config.train.eval_batch_size}")
    return keys


def _run(job: str | None, overrides: Sequence[str], world_topo: Topology
         ) -> tuple[float, float, float]:
    """(slowest worker's median step seconds, largest rank's peak bytes, largest rank's CPU
    seconds) of one run, in a run directory of its own (a run directory holds one run)."""
    run_dir = world_topo.world.bcast(tempfile.mkdtemp(prefix="hpctrain-plan-")
                                     if world_topo.rank == 0 else None, root=0)
    config = load_config(job, [*overrides, f"train.run_dir='{run_dir}'"])
    topo = build_topology(config)
    _reset_peak()
    cpu = time.process_time()
    summary = run_training(config, topo)
    cpu = time.process_time() - cpu
    peak = max(world_topo.world.allgather(_peak()))
    cpus = world_topo.world.allgather(cpu)
    step = max(t.p50 for t in summary.step_times) if world_topo.rank == 0 else 0.0
    topo.free()
    return step, peak, max(cpus)


def _measure(job: str | None, overrides: Sequence[str], short: Sequence[str],
             once: Sequence[str], world_topo: Topology) -> tuple[float, float, float]:
    """(median step s, peak bytes, CPU s per step) of a layout: a one-step run, then a run of
    ``--steps``; the difference of their CPU times per extra step leaves setup and
    evaluation out. A one-step run before them takes what only a process's first run of the
    layout pays: numba compiling its kernels on a machine's first run (seconds of CPU,
    which made the difference negative), and the allocator's first fill."""
    _run(job, [*overrides, *once], world_topo)
    _, _, cpu1 = _run(job, [*overrides, *once], world_topo)
    step, peak, cpu = _run(job, [*overrides, *short], world_topo)
    steps = load_config(job, [*overrides, *short]).train.steps
    return step, peak, (cpu - cpu1) / max(steps - 1, 1)


def validation_rows(predictions: Sequence[Prediction],
                    measured: Sequence[tuple[float, float, float]]
                    ) -> list[dict[str, float | str]]:
    """Predicted against measured, with the relative error of each (pure)."""
    rows = []
    for q, (step, peak, cpu) in zip(predictions, measured, strict=True):
        rows.append({"layout": q.proposal.name, "predicted_ms": q.step_s * 1e3,
                     "measured_ms": step * 1e3,
                     "time_error": (q.step_s - step) / step if step else float("nan"),
                     "cpu_ms": cpu * 1e3,
                     "cpu_error": (q.step_s - cpu) / cpu if cpu > 0 else float("nan"),
                     "predicted_mib": q.peak_memory / MIB, "measured_mib": peak / MIB,
                     "memory_error": (q.peak_memory - peak) / peak if peak else float("nan")})
    return rows


def format_validation(rows: Sequence[dict[str, float | str]], ranks: int,
                      oversubscribed: bool) -> str:
    lines = [f"{'layout':<44} {'pred ms':>8} {'meas ms':>8} {'err':>7} {'cpu ms':>8} "
             f"{'err':>7} {'pred MiB':>9} {'meas MiB':>9} {'err':>7}"]
    for r in rows:
        lines.append(f"{r['layout']:<44} {r['predicted_ms']:>8.2f} {r['measured_ms']:>8.2f} "
                     f"{r['time_error']:>+7.0%} {r['cpu_ms']:>8.2f} {r['cpu_error']:>+7.0%} "
                     f"{r['predicted_mib']:>9.0f} {r['measured_mib']:>9.0f} "
                     f"{r['memory_error']:>+7.0%}")
    if len(rows) > 1:
        fastest = min(rows, key=lambda r: r["measured_ms"])
        lines.append(f"first layout measured {rows[0]['measured_ms']:.2f} ms, the fastest "
                     f"of these ({fastest['layout']}) {fastest['measured_ms']:.2f} ms "
                     f"({rows[0]['measured_ms'] / fastest['measured_ms'] - 1:+.0%})")
    if oversubscribed:
        lines.append(f"note: {ranks} ranks share fewer cores: measured times include waiting "
                     f"for descheduled ranks")
    lines.append("note: meas ms is wall time on this machine as it is now (other load inflates "
                 "it); cpu ms is the busiest rank's CPU time per step")
    return "\n".join(lines)


def run_validate(args: argparse.Namespace) -> int:
    """Plan on world rank 0, run the top layouts on every rank, print the comparison."""
    from hpctrain.plan.cli import cluster_of
    from hpctrain.plan.proposals import plan, predict_job

    base = load_config(args.job, args.set)
    # a world any launch fits, to plan over: the job as one server-less data-parallel layout
    # (with the keys that only fit servers or stages reset, which a bare replace kept:
    # stage cuts, the pipeline's wire, embeddings.mode = 'ps', ssp_lr = 'sqrt')
    topo = build_topology(load_config(args.job, [*args.set, *Proposal().overrides(),
                                                 "parallel.dp=0"]))
    size = topo.world.Get_size()
    top: list[Prediction] = []
    cluster = None
    if topo.rank == 0:
        cluster = cluster_of(args, ranks=size)
        if cluster.ranks != size:
            raise ConfigError(f"--validate: the cluster has {cluster.ranks} ranks, "
                              f"mpiexec launched {size}")
        own = predict_job(base, cluster)
        top = [own] if own.feasible else []
        top += [q for q in plan(base, cluster, args.job, args.set)
                if q.feasible and q.proposal != own.proposal]
        top = top[:args.runs]
    top = topo.world.bcast(top, root=0)
    if not top:
        raise ConfigError("--validate: no layout of the job fits the launched ranks")
    short, once = _short(base, max(args.steps, 2)), _short(base, 1)
    measured = [_measure(args.job, [*args.set, *q.proposal.overrides()], short, once, topo)
                for q in top]
    if topo.rank == 0:
        rows = validation_rows(top, measured)
        print(format_validation(rows, size, cluster.oversubscribed or
                                size > (os.cpu_count() or size)), flush=True)
    topo.free()
    return 0
