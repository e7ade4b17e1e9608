"""What a timeline from :mod:`hpctrain.runtime.trace` says: ``hpctrain trace summarize FILE``.

Three answers, from the complete events (``ph: "X"``) alone:

- **critical path**: a BSP step ends when its slowest worker does, so each step's time is the
  slowest rank's ``step`` span; it is split among that rank's main-thread phases by their
  exclusive time (a span's duration less its nested spans'), and what no span covers is
  ``(untraced)``. Summed over steps, per phase. Main-thread spans outside any step
  (checkpoints, evaluation) follow, per phase the largest rank total.
- **reductions hidden behind backward**: per gradient bucket, the share of its ``reduce``
  spans (launch to completion) that overlaps its rank's ``backward`` spans.
- **slowest rank per step**: which rank that was, how long it took, and the median rank.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.errors import ConfigError

__all__ = ["load_events", "summarize", "format_summary"]

_EPS_US = 0.01


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """The complete events of a trace file (a ``traceEvents`` object or a bare list)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable trace JSON file ({exc})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ConfigError(f"{path}: no traceEvents list")
    if not all(isinstance(e, dict) for e in events):
        raise ConfigError(f"{path}: traceEvents holds something other than event objects")
    try:
        spans = [e for e in events if e.get("ph") == "X" and float(e["dur"]) >= 0
                 and float(e["ts"]) == float(e["ts"])]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: a complete event lacks ts/dur ({exc})") from None
    if not spans:
        raise ConfigError(f"{path}: no spans (complete events) to summarize")
    return spans


def _exclusive(spans: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """Each span of one thread with its duration less that of the spans nested in it."""
    ordered = sorted(spans, key=lambda e: (e["ts"], -e["dur"]))
    own = {id(e): float(e["dur"]) for e in ordered}
    stack: list[dict[str, Any]] = []
    for e in ordered:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + _EPS_US:
            stack.pop()
        if stack and e["ts"] + e["dur"] <= stack[-1]["ts"] + stack[-1]["dur"] + _EPS_US:
            own[id(stack[-1])] -= float(e["dur"])
        stack.append(e)
    return [(e, max(0.0, own[id(e)])) for e in ordered]


def _within(e: dict[str, Any], outer: dict[str, Any]) -> bool:
    return e["ts"] + _EPS_US >= outer["ts"] and \
        e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + _EPS_US


def _overlap(begin: float, end: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(begin, a)) for a, b in intervals)


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The three answers (module doc) as plain data, times in seconds."""
    threads: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        threads[(int(e["pid"]), int(e["tid"]))].append(e)
    main = {pid: spans for (pid, tid), spans in threads.items() if tid == 0}
    steps: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)  # step -> rank -> span
    for pid, spans in main.items():
        for e in spans:
            if e["name"] == "step":
                steps[int(e.get("args", {}).get("step", -1))][pid] = e
    # each main-thread span's exclusive time, under the step it lies in (None: outside)
    per_step: dict[int, dict[int | None, dict[str, float]]] = {}
    for pid, spans in main.items():
        mine = sorted(((e, k) for k, ranks in steps.items() for r, e in ranks.items()
                       if r == pid), key=lambda ek: ek[0]["ts"])
        starts = [e["ts"] for e, _ in mine]
        buckets_of = per_step[pid] = defaultdict(lambda: defaultdict(float))
        for e, own in _exclusive([e for e in spans if e["name"] != "step"]):
            at = bisect.bisect_right(starts, e["ts"] + _EPS_US) - 1
            key = mine[at][1] if at >= 0 and _within(e, mine[at][0]) else None
            buckets_of[key][e["name"]] += own / 1e6
    critical: dict[str, float] = defaultdict(float)
    slowest = []
    for step in sorted(steps):
        ranks = steps[step]
        rank = max(ranks, key=lambda r: ranks[r]["dur"])
        seconds = ranks[rank]["dur"] / 1e6
        phases = per_step[rank].get(step, {})
        for name, own in phases.items():
            critical[name] += own
        critical["(untraced)"] += max(0.0, seconds - sum(phases.values()))
        durations = [s["dur"] / 1e6 for s in ranks.values()]
        slowest.append({"step": step, "rank": rank, "seconds": seconds,
                        "median_s": float(np.median(durations)), "ranks": len(ranks)})
    outside: dict[str, float] = defaultdict(float)
    for pid in per_step:
        for name, own in per_step[pid].get(None, {}).items():
            outside[name] = max(outside[name], own)
    buckets: dict[str, dict[str, float]] = {}
    for (pid, _), spans in sorted(threads.items()):
        backward = [(e["ts"], e["ts"] + e["dur"]) for e in main.get(pid, [])
                    if e["name"] == "backward"]
        for e in spans:
            if e["name"] != "reduce":
                continue
            key = f"bucket {e.get('args', {}).get('bucket', '?')}"
            b = buckets.setdefault(key, {"reductions": 0, "seconds": 0.0, "hidden_s": 0.0})
            b["reductions"] += 1
            b["seconds"] += e["dur"] / 1e6
            b["hidden_s"] += _overlap(e["ts"], e["ts"] + e["dur"], backward) / 1e6
    return {"critical_path": dict(sorted(critical.items(), key=lambda kv: -kv[1])),
            "outside_steps": dict(outside),
            "reductions": buckets, "slowest": slowest}


def format_summary(summary: dict[str, Any], max_steps: int = 20) -> str:
    """The summary as text tables (at most ``max_steps`` step rows, then counts per rank)."""
    out = []
    path = summary["critical_path"]
    total = sum(path.values())
    out.append(f"critical path over {len(summary['slowest'])} steps: {total:.4f} s "
               "(each step on its slowest rank)")
    out.append(f"  {'phase':<28}{'seconds':>10}{'share':>8}")
    for name, seconds in path.items():
        out.append(f"  {name:<28}{seconds:>10.4f}{seconds / total if total else 0:>8.1%}")
    if summary["outside_steps"]:
        out.append("outside steps (largest rank total):")
        for name, seconds in sorted(summary["outside_steps"].items(), key=lambda kv: -kv[1]):
            out.append(f"  {name:<28}{seconds:>10.4f}")
    out.append("gradient reductions (launch to completion) hidden behind backward:")
    if not summary["reductions"]:
        out.append("  none traced")
    for name, b in summary["reductions"].items():
        hidden = b["hidden_s"] / b["seconds"] if b["seconds"] else 0.0
        out.append(f"  {name:<12}{b['reductions']:>6} reductions  mean "
                   f"{b['seconds'] / b['reductions'] * 1e3:.3f} ms  hidden {hidden:.1%}")
    slowest = summary["slowest"]
    out.append("slowest rank per step:")
    for row in slowest[:max_steps]:
        out.append(f"  step {row['step']:>6}  rank {row['rank']:>3}  {row['seconds'] * 1e3:9.3f}"
                   f" ms  (median of {row['ranks']} ranks {row['median_s'] * 1e3:.3f} ms)")
    if len(slowest) > max_steps:
        counts: dict[int, int] = defaultdict(int)
        for row in slowest:
            counts[row["rank"]] += 1
        out.append(f"  ... {len(slowest) - max_steps} more; slowest in all steps: " + ", ".join(
            f"rank {r} {n}x" for r, n in sorted(counts.items())))
    return "\n".join(out)
