"""The `radixserve` command: `serve` runs the OpenAI-compatible server, `bench` the benchmarks.

This module builds the parser and dispatches; `serve`'s flags are cli_serve_flags.py's and
its command cli_serve.py's (their public names are importable from here too), the `bench`
subcommands radixserve/benchmark/cli.py's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from radixserve.cli_serve import (
    GRACEFUL_SHUTDOWN_S,
    BoundedServer,
    cache_hash_secret,
    engine_options,
    serve_command,
    tenant_keys,
)
from radixserve.cli_serve_flags import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_REQUEST_TOKENS,
    DEFAULT_PORT,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    DEFAULT_TURN_MEMORY_TOKENS,
    DEPRECATED_FLAGS,
    add_serve_parser,
)

__all__ = [
    "DEFAULT_BODY_TIMEOUT_S", "DEFAULT_HEAD_TIMEOUT_S", "DEFAULT_HOST", "DEFAULT_KEEP_ALIVE_S",
    "DEFAULT_MAX_REQUEST_TOKENS", "DEFAULT_PORT", "DEFAULT_SHUTDOWN_TIMEOUT_S", "DEFAULT_STALL_TIMEOUT_S",
    "DEFAULT_TURN_MEMORY_TOKENS", "DEPRECATED_FLAGS", "GRACEFUL_SHUTDOWN_S", "BoundedServer",
    "build_parser", "cache_hash_secret", "engine_options", "main", "serve_command", "tenant_keys",
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `radixserve` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="radixserve",
        description="LLM serving runtime with a radix-tree prefix cache over paged KV memory.")
    parser.add_argument("--version", action="version", version=f"radixserve {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve_parser(subparsers)
    _add_bench_parser_if_present(subparsers)
    return parser


def _add_bench_parser_if_present(subparsers: argparse._SubParsersAction) -> None:
    # Imported here: the benchmark package is optional for serving and pulls in plotting.
    try:
        from radixserve.benchmark.cli import add_bench_parser
    except ModuleNotFoundError as exc:
        if exc.name in ("radixserve.benchmark", "radixserve.benchmark.cli"):
            return
        raise
    add_bench_parser(subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `radixserve` console script."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.handler(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixserve")
    except PackageNotFoundError:
        return "unknown (not installed)"
