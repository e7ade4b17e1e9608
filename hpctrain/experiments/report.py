"""``hpctrain report``: put any set of run directories together into one comparison.

1. Read every run directory (:mod:`hpctrain.experiments.rundirs`). Runs without a summary
   (unfinished) or with a non-finite final loss (failed) are listed, never averaged.
2. Refuse runs that differ in a model or data key (``model.*``, ``data.*``): their losses
   measure different problems. Group the others by the config keys whose values differ,
   seeds and run folders aside (those make the repeats of a group).
3. Read each run's curve: the periodic held-out evaluation on a fixed subset of the eval
   split (``--metric heldout``, the ``heldout_log_loss`` records), or the training loss
   smoothed by a moving mean over ``SMOOTH`` records (``--metric train``). The default target
   is the loss every run reaches: the highest, over runs, of the loss a run has at 80% of its
   samples. A run reaches it where its curve first crosses it (linear between points).
4. Per group: mean and Student t interval, and the MLPerf mean without the fastest and
   slowest run, of final held-out log loss and AUC, samples/s, time and samples to target
   and mean staleness. Per other group: the ratio of each mean to the baseline group's with
   its Fieller interval and a verdict (faster, slower, no significant difference at 95%).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpctrain import stats
from hpctrain.errors import ConfigError
from hpctrain.experiments.rundirs import Run, find_runs
from hpctrain.train.rundir import write_text_atomic

__all__ = ["build_report", "format_report", "write_report", "report_paths", "METRICS"]

SMOOTH = 5
TARGET_FRACTION = 0.8
REPEAT_KEYS = frozenset({"train.seed", "sync.straggler_seed", "train.run_dir", "train.progress",
                         "runtime.log_level"})
"""Keys that vary between the repeats of one group; any other differing key makes groups."""
SAME_PREFIXES = ("model.", "data.")
"""Keys that must agree for runs to compare at all."""
METRICS = {  # name: (label, verdict below 1, verdict above 1)
    "time_to_target_s": ("time to target (s)", "faster", "slower"),
    "samples_to_target": ("samples to target", "fewer samples", "more samples"),
    "final_log_loss": ("final held-out log loss", "lower", "higher"),
    "final_auc": ("final held-out AUC", "lower", "higher"),
    "samples_per_s": ("samples/s", "slower", "faster"),
    "staleness_mean": ("mean staleness (clocks)", "lower", "higher"),
}


def report_paths(paths: Sequence[str], metric: str = "heldout", target: float | None = None,
                 baseline: str | None = None) -> dict[str, Any]:
    return build_report(find_runs(list(paths)), metric, target, baseline)


def build_report(runs: list[Run], metric: str = "heldout", target: float | None = None,
                 baseline: str | None = None) -> dict[str, Any]:
    """The comparison of ``runs`` as a JSON-ready dict (see the module docstring)."""
    if metric not in ("heldout", "train"):
        raise ConfigError(f"--metric {metric!r}: expected heldout or train")
    _check_comparable(runs)
    excluded = [{"run": str(r.path), "why": r.problem} for r in runs if r.problem]
    done = [r for r in runs if not r.problem]
    if not done:
        raise ConfigError(f"no finished run to report among {len(runs)}: "
                          + "; ".join(f"{e['run']} {e['why']}" for e in excluded))
    curves = {r.path: _curve(r, metric) for r in done}
    target_source = "--target"
    if target is None:
        target = max(_loss_at(c, TARGET_FRACTION) for c in curves.values())
        target_source = (f"highest loss of any run at {TARGET_FRACTION:.0%} of its samples "
                         f"({metric} curve)")
    keys = _group_keys(done)
    grouped: dict[tuple, list[Run]] = {}
    for run in done:
        grouped.setdefault(tuple(run.config.get(k) for k in keys), []).append(run)
    groups = []
    for values, members in grouped.items():
        name = ", ".join(f"{k}={_text(v)}" for k, v in zip(keys, values, strict=True)) or "all"
        per_run = [_run_figures(r, curves[r.path], target) for r in members]
        groups.append({"name": name, "keys": dict(zip(keys, map(_text, values), strict=True)),
                       "n": len(members), "runs": per_run,
                       "metrics": {m: _aggregate([p[m] for p in per_run]) for m in METRICS},
                       "curves": _bands([curves[r.path] for r in members])})
    first = tuple(runs[0].config.get(k) for k in keys)  # the first run's group, the default
    default = groups[list(grouped).index(first)] if first in grouped else groups[0]
    warnings = [] if baseline or first in grouped else [
        f"the first run's group has no finished run; ratios to {default['name']}"]
    base = _baseline(groups, baseline, default)
    for group in groups:
        if group is not base:
            group["vs_baseline"] = {m: _compare(group, base, m) for m in METRICS}
    warnings += [f"group {g['name']}: {g['n']} run(s); fewer than 3 give a weak interval"
                 for g in groups if g["n"] < 3]
    warnings += [f"{r.path} was resumed from a checkpoint that did not save the run's clock: "
                 f"its curve restarts at the resume, so its times and samples to target do "
                 f"not compare" for r in done if _clock_restarted(r)]
    return {"metric": metric, "target_loss": target, "target_source": target_source,
            "level": stats.LEVEL, "mean_interval": stats.MEAN_METHOD,
            "ratio_interval": stats.RATIO_METHOD, "baseline": base["name"],
            "group_keys": keys, "groups": groups, "excluded": excluded, "warnings": warnings}


def _check_comparable(runs: list[Run]) -> None:
    first = runs[0]
    for run in runs[1:]:
        for key in sorted(set(first.config) | set(run.config)):
            if key.startswith(SAME_PREFIXES) and first.config.get(key) != run.config.get(key):
                raise ConfigError(
                    f"{key} differs: {_text(first.config.get(key))} in {first.path}, "
                    f"{_text(run.config.get(key))} in {run.path}; runs of different models or "
                    f"data do not compare")


def _group_keys(runs: list[Run]) -> list[str]:
    keys = sorted({k for r in runs for k in r.config})
    return [k for k in keys if k not in REPEAT_KEYS
            and len({repr(r.config.get(k)) for r in runs}) > 1]


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(map(_text, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _clock_restarted(run: Run) -> bool:
    """Whether the run's records go back in time: a resume from a checkpoint written before
    hpctrain saved the run's clock and sample count started both from zero again."""
    times = [r["time_s"] for r in run.records if "time_s" in r]
    return any(later < earlier for earlier, later in itertools.pairwise(times))


def _curve(run: Run, metric: str) -> list[tuple[float, float, float]]:
    """(time s, samples, loss) points of ``run``'s curve."""
    if metric == "heldout":
        points = [(r["time_s"], r["samples"], r["heldout_log_loss"]) for r in run.records
                  if "heldout_log_loss" in r]
        if not points:
            raise ConfigError(f"{run.path}: no held-out curve in metrics.jsonl (the run had "
                              f"train.eval_every = 0); use --metric train or rerun with "
                              f"train.eval_every set")
        return points
    raw = [(r["time_s"], r["samples"], r["train_loss"]) for r in run.records
           if "train_loss" in r and math.isfinite(r["train_loss"])]
    if not raw:
        raise ConfigError(f"{run.path}: no training loss records in metrics.jsonl")
    out = []
    for i, (t, s, _) in enumerate(raw):
        window = [p[2] for p in raw[max(0, i - SMOOTH + 1): i + 1]]
        out.append((t, s, sum(window) / len(window)))
    return out


def _loss_at(curve: list[tuple[float, float, float]], fraction: float) -> float:
    """The curve's loss at ``fraction`` of its last point's samples (linear between points)."""
    x = fraction * curve[-1][1]
    for (_, s0, l0), (_, s1, l1) in zip(curve, curve[1:], strict=False):
        if s0 <= x <= s1:
            return l0 + (l1 - l0) * ((x - s0) / (s1 - s0) if s1 > s0 else 1.0)
    return curve[0][2] if x < curve[0][1] else curve[-1][2]


def _hit(curve: list[tuple[float, float, float]], target: float) -> tuple[float, float] | None:
    """(time s, samples) where the curve first reaches ``target`` (linear between points)."""
    for i, (t, s, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return t, s
            t0, s0, l0 = curve[i - 1]
            frac = (l0 - target) / (l0 - loss)
            return t0 + frac * (t - t0), s0 + frac * (s - s0)
    return None


def _run_figures(run: Run, curve: list[tuple[float, float, float]], target: float
                 ) -> dict[str, Any]:
    summary = run.summary or {}
    tables = summary.get("staleness", {})
    reads = sum(t["reads"] for t in tables.values())
    hit = _hit(curve, target)
    return {"run": str(run.path), "seed": run.config.get("train.seed"),
            "time_to_target_s": hit[0] if hit else None,
            "samples_to_target": hit[1] if hit else None,
            "final_log_loss": summary["eval"]["log_loss"],
            "final_auc": summary["eval"].get("auc"),
            "samples_per_s": summary.get("samples_per_s"),
            "staleness_mean": (sum(t["mean"] * t["reads"] for t in tables.values()) / reads
                               if reads else None)}


def _aggregate(values: list[float | None]) -> dict[str, Any]:
    """Mean, interval and trimmed mean; a figure some run lacks has none (``missing`` says
    how many: e.g. runs that never reached the target)."""
    present = [v for v in values if v is not None and math.isfinite(v)]
    missing = len(values) - len(present)
    if missing or not present:
        return {"missing": missing, "values": values}
    interval = stats.mean_interval(present)
    return {**interval.as_dict(), "trimmed_mean": stats.trimmed_mean(present),
            "missing": 0, "values": values}


def _compare(group: dict[str, Any], base: dict[str, Any], metric: str) -> dict[str, Any]:
    a, b = group["metrics"][metric], base["metrics"][metric]
    if a["missing"] or b["missing"]:
        counts = f"{a['missing']} of {group['n']} and {b['missing']} of {base['n']} runs"
        if metric == "staleness_mean":  # no parameter server: no reads whose age to count
            return {"verdict": f"not measured ({counts} read no parameter-server rows)"}
        return {"verdict": f"not comparable ({counts} lack it)"}
    if not b["estimate"]:
        return {"verdict": "no ratio (the baseline's mean is 0)"}
    ratio = stats.ratio_interval(a["values"], b["values"])
    _, lower, higher = METRICS[metric]
    return {**ratio.as_dict(), "verdict": stats.verdict(ratio, lower, higher)}


def _baseline(groups: list[dict[str, Any]], baseline: str | None,
              default: dict[str, Any]) -> dict[str, Any]:
    """The group ``baseline`` names: ``KEY=VALUE``, or several joined by commas
    (``train.zero=0,comm.bucket_kib=512``) where the groups differ in more than one key;
    ``default`` without one."""
    if baseline is None:
        return default
    wanted = {}
    for pair in re.split(r",\s*(?=[\w.]+=)", baseline):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--baseline {baseline!r}: expected KEY=VALUE[,KEY=VALUE...], "
                              "e.g. sync.model=bsp")
        wanted[key.strip()] = value.strip()
    found = [g for g in groups if all(g["keys"].get(k) == v for k, v in wanted.items())]
    if len(found) != 1:
        names = "; ".join(g["name"] for g in groups)
        raise ConfigError(f"--baseline {baseline!r}: matches {len(found)} groups, not one "
                          f"(groups: {names})")
    return found[0]


def _bands(curves: list[list[tuple[float, float, float]]], points: int = 40
           ) -> dict[str, list[dict[str, float | None]]]:
    """The group's mean curve against time and against samples on a common grid (up to the
    shortest run's end), with the t interval at each grid point."""
    out = {}
    for axis, name in ((0, "time_s"), (1, "samples")):
        end = min(c[-1][axis] for c in curves)
        start = max(c[0][axis] for c in curves)
        grid = [start + (end - start) * i / (points - 1) for i in range(points)] if (
            end > start) else [end]
        rows = []
        for x in grid:
            interval = stats.mean_interval([_interp(c, axis, x) for c in curves])
            rows.append({"x": x, "mean": interval.estimate, "lo": interval.lo,
                         "hi": interval.hi})
        out[name] = rows
    return out


def _interp(curve: list[tuple[float, float, float]], axis: int, x: float) -> float:
    for p, q in zip(curve, curve[1:], strict=False):
        if p[axis] <= x <= q[axis]:
            span = q[axis] - p[axis]
            return p[2] + (q[2] - p[2]) * ((x - p[axis]) / span if span else 1.0)
    return curve[-1][2] if x >= curve[-1][axis] else curve[0][2]


# -- output --------------------------------------------------------------------------------

def _cell(m: dict[str, Any], metric: str) -> str:
    if m.get("missing") or "estimate" not in m:  # no reads of servers: no staleness to count
        return f"{m.get('missing', '?')} " + (
            "not measured" if metric == "staleness_mean" else "missing")
    digits = _DIGITS[metric]
    text = f"{m['estimate']:.{digits}f}"
    if m["lo"] is not None:
        text += f" [{m['lo']:.{digits}f}, {m['hi']:.{digits}f}]"
    return text


_DIGITS = {"time_to_target_s": 1, "samples_to_target": 0, "final_log_loss": 4,
           "final_auc": 4, "samples_per_s": 0, "staleness_mean": 2}


def _tables(report: dict[str, Any], markdown: bool) -> list[str]:
    """The per-group table and the comparison table: markdown, or aligned columns."""
    blocks = _rows(report)
    if markdown:
        return [line for block in blocks for line in (
            ["| " + " | ".join(block[0]) + " |", "| " + " | ".join(["---"] * len(block[0]))
             + " |"] + ["| " + " | ".join(r) + " |" for r in block[1:]] + [""])]
    lines = []
    for block in blocks:
        widths = [max(len(r[i]) for r in block) for i in range(len(block[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                  for r in block] + [""]
    return lines


def _rows(report: dict[str, Any]) -> list[list[list[str]]]:
    """The rows (header first) of the per-group table and of the comparison table."""
    groups = [["group", "n", *(METRICS[m][0] for m in METRICS), "to target (MLPerf mean)"]]
    for g in report["groups"]:
        trimmed = g["metrics"]["time_to_target_s"].get("trimmed_mean")
        groups.append([g["name"], str(g["n"]),
                       *(_cell(g["metrics"][m], m) for m in METRICS),
                       f"{trimmed:.1f}" if trimmed is not None else "-"])
    ratios = [["vs " + report["baseline"], *(f"{METRICS[m][0]} ratio" for m in METRICS)]]
    for g in report["groups"]:
        if "vs_baseline" not in g:
            continue
        cells = []
        for m in METRICS:
            c = g["vs_baseline"][m]
            bounds = (f" [{c['lo']:.3f}, {c['hi']:.3f}]" if c.get("lo") is not None else "")
            cells.append(f"{c['estimate']:.3f}{bounds} {c['verdict']}" if "estimate" in c
                         else c["verdict"])
        ratios.append([g["name"], *cells])
    return [groups, ratios] if len(ratios) > 1 else [groups]


def _preamble(report: dict[str, Any]) -> list[str]:
    lines = [f"target {report['metric']} log loss {report['target_loss']:.4f} "
             f"({report['target_source']})",
             f"means with {report['level']:.0%} {report['mean_interval']}; ratios to "
             f"{report['baseline']} with {report['level']:.0%} {report['ratio_interval']}"]
    lines += [f"warning: {w}" for w in report["warnings"]]
    lines += [f"not averaged: {e['run']} {e['why']}" for e in report["excluded"]]
    return lines


def format_report(report: dict[str, Any]) -> str:
    return "\n".join(_preamble(report) + [""] + _tables(report, markdown=False))


def write_report(report: dict[str, Any], out: str | Path) -> list[Path]:
    """report.json, report.md, curves.png and time_to_target.png into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    md = ["# hpctrain report", ""] + [f"- {line}" for line in _preamble(report)] + [""]
    md += _tables(report, markdown=True) + ["![curves](curves.png)", "",
                                            "![time to target](time_to_target.png)", ""]
    write_text_atomic(out / "report.md", "\n".join(md))
    return [out / "report.json", out / "report.md", *_plot(report, out)]


def _plot(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for g in report["groups"]:
        for axis, name, label in ((axes[0], "time_s", "time (s)"),
                                  (axes[1], "samples", "samples")):
            rows = g["curves"][name]
            xs = [r["x"] for r in rows]
            line, = axis.plot(xs, [r["mean"] for r in rows], label=f"{g['name']} (n={g['n']})")
            if all(r["lo"] is not None for r in rows):
                axis.fill_between(xs, [r["lo"] for r in rows], [r["hi"] for r in rows],
                                  color=line.get_color(), alpha=0.2)
            axis.set_xlabel(label)
    for axis in axes:
        axis.axhline(report["target_loss"], color="grey", linestyle=":", linewidth=1)
        axis.set_ylabel(f"{report['metric']} log loss")
        axis.legend(fontsize=7)
    fig.suptitle(f"mean of runs with {report['level']:.0%} t interval bands")
    fig.tight_layout()
    curves = out / "curves.png"
    fig.savefig(curves, dpi=90)
    plt.close(fig)

    fig, axis = plt.subplots(figsize=(6, 0.5 + 0.5 * len(report["groups"])))
    names, means, errors = [], [], [[], []]
    for g in report["groups"]:
        m = g["metrics"]["time_to_target_s"]
        names.append(g["name"])
        means.append(m.get("estimate", float("nan")))
        errors[0].append(m["estimate"] - m["lo"] if m.get("lo") is not None else 0.0)
        errors[1].append(m["hi"] - m["estimate"] if m.get("hi") is not None else 0.0)
    axis.barh(range(len(names)), means, xerr=errors, capsize=3, color="tab:blue", alpha=0.7)
    axis.set_yticks(range(len(names)), names, fontsize=7)
    axis.set_xlabel(f"time to target {report['target_loss']:.4f} (s), "
                    f"{report['level']:.0%} t interval")
    fig.tight_layout()
    bars = out / "time_to_target.png"
    fig.savefig(bars, dpi=90)
    plt.close(fig)
    return [curves, bars]
