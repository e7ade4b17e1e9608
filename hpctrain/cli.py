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

from hpctrain.config import JobConfig, doc_table, dump_toml, load_config
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.runtime.abort import USER_ERROR, run_guarded, world_rank
from hpctrain.runtime.log import setup_logging
from hpctrain.runtime.preempt import EXIT_STOPPED, exit_code
from hpctrain.runtime.world import Topology, build_topology
from hpctrain.sync.models import parse_models

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # its own parser: `plan calc ...` beside `plan [JOB.toml]`
        from hpctrain.plan.cli import main as plan_main

        return plan_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        job, overrides = args.job, [*args.set, *_command_overrides(args)]
        if getattr(args, "resume", None):
            job = job or _resumed_job(args.resume)
            overrides.append(f"train.run_dir={args.resume!r}")
        config = load_config(job, overrides)
        if args.command == "compare-sync":
            parse_models(args.models)
            if not config.ps.servers:  # sync models govern parameter-server tables
                config = load_config(args.job, ["ps.servers=1", "ps.mode='full'", *args.set,
                                                *_command_overrides(args)])
        setup_logging(world_rank(), config.runtime.log_level)
        topo = build_topology(config) if args.command in _NEEDS_WORLD else None
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


def _parser() -> argparse.ArgumentParser:
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
                         help="comma-separated: bsp, ssp:S, asp (default bsp,ssp:2,ssp:8,asp)")
    compare.add_argument("--stragglers", default="none",
                         help="none, transient:P:FACTOR or persistent:WORKER[+WORKER]:FACTOR")
    compare.add_argument("--target-loss", type=float, default=None,
                         help="training loss to time (default: 1.01 x the first model's final)")
    compare.add_argument("--out", default=None,
                         help="results folder (default runs/compare-<date-time>)")
    cfg = command("config", "print the resolved job as TOML")
    cfg.add_argument("--doc", action="store_true", help="print the table of all config keys")
    bench = sub.add_parser("bench", help="measure a part of the toolkit on this MPI world "
                                         "(ratios to a baseline measured in the same run)",
                           description="measure a part of the toolkit on this MPI world")
    benches = bench.add_subparsers(dest="bench", required=True)
    ps = command("ps", "parameter-server pull/push rows/s and bytes per step against torch "
                       "EmbeddingBag(sparse=True)", benches)
    ps.add_argument("--servers", type=int, default=1, help="server ranks (default 1)")
    from hpctrain.bench import ps as bench_ps

    bench_ps.add_arguments(ps)
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
    from hpctrain.bench import tiering as bench_tiering

    bench_tiering.add_arguments(tiering)
    _bench_allreduce_args(command("allreduce", "time allreduce for each algorithm against "
                                  "native MPI_Allreduce", benches))
    command("calibrate", "measure the cost model's alpha/beta parameters and write them "
                         "(point comm.calibration at the file)", benches).add_argument(
        "--out", default="comm-calibration.json", help="output file (default: %(default)s)")
    sub.add_parser("plan", add_help=False,
                   help="predict memory and step time of the job's layouts on a cluster, "
                        "rank them, validate them (`hpctrain plan --help`); `plan calc` "
                        "does the formulas of distributed training")
    return parser


def _resumed_job(run_dir: str) -> str:
    config = os.path.join(run_dir, "config.toml")
    if not os.path.exists(config):
        raise ConfigError(f"--resume {run_dir}: no config.toml there (not a run directory?)")
    return config


def _command_overrides(args: argparse.Namespace) -> list[str]:
    """Config keys a command's own flags set (they win over --set)."""
    if args.command == "bench" and args.bench == "ps":
        return [f"ps.servers={args.servers}", "train.progress=false"]
    if args.command == "bench" and args.bench == "tiering":
        return ["ps.servers=1", "train.progress=false"]
    if args.command == "compare-sync":
        from hpctrain.train.compare import straggler_overrides

        return straggler_overrides(args.stragglers)
    return []


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
    from hpctrain.bench.report import print_rows

    rows = bench_ps.run(args, topo)
    if rows is not None:
        print_rows(rows, ["mode", "prefetch", "rows_per_s", "baseline_rows_per_s",
                          "ratio_to_baseline", "bytes_per_step", "bytes_ratio",
                          "server_memory_ratio"], args.json)
    return 0


def _bench_tiering(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.bench import tiering as bench_tiering
    from hpctrain.bench.report import print_rows

    rows = bench_tiering.run(args, config, topo)
    if rows is not None:
        print_rows(rows, bench_tiering.COLUMNS, args.json)
    return 0


def _compare_sync(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.train.compare import compare_sync, format_comparison
    from hpctrain.train.rundir import default_run_dir

    out = args.out or default_run_dir().replace("runs/", "runs/compare-")
    out = topo.world.bcast(out, root=0)
    result = compare_sync(config, topo, args.models, out, args.target_loss)
    if result is not None:
        print(format_comparison(result))
        print(f"wrote {out}/summary.json and {out}/loss.png")
    return 0


def _config(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    if world_rank() == 0:
        print(doc_table() if args.doc else dump_toml(config), end="")
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
             "bench": _bench, "compare-sync": _compare_sync}
_BENCHES = {"ps": _bench_ps, "pipeline": _bench_pipeline, "tiering": _bench_tiering,
            "allreduce": _bench_comm, "calibrate": _bench_comm}
_NEEDS_WORLD = {"train", "info", "bench", "compare-sync"}

if __name__ == "__main__":
    sys.exit(main())
