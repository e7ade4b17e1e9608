"""``hpctrain bench embeddings``: one job through every embedding layout, in one launch.

Layouts: replicated tables (the baseline), all-to-all over the workers in each sharding,
the parameter server with 1 and 2 server ranks (the last ranks of the same world; the
global batch and so the id stream stay the same, on fewer workers), and the parameter
server with a hot tier (``--hot`` of the rows). Every layout trains ``--steps`` steps of the
job (``hpctrain train``'s job: the embedded default unless a file is given); the layouts
run interleaved, ``--repeat`` rounds each starting from a different layout. A layout's
speed is compared with the replicated run of the same round (other jobs on the machine slow
a round's runs alike): ``speed_ratio`` is the geometric mean of the rounds' ratios with its
95% interval (:func:`~hpctrain.stats.paired_ratio_interval`; none for a single
round), ``step_ratio`` the same mean of step times; the other figures are means over the
rounds.

Reported per layout, each also as a ratio to replicated: mean step time, samples/s,
embedding bytes per step that leave their rank (all workers and servers, measured by the
stores; dense allreduces, the same in every layout, are left out) against the minimum for
the batches, and table memory per rank (values and optimizer state the busiest rank holds:
replicated, every row on every worker; all-to-all, its shard; PS, a server's shard).
Memory is computed from what the stores hold, not from the process's peak RSS, which in
one launch only grows from layout to layout.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import numpy as np

from embeddings.alltoall import ShardedTables
from embeddings.optim import SparseOptimizer
from embeddings.replicated import ReplicatedTables
from embeddings.worker_sharding import SHARDINGS
from hpctrain.bench.report import interval_note, mean_row
from hpctrain.config import JobConfig, load_config
from hpctrain.runtime.world import Topology, build_topology
from hpctrain.stats import paired_ratio_interval
from hpctrain.train.job import run_training
from hpctrain.train.report import Summary
from hpctrain.train.trainer import Trainer

__all__ = ["add_arguments", "run", "COLUMNS", "layouts", "plot", "speed_note"]

COLUMNS = ["layout", "workers", "step_ms", "step_ratio", "samples_per_s", "speed_ratio",
           "speed_ratio_lo", "speed_ratio_hi", "bytes_per_step", "min_bytes_per_step",
           "bytes_over_min", "bytes_ratio", "table_mb_per_rank", "memory_ratio",
           "eval_log_loss"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="interleaved rounds; ratios to replicated are the rounds' "
                             "geometric means with their 95%% intervals (default 3)")
    parser.add_argument("--hot", type=float, default=0.05,
                        help="hot tier of the tiered layout, a share of all rows (0.05)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="bar chart of the ratios")


def layouts(ranks: int) -> list[tuple[str, list[str]]]:
    """(name, config overrides) of every layout a world of ``ranks`` ranks can run."""
    # a job file's own servers and hot tier belong to no layout but the ones that name them
    untiered = ["tiering.budget=0"]
    local = ["ps.servers=0", *untiered]
    out = [("replicated", ['embeddings.mode="replicated"', *local])]
    out += [(f"alltoall:{s}", ['embeddings.mode="alltoall"', f'embeddings.sharding="{s}"',
                               *local]) for s in SHARDINGS]
    for servers in (1, 2):
        if ranks > servers:
            out.append((f"ps:{servers}", ['embeddings.mode="ps"', f"ps.servers={servers}",
                                          *untiered]))
    if ranks > 1:
        out.append(("ps:1+tiering", ['embeddings.mode="ps"', "ps.servers=1"]))
    return out


def run(args: argparse.Namespace, config: JobConfig,
        topo: Topology) -> list[dict[str, Any]] | None:
    """Train every layout (collective over the world); world rank 0 returns the rows."""
    cases = layouts(topo.world.Get_size())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in cases}
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-") as scratch:
        scratch = topo.world.bcast(scratch, root=0)
        # warm-up (JIT compilation, first-touch allocations), not measured
        _train(args, topo, "warm-up", cases[0][1], f"{scratch}/warm-up", steps=2)
        for rnd in range(args.repeat):
            for i in range(len(cases)):
                name, overrides = cases[(rnd + i) % len(cases)]
                if name.endswith("tiering"):
                    overrides = [*overrides, f"tiering.budget={args.hot}",
                                 'tiering.budget_unit="fraction"']  # --hot: a share of rows
                result = _train(args, topo, name, overrides, f"{scratch}/{rnd}-{i}")
                if result:
                    runs[name].append(result)
    if topo.rank != 0:
        return None
    base = runs["replicated"]
    base_row = mean_row(base)
    rows = []
    for name, _ in cases:
        mine = runs[name]
        row = mean_row(mine)
        speed = paired_ratio_interval([r["samples_per_s"] for r in mine],
                                      [r["samples_per_s"] for r in base])
        step = paired_ratio_interval([r["step_ms"] for r in mine], [r["step_ms"] for r in base])
        rows.append({**row, "rounds": len(mine), "step_ratio": step.estimate,
                     "speed_ratio": speed.estimate, "speed_ratio_lo": speed.lo,
                     "speed_ratio_hi": speed.hi,
                     "round_speed_ratios": [r["samples_per_s"] / b["samples_per_s"]
                                            for r, b in zip(mine, base, strict=True)],
                     "bytes_ratio": row["bytes_per_step"] / max(base_row["bytes_per_step"], 1),
                     "memory_ratio": row["table_mb_per_rank"] / base_row["table_mb_per_rank"]})
    if args.plot:
        plot(rows, args.plot)
    return rows


def speed_note(rows: list[dict[str, Any]]) -> str:
    """What the ratio columns are, and where there is no interval, why."""
    return interval_note("ratios to replicated", rows[0]["rounds"] if rows else 0, "round",
                         "speed_ratio_lo-speed_ratio_hi")


def _train(args: argparse.Namespace, world: Topology, name: str, overrides: list[str],
           run_dir: str, steps: int = 0) -> dict[str, Any] | None:
    """One run of layout ``name``; world rank 0 returns its figures."""
    config = load_config(args.job, overrides=[
        *args.set, f"train.steps={steps or args.steps}", "train.progress=false",
        "train.eval_every=0", "checkpoint.at_end=false", f"train.run_dir={run_dir!r}", *overrides])
    topo = build_topology(config, world.world)
    facts: dict[str, Any] = {}

    def read(trainer: Trainer) -> None:
        facts.update(_store_facts(trainer))

    summary = run_training(config, topo, on_trained=read)
    held = topo.world.gather(facts.get("table_bytes", 0), root=0)
    sent = topo.world.gather(facts.get("bytes_sent", 0), root=0)
    least = topo.world.gather(facts.get("min_bytes", 0), root=0)
    rank, workers = topo.rank, topo.workers
    topo.free()
    if rank != 0:
        return None
    steps = max(summary.steps, 1)
    measured, minimum = sum(sent), sum(least)
    if summary.ps_clients:
        measured, minimum = _ps_bytes(summary, config)
    if summary.ps_servers:  # a server holds its shard's arrays
        held.append(max(s.resident_bytes for s in summary.ps_servers))
    return {"layout": name, "workers": workers,
            "step_ms": 1e3 * summary.step_s / steps, "samples_per_s": summary.samples_per_s,
            "bytes_per_step": measured / steps, "min_bytes_per_step": minimum / steps,
            "bytes_over_min": measured / max(minimum, 1),
            "table_mb_per_rank": max(held) / 2**20,
            "eval_log_loss": summary.eval.get("log_loss", float("nan"))}


def _row_bytes(config: JobConfig) -> int:
    """Bytes of one row with its optimizer state."""
    dim = config.model.embedding_dim
    return 4 * (dim + SparseOptimizer(config.train.table_optimizer).state_width(dim))


def _store_facts(trainer: Trainer) -> dict[str, Any]:
    """This worker's table bytes and embedding traffic (replicated and all-to-all)."""
    store = trainer.store
    if isinstance(store, ShardedTables):
        t = store.tables
        return {"table_bytes": t.weight.nbytes + t.state.nbytes,
                "bytes_sent": store.stats.train_bytes_sent, "min_bytes": store.stats.min_bytes}
    if isinstance(store, ReplicatedTables):
        t = store.tables
        # the minimum: every worker's unique rows (id and gradient) reach every other one
        return {"table_bytes": t.weight.nbytes + t.state.nbytes,
                "bytes_sent": store.bytes_sent, "min_bytes": store.bytes_sent}
    tiering = trainer.counters().tiering
    return {"table_bytes": (tiering.hot_rows if tiering else 0) * _row_bytes(trainer.config),
            "bytes_sent": 0, "min_bytes": 0}


def _ps_bytes(summary: Summary, config: JobConfig) -> tuple[int, int]:
    """Parameter-server traffic of all workers (and the hot tier's among them), and its
    minimum: each pulled row's id and value, each pushed row's gradient."""
    row = 4 * config.model.embedding_dim
    clients = summary.ps_clients
    wire = sum(c.pull_bytes_sent + c.pull_bytes_received + c.push_bytes_sent
               + c.move_bytes_sent + c.move_bytes_received for c in clients)
    wire += sum(t.sync_bytes + t.count_bytes for t in summary.tiering)
    least = sum(c.rows_pulled * (8 + row) + c.rows_pushed * row for c in clients)
    return wire, least


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Bars of step time, bytes and memory per layout, as ratios to replicated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["layout"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows)), 4))
    for k, key in enumerate(("step_ratio", "bytes_ratio", "memory_ratio")):
        ax.bar(x + (k - 1) * 0.27, [r[key] for r in rows], 0.27, label=key)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("ratio to replicated")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
