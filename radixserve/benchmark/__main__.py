"""`python -m radixserve.benchmark MODE ...`: the `radixserve bench` subcommands on their own."""

from __future__ import annotations

import argparse

from radixserve.benchmark.cli import add_bench_parser


def main() -> int:
    """Parses `MODE ...` as `radixserve bench MODE ...` would and runs it."""
    parser = argparse.ArgumentParser(prog="python -m radixserve.benchmark")
    # The bench parser's own name is the module's: its usage lines read "python -m
    # radixserve.benchmark simulate ...", a command that runs (not "... benchmark bench simulate").
    add_bench_parser(parser.add_subparsers(dest="command", required=True), prog="python -m radixserve.benchmark")
    args = parser.parse_args(["bench", *__import__("sys").argv[1:]])
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
