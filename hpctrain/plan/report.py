"""Printing a plan: per layout predicted samples/s and peak memory, per rank kind memory,
predicted ms and bytes in and out (as TorchRec's planner statistics), or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hpctrain.plan.cluster import Cluster
from hpctrain.plan.types import Prediction

__all__ = ["format_plan", "plan_json", "shortfall"]

MIB = 2.0**20


def format_plan(predictions: Sequence[Prediction], cluster: Cluster, top: int = 0) -> str:
    """The ranked table; ``top`` > 0 details that many feasible layouts' ranks."""
    lines = [f"cluster: {cluster.nodes} node(s) x {cluster.ranks_per_node} ranks, "
             f"{cluster.memory_per_rank / MIB:,.0f} MiB per rank, device "
             f"{cluster.device.flops / 1e9:.1f} GFLOP/s, "
             f"{cluster.device.memory_bandwidth / 1e9:.1f} GB/s ({cluster.device.source}), "
             f"links from {cluster.comm.source} ({cluster.source})"]
    if cluster.oversubscribed:
        lines.append(f"note: {cluster.ranks_per_node} ranks share {cluster.cores_per_node} "
                     f"cores per node: predicted times assume each gets "
                     f"{cluster.core_share:.2f} of a core")
    lines.append(f"{'#':>3} {'layout':<44} {'samples/s':>10} {'step ms':>9} "
                 f"{'peak MiB':>9}  status")
    for i, q in enumerate(predictions, 1):
        status = "ok" if q.feasible else "infeasible: " + "; ".join(q.infeasible)
        lines.append(f"{i:>3} {q.proposal.name:<44} {q.samples_per_s:>10,.0f} "
                     f"{q.step_s * 1e3:>9.2f} {q.peak_memory / MIB:>9,.0f}  {status}")
    shown = [q for q in predictions if q.feasible][:top]
    for i, q in enumerate(shown, 1):
        lines.append(f"\nlayout {i}: {q.proposal.name}")
        lines.append(f"  {'rank':<10} {'x':>3} {'memory MiB':>10} {'pred ms':>8} "
                     f"{'in KiB':>9} {'out KiB':>9}  memory by part / time by phase")
        for r in q.ranks:
            parts = ", ".join(f"{k} {v / MIB:.1f}" for k, v in r.memory.items() if v)
            phases = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r.time_s.items() if v)
            lines.append(f"  {r.role:<10} {r.count:>3} {r.memory_bytes / MIB:>10,.1f} "
                         f"{r.step_s * 1e3:>8.2f} {r.input_bytes / 1024:>9,.1f} "
                         f"{r.output_bytes / 1024:>9,.1f}  MiB: {parts}; ms: {phases}")
    return "\n".join(lines)


def plan_json(predictions: Sequence[Prediction], cluster: Cluster) -> str:
    def one(q: Prediction) -> dict[str, Any]:
        return {"layout": q.proposal.name, "proposal": q.proposal.__dict__,
                "overrides": q.proposal.overrides(), "samples_per_s": q.samples_per_s,
                "step_s": q.step_s, "peak_memory_bytes": q.peak_memory,
                "feasible": q.feasible,
                "infeasible": list(q.infeasible), "notes": list(q.notes),
                "ranks": [{"role": r.role, "count": r.count, "memory": r.memory,
                           "memory_bytes": r.memory_bytes, "time_s": r.time_s,
                           "step_s": r.step_s, "input_bytes": r.input_bytes,
                           "output_bytes": r.output_bytes} for r in q.ranks]}

    return json.dumps({"cluster": {"nodes": cluster.nodes,
                                   "ranks_per_node": cluster.ranks_per_node,
                                   "cores_per_node": cluster.cores_per_node,
                                   "memory_per_rank": cluster.memory_per_rank,
                                   "base_memory": cluster.base_memory,
                                   "device": cluster.device.__dict__,
                                   "oversubscribed": cluster.oversubscribed},
                       "layouts": [one(q) for q in predictions]}, indent=2)


def shortfall(predictions: Sequence[Prediction], cluster: Cluster) -> str:
    """What is short when no layout fits: the least memory any layout needs."""
    best = min(predictions, key=lambda q: q.peak_memory)
    over = best.peak_memory - cluster.memory_per_rank
    if over > 0:
        return (f"no layout fits: the smallest ({best.proposal.name}) needs "
                f"{best.peak_memory / MIB:,.0f} MiB on its largest rank, "
                f"{over / MIB:,.0f} MiB over the {cluster.memory_per_rank / MIB:,.0f} MiB "
                f"per rank")
    return f"no layout fits {cluster.ranks} ranks: {best.proposal.name}: " + "; ".join(
        best.infeasible)
