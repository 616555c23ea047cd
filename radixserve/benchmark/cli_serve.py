"""`radixserve bench serve`: its arguments and the command."""

from __future__ import annotations

import argparse
import asyncio

from radixserve.benchmark.cli_common import (
    INTERRUPTED,
    add_api_key_arg,
    add_workload_args,
    load_workload,
    output_file,
    positive_float,
    positive_int,
    say,
    write_json,
)
from radixserve.benchmark.report import serve_table


DEFAULT_CONCURRENCY = 16
SYNTHETIC_VOCAB_SIZE = 32000  # the workload generators' default


def loop_settings(args: argparse.Namespace) -> tuple[bool, int | None]:
    """(open loop, concurrency) of a `bench serve` command line. `--request-rate` implies
    `--open-loop`: the closed loop never reads arrival times, so a rate without it was
    silently a burst of `--concurrency` requests. `--concurrency` belongs to the closed loop:
    ValueError with an open one rather than ignoring it."""
    open_loop = args.open_loop or args.request_rate is not None
    if open_loop and args.concurrency is not None:
        raise ValueError("--concurrency is the closed loop's; --open-loop and --request-rate send each "
                         "request at its arrival time (give one or the other)")
    return open_loop, None if open_loop else (args.concurrency or DEFAULT_CONCURRENCY)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="drive a running server over HTTP (/v1/completions, token ids)")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    add_workload_args(p)
    p.add_argument("--concurrency", type=positive_int, default=None,
                   help=f"requests in flight (closed loop; default: {DEFAULT_CONCURRENCY}); not with --open-loop "
                        "or --request-rate")
    p.add_argument("--open-loop", action="store_true",
                   help="send each request at its arrival time (trace timestamps or --request-rate; "
                        "--request-rate implies it)")
    p.add_argument("--model", default=None, help="model name to put in requests")
    add_api_key_arg(p)
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="keep token ids below the model's vocabulary size, trace ids rehashed into it "
                        f"(default: the size a radixserve server reports, else {SYNTHETIC_VOCAB_SIZE} for "
                        "synthetic workloads and the trace's own ids)")
    p.add_argument("--timeout-s", type=positive_float, default=600.0,
                   help="per-request timeout in seconds (default: %(default)s)")
    p.add_argument("--json", type=output_file, help="write the summary here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    """`radixserve bench serve`."""
    from radixserve.benchmark.serve import probe_vocab_size, run_serve_benchmark

    try:
        open_loop, concurrency = loop_settings(args)
    except ValueError as error:
        say(f"error: {error}")
        return 2
    if args.vocab_size is None:
        vocab = probe_vocab_size(args.url, model=args.model, api_key=args.api_key)
        if vocab is not None and (args.trace is not None or vocab < SYNTHETIC_VOCAB_SIZE):
            say(f"token ids kept below the server's vocabulary size, {vocab} (--vocab-size to choose)")
            args.vocab_size = vocab
    extra = {"vocab_size": args.vocab_size} if args.vocab_size is not None and args.workload else {}
    try:
        workload = load_workload(args, **extra)
    except ValueError as error:
        say(f"error: {error}")
        return 2
    try:
        # Ctrl-C: asyncio.run cancels the run, which returns what finished (interrupted).
        result = asyncio.run(run_serve_benchmark(args.url, workload, concurrency=concurrency,
                                                 open_loop=open_loop, model=args.model,
                                                 timeout_s=args.timeout_s, progress=not args.no_progress,
                                                 api_key=args.api_key, keep_on_cancel=True))
    except KeyboardInterrupt:  # a second Ctrl-C, or one that came before the run began
        say("interrupted: no results kept")
        return INTERRUPTED
    summary = result.summary()
    if summary["completed"]:
        print(serve_table({workload.name: summary}))
    if args.json:
        write_json(args.json, summary | {"open_loop": open_loop, "concurrency": concurrency,
                                         "error_messages": dict(result.errors())})
    if result.interrupted:
        failed = summary["errors"] - sum(1 for r in result.records if r.error == "interrupted")
        say(f"interrupted: {summary['completed']} of {summary['requests']} requests finished"
            + (f", {failed} failed" if failed else "") + "; the others are counted as errors 'interrupted'"
            + (f"; summary of those that finished written to {args.json}" if args.json else ""))
        return INTERRUPTED
    if summary["errors"]:
        say(f"FAILED: {summary['errors']} of {summary['requests']} requests failed"
             + ("" if summary["completed"] else " (none completed: no table)") + "; errors:")
        for message, count in result.errors()[:5]:
            say(f"  {count} x {message}")
        return 1
    return 0
