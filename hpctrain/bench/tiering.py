"""``hpctrain bench tiering``: hot/cold tiering against the untiered parameter server.

Launch with one server and the workers, e.g. ``mpiexec -n 4 hpctrain bench tiering``.
Two measurements per setting (Zipf exponent x hot budget as a share of all rows):

1. **Hit rates** on the synthetic generator's id stream of one ``--rows`` table (tables of
   one size and exponent all behave alike), without MPI traffic: the share of lookups the
   hot set serves under LFU and LRU, replaying what the tiered store does (the same
   :class:`~embeddings.hotcold.HotSetPlanner` and tracker, counts merged per global batch,
   re-tiered on :func:`~embeddings.hotcold.retier_due`'s schedule), and the oracle: the best
   static hot set of that size for the same stream, in hindsight. The stream is long
   (``--stream-steps`` x ``--stream-batch`` lookups, 20M by default) so that the first
   lookup of each row, which no policy but hindsight can serve, weighs little. The
   exponents are shared out over the workers.
2. **Training**: real runs of the DLRM on ``--tables`` such tables, untiered (every row on
   the server) and tiered (LFU), back to back in pairs, so that other jobs on the machine
   slow both runs of a pair alike: per setting ``--repeat`` pairs, the untiered run first in
   the first pair, the tiered one in the second, and so on, after a short untiered and
   tiered run that are not measured (a process's first run starts colder). Bytes to and
   from the servers per training step (pulls, pushes and the re-tierings' moves, all
   workers) and samples per second (the mean over the runs of each kind); ``speedup`` is
   the geometric mean of the pairs' tiered/untiered ratios with its 95% interval
   (:func:`~hpctrain.stats.paired_ratio_interval`; none for a single pair). The tiered
   workers also exchange the hot rows' gradient sums and lookup counts among themselves:
   ``wire_ratio`` counts those bytes too, since a network carries both (``bytes_ratio``,
   the servers' alone, makes the tier look cheaper than it is). Under ``comm.emulate``,
   the share of the untiered runs spent waiting for the emulated network bounds what
   cutting network time, by a tier or otherwise, could buy there (``network_bound``).
   Peak memory is not measured here: every run shares this process, whose peak includes the
   hit-rate streams; ``hpctrain train`` reports it per run. A short run cannot learn the
   hot set of a million-row table online, so the tiered runs start from a scan of the first
   ``--prescan`` training samples' ids (``tiering.prescan``); the rows that scan makes hot
   and the time it takes are reported apart (``warm_start_bytes``, ``warm_start_s``), as is
   the final write-back of the hot rows, which is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
import time
from typing import Any

import numpy as np

from embeddings.freq import FrequencyTracker, oracle_hit_rate
from embeddings.hotcold import HotSetPlanner, merge_seen, retier_due
from hpctrain.bench.report import interval_note, mean_row
from hpctrain.config import JobConfig, load_config
from hpctrain.data.synthetic import SyntheticClicks
from hpctrain.runtime.waits import Wait, wait_all
from hpctrain.runtime.world import Topology
from hpctrain.stats import PAIRED_METHOD, paired_ratio_interval
from hpctrain.train.job import run_training

__all__ = ["add_arguments", "run", "COLUMNS", "notes"]

log = logging.getLogger(__name__)

_WARM_UP_STEPS = 10

COLUMNS = ["zipf", "hot_fraction", "lfu_hit_rate", "lru_hit_rate", "oracle_hit_rate",
           "train_hit_rate", "bytes_ratio", "wire_ratio", "samples_per_s",
           "baseline_samples_per_s", "speedup", "speedup_lo", "speedup_hi"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tables", type=int, default=4, help="embedding tables (default 4)")
    parser.add_argument("--rows", type=int, default=1 << 20, help="rows per table (2^20)")
    parser.add_argument("--zipf", type=float, nargs="+", default=[0.9, 1.05, 1.2],
                        help="Zipf exponents of the ids (default 0.9 1.05 1.2)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.05, 0.1],
                        help="hot budgets, shares of all rows (default 0.01 0.05 0.1)")
    parser.add_argument("--stream-steps", type=int, default=300,
                        help="global batches of the hit-rate streams (default 300)")
    parser.add_argument("--stream-batch", type=int, default=65536,
                        help="samples per global batch of the streams (default 65536)")
    parser.add_argument("--train-steps", type=int, default=300,
                        help="steps of each training run (default 300)")
    parser.add_argument("--prescan", type=int, default=5_000_000,
                        help="training samples scanned to seed the hot set (default 5M)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="untiered/tiered pairs of runs per setting; the speedup is "
                             "their geometric mean with its 95%% interval (default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the result rows as JSON")


def run(args: argparse.Namespace, config: JobConfig,
        topo: Topology) -> list[dict[str, Any]] | None:
    """Run both measurements on every rank; world rank 0 returns one row per setting."""
    settings = [(z, b) for z in args.zipf for b in args.budgets]
    if config.tiering.budget and topo.rank == 0:
        log.warning("bench tiering: tiering.budget = %s of the job is not used: the runs "
                    "take --budgets (shares of the rows) and 0 for the untiered baseline",
                    config.tiering.budget)
    hits = _hit_rates(args, config, topo) if topo.is_worker else []
    # ranks done early wait without spinning
    wait_all([topo.world.Ibarrier()], Wait("barrier", topo.world))
    gathered = topo.world.gather(hits, root=0)
    training = _training(args, config, topo)
    if topo.rank != 0:
        return None
    by_setting = {(r["zipf"], r["hot_fraction"]): r for part in gathered for r in part}
    return [{**by_setting[s], **training[s]} for s in settings]


# -- hit rates on id streams -------------------------------------------------------------------


def _hit_rates(args: argparse.Namespace, config: JobConfig,
               topo: Topology) -> list[dict[str, Any]]:
    """This worker's share of the exponents (every ``W``-th): all budgets and policies."""
    rows = []
    for zipf in args.zipf[topo.worker_rank:: topo.workers]:
        stream = _stream(args, zipf, config.data.seed)
        for budget in args.budgets:
            capacity = int(budget * args.rows)
            row = {"zipf": zipf, "hot_fraction": budget, "hot_rows": capacity,
                   "stream_lookups": sum(int(c.sum()) for _, c in stream)}
            for policy in ("lfu", "lru"):
                start = time.perf_counter()
                row[f"{policy}_hit_rate"] = _replay(args, config, stream, capacity, policy)
                row[f"{policy}_replay_s"] = time.perf_counter() - start
            total = np.zeros(args.rows)
            for ids, counts in stream:
                total[ids] += counts
            row["oracle_hit_rate"] = oracle_hit_rate(total, capacity)
            row["lfu_gap"] = row["oracle_hit_rate"] - row["lfu_hit_rate"]
            rows.append(row)
    return rows


def _stream(args: argparse.Namespace, zipf: float,
            seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each global batch's unique rows of one table and their lookup counts."""
    data = SyntheticClicks([args.rows], args.stream_steps * args.stream_batch, 1, zipf, seed)
    batch = args.stream_batch
    return [np.unique(data.sparse("train", s * batch, (s + 1) * batch)[:, 0],
                      return_counts=True) for s in range(args.stream_steps)]


def _replay(args: argparse.Namespace, config: JobConfig,
            stream: list[tuple[np.ndarray, np.ndarray]], capacity: int, policy: str) -> float:
    """Share of the stream's lookups served by the hot set that the tiered store would
    hold under ``policy``, with the job's tiering settings: a plan started at a due step
    is installed at the next one, as the store's background planning does."""
    tc = config.tiering
    tracker = FrequencyTracker([args.rows], tc.exact_below, tc.sketch_width, tc.sketch_depth,
                               capacity)
    planner = HotSetPlanner(tracker, capacity, policy, tc.admission, tc.decay)
    hits = lookups = 0
    seen = []
    live = planned = None  # the installed hot set, the one planned at the last due step
    for step, (ids, counts) in enumerate(stream):
        if live is not None:
            hits += int(counts[np.isin(ids, live, assume_unique=True)].sum())
        lookups += int(counts.sum())
        seen.append((ids, counts, np.full(len(ids), step)))
        if retier_due(step, tc.interval):
            live = planned
            planner.record(*merge_seen(*(np.concatenate(part) for part in zip(*seen,
                                                                              strict=True))))
            planned = planner.plan().hot
            seen = []
    return hits / lookups


# -- training runs ---------------------------------------------------------------------------


def _training(args: argparse.Namespace, config: JobConfig,
              topo: Topology) -> dict[tuple[float, float], dict[str, Any]]:
    """Alternating untiered and tiered runs per setting; collective over the world. World
    rank 0 gets, per setting, bytes and samples/s against the untiered runs."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-") as scratch:
        # not measured: a process's first runs load the server's and the tier's kernels and
        # settle its allocators (with the untiered run of the first pair its process's
        # first, that pair's ratio came out 1.33-1.56 against 0.86-1.00 for the others)
        for budget in (0.0, args.budgets[0]):
            _train(args, config, topo, args.zipf[0], budget, f"{scratch}/warm-up",
                   steps=_WARM_UP_STEPS)
        for zipf in args.zipf:
            for budget in args.budgets:
                pairs = []
                for r in range(args.repeat):
                    runs = {b: _train(args, config, topo, zipf, b, f"{scratch}/{budget}-{r}")
                            for b in ((0.0, budget) if r % 2 == 0 else (budget, 0.0))}
                    pairs.append((runs[0.0], runs[budget]))
                if topo.rank != 0:
                    continue
                base, tiered = (mean_row([pair[k] for pair in pairs]) for k in (0, 1))
                speedup = paired_ratio_interval([t["samples_per_s"] for _, t in pairs],
                                                [b["samples_per_s"] for b, _ in pairs])
                results[(zipf, budget)] = {
                    "train_hit_rate": tiered["hit_rate"],
                    "train_oracle_hit_rate": tiered["oracle_hit_rate"],
                    "bytes_per_step": tiered["bytes_per_step"],
                    "baseline_bytes_per_step": base["bytes_per_step"],
                    "bytes_ratio": tiered["bytes_per_step"] / base["bytes_per_step"],
                    "wire_ratio": (tiered["bytes_per_step"] + tiered["peer_bytes_per_step"])
                    / (base["bytes_per_step"] + base["peer_bytes_per_step"]),
                    "warm_start_bytes": tiered["warm_start_bytes"],
                    "warm_start_s": tiered["warm_start_s"],
                    "move_bytes_per_step": tiered["move_bytes_per_step"],
                    "peer_bytes_per_step": tiered["peer_bytes_per_step"],
                    "samples_per_s": tiered["samples_per_s"],
                    "baseline_samples_per_s": base["samples_per_s"],
                    "speedup": speedup.estimate,
                    "speedup_lo": speedup.lo,
                    "speedup_hi": speedup.hi,
                    "speedup_method": PAIRED_METHOD,
                    "pair_speedups": [t["samples_per_s"] / b["samples_per_s"]
                                      for b, t in pairs],
                    "retier_share": tiered["retier_share"],
                    "train_steps": args.train_steps,
                }
                if "network_share" in base:  # comm.emulate
                    results[(zipf, budget)].update(
                        network_share=base["network_share"],
                        tiered_network_share=tiered["network_share"],
                        network_bound=1.0 / max(1.0 - base["network_share"], 1e-9))
    return results


def notes(rows: list[dict[str, Any]]) -> str:
    """What the speedup and byte columns are (where there is no interval, why), and under
    an emulated network the most that cutting its waits could give."""
    lines = [interval_note("speedup (tiered over untiered samples/s)",
                           len(rows[0]["pair_speedups"]) if rows else 0, "pair",
                           "speedup_lo-speedup_hi"),
             "bytes_ratio: tiered over untiered bytes to and from the servers; wire_ratio: "
             "the same with the hot sums and counts the tiered workers exchange"]
    for row in rows:
        if "network_share" in row:
            lines.append(
                f"zipf {row['zipf']}, hot {row['hot_fraction']}: the untiered runs waited "
                f"{100 * row['network_share']:.1f}% of their time for the emulated network "
                f"(largest worker; tiered {100 * row['tiered_network_share']:.1f}%), so no "
                f"cut in network time speeds them up more than {row['network_bound']:.3f}x")
    return "\n".join(lines)


def _train(args: argparse.Namespace, config: JobConfig, topo: Topology, zipf: float,
           budget: float, scratch: str, steps: int = 0) -> dict[str, float]:
    """One training run of ``steps`` (default ``--train-steps``); world rank 0 returns its
    traffic and throughput. The run writes no checkpoint: saving writes every hot row back
    to the servers, traffic of no step."""
    steps = steps or args.train_steps
    samples = max(args.train_steps * config.train.batch_size, args.prescan)
    base = load_config(args.job, overrides=[
        f"data.table_sizes=[{', '.join([str(args.rows)] * args.tables)}]",
        f"data.zipf={zipf}", f"data.train_samples={samples}",
        *([f"tiering.prescan={args.prescan}"] if budget else []),  # no hot tier to seed
        "data.eval_samples=1000", f"train.steps={steps}", "train.progress=false",
        "checkpoint.at_end=false", "checkpoint.every_minutes=0",
        f"ps.servers={topo.roles.servers}",
        f"train.run_dir={f'{scratch}/z{zipf}-b{budget}'!r}", *args.set,
        # after --set: each run's budget is this setting's, a share of the rows (--budgets)
        f"tiering.budget={budget}", 'tiering.budget_unit="fraction"'])
    job = dataclasses.replace(base, runtime=config.runtime)
    summary = run_training(job, topo)
    if topo.rank != 0:
        return {}
    clients, steps = summary.ps_clients, max(summary.steps, 1)
    wire = sum(c.pull_bytes_sent + c.pull_bytes_received + c.push_bytes_sent
               + c.move_bytes_sent + c.move_bytes_received for c in clients)
    moves = sum(c.move_bytes_sent + c.move_bytes_received for c in clients)
    tiers = summary.tiering
    lookups = sum(t.lookups for t in tiers)
    shares = summary.emulated_shares(topo.roles.workers)  # empty unless comm.emulate
    network = {"network_share": max(shares)} if shares else {}
    return {**network, "bytes_per_step": wire / steps, "move_bytes_per_step": moves / steps,
            "peer_bytes_per_step": sum(t.sync_bytes + t.count_bytes for t in tiers)
            / steps,
            "samples_per_s": summary.samples_per_s,
            "hit_rate": sum(t.hits for t in tiers) / lookups if lookups else 0.0,
            "oracle_hit_rate": tiers[0].oracle_hit_rate if tiers else 0.0,
            "retier_share": summary.phase_s["retier"] / max(summary.wall_s, 1e-9),
            "warm_start_bytes": sum(t.warm_start_bytes for t in tiers),
            "warm_start_s": max((t.warm_start_s for t in tiers), default=0.0)}
