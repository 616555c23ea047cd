"""`radixserve bench {simulate,serve,compare,tiers,matrix,peers}`: the parser; each subcommand lives in
its own module (cli_simulate, cli_serve, cli_compare: compare and tiers, cli_matrix, cli_peers), with
what they share in cli_common."""

from __future__ import annotations

import argparse

from radixserve.benchmark.cli_common import load_workload, parse_workload_args
from radixserve.benchmark.cli_compare import _add_compare, _add_tiers, _report_failures
from radixserve.benchmark.cli_matrix import _add_matrix
from radixserve.benchmark.cli_peers import _add_peers
from radixserve.benchmark.cli_serve import _add_serve
from radixserve.benchmark.cli_simulate import EVICTION_POLICIES, _add_simulate

__all__ = ["EVICTION_POLICIES", "_report_failures", "add_bench_parser", "load_workload", "parse_workload_args"]


def add_bench_parser(subparsers: argparse._SubParsersAction, prog: str | None = None) -> None:
    """Adds `bench` and its subcommands to the top-level `radixserve` parser; `prog`: the name
    its usage lines give the command (default: `radixserve bench`)."""
    bench = subparsers.add_parser("bench", help="prefix-hit-rate benchmarks (simulated or against a server)",
                                  **({"prog": prog} if prog else {}),
                                  description="Prefix-cache benchmarks: simulate the cache offline, drive a "
                                              "running server, or compare cache on/off/transformers.")
    sub = bench.add_subparsers(dest="bench_command", metavar="MODE", required=True)
    _add_simulate(sub)
    _add_serve(sub)
    _add_compare(sub)
    _add_tiers(sub)
    _add_matrix(sub)
    _add_peers(sub)
