"""``hpctrain plan``: the planner's command line (``hpctrain.cli`` hands it the arguments).

    hpctrain plan jobs/configs/default.toml --nodes 1 --ranks-per-node 4
    hpctrain plan JOB.toml --cluster cluster.toml --json --write best.toml
    mpiexec -n 2 hpctrain plan JOB.toml --validate          # predicted against measured
    hpctrain plan calc zero --params 7B --stage 3 --dp 64
    hpctrain plan calc allreduce --bytes 100MiB --ranks 8 --latency 2us --bandwidth 200Gb/s

Bad input is one line on stderr and exit code 2, as everywhere in hpctrain.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from hpctrain.config import JobConfig, dump_toml, load_config
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.plan.calc import add_calc_parsers, format_results, run_calc
from hpctrain.plan.cluster import Cluster, load_cluster, machine_cluster
from hpctrain.plan.proposals import plan
from hpctrain.plan.report import format_plan, plan_json, shortfall
from hpctrain.plan.types import Prediction

__all__ = ["main", "cluster_of", "write_job"]

USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, exit 2 (argparse prints the whole usage otherwise)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USER_ERROR, f"{self.prog}: error: {message}\n")


def _calc_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpctrain plan calc",
                     description="formulas of distributed training, with named inputs")
    add_calc_parsers(parser.add_subparsers(dest="formula", required=True,
                                           parser_class=_Parser))
    return parser


def _plan_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hpctrain plan",
                description="predict per-rank memory and step time of every layout of the job "
                            "on a cluster and rank them (`hpctrain plan calc --help`: the "
                            "formulas)")
    p.add_argument("job", nargs="?", help="TOML job file (default: the embedded job)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job key, as for `hpctrain train`")
    p.add_argument("--cluster", metavar="FILE.toml", help="cluster description (README: "
                   "Planning a layout); keys it omits come from this machine")
    p.add_argument("--nodes", type=int, help="nodes (without --cluster: of this machine)")
    p.add_argument("--ranks-per-node", type=int, help="ranks per node")
    p.add_argument("--calibration", metavar="FILE", help="`hpctrain bench calibrate` output "
                   "for the links (without --cluster)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--top", type=int, default=3, help="layouts whose ranks are detailed "
                   "(default 3)")
    p.add_argument("--write", metavar="JOB.toml", help="write the best layout as a job file")
    p.add_argument("--validate", action="store_true", help="under mpiexec: run the top "
                   "layouts briefly on the launched ranks and compare with the predictions")
    p.add_argument("--steps", type=int, default=20, help="--validate: steps per run "
                   "(default 20)")
    p.add_argument("--runs", type=int, default=3, help="--validate: layouts run, the job's "
                   "own first, then the best predicted (default 3)")
    return p


def main(argv: Sequence[str]) -> int:
    """Run ``hpctrain plan ARGV``; the exit code."""
    argv = list(argv)
    try:
        if argv[:1] == ["calc"]:
            args = _calc_parser().parse_args(argv[1:])
            print(format_results(run_calc(args.formula, args), args.json))
            return 0
        args = _plan_parser().parse_args(argv)
        if args.validate:  # ranks communicate: an error on one ends the job
            from hpctrain.plan.validate import run_validate
            from hpctrain.runtime.abort import run_guarded

            return run_guarded(lambda: run_validate(args))
        return _plan(args)
    except HpctrainError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR


def cluster_of(args: argparse.Namespace, ranks: int | None = None) -> Cluster:
    """The cluster the flags describe: a file, or this machine ``--nodes x
    --ranks-per-node`` (default: one node of ``ranks``, or of this machine's cores)."""
    if args.cluster:
        if args.nodes or args.ranks_per_node or args.calibration:
            raise ConfigError("--cluster: give the sizes in the file, not also --nodes, "
                              "--ranks-per-node or --calibration")
        return load_cluster(args.cluster)
    for flag in ("nodes", "ranks_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be >= 1, got {value}")
    return machine_cluster(args.nodes or 1, args.ranks_per_node or ranks or os.cpu_count() or 1,
                           args.calibration)


def _plan(args: argparse.Namespace) -> int:
    config = load_config(args.job, args.set)
    cluster = cluster_of(args)
    predictions = plan(config, cluster, args.job, args.set)
    fits = [q for q in predictions if q.feasible]
    print(plan_json(predictions, cluster) if args.json else
          format_plan(predictions, cluster, args.top), flush=True)
    if not fits:
        raise ConfigError(shortfall(predictions, cluster))
    if args.write:
        write_job(args.write, config, args.job, args.set, fits[0])
        if not args.json:
            print(f"wrote {args.write}: {fits[0].proposal.name} "
                  f"(run it with `mpiexec -n {cluster.ranks} hpctrain train {args.write}`)")
    return 0


def write_job(path: str, config: JobConfig, job: str | None, overrides: Sequence[str],
              best: Prediction) -> None:
    """The job with ``best``'s layout, as a TOML file ``hpctrain train`` loads (atomic)."""
    resolved = load_config(job, [*overrides, *best.proposal.overrides()], env={})
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(f"# hpctrain plan: {best.proposal.name}, predicted "
                   f"{best.samples_per_s:,.0f} samples/s\n" + dump_toml(resolved),
                   encoding="utf-8")
    tmp.replace(out)
