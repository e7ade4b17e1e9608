"""``hpctrain``: the command line. Every command runs on every rank of an MPI launch.

    mpiexec -n 4 hpctrain train                       # the embedded default job
    mpiexec -n 2 hpctrain train jobs/configs/criteo_sample.toml --set train.lr=0.05
    mpiexec -n 2 hpctrain info
    mpiexec -n 4 hpctrain bench tiering --json tiering.json   # 1 server + 3 workers
    hpctrain preprocess jobs/configs/criteo_sample.toml --out sample.h5
    hpctrain config [JOB.toml] [--doc]

A config error is found identically on every rank before any message is exchanged: rank 0
prints it as one line and every rank exits with code 2. Once ranks communicate, an error on
any rank ends the whole job (see :mod:`hpctrain.runtime.abort`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from hpctrain.config import JobConfig, doc_table, dump_toml, load_config
from hpctrain.errors import HpctrainError
from hpctrain.runtime.abort import USER_ERROR, run_guarded, world_rank
from hpctrain.runtime.log import setup_logging
from hpctrain.runtime.world import Topology, build_topology

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.job, [*args.set, *_bench_overrides(args)])
        setup_logging(world_rank(), config.runtime.log_level)
        topo = build_topology(config) if args.command in _NEEDS_WORLD else None
    except HpctrainError as exc:
        if world_rank() == 0:
            print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR
    command: Callable[[argparse.Namespace, JobConfig, Topology | None], int] = _COMMANDS[
        args.command]
    return run_guarded(lambda: command(args, config, topo))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpctrain", description="Distributed DLRM training over MPI "
                                     "(launch with mpiexec/srun; see README.md).")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("job", nargs="?", help="TOML job file (default: the embedded job)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.batch_size=256")
        return p

    command("train", "train the job's DLRM on this MPI world")
    command("info", "print the MPI world, roles, threads, torch/CUDA/NCCL and allocation")
    pre = command("preprocess", "convert the job's Criteo text files into one HDF5 file")
    pre.add_argument("--out", required=True, help="output .h5 path (written atomically)")
    cfg = command("config", "print the resolved job as TOML")
    cfg.add_argument("--doc", action="store_true", help="print the table of all config keys")
    bench = sub.add_parser("bench", help="benchmarks, with ratios to a baseline measured in "
                                         "the same run")
    bench.set_defaults(job=None, set=[])
    kinds = bench.add_subparsers(dest="bench", required=True)
    ps = kinds.add_parser("ps", help="parameter-server pull/push rows/s and bytes per step "
                                     "against torch EmbeddingBag(sparse=True)")
    ps.add_argument("--servers", type=int, default=1, help="server ranks (default 1)")
    from hpctrain.bench import ps as bench_ps

    bench_ps.add_arguments(ps)
    tiering = kinds.add_parser("tiering", help="hot/cold tiering: LFU/LRU/oracle hit rates, "
                                               "bytes and samples/s against the untiered "
                                               "parameter server (one server rank)")
    from hpctrain.bench import tiering as bench_tiering

    bench_tiering.add_arguments(tiering)
    return parser


def _bench_overrides(args: argparse.Namespace) -> list[str]:
    if args.command == "bench" and args.bench == "ps":
        return [f"ps.servers={args.servers}", "train.progress=false"]
    if args.command == "bench" and args.bench == "tiering":
        return ["ps.servers=1", "train.progress=false"]
    return []


def _train(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.train.report import print_summary
    from hpctrain.train.trainer import run_training

    summary = run_training(config, topo)
    if topo.rank == 0:
        print_summary(summary, topo.workers)
    return 0


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


def _bench(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.bench.report import print_rows

    if args.bench == "ps":
        from hpctrain.bench import ps as bench_ps

        rows = bench_ps.run(args, topo)
        columns = ["mode", "prefetch", "rows_per_s", "baseline_rows_per_s", "ratio_to_baseline",
                   "bytes_per_step", "bytes_ratio", "server_memory_ratio"]
    else:
        from hpctrain.bench import tiering as bench_tiering

        rows = bench_tiering.run(args, config, topo)
        columns = bench_tiering.COLUMNS
    if rows is not None:
        print_rows(rows, columns, args.json)
    return 0


def _config(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    if world_rank() == 0:
        print(doc_table() if args.doc else dump_toml(config), end="")
    return 0


_COMMANDS = {"train": _train, "info": _info, "preprocess": _preprocess, "config": _config,
             "bench": _bench}
_NEEDS_WORLD = {"train", "info", "bench"}

if __name__ == "__main__":
    sys.exit(main())
