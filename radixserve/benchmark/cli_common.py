"""What the `radixserve bench` subcommands share: workload arguments and loading, output
files, progress bars and status lines."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from radixserve.benchmark.workloads import (
    WORKLOADS,
    Workload,
    make_workload,
    mooncake_trace,
    with_poisson_arrivals,
)


def add_workload_args(parser: argparse.ArgumentParser, *, trace: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--workload", choices=sorted(WORKLOADS), help="synthetic workload")
    if trace:
        group.add_argument("--trace", type=Path, help="Mooncake trace (JSONL) to replay")
    parser.add_argument("--workload-args", default="", metavar="K=V,...",
                        help="generator overrides, e.g. num_groups=8,prompts_per_group=4")
    parser.add_argument("--limit", type=positive_int, default=None, metavar="N", help="first N requests only")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="Poisson arrivals at this many requests/s (synthetic workloads arrive at t=0 otherwise)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")


def positive_int(text: str) -> int:
    """An argparse `type`: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_workload_args(text: str) -> dict[str, Any]:
    """'a=1,b=0.5,c=true,d=x' -> {'a': 1, 'b': 0.5, 'c': True, 'd': 'x'}."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--workload-args: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = _parse_value(value.strip())
    return out


def _parse_value(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def load_workload(args: argparse.Namespace, **extra: Any) -> Workload:
    """The workload the command line describes."""
    if getattr(args, "trace", None) is not None:
        workload = mooncake_trace(args.trace, limit=args.limit, vocab_size=getattr(args, "vocab_size", None))
    else:
        params = {"seed": args.seed, **extra, **parse_workload_args(args.workload_args)}
        workload = make_workload(args.workload, **params)
        if args.limit is not None:
            workload = Workload(workload.name, workload.requests[: args.limit], workload.params)
    if args.request_rate is not None:
        workload = with_poisson_arrivals(workload, args.request_rate, seed=args.seed)
    return workload


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def progress_bar(total: int, desc: str):  # -> tqdm
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)


def say(message: str, bar: Any = None) -> None:
    """A status line on stderr; with a progress `bar` running, on a line of its own above it."""
    line = f"radixserve bench: {message}"
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)
