"""What the `radixserve bench` subcommands share: workload arguments and loading, output
files, progress bars and status lines."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
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
        group.add_argument("--trace", type=existing_file, help="Mooncake trace (JSONL) to replay")
    parser.add_argument("--workload-args", default="", metavar="K=V,...",
                        help="generator overrides, e.g. num_groups=8,prompts_per_group=4")
    parser.add_argument("--limit", type=positive_int, default=None, metavar="N", help="first N requests only")
    parser.add_argument("--request-rate", type=positive_float, default=None,
                        help="Poisson arrivals at this many requests/s (synthetic workloads arrive at t=0 otherwise)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")


def add_api_key_arg(parser: argparse.ArgumentParser, to: str = "the server") -> None:
    """`--api-key`, by default $RADIXSERVE_API_KEY (`bench serve`, `bench peers`)."""
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                        help=f"sent to {to} as 'Authorization: Bearer KEY' (default: $RADIXSERVE_API_KEY, "
                             "else none)")


def _checked_int(text: str, ok: Callable[[int], bool], expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse `type`: an integer >= 1."""
    return _checked_int(text, lambda value: value >= 1, "a positive integer")


def positive_float(text: str) -> float:
    """An argparse `type`: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def power_of_two(text: str) -> int:
    """An argparse `type`: 1, 2, 4, 8, ... (a page size)."""
    return _checked_int(text, lambda value: value >= 1 and not value & (value - 1), "a power of two")


def token_counts(minimum: int) -> Callable[[str], list[int]]:
    """An argparse `type`: '0.5M,1M' -> [500000, 1000000], each at least `minimum`."""
    from radixserve.benchmark.report import parse_tokens

    def parse(text: str) -> list[int]:
        try:
            counts = [parse_tokens(part) for part in text.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < minimum:
            raise argparse.ArgumentTypeError(f"expected token counts of at least {minimum} such as 64k or "
                                             f"0.5M,1M, got {text!r}")
        return counts

    parse.__name__ = "token counts"
    return parse


def positive_ints(text: str) -> list[int]:
    """An argparse `type`: '1,4' -> [1, 4], each >= 1."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,4, got {text!r}")
    return values


def token_count(minimum: int) -> Callable[[str], int]:
    """An argparse `type`: '8M' -> 8000000, at least `minimum`."""
    counts = token_counts(minimum)

    def parse(text: str) -> int:
        values = counts(text)
        if len(values) != 1:
            raise argparse.ArgumentTypeError(f"expected one token count such as 8M, got {text!r}")
        return values[0]

    parse.__name__ = "token count"
    return parse


def names_among(choices: list[str]) -> Callable[[str], list[str]]:
    """An argparse `type`: 'a,b' -> ['a', 'b'], each one of `choices`."""
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",")]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected names among {', '.join(choices)}, got {text!r}")
        return names

    parse.__name__ = "names"
    return parse


def existing_file(text: str) -> Path:
    """An argparse `type`: a path to a readable file (a trace), checked as the command line is
    read rather than as a traceback once the command runs."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {'is a directory' if path.is_dir() else 'no such file'}")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return path


def output_file(text: str) -> Path:
    """An argparse `type`: a path the command can write when it ends (--json, --markdown,
    --plot): its nearest existing directory takes a new file. Checked before the run, so a
    typo does not lose a run of minutes after it; nothing is created here."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory")
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(f"{ancestor} is not a directory")
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{text}: cannot write there ({error.strerror or error})") from None
    return path


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
        try:
            workload = mooncake_trace(args.trace, limit=args.limit, vocab_size=getattr(args, "vocab_size", None))
        except OSError as error:
            raise ValueError(f"--trace {args.trace}: {error.strerror or error}") from error
        except KeyError as error:
            raise ValueError(f"--trace {args.trace}: a record has no {error} (a Mooncake trace's records have "
                             "timestamp, input_length, output_length and hash_ids)") from error
        except (ValueError, TypeError) as error:  # not JSON, or a field of the wrong type
            raise ValueError(f"--trace {args.trace}: {error}") from error
    else:
        overrides = parse_workload_args(args.workload_args)
        check_workload_args(args.workload, overrides)
        try:
            workload = make_workload(args.workload, **{"seed": args.seed, **extra, **overrides})
        except (TypeError, ValueError) as error:  # num_groups=2.5, system_len=abc
            raise ValueError(f"--workload-args {args.workload_args!r}: {error}") from error
        if args.limit is not None:
            workload = Workload(workload.name, workload.requests[: args.limit], workload.params)
    if not workload.requests:
        # An empty run measured nothing, yet reported an all-0% table with rc 0.
        raise ValueError(f"the workload has no requests (--workload-args {args.workload_args!r})"
                         if getattr(args, "trace", None) is None else f"--trace {args.trace}: no requests")
    if args.request_rate is not None:
        workload = with_poisson_arrivals(workload, args.request_rate, seed=args.seed)
    return workload


def check_workload_args(name: str, overrides: dict[str, Any]) -> None:
    """ValueError naming the keywords of `--workload-args` that workload `name`'s generator
    does not take (and those it does)."""
    parameters = inspect.signature(WORKLOADS[name]).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return  # a generator that forwards its keywords: it reports them itself
    taken = [p for p in parameters if p != "seed"]
    unknown = [key for key in overrides if key not in parameters]
    if unknown:
        raise ValueError(f"--workload-args: {name} takes no {', '.join(map(repr, unknown))} "
                         f"(it takes: {', '.join(taken)})")


def write_json(path: Path, obj: Any) -> None:
    """Writes `obj` as strict JSON: an infinite or undefined figure (an imbalance of ∞, a NaN
    percentile) becomes null, since the bare Infinity/NaN tokens Python writes by default are
    not JSON (JSON.parse, Go, serde_json reject the file); numpy values become plain ones."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite_json(obj), indent=2, allow_nan=False) + "\n")


def finite_json(value: Any) -> Any:
    """`value` with numpy arrays and scalars made plain and non-finite floats made None."""
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(item) for item in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str | int | bool) or value is None:
        return value
    if hasattr(value, "tolist"):  # numpy array or scalar
        return finite_json(value.tolist())
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


INTERRUPTED = 130  # the exit status of a command ended by Ctrl-C (128 + SIGINT)


def interruptible(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A `bench` handler that ends on Ctrl-C with one line and exit status 130 instead of a
    KeyboardInterrupt traceback (the servers a command launched are stopped by their own
    `finally` on the way out)."""
    def handler(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except KeyboardInterrupt:
            say("interrupted: no results kept" + (f" (nothing written to {args.json})"
                                                  if getattr(args, "json", None) else ""))
            return INTERRUPTED

    handler.__name__ = handler.__qualname__ = command.__name__
    handler.__doc__ = command.__doc__
    return handler


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
