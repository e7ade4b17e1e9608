"""``hpctrain``: the command line. Every command runs on every rank of an MPI launch.

    mpiexec -n 4 hpctrain train                       # the embedded default job
    mpiexec -n 2 hpctrain train jobs/configs/criteo_sample.toml --set train.lr=0.05
    mpiexec -n 2 hpctrain info
    hpctrain preprocess jobs/configs/criteo_sample.toml --out sample.h5
    hpctrain config [JOB.toml] [--doc]
    mpiexec -n 4 hpctrain bench allreduce --json out.json --plot out.png
    mpiexec -n 4 hpctrain bench calibrate --out comm.json

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
        config = load_config(args.job, args.set)
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

    def command(name: str, help: str, parent: argparse._SubParsersAction = sub
                ) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help, description=help)
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
    benches = sub.add_parser("bench", help="measure parts of the toolkit on this MPI world",
                             description="measure parts of the toolkit on this MPI world"
                             ).add_subparsers(dest="bench", required=True)
    _bench_allreduce_args(command("allreduce", "time allreduce for each algorithm against "
                                  "native MPI_Allreduce", benches))
    command("calibrate", "measure the cost model's alpha/beta parameters and write them "
                         "(point comm.calibration at the file)", benches).add_argument(
        "--out", default="comm-calibration.json", help="output file (default: %(default)s)")
    return parser


def _bench_allreduce_args(p: argparse.ArgumentParser) -> None:
    def sizes(text: str) -> list[int]:
        from hpctrain.comm.bench import parse_sizes

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
    from hpctrain.train.report import print_summary
    from hpctrain.train.trainer import Trainer

    summary = Trainer(config, topo).fit()
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


def _config(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    if world_rank() == 0:
        print(doc_table() if args.doc else dump_toml(config), end="")
    return 0


def _bench(args: argparse.Namespace, config: JobConfig, topo: Topology | None) -> int:
    from hpctrain.comm import Group

    group = Group(topo.world, config.comm)
    if args.bench == "calibrate":
        from hpctrain.comm.calibrate import run_calibrate

        run_calibrate(group, args.out, echo=print)
    else:
        from hpctrain.comm.bench import run_allreduce

        run_allreduce(group, args.sizes, [a for a in args.algorithms.split(",") if a],
                      args.reps, args.dtype, not args.no_fusion, args.json, args.plot,
                      echo=print)
    group.free()
    return 0


_COMMANDS = {"train": _train, "info": _info, "preprocess": _preprocess, "config": _config,
             "bench": _bench}
_NEEDS_WORLD = {"train", "info", "bench"}

if __name__ == "__main__":
    sys.exit(main())
