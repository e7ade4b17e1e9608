"""``hpctrain compare-sync``: the same job under several sync models, repeated.

``--repeats N`` (default 3) trains every model N times into ``OUT/<model>-r<i>/``, the
models interleaved within each repeat (so the machine's drift spreads over all of them),
repeat i adding i to ``train.seed`` (model initialisation) and ``sync.straggler_seed``
(which steps straggle). The data and its order stay fixed. Without ``train.eval_every``
the runs evaluate every 5% of their steps, on the fixed ``train.eval_subset``; then world
rank 0 prints and writes the report of :mod:`hpctrain.experiments.report` (intervals,
ratios to the first model, verdicts) into ``OUT``.

``--repeats 1`` keeps the single-run table: ``OUT/<model>/``, ``OUT/summary.json`` and
``OUT/loss.png`` (training loss against wall-clock time and against samples), with time and
samples to a target training loss, by default 1.01 x the first model's final training loss.
A model that never reaches the target is reported as "not reached".
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from hpctrain.config import JobConfig, SyncConfig, local_period
from hpctrain.errors import ConfigError
from hpctrain.experiments.report import build_report, write_report
from hpctrain.experiments.rundirs import read_run
from hpctrain.runtime.world import Topology
from hpctrain.sync.models import parse_models
from hpctrain.train.job import run_training
from hpctrain.train.rundir import read_metrics

__all__ = ["straggler_overrides", "sync_variants", "compare_sync", "format_comparison"]

EVALUATIONS = 20
"""Held-out evaluations per run when the job sets no ``train.eval_every``."""

log = logging.getLogger(__name__)


def straggler_overrides(spec: str) -> list[str]:
    """``--set`` items for ``none``, ``transient:P:FACTOR`` or ``persistent:W[+W...]:FACTOR``."""
    kind, *args = spec.strip().lower().split(":")
    try:
        if kind == "none" and not args:
            return []
        if kind == "transient" and len(args) == 2:
            return [f"sync.straggle_probability={float(args[0])}",
                    f"sync.straggle_factor={float(args[1])}"]
        if kind == "persistent" and len(args) == 2:
            workers = [int(w) for w in args[0].split("+")]
            return [f"sync.slow_workers={workers}", f"sync.slow_factor={float(args[1])}"]
    except ValueError:
        pass
    raise ConfigError(f"--stragglers {spec!r}: expected none, transient:P:FACTOR (e.g. "
                      f"transient:0.1:3) or persistent:WORKER[+WORKER]:FACTOR (e.g. "
                      f"persistent:1:3)")


def sync_variants(models_text: str, sync: SyncConfig) -> list[tuple[str, SyncConfig]]:
    """(label, sync section) per item of ``--models``: ``bsp``, ``ssp:S`` and ``asp`` set
    ``sync.model``; ``local:H`` sets ``sync.dense`` (local SGD) and keeps the tables' model."""
    variants = []
    for text in (t.strip().lower() for t in models_text.split(",") if t.strip()):
        if text.startswith("local"):
            local_period(text)
            variants.append((text, dataclasses.replace(sync, dense=text)))
        else:
            model = parse_models(text)[0]
            variants.append((model.name, dataclasses.replace(sync, model=model.name)))
    if not variants:
        parse_models(models_text)  # the error for an empty list
    return variants


def compare_sync(config: JobConfig, topo: Topology, models_text: str, out: str,
                 target_loss: float | None, repeats: int = 3) -> dict[str, Any] | None:
    """Train ``config`` ``repeats`` times per model; world rank 0 returns (and writes) the
    report (``repeats`` > 1) or the single-run comparison."""
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: expected at least 1")
    variants = sync_variants(models_text, config.sync)
    out_dir = Path(out)
    runs = []
    every = config.train.eval_every or (max(1, _steps(config) // EVALUATIONS)
                                        if repeats > 1 else 0)
    for repeat in range(repeats):
        for label, sync in variants:
            name = label.replace(":", "") + (f"-r{repeat}" if repeats > 1 else "")
            tc = dataclasses.replace(config.train, run_dir=str(out_dir / name), progress=False,
                                     seed=config.train.seed + repeat,
                                     eval_every=every if repeats > 1 else
                                     config.train.eval_every)
            sc = dataclasses.replace(sync, straggler_seed=config.sync.straggler_seed + repeat)
            log.info("compare-sync: repeat %d of %d under %s", repeat + 1, repeats, label)
            summary = run_training(dataclasses.replace(config, train=tc, sync=sc), topo)
            if topo.rank == 0:
                runs.append((label, summary))
    if topo.rank != 0:
        return None
    if repeats > 1:
        report = build_report([read_run(Path(s.run_dir)) for _, s in runs],
                              target=target_loss)
        write_report(report, out_dir)
        return report
    result = _tabulate(runs, out_dir, target_loss)
    (out_dir / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out_dir / "loss.png")
    return result


def _steps(config: JobConfig) -> int:
    """Optimizer steps of the job (one pass over a synthetic split when train.steps is 0)."""
    tc = config.train
    if tc.steps:
        return tc.steps
    if config.data.source == "synthetic":
        return max(1, config.data.train_samples // (tc.batch_size * tc.accumulate))
    raise ConfigError("compare-sync --repeats > 1 needs train.eval_every or train.steps for a "
                      "non-synthetic job (its held-out curve times the target)")


def _tabulate(runs, out_dir: Path, target_loss: float | None) -> dict[str, Any]:
    records = {name: read_metrics(Path(s.run_dir, "metrics.jsonl")) for name, s in runs}
    curves = {name: [r for r in records[name] if "train_loss" in r] for name, _ in runs}
    if target_loss is None:
        first = curves[runs[0][0]]
        target_loss = 1.01 * first[-1]["train_loss"]
    rows = []
    for name, summary in runs:
        hit = next((r for r in curves[name] if r["train_loss"] <= target_loss), None)
        tables = summary.staleness()
        reads = sum(t["reads"] for t in tables.values()) or 1
        rows.append({
            "model": name,
            "time_to_target_s": hit["time_s"] if hit else None,
            "samples_to_target": hit["samples"] if hit else None,
            "final_log_loss": summary.eval.get("log_loss"),
            "final_auc": summary.eval.get("auc"),
            "samples_per_s": summary.samples_per_s,
            "wall_s": summary.wall_s,
            "dense_syncs": summary.dense_syncs,
            "staleness_mean": sum(t["mean"] * t["reads"] for t in tables.values()) / reads,
            "staleness_p99": max((t["p99"] for t in tables.values()), default=0.0),
            "staleness_max": max((t["max"] for t in tables.values()), default=0.0),
            "staleness_per_table": tables,
            "step_times": summary.as_dict()["step_times"],
            "curve": [{k: r[k] for k in ("step", "samples", "time_s", "train_loss")}
                      for r in curves[name]],
            "eval_curve": [r for r in records[name] if "heldout_log_loss" in r],
        })
    return {"target_loss": target_loss, "out": str(out_dir), "models": rows}


def format_comparison(result: dict[str, Any]) -> str:
    header = (f"{'model':<8} {'to target':>10} {'samples':>9} {'log loss':>9} {'vs first':>8} "
              f"{'AUC':>7} {'samples/s':>10} {'stale mean':>10} {'p99':>5} {'max':>5}")
    lines = ["one run of each model (--repeats 1): no intervals, so a difference may be "
             "noise (--repeats 3 or more for intervals)",
             f"target training loss {result['target_loss']:.4f}", header]
    first = result["models"][0]["final_log_loss"]
    for row in result["models"]:
        reached = (f"{row['time_to_target_s']:>9.1f}s {row['samples_to_target']:>9,}"
                   if row["time_to_target_s"] is not None else f"{'not reached':>20}")
        gap = 100.0 * (row["final_log_loss"] - first) / first
        lines.append(f"{row['model']:<8} {reached} {row['final_log_loss']:>9.4f} {gap:>+7.2f}% "
                     f"{row['final_auc']:>7.4f} {row['samples_per_s']:>10,.0f} "
                     f"{row['staleness_mean']:>10.2f} {row['staleness_p99']:>5.0f} "
                     f"{row['staleness_max']:>5.0f}")
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(11, 4))
    for row in result["models"]:
        curve = row["curve"]
        by_time.plot([r["time_s"] for r in curve], [r["train_loss"] for r in curve],
                     label=row["model"])
        by_samples.plot([r["samples"] for r in curve], [r["train_loss"] for r in curve],
                        label=row["model"])
    for axis, label in ((by_time, "wall-clock time (s)"), (by_samples, "samples")):
        axis.axhline(result["target_loss"], color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel(label)
        axis.set_ylabel("training loss")
        axis.legend()
    fig.suptitle("hpctrain compare-sync")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
