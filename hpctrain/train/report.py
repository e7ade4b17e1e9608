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
        ("peak RSS per rank", f"{max(rss):,.0f} MB max" + (
            f" ({', '.join(f'{m:,.0f}' for m in rss)})" if len(rss) <= 8 else "")),
    ]
    if summary.skipped_lines:
        rows.append(("skipped input lines", f"{summary.skipped_lines:,}"))
    rows.append(("run dir", summary.run_dir))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def print_summary(summary: Summary, workers: int) -> None:
    print("hpctrain: training finished\n" + format_summary(summary, workers), flush=True)
