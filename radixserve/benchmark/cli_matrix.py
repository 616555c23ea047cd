"""`radixserve bench matrix`: its arguments and the command (the matrix itself: matrix.py)."""

from __future__ import annotations

import argparse

from radixserve.benchmark.cli_common import (
    interruptible,
    names_among,
    output_file,
    positive_float,
    positive_ints,
    progress_bar,
    say,
    token_count,
    token_counts,
    write_json,
)
from radixserve.benchmark.cli_simulate import EVICTION_POLICIES, HOST_WRITE_POLICIES

# --quick: a smoke test of every part of the matrix in seconds. Lengths at 1/64 keep every
# shared part of the quick workloads a page or more (at 1/256 gsp's system prompt and
# zipf-docs' documents were under one 16-token page: nothing to hit), on a thirty-second of
# the conversations, documents and requests; the smaller capacity is under pressure, the
# larger holds nearly all.
QUICK_SCALE = 1 / 64
QUICK_COUNT_SCALE = 1 / 32
QUICK_CAPACITIES = "0.5M,4M"
QUICK_WORKLOADS = ("chat-gaps", "zipf-docs", "gsp")
DEFAULT_SCALE = 1 / 32
DEFAULT_COUNT_SCALE = 1 / 4
DEFAULT_CAPACITIES = "0.5M,1M,2M,4M,8M,16M"


def _add_matrix(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("matrix", help="every workload x capacity x tiers x replicas: the default eviction rule "
                                      "vs LRU, the best fixed rule and the optimum")
    p.add_argument("--scale", type=positive_float, default=None,
                   help="multiplies every capacity, the host tier and the size of every workload (default "
                        "1/32: the 0.5M-16M matrix as 16k-500k tokens, minutes on one core)")
    p.add_argument("--count-scale", type=positive_float, default=None,
                   help="multiplies the number of conversations, documents and requests (the trace: its "
                        f"first requests) and, again, every capacity (default {DEFAULT_COUNT_SCALE:g})")
    p.add_argument("--workloads", default=None, metavar="W,W,...",
                   help="these workloads only (default: every one of the matrix, see "
                        "`matrix.matrix_workloads`; the held-out mixes phases, blend, scan-burst and drift "
                        "run only when named)")
    p.add_argument("--capacity-tokens", type=token_counts(1), default=None, metavar="N,N,...",
                   help=f"device capacities before scaling (default: {DEFAULT_CAPACITIES})")
    p.add_argument("--host-capacity-tokens", type=token_count(0), default="8M", metavar="N",
                   help="the host tier of the device+host cells, before scaling (0: none; default %(default)s)")
    p.add_argument("--replicas", type=positive_ints, default="1,4", metavar="N,N",
                   help="replica counts (more than 1: device only, behind the cache-aware router)")
    p.add_argument("--fixed-rules", type=names_among(list(EVICTION_POLICIES)), default="lru,reuse-boost",
                   metavar="R,R,...",
                   help="the fixed rules the default is compared with (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke test: scale 1/{1 / QUICK_SCALE:g}, count scale 1/{1 / QUICK_COUNT_SCALE:g}, "
                        f"capacities {QUICK_CAPACITIES}, workloads {','.join(QUICK_WORKLOADS)} (unless "
                        "--workloads); not with --scale, --count-scale or --capacity-tokens")
    p.add_argument("--json", type=output_file, help="write every cell here")
    p.add_argument("--markdown", type=output_file, help="write the table here")
    p.add_argument("--host-write-policy", default="write-back", choices=HOST_WRITE_POLICIES,
                   help="how the device+host cells' host tier copies (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=interruptible(matrix_command))


def available_workloads(names: list[str], *, named: bool) -> tuple[list[str], str | None]:
    """`names` less the Mooncake trace where its file is missing (an install from the wheel:
    the trace lives in the source tree's bench/data, not in the package), with the line that
    says so: an error if `named` on the command line, else a note that it is skipped. Checked
    before the first cell: it failed with FileNotFoundError after minutes of the others."""
    from radixserve.benchmark import matrix

    if "mooncake" not in names or matrix.TRACE.is_file():
        return names, None
    where = f"{matrix.TRACE} not found (it ships with a source checkout, not the wheel)"
    if named:
        return names, f"error: --workloads mooncake: {where}"
    return [n for n in names if n != "mooncake"], f"mooncake skipped: {where}"


def matrix_command(args: argparse.Namespace) -> int:
    """`radixserve bench matrix`."""
    from radixserve.benchmark.matrix import known_workloads, matrix_summary, matrix_table, matrix_workloads, run_matrix

    if args.quick:
        given = [flag for flag, value in (("--capacity-tokens", args.capacity_tokens), ("--scale", args.scale),
                                          ("--count-scale", args.count_scale)) if value is not None]
        if given:
            say(f"error: --quick sets {', '.join(given)} itself; leave out --quick to choose")
            return 2
        scale, count_scale, capacities = QUICK_SCALE, QUICK_COUNT_SCALE, token_counts(1)(QUICK_CAPACITIES)
    else:
        scale = DEFAULT_SCALE if args.scale is None else args.scale
        count_scale = DEFAULT_COUNT_SCALE if args.count_scale is None else args.count_scale
        capacities = args.capacity_tokens or token_counts(1)(DEFAULT_CAPACITIES)
    names = args.workloads.split(",") if args.workloads else (
        list(QUICK_WORKLOADS) if args.quick else matrix_workloads())
    unknown = [n for n in names if n not in known_workloads()]
    if unknown or scale <= 0:
        say(f"error: --workloads among {known_workloads()}, --scale > 0 (got {unknown or scale})")
        return 2
    names, problem = available_workloads(names, named=bool(args.workloads))
    if problem is not None:
        say(problem)
        if not names or args.workloads:
            return 2
    replicas, host = args.replicas, args.host_capacity_tokens
    total = len(names) * len(capacities) * (len(replicas) + (1 if host else 0))
    bar = None if args.no_progress else progress_bar(total, "cells")
    cells = run_matrix(names, capacities, scale=scale, count_scale=count_scale, host_tokens=host, replicas=replicas,
                       fixed=args.fixed_rules, write_policy=args.host_write_policy,
                       on_cell=(lambda _: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    table = matrix_table(cells) + "\n\n" + matrix_summary(cells)
    if host and args.host_write_policy != "write-back":
        table = f"Host tier write policy: {args.host_write_policy}.\n\n{table}"
    print(table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.json:
        write_json(args.json, {"scale": scale, "count_scale": count_scale,
                               "host_write_policy": args.host_write_policy if host else None,
                               "cells": [c.to_dict() for c in cells]})
    return 0
