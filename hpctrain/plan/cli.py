"""``hpctrain plan``: the planner's command line (``hpctrain.cli`` hands it the arguments).

    hpctrain plan calc zero --params 7B --stage 3 --dp 64
    hpctrain plan calc allreduce --bytes 100MiB --ranks 8 --latency 2us --bandwidth 200Gb/s

Bad input is one line on stderr and exit code 2, as everywhere in hpctrain.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from hpctrain.errors import HpctrainError
from hpctrain.plan.calc import add_calc_parsers, format_results, run_calc

__all__ = ["main"]

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


def main(argv: Sequence[str]) -> int:
    """Run ``hpctrain plan ARGV``; the exit code."""
    argv = list(argv)
    try:
        if argv[:1] == ["calc"]:
            args = _calc_parser().parse_args(argv[1:])
            print(format_results(run_calc(args.formula, args), args.json))
            return 0
        raise HpctrainError("plan: only `hpctrain plan calc` is available")
    except HpctrainError as exc:
        print(f"hpctrain plan: error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR
