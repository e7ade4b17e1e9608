"""``hpctrain``: the command line. Every command runs on every rank of an MPI launch.

    mpiexec -n 4 hpctrain train                       # the embedded default job
    mpiexec -n 2 hpctrain train jobs/configs/criteo_sample.toml --set train.lr=0.05
    mpiexec -n 2 hpctrain info
    mpiexec -n 4 hpctrain bench tiering --json tiering.json   # 1 server + 3 workers
    mpiexec -n 4 hpctrain compare-sync --models bsp,ssp:4,asp --stragglers transient:0.1:3
    hpctrain preprocess jobs/configs/criteo_sample.toml --out sample.h5
    hpctrain config [JOB.toml] [--doc]
    hpctrain plan [JOB.toml] --cluster cluster.toml    # predicted memory/time per layout
    hpctrain plan calc zero --params 7B --stage 3 --dp 64
    mpiexec -n 2 hpctrain train --set runtime.trace=t.json; hpctrain trace summarize t.json
    hpctrain sweep jobs/sweeps/sync_stragglers.toml --out runs/sweep   # array scripts
    hpctrain sweep --run runs/sweep                                    # or run them here
    hpctrain report runs/sweep --baseline sync.model=bsp     # intervals, ratios, plots
    mpiexec -n 4 hpctrain bench pipeline --json pipeline.json   # GPipe vs 1F1B bubble
    mpiexec -n 4 hpctrain bench allreduce --json out.json --plot out.png
    mpiexec -n 4 hpctrain bench calibrate --out comm.json

A config error is found identically on every rank before any message is exchanged: rank 0
prints it as one line and every rank exits with code 2. Once ranks communicate, an error on
any rank ends the whole job (see :mod:`hpctrain.runtime.abort`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hpctrain.config import JobConfig, doc_table, dump_toml, load_config
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.runtime.abort import USER_ERROR, run_guarded, world_rank
from hpctrain.runtime.env import share_one_heap
from hpctrain.runtime.log import setup_logging
from hpctrain.runtime.preempt import EXIT_STOPPED, exit_code

if TYPE_CHECKING:
    from hpctrain.runtime.world import Topology

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; a rank that fails outside a command's own guard, importing torch
    or numba on a node with a broken install say, still ends the job (``run_guarded``),
    not leaves the others waiting for it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    share_one_heap()  # before any thread of ours starts
    return run_guarded(lambda: _main(argv))


def _main(argv: list[str]) -> int:
    if argv[:1] == ["plan"]:  # its own parser: `plan calc ...` beside `plan [JOB.toml]`
        from hpctrain.plan.cli import main as plan_main

        return plan_main(argv[1:])
    args = _parser(bench_flags=argv[:1] == ["bench"]).parse_args(argv)
    if args.command in _OFFLINE:  # no job and no MPI world: files in, files out
        try:
            return _OFFLINE[args.command](args)
        except HpctrainError as exc:
            print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
            return USER_ERROR
    try:
        job, overrides = args.job, [*args.set, *_command_overrides(args)]
        if getattr(args, "resume", None):
            job = job or _resumed_job(args.resume)
            overrides.append(f"train.run_dir={args.resume!r}")
        config = load_config(job, overrides)
        if args.command == "compare-sync":
            from hpctrain.experiments.compare import sync_variants

            local = any(s.dense != "bsp" for _, s in sync_variants(args.models, config.sync))
            if args.repeats < 1:
                raise ConfigError(f"--repeats {args.repeats}: expected at least 1")
            if not config.ps.servers:  # sync models govern parameter-server tables; local
                mode = "hybrid" if local else "full"  # SGD needs the dense part on workers
                config = load_config(args.job, ["ps.servers=1", f"ps.mode={mode!r}", *args.set,
                                                *_command_overrides(args)])
        if args.command == "bench" and args.bench in ("allreduce", "calibrate") and \
                config.comm.emulate:
            raise ConfigError(f"bench {args.bench}: comm.emulate is set, but this benchmark "
                              f"measures against MPI_Allreduce called directly, which the "
                              f"emulated network does not delay; use hpctrain bench emulate")
        if args.command == "bench":
            _check_bench_flags(args)
        if args.command == "trace" and args.steps < 0:
            raise ConfigError(f"trace summarize: --steps {args.steps}: expected 0 or more step "
                              f"rows")
        if args.command == "bench" and args.bench == "emulate" and not (
                config.comm.emulate and config.comm.node_size):
            raise ConfigError("bench emulate: set comm.emulate (e.g. '20000,0.4') and "
                              "comm.node_size (ranks per emulated node)")
        setup_logging(world_rank(), config.runtime.log_level)
        topo = None
        if args.command in _NEEDS_WORLD:
            from hpctrain.runtime.world import build_topology  # torch: inside the guard

            topo = build_topology(config)
    except HpctrainError as exc:
        if world_rank() == 0:
            print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR
    command: Callable[[argparse.Namespace, JobConfig, Topology | None], int] = _COMMANDS[
        args.command]
    return run_guarded(lambda: _run(command, args, config, topo))


def _run(command: Callable[[argparse.Namespace, JobConfig, Topology | None], int],
         args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    """Run ``command``, then free the Topology and every group it owns (collective)."""
    code = command(args, config, topo)
    if topo is not None:
        topo.free()
    return code


def _parser(bench_flags: bool = True) -> argparse.ArgumentParser:
    """Every command; the benchmarks' own flags with ``bench_flags`` (:func:`_add_bench_flags`)."""
    parser = argparse.ArgumentParser(
        prog="hpctrain", description="Distributed DLRM training over MPI "
                                     "(launch with mpiexec/srun; see README.md).")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, parent: argparse._SubParsersAction = sub
                ) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help, description=help)
        p.add_argument("job", nargs="?", help="TOML job file (default: the embedded job)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.batch_size=256")
        return p

    train = command("train", "train the job's DLRM on this MPI world")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its newest complete checkpoint "
                            "(with no JOB, the run's own config.toml)")
    command("info", "print the MPI world, roles, threads, torch/CUDA/NCCL and allocation")
    pre = command("preprocess", "convert the job's Criteo text files into one HDF5 file")
    pre.add_argument("--out", required=True, help="output .h5 path (written atomically)")
    compare = command("compare-sync", "train the job under several sync models and compare "
                                      "them (table, summary.json, loss.png)")
    compare.add_argument("--models", default="bsp,ssp:2,ssp:8,asp",
                         help="comma-separated: bsp, ssp:S, asp, local:H (local SGD for the "
                              "dense part; a job without servers then runs hybrid, not full) "
                              "(default bsp,ssp:2,ssp:8,asp)")
    compare.add_argument("--stragglers", default="none",
                         help="none, transient:P:FACTOR or persistent:WORKER[+WORKER]:FACTOR")
    compare.add_argument("--repeats", type=int, default=3,
                         help="runs per model, interleaved, seed + i in repeat i; then the "
                              "report with 95%% intervals (default 3; 1: the single-run table)")
    compare.add_argument("--target-loss", type=float, default=None,
                         help="loss to time: held-out (repeats > 1; default: the loss every "
                              "run reaches) or training loss (--repeats 1; default: 1.01 x the "
                              "first model's final)")
    compare.add_argument("--out", default=None,
                         help="results folder (default runs/compare-<date-time>)")
    _experiment_args(sub)
    cfg = command("config", "print the resolved job as TOML")
    cfg.add_argument("--doc", action="store_true", help="print the table of all config keys")
    bench = sub.add_parser("bench", help="measure a part of the toolkit on this MPI world "
                                         "(ratios to a baseline measured in the same run)",
                           description="measure a part of the toolkit on this MPI world")
    benches = bench.add_subparsers(dest="bench", required=True)
    ps = command("ps", "parameter-server pull/push rows/s and bytes per step against torch "
                       "EmbeddingBag(sparse=True)", benches)
    ps.add_argument("--servers", type=int, default=1, help="server ranks (default 1)")
    pipe = command("pipeline", "bubble fraction and peak held activations of GPipe and 1F1B "
                               "against (p-1)/(m+p-1)", benches)
    pipe.add_argument("--p", type=int, nargs="+", default=[2, 4], metavar="P",
                      help="pipeline stages (default: 2 4; needs max(P) workers)")
    pipe.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16], metavar="M",
                      help="micro-batches per batch (default: 1 4 8 16)")
    pipe.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                      choices=["gpipe", "1f1b"], help="schedules (default: both)")
    pipe.add_argument("--width", type=int, default=1024, help="MLP width (default: 1024)")
    pipe.add_argument("--layers", type=int, default=8, help="MLP layers (default: 8)")
    pipe.add_argument("--micro-batch", type=int, default=64,
                      help="samples per micro-batch (default: 64)")
    pipe.add_argument("--repeats", type=int, default=3,
                      help="measured runs per row after a warm-up run; the median is shown")
    pipe.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    tiering = command("tiering", "hot/cold tiering: LFU/LRU/oracle hit rates, bytes and "
                                 "samples/s against the untiered parameter server (one server "
                                 "rank)", benches)
    embeddings = command("embeddings", "one job through replicated, all-to-all (each "
                                       "sharding), PS (1 and 2 servers) and tiered tables: "
                                       "step time, bytes, memory", benches)
    alltoall = command("alltoall", "time alltoallv for each algorithm against native "
                                   "MPI_Alltoallv", benches)
    dlrm = command("dlrm", "hpctrain's training step against a plain-torch DLRM step "
                           "(EmbeddingBag sparse=True, SGD) and the MLP-only bound, "
                           "interleaved in one process", benches)
    data = command("data", "data phase of the Criteo text reader against its HDF5 file "
                           "(hpctrain preprocess), alternating passes", benches)
    _bench_allreduce_args(command("allreduce", "time allreduce for each algorithm against "
                                  "native MPI_Allreduce", benches))
    emulate = command("emulate", "check comm.emulate: extra time of a ping-pong and "
                                 "allreduces over the delay predicted", benches)
    command("calibrate", "measure the cost model's alpha/beta parameters and write them "
                         "(point comm.calibration at the file)", benches).add_argument(
        "--out", default="comm-calibration.json", help="output file (default: %(default)s)")
    if bench_flags:
        _add_bench_flags({"ps": ps, "tiering": tiering, "embeddings": embeddings,
                          "alltoall": alltoall, "dlrm": dlrm, "data": data, "emulate": emulate})
    sub.add_parser("plan", add_help=False,
                   help="predict memory and step time of the job's layouts on a cluster, "
                        "rank them, validate them (`hpctrain plan --help`); `plan calc` "
                        "does the formulas of distributed training")
    trace = sub.add_parser("trace", help="read a timeline written with runtime.trace",
                           description="read a timeline written with runtime.trace")
    trace.set_defaults(job=None, set=[])
    traces = trace.add_subparsers(dest="trace", required=True)
    summarize = traces.add_parser("summarize", help="per phase the time on the critical path, "
                                  "the reductions hidden behind backward, the slowest rank "
                                  "per step")
    summarize.add_argument("file", help="trace JSON file")
    summarize.add_argument("--steps", type=int, default=20,
                           help="step rows to print (default: %(default)s)")
    return parser


def _experiment_args(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="compare run directories: per-group means with 95%% "
                                           "intervals, ratios to a baseline, report.json/.md "
                                           "and plots", description="compare run directories")
    report.add_argument("paths", nargs="+", metavar="RUN_DIR_OR_SWEEP",
                        help="run directories, or folders holding them")
    report.add_argument("--metric", default="heldout", choices=("heldout", "train"),
                        help="curve for the target: periodic held-out evaluation (default) or "
                             "smoothed training loss")
    report.add_argument("--target", type=float, default=None,
                        help="loss to time (default: the loss every run reaches)")
    report.add_argument("--baseline", metavar="KEY=VALUE[,KEY=VALUE...]",
                        help="group the ratios refer to, by one key or several where groups "
                             "differ in more (default: the first group)")
    report.add_argument("--out", help="folder for report.json, report.md and the plots "
                                      "(default: the first path)")


    sweep = sub.add_parser("sweep", help="write a sweep file's job files and Slurm/PBS array "
                                         "scripts (--out), or run them here (--run)",
                           description="write a sweep's jobs and array scripts, or run them")
    sweep.add_argument("sweep_file", nargs="?", metavar="SWEEP.toml")
    sweep.add_argument("--out", metavar="DIR", help="folder for the jobs, scripts and runs")
    sweep.add_argument("--run", metavar="DIR", help="run every task of the sweep in DIR here, "
                                                    "skipping finished runs and resuming "
                                                    "interrupted ones")
    sweep.add_argument("--task", nargs=3, metavar=("DIR", "RANKS", "INDEX"),
                       help="run task INDEX of DIR's RANKS-rank list (what array tasks call)")
    sweep.add_argument("--launcher", default="mpiexec", choices=("mpiexec", "srun"),
                       help="how --run and --task start their ranks (default mpiexec)")


def _sweep(args: argparse.Namespace) -> int:
    from hpctrain.experiments import sweep

    if args.task:
        folder, ranks, index = args.task
        if not (ranks.isdigit() and index.isdigit()):
            raise ConfigError(f"--task {folder} {ranks} {index}: RANKS and INDEX must be "
                              f"integers >= 0")
        task = sweep.task_of(folder, int(ranks), int(index))
        try:
            did = sweep.run_task(task, args.launcher)
        except sweep.Stopped as stop:
            print(f"hpctrain sweep: {stop}", flush=True)
            return stop.code
        print(f"hpctrain sweep: {task.name} ({task.values}): {did}", flush=True)
        return 1 if did.startswith("failed") else 0
    if args.run:
        try:
            return 1 if sweep.run_all(args.run, args.launcher,
                                      lambda line: print(line, flush=True)) else 0
        except sweep.Stopped as stop:
            print(f"hpctrain sweep: {stop}", flush=True)
            return stop.code
    if not (args.sweep_file and args.out):
        raise ConfigError("hpctrain sweep: give SWEEP.toml --out DIR, --run DIR or --task")
    tasks = sweep.write_sweep(args.sweep_file, args.out)
    sizes = sorted({t.ranks for t in tasks})
    print(f"hpctrain sweep: {len(tasks)} runs in {args.out}/jobs; submit with "
          + " ".join(f"sbatch {args.out}/slurm-{w}.sbatch" for w in sizes) + " (or qsub "
          + " ".join(f"{args.out}/pbs-{w}.pbs" for w in sizes) + f"), or run here with "
          f"hpctrain sweep --run {args.out}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from hpctrain.experiments.report import format_report, report_paths, write_report

    report = report_paths(args.paths, args.metric, args.target, args.baseline)
    print(format_report(report))
    written = write_report(report, args.out or args.paths[0])
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _resumed_job(run_dir: str) -> str:
    config = os.path.join(run_dir, "config.toml")
    if not os.path.exists(config):
        raise ConfigError(f"--resume {run_dir}: no config.toml there (not a run directory?)")
    return config


def _command_overrides(args: argparse.Namespace) -> list[str]:
    """Config keys a command's own flags set (they win over --set)."""
    if args.command == "bench" and args.bench == "ps":
        return [f"ps.servers={args.servers}", "train.progress=false"]
    if args.command == "bench" and args.bench == "dlrm":
        return ["train.progress=false"]
    if args.command == "bench" and args.bench == "tiering":
        return ["ps.servers=1", "train.progress=false"]
    if args.command == "compare-sync":
        from hpctrain.experiments.compare import straggler_overrides

        return straggler_overrides(args.stragglers)
    return []


# Count flags of each benchmark that must be at least 1 (0 or less has no run to time).
_POSITIVE_FLAGS = {"allreduce": ("reps",), "alltoall": ("reps",), "emulate": ("reps",),
                   "embeddings": ("steps", "repeat"), "tiering": ("repeat",),
                   "ps": ("tables", "rows", "dim", "batch", "steps")}


def _check_bench_flags(args: argparse.Namespace) -> None:
    """Flag values a benchmark cannot run with, refused before the world is laid out (the
    same on every rank: one line from rank 0, exit 2)."""
    for flag in _POSITIVE_FLAGS.get(args.bench, ()):
        if getattr(args, flag) < 1:
            raise ConfigError(f"bench {args.bench}: --{flag.replace('_', '-')} "
                              f"{getattr(args, flag)}: expected at least 1")
    if args.bench == "embeddings" and not args.hot > 0:
        raise ConfigError(f"bench embeddings: --hot {args.hot}: expected a share of the rows "
                          f"above 0 (the tiered layout needs a hot tier)")
    if args.bench == "allreduce":
        from hpctrain.comm.select import ALGORITHMS
        from hpctrain.comm.types import DTYPES

        known = (*ALGORITHMS, "resident")
        if unknown := [a for a in args.algorithms.split(",") if a and a not in known]:
            raise ConfigError(f"bench allreduce: unknown algorithm(s) {', '.join(unknown)}; "
                              f"choose from {', '.join(known)}")
        item = DTYPES[args.dtype].itemsize
        if odd := [s for s in args.sizes if s % item]:
            raise ConfigError(f"bench allreduce: --sizes {odd[0]} bytes is not a whole number "
                              f"of {args.dtype} elements ({item} bytes each)")


def _add_bench_flags(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """Each benchmark module's own flags, added to its command's parser. Only a ``bench``
    command builds them: the modules import torch and the trainer, which the other commands
    never need, and which take a second or more to import (much more from a parallel file
    system)."""
    from hpctrain.bench import alltoall, data, dlrm, embeddings, emulate, ps, tiering

    for module in (alltoall, data, dlrm, embeddings, emulate, ps, tiering):
        module.add_arguments(parsers[module.__name__.rpartition(".")[2]])


def _bench_allreduce_args(p: argparse.ArgumentParser) -> None:
    def sizes(text: str) -> list[int]:
        from hpctrain.bench.allreduce import parse_sizes

        try:
            return parse_sizes(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p.add_argument("--sizes", type=sizes, default="4KiB-64MiB",
                   help="message sizes: a range of powers of two (4KiB-64MiB, the default) "
                        "or a list (4KiB,1MiB)")
    p.add_argument("--algorithms", default="auto,resident,shm,hierarchical,"
                   "recursive_doubling,halving_doubling,ring,tree,torch",
                   help="cases besides native (default: %(default)s; unavailable ones are "
                        "skipped)")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions (median)")
    p.add_argument("--dtype", default="float32",
                   choices=("float32", "float64", "float16", "bfloat16", "int32", "int64"))
    p.add_argument("--no-fusion", action="store_true", help="skip the tensor-fusion case")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot bus bandwidth against size")


def _train(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.train.job import run_training
    from hpctrain.train.report import print_summary

    summary = run_training(config, topo, resume=bool(args.resume))
    if topo.rank == 0:
        print_summary(summary, topo.workers)
        if summary.stopped_at:
            print(f"hpctrain: stopped by a signal after step {summary.stopped_at} with a "
                  f"checkpoint; continue with: hpctrain train --resume {summary.run_dir} "
                  f"(exit code {EXIT_STOPPED})", flush=True)
    return exit_code(topo.world, bool(summary.stopped_at))


def _info(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.runtime.info import collect_info, format_info

    facts = collect_info(topo)
    if topo.rank == 0:
        print(format_info(facts))
    return 0


def _preprocess(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    if world_rank() != 0:
        return 0
    from hpctrain.data.preprocess import preprocess

    result = preprocess(config.data, args.out, progress=config.train.progress)
    print(f"hpctrain: wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in result.items()))
    return 0


def _bench_ps(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.bench import ps as bench_ps
    from hpctrain.bench.report import print_rows, write_json

    rows = bench_ps.run(args, topo)
    if rows is not None:
        servers = [r for r in rows if r["mode"] == "server"]
        print_rows([r for r in rows if r["mode"] != "server"],
                   ["mode", "prefetch", "rows_per_s", "baseline_rows_per_s",
                    "ratio_to_baseline", "bytes_per_step", "bytes_ratio",
                    "server_memory_ratio"])
        print_rows(servers, ["mode", "rank", "workers", "threads", "rows_per_s",
                             "busy_fraction", "busy_s", "busy_cpu_s", "pulls", "pushes"])
        if args.json:
            write_json(args.json, rows)
            print(f"wrote {len(rows)} rows to {args.json}")
    return 0


def _bench_tiering(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.bench import tiering as bench_tiering
    from hpctrain.bench.report import print_rows

    rows = bench_tiering.run(args, config, topo)
    if rows is not None:
        print_rows(rows, bench_tiering.COLUMNS, args.json)
        print(bench_tiering.notes(rows))
    return 0


def _bench_dlrm(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.bench import dlrm as bench_dlrm
    from hpctrain.bench.report import print_rows

    rows = bench_dlrm.run(args, config, topo)
    print_rows(rows, bench_dlrm.COLUMNS, args.json)
    for row in rows:
        if "overhead" in row:
            print(f"trace overhead at batch {row['batch']}: traced/untraced step time "
                  f"{row['overhead']:.3f}")
    return 0


def _bench_data(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    if world_rank() != 0:
        return 0
    from hpctrain.bench import data as bench_data
    from hpctrain.bench.report import print_rows

    print_rows(bench_data.run(args, config), bench_data.COLUMNS, args.json)
    return 0


def _compare_sync(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.experiments.compare import compare_sync, format_comparison
    from hpctrain.runtime.waits import Wait
    from hpctrain.train.rundir import default_run_dir

    out = args.out or default_run_dir().replace("runs/", "runs/compare-")
    with Wait("bcast", topo.world):
        out = topo.world.bcast(out, root=0)
    result = compare_sync(config, topo, args.models, out, args.target_loss, args.repeats)
    if result is not None and args.repeats > 1:
        from hpctrain.experiments.report import format_report

        print(format_report(result))
        print(f"wrote {out}/report.json, report.md, curves.png and time_to_target.png")
    elif result is not None:
        print(format_comparison(result))
        print(f"wrote {out}/summary.json and {out}/loss.png")
    return 0


def _config(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    if world_rank() == 0:
        print(doc_table() if args.doc else dump_toml(config), end="")
    return 0


def _trace(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    if world_rank() != 0:
        return 0
    from hpctrain.runtime.trace_summary import format_summary, load_events, summarize

    print(format_summary(summarize(load_events(args.file)), args.steps))
    return 0


def _bench(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    return _BENCHES[args.bench](args, config, topo)


def _bench_pipeline(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.bench.pipeline import PipelineBench, format_rows, write_json

    bench = PipelineBench(tuple(args.p), tuple(args.m), tuple(args.schedules), args.width,
                          args.layers, args.micro_batch, args.repeats)
    try:
        bench.check(topo.workers)
    except HpctrainError as exc:  # identical on every rank, before any message
        if topo.rank == 0:
            print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR
    rows = bench.run(topo)
    if rows is not None:
        print(format_rows(rows), flush=True)
        if args.json:
            write_json(args.json, rows, bench, topo)
    return 0


def _bench_embeddings(args: argparse.Namespace, config: JobConfig,
                      topo: Topology | None) -> int:
    from hpctrain.bench import embeddings as bench_embeddings
    from hpctrain.bench.report import print_rows

    rows = bench_embeddings.run(args, config, topo)
    if rows is not None:
        print_rows(rows, bench_embeddings.COLUMNS, args.json)
        print(bench_embeddings.speed_note(rows))
    return 0


def _bench_alltoall(args: argparse.Namespace, config: JobConfig,
                    topo: Topology | None) -> int:
    from hpctrain.bench import alltoall as bench_alltoall
    from hpctrain.bench.report import print_rows
    from hpctrain.comm import Group

    group = Group(topo.role_comm, config.comm)
    rows = bench_alltoall.run(args, group)
    if rows is not None:
        print_rows(rows, bench_alltoall.COLUMNS, args.json)
    group.free()
    return 0


def _bench_emulate(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.bench import emulate as bench_emulate
    from hpctrain.bench.report import print_rows

    rows = bench_emulate.run(args, topo)
    if rows is not None:
        print_rows(rows, bench_emulate.COLUMNS, args.json)
    return 0


def _bench_comm(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.comm.owner import communicators

    group = communicators(topo).over(topo.world)
    if args.bench == "calibrate":
        from hpctrain.bench.calibrate import run_calibrate

        run_calibrate(group, args.out, echo=print)
    else:
        from hpctrain.bench.allreduce import run_allreduce

        run_allreduce(group, args.sizes, [a for a in args.algorithms.split(",") if a],
                      args.reps, args.dtype, not args.no_fusion, args.json, args.plot,
                      echo=print)
    communicators(topo).release(group)
    return 0


_COMMANDS = {"train": _train, "info": _info, "preprocess": _preprocess, "config": _config,
             "bench": _bench, "compare-sync": _compare_sync, "trace": _trace}
_BENCHES = {"ps": _bench_ps, "pipeline": _bench_pipeline, "tiering": _bench_tiering,
            "allreduce": _bench_comm, "calibrate": _bench_comm, "alltoall": _bench_alltoall,
            "embeddings": _bench_embeddings, "dlrm": _bench_dlrm, "data": _bench_data,
            "emulate": _bench_emulate}
_OFFLINE = {"report": _report, "sweep": _sweep}
_NEEDS_WORLD = {"train", "info", "bench", "compare-sync"}

if __name__ == "__main__":
    sys.exit(main())
