"""What a finished run reports: the :class:`Summary` and the short table rank 0 prints.

The per-rank counters are the typed records their owners keep (the parameter-server
client's :class:`~ps.client.ClientStats`, the server's :class:`~ps.server.ServerStats`, the
tiered store's :class:`~embeddings.tiered.TieringStats`, the trainer's :class:`StepTimes`);
:meth:`Summary.as_dict` turns them into ``summary.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from embeddings.tiered import TieringStats
from hpctrain.comm.emulate import NetStats
from ps.client import ClientStats
from ps.server import ServerStats

__all__ = ["PHASES", "StepTimes", "Summary", "format_summary", "print_summary"]

PHASES = ("data", "lookup", "compute", "dense_sync", "optimizer", "push", "retier",
          "checkpoint")


@dataclass
class StepTimes:
    """One worker's step seconds: mean, p50, p99 and max, and its straggler sleep."""

    mean: float
    p50: float
    p99: float
    max: float
    straggler_sleep: float

    @classmethod
    def of(cls, steps: list[float], straggler_sleep: float) -> StepTimes:
        s = np.array(steps or [0.0])
        return cls(float(s.mean()), float(np.percentile(s, 50)), float(np.percentile(s, 99)),
                   float(s.max()), straggler_sleep)


@dataclass
class Summary:
    """What a finished run reports (rank 0 holds the evaluation figures)."""

    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    train_loss: float = float("nan")
    eval: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: list[float] = field(default_factory=list)
    skipped_lines: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    """Per worker: steps (full PS mode: own contributions) skipped for non-finite values."""
    run_dir: str = ""
    ps_clients: list[ClientStats] = field(default_factory=list)
    ps_servers: list[ServerStats] = field(default_factory=list)
    step_times: list[StepTimes] = field(default_factory=list)
    tiering: list[TieringStats] = field(default_factory=list)
    dense_reduced_bytes: int = 0
    """Bytes worker 0 handed to the dense gradient reductions (``comm.wire_dtype``)."""
    dense_syncs: int = 0
    """Dense synchronisations of worker 0: gradient reductions, or local SGD's averages."""
    pipeline_sent_bytes: int = 0
    """Bytes worker 0 (pipeline stage 0) sent to the next stage (``parallel.wire_dtype``)."""
    stopped_at: int = 0
    """The step after which SIGTERM/SIGUSR1 stopped the run (0: it ran to the end)."""
    optimizer_state_bytes: list[int] = field(default_factory=list)
    """Per worker: bytes of dense optimizer state it holds (ZeRO: its shard)."""
    gradient_bytes: list[int] = field(default_factory=list)
    """Per worker: bytes of dense gradient it keeps between steps (ZeRO-2: its shard)."""
    emulated: list[NetStats] = field(default_factory=list)
    """Per world rank, with ``comm.emulate``: seconds waited for the emulated network beyond
    the real transfer, and the messages and bytes it delayed (received across nodes)."""

    @property
    def step_s(self) -> float:
        """Time in the training step proper (everything but reading data)."""
        return sum(v for k, v in self.phase_s.items() if k != "data")

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s else 0.0

    @property
    def step_samples_per_s(self) -> float:
        return self.samples / self.step_s if self.step_s else 0.0

    def emulated_shares(self, workers: int) -> list[float]:
        """Per worker, with ``comm.emulate``: its seconds waiting for the emulated network
        as a share of the run (empty without)."""
        wall = max(self.wall_s, 1e-9)
        return [e.emulated_s / wall for e in self.emulated[:workers]]

    def as_dict(self) -> dict[str, object]:
        return {"steps": self.steps, "samples": self.samples, "wall_s": self.wall_s,
                "step_s": self.step_s, "phase_s": self.phase_s,
                "samples_per_s": self.samples_per_s,
                "step_samples_per_s": self.step_samples_per_s, "train_loss": self.train_loss,
                "eval": self.eval, "peak_rss_mb": self.peak_rss_mb,
                "skipped_lines": self.skipped_lines, "skipped_steps": self.skipped_steps,
                "ps_clients": [c.as_dict() for c in self.ps_clients],
                "ps_servers": [s.as_dict() for s in self.ps_servers],
                "step_times": [asdict(t) for t in self.step_times],
                "staleness": self.staleness(), "tiering": [t.as_dict() for t in self.tiering],
                "dense_reduced_bytes": self.dense_reduced_bytes,
                "dense_syncs": self.dense_syncs,
                "pipeline_sent_bytes": self.pipeline_sent_bytes,
                "optimizer_state_bytes": self.optimizer_state_bytes,
                "gradient_bytes": self.gradient_bytes,
                "emulated": [asdict(e) for e in self.emulated]}

    def staleness(self) -> dict[str, dict[str, float]]:
        """Per table, over all servers: reads, mean, p99 and max staleness in clocks."""
        merged: dict[str, dict[int, int]] = {}
        for server in self.ps_servers:
            for table, counts in server.staleness.items():
                for gap, n in counts.items():
                    merged.setdefault(table, {})
                    merged[table][int(gap)] = merged[table].get(int(gap), 0) + n
        out = {}
        for table, counts in merged.items():
            gaps = np.array(sorted(counts))
            weights = np.array([counts[g] for g in gaps])
            cumulative = np.cumsum(weights) / weights.sum()
            out[table] = {"reads": int(weights.sum()),
                          "mean": float((gaps * weights).sum() / weights.sum()),
                          "p99": float(gaps[np.searchsorted(cumulative, 0.99)]),
                          "max": float(gaps.max())}
        return out


def format_summary(summary: Summary, workers: int) -> str:
    rows = _run_rows(summary, workers)
    if summary.ps_clients:
        rows.append(_client_row(summary))
    if summary.tiering:
        rows.extend(_tiering_rows(summary))
    if summary.emulated:
        rows.append(_emulated_row(summary, workers))
    for s in summary.ps_servers:
        rows.append((f"server rank {s.rank}",
                     f"{s.pulls:,} pulls, {s.pushes:,} pushes, {s.rows_out:,} rows "
                     f"out, {s.rows_in:,} in, {s.deferred:,} deferred "
                     f"({s.deferred_wait_s:.2f} s), {s.resident_bytes / 2**20:,.1f} MB, "
                     f"{s.rows_per_s:,.0f} rows/s, busy {s.busy_fraction:.0%} "
                     f"({s.busy_cpu_s:.2f} s CPU of {s.busy_s:.2f} s), "
                     f"{s.threads} thread{'s' if s.threads > 1 else ''}"))
    if summary.skipped_lines:
        rows.append(("skipped input lines", f"{summary.skipped_lines:,}"))
    if any(summary.skipped_steps):
        rows.append(("skipped steps (NaN/Inf)", ", ".join(map(str, summary.skipped_steps))
                     + " (per worker)"))
    rows.append(("run dir", summary.run_dir))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _run_rows(summary: Summary, workers: int) -> list[tuple[str, str]]:
    ev = summary.eval
    rss = summary.peak_rss_mb
    evaluation = [
        ("eval log loss", f"{ev.get('log_loss', float('nan')):.4f}  "
                          f"(base rate {ev.get('base_rate_log_loss', float('nan')):.4f})"),
        ("eval AUC", f"{ev.get('auc', float('nan')):.4f}"),
        ("eval accuracy", f"{ev.get('accuracy', float('nan')):.4f}"),
    ] if ev else [("eval", "not run (stopped before the last step; the resumed run evaluates)")]
    return [
        ("steps", f"{summary.steps:,} ({summary.samples:,} samples on {workers} workers)"),
        *evaluation,
        ("train loss (last)", f"{summary.train_loss:.4f}"),
        ("samples/s end to end", f"{summary.samples_per_s:,.0f}  ({summary.wall_s:.1f} s)"),
        ("samples/s step only", f"{summary.step_samples_per_s:,.0f}  ({summary.step_s:.1f} s)"),
        ("step time (worker 0)", _phase_shares(summary)),
        ("peak RSS per worker", f"{max(rss):,.0f} MB max" + (
            f" ({', '.join(f'{m:,.0f}' for m in rss)})" if len(rss) <= 8 else "")),
    ]


def _phase_shares(summary: Summary) -> str:
    """Each phase's share of the run's clock; checkpoint writes are kept off that clock
    (as evaluations are), so they are seconds beside it, not a share of it."""
    shares = "  ".join(f"{k} {100 * v / max(summary.wall_s, 1e-9):.0f}%"
                       for k, v in summary.phase_s.items() if k != "checkpoint")
    saving = summary.phase_s.get("checkpoint", 0.0)
    return shares + (f"  (and {saving:.1f} s writing checkpoints)" if saving else "")


def _client_row(summary: Summary) -> tuple[str, str]:
    c = summary.ps_clients[0]
    steps = max(summary.steps, 1)
    wire = (c.pull_bytes_sent + c.pull_bytes_received + c.push_bytes_sent
            + c.move_bytes_sent + c.move_bytes_received)
    return ("ps traffic (worker 0)",
            f"{wire / steps / 1024:,.1f} KiB/step, "
            f"pull wait {100 * c.pull_wait_s / max(summary.wall_s, 1e-9):.1f}% "
            f"of the run, {c.prefetch_hits:,} prefetch hits")


def _emulated_row(summary: Summary, workers: int) -> tuple[str, str]:
    """Seconds each worker waited for the emulated network, as shares of the run."""
    shares = summary.emulated_shares(workers)
    messages = sum(e.messages for e in summary.emulated)
    return ("emulated transfer", f"{100 * max(shares):.1f}% of the run max per worker ("
            + ", ".join(f"{100 * s:.1f}" for s in shares[:8]) + f"); {messages:,} messages "
            f"delayed, {sum(e.bytes for e in summary.emulated) / 2**20:,.1f} MiB")


def _tiering_rows(summary: Summary) -> list[tuple[str, str]]:
    """Hit rate of all workers against the oracle, and worker 0's tiers and moves."""
    tiers = summary.tiering
    first = tiers[0]
    lookups = sum(t.lookups for t in tiers)
    hit_rate = sum(t.hits for t in tiers) / max(lookups, 1)
    steps = max(summary.steps, 1)
    return [
        ("hot tier", f"{first.hot_rows:,} of {first.capacity:,} rows, "
                     f"{first.resident_bytes / 2**20:,.1f} MB resident of "
                     f"{first.budget_bytes / 2**20:,.1f} MB budget"),
        ("hot hit rate", f"{hit_rate:.3f} of {lookups:,} lookups (oracle "
                         f"{first.oracle_hit_rate:.3f}); per table "
                         + " ".join(f"{h / max(n, 1):.2f}" for h, n in
                                    zip(first.table_hits, first.table_lookups, strict=True))),
        ("tier traffic (worker 0)", f"hot sync {first.sync_bytes / steps / 1024:,.1f} KiB/step"
                                    + (f" ({first.carried_rows / steps:,.0f} rows updated "
                                       f"per step, {first.carried_spills} spilled)"
                                       if first.carried_syncs else "") + ", "
                                    f"{first.retiers} re-tierings moved "
                                    f"{first.rows_promoted:,} rows in and "
                                    f"{first.rows_demoted:,} out, planned "
                                    + ("in the background" if first.planned_in_background
                                       else "inline")
                                    + f" ({first.plan_s:.2f} s)"),
    ]


def print_summary(summary: Summary, workers: int) -> None:
    # a stop on a signal is no end: the run resumes from the checkpoint it wrote
    head = "stopped by a signal" if summary.stopped_at else "finished"
    print(f"hpctrain: training {head}\n" + format_summary(summary, workers), flush=True)
