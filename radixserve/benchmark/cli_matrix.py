"""`radixserve bench matrix`: its arguments and the command (the matrix itself: matrix.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from radixserve.benchmark.cli_common import progress_bar, say
from radixserve.benchmark.cli_simulate import HOST_WRITE_POLICIES
from radixserve.benchmark.report import parse_tokens

QUICK_SCALE = 1 / 256  # --quick: a smoke test of every part of the matrix, in seconds
QUICK_COUNT_SCALE = 1 / 8  # ... on an eighth of the conversations, documents and requests
QUICK_CAPACITIES = "4M,16M"


def _add_matrix(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("matrix", help="every workload x capacity x tiers x replicas: the default eviction rule "
                                      "vs LRU, the best fixed rule and the optimum")
    p.add_argument("--scale", type=float, default=1 / 32,
                   help="multiplies every capacity, the host tier and the size of every workload (default "
                        "1/32: the 0.5M-16M matrix as 16k-500k tokens, minutes on one core)")
    p.add_argument("--count-scale", type=float, default=1 / 4,
                   help="multiplies the number of conversations, documents and requests (the trace: its "
                        "first requests) and, again, every capacity (default %(default)s)")
    p.add_argument("--workloads", default=None, metavar="W,W,...",
                   help="these workloads only (default: every one of the matrix, see "
                        "`matrix.matrix_workloads`; the held-out mixes phases, blend, scan-burst and drift "
                        "run only when named)")
    p.add_argument("--capacity-tokens", default="0.5M,1M,2M,4M,8M,16M", metavar="N,N,...",
                   help="device capacities before scaling (default: %(default)s)")
    p.add_argument("--host-capacity-tokens", default="8M", metavar="N",
                   help="the host tier of the device+host cells, before scaling (0: none; default %(default)s)")
    p.add_argument("--replicas", default="1,4", metavar="N,N",
                   help="replica counts (more than 1: device only, behind the cache-aware router)")
    p.add_argument("--fixed-rules", default="lru,reuse-boost", metavar="R,R,...",
                   help="the fixed rules the default is compared with (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"scale {QUICK_SCALE:g}, capacities {QUICK_CAPACITIES}, three workloads: a smoke test")
    p.add_argument("--json", type=Path, help="write every cell here")
    p.add_argument("--markdown", type=Path, help="write the table here")
    p.add_argument("--host-write-policy", default="write-back", choices=HOST_WRITE_POLICIES,
                   help="how the device+host cells' host tier copies (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=matrix_command)


def matrix_command(args: argparse.Namespace) -> int:
    """`radixserve bench matrix`."""
    from radixserve.benchmark.matrix import known_workloads, matrix_summary, matrix_table, matrix_workloads, run_matrix

    scale = QUICK_SCALE if args.quick else args.scale
    capacities = [parse_tokens(c) for c in (QUICK_CAPACITIES if args.quick else args.capacity_tokens).split(",")]
    names = args.workloads.split(",") if args.workloads else (
        ["chat-gaps", "zipf-docs", "gsp"] if args.quick else matrix_workloads())
    unknown = [n for n in names if n not in known_workloads()]
    if unknown or scale <= 0:
        say(f"error: --workloads among {known_workloads()}, --scale > 0 (got {unknown or scale})")
        return 2
    replicas = [int(n) for n in args.replicas.split(",")]
    host = parse_tokens(args.host_capacity_tokens)
    total = len(names) * len(capacities) * (len(replicas) + (1 if host else 0))
    bar = None if args.no_progress else progress_bar(total, "cells")
    count_scale = QUICK_COUNT_SCALE if args.quick else args.count_scale
    cells = run_matrix(names, capacities, scale=scale, count_scale=count_scale, host_tokens=host, replicas=replicas,
                       fixed=args.fixed_rules.split(","), write_policy=args.host_write_policy,
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
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"scale": scale, "count_scale": count_scale,
                                         "host_write_policy": args.host_write_policy if host else None,
                                         "cells": [c.to_dict() for c in cells]}, indent=1))
    return 0
