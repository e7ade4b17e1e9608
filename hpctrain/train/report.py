"""The short table a finished run prints on rank 0."""

from __future__ import annotations

from hpctrain.train.trainer import Summary

__all__ = ["print_summary", "format_summary"]


def format_summary(summary: Summary, workers: int) -> str:
    ev = summary.eval
    rss = summary.peak_rss_mb
    rows = [
        ("steps", f"{summary.steps:,} ({summary.samples:,} samples on {workers} workers)"),
        ("eval log loss", f"{ev.get('log_loss', float('nan')):.4f}  "
                          f"(base rate {ev.get('base_rate_log_loss', float('nan')):.4f})"),
        ("eval AUC", f"{ev.get('auc', float('nan')):.4f}"),
        ("eval accuracy", f"{ev.get('accuracy', float('nan')):.4f}"),
        ("train loss (last)", f"{summary.train_loss:.4f}"),
        ("samples/s end to end", f"{summary.samples_per_s:,.0f}  ({summary.wall_s:.1f} s)"),
        ("samples/s step only", f"{summary.step_samples_per_s:,.0f}  ({summary.step_s:.1f} s)"),
        ("step time (worker 0)", "  ".join(
            f"{k} {100 * v / max(summary.wall_s, 1e-9):.0f}%"
            for k, v in summary.phase_s.items())),
        ("peak RSS per worker", f"{max(rss):,.0f} MB max" + (
            f" ({', '.join(f'{m:,.0f}' for m in rss)})" if len(rss) <= 8 else "")),
    ]
    if summary.ps_clients:
        c = summary.ps_clients[0]
        steps = max(summary.steps, 1)
        wire = (c["pull_bytes_sent"] + c["pull_bytes_received"] + c["push_bytes_sent"]
                + c["move_bytes_sent"] + c["move_bytes_received"])
        rows.append(("ps traffic (worker 0)",
                     f"{wire / steps / 1024:,.1f} KiB/step, "
                     f"pull wait {100 * c['pull_wait_s'] / max(summary.wall_s, 1e-9):.1f}% "
                     f"of the run, {c['prefetch_hits']:,} prefetch hits"))
    if summary.tiering:
        rows.extend(_tiering_rows(summary))
    for s in summary.ps_servers:
        rows.append((f"server rank {s['rank']}",
                     f"{s['pulls']:,} pulls, {s['pushes']:,} pushes, {s['rows_out']:,} rows "
                     f"out, {s['rows_in']:,} in, {s['deferred']:,} deferred "
                     f"({s['deferred_wait_s']:.2f} s), {s['resident_bytes'] / 2**20:,.1f} MB"))
    if summary.skipped_lines:
        rows.append(("skipped input lines", f"{summary.skipped_lines:,}"))
    if any(summary.skipped_steps):
        rows.append(("skipped steps (NaN/Inf)", ", ".join(map(str, summary.skipped_steps))
                     + " (per worker)"))
    rows.append(("run dir", summary.run_dir))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _tiering_rows(summary: Summary) -> list[tuple[str, str]]:
    """Hit rate of all workers against the oracle, and worker 0's tiers and moves."""
    tiers = summary.tiering
    first = tiers[0]
    lookups = sum(t["lookups"] for t in tiers)
    hit_rate = sum(t["hits"] for t in tiers) / max(lookups, 1)
    steps = max(summary.steps, 1)
    return [
        ("hot tier", f"{first['hot_rows']:,} of {first['capacity']:,} rows, "
                     f"{first['resident_bytes'] / 2**20:,.1f} MB resident of "
                     f"{first['budget_bytes'] / 2**20:,.1f} MB budget"),
        ("hot hit rate", f"{hit_rate:.3f} of {lookups:,} lookups (oracle "
                         f"{first['oracle_hit_rate']:.3f}); per table "
                         + " ".join(f"{h / max(n, 1):.2f}" for h, n in
                                    zip(first["table_hits"], first["table_lookups"],
                                        strict=True))),
        ("tier traffic (worker 0)", f"hot sync {first['sync_bytes'] / steps / 1024:,.1f} KiB/step, "
                                    f"{first['retiers']} re-tierings moved "
                                    f"{first['rows_promoted']:,} rows in and "
                                    f"{first['rows_demoted']:,} out"),
    ]


def print_summary(summary: Summary, workers: int) -> None:
    print("hpctrain: training finished\n" + format_summary(summary, workers), flush=True)
