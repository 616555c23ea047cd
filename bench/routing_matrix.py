"""Routing on real arrivals: N replicas x C against one replica x N*C, per workload.

For each workload (the Mooncake synthetic trace, the generated workloads, conversations whose
turns arrive minutes apart) and each eviction rule (the default and LRU), `run_cluster_suite`
runs the routers side by side and the ideal (one replica holding N times the memory). Each row:
hit rate, share of the ideal, request imbalance (max/min per replica) over the run and over
the worst window of 1,000 requests, the share of requests whose cached tokens the router
predicted within a page, and the recomputed share. The simulator is deterministic: one run.

    PYTHONPATH=. nice -n 10 python bench/routing_matrix.py --json bench/results/routing_matrix.json \
        [--only gapped-chat] [--eviction reuse-boost]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from radixserve.benchmark.cli_simulate import EVICTION_POLICIES
from radixserve.benchmark.cluster_sim import IMBALANCE_WINDOW, run_cluster_suite
from radixserve.benchmark.simulate import SimConfig
from radixserve.benchmark.workloads import Workload, make_workload, mooncake_trace, with_poisson_arrivals

ROUTERS = ["cache-aware", "cache-aware-inflight", "round-robin"]
TRACE = Path(__file__).parent / "data" / "mooncake_synthetic_trace.jsonl"


def workloads() -> list[tuple[str, Workload, SimConfig]]:
    """(name, workload, per-replica configuration): the docs' routing table plus the trace,
    the gapped conversations and a closed loop of tool-calling agents."""
    gapped = dict(num_conversations=300, mean_turns=10, max_turns=80)
    return [
        ("mooncake trace, 0.5M + host 2M, 512-token pages", mooncake_trace(TRACE),
         SimConfig(500_000, page_size=512, host_capacity_tokens=2_000_000)),
        ("mooncake trace, 0.5M, 512-token pages", mooncake_trace(TRACE), SimConfig(500_000, page_size=512)),
        ("gapped-chat (300 conversations), 150k", make_workload("gapped-chat", **gapped), SimConfig(150_000)),
        ("gapped-chat, 100k + host 400k", make_workload("gapped-chat", **gapped),
         SimConfig(100_000, host_capacity_tokens=400_000)),
        ("gsp, 30k", make_workload("gsp"), SimConfig(30_000)),
        ("multiturn, 20k", make_workload("multiturn"), SimConfig(20_000)),
        ("agent, 25k", make_workload("agent"), SimConfig(25_000)),
        ("multiturn, Poisson 20 req/s, 20k", with_poisson_arrivals(make_workload("multiturn"), 20.0), SimConfig(20_000)),
        ("agent, Poisson 20 req/s, 25k", with_poisson_arrivals(make_workload("agent"), 20.0), SimConfig(25_000)),
        # A closed loop of 64 tool-calling agents started together: each replica's clients
        # finish in step, so one replica is often empty for a moment.
        ("tools (64 agents), 0.5M", make_workload("tools", num_agents=64), SimConfig(500_000)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--eviction", default="reuse-boost,lru", help="eviction rules, comma-separated")
    parser.add_argument("--only", default=None, help="workloads whose name contains this")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for name, workload, base in workloads():
        if args.only and args.only not in name:
            continue
        for eviction_name in args.eviction.split(","):
            eviction, retention = EVICTION_POLICIES[eviction_name]
            config = SimConfig(**{**base.__dict__, "eviction_policy": eviction})
            start = time.perf_counter()
            result = run_cluster_suite(workload, config, args.replicas, ROUTERS, retention=retention)
            result.update(name=name, eviction=eviction_name)
            rows.append(result)
            print(f"{name} / {eviction_name} ({time.perf_counter() - start:.0f} s): ideal {result['ideal_hit_rate']:.1%}, "
                  + ", ".join(f"{r['router']} {r['hit_rate']:.1%} ({r['windowed_imbalance']:.2f})" for r in result["runs"]),
                  file=sys.stderr, flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(rows, indent=1, default=float) + "\n")
    print(table(rows, args.replicas))
    return 0


def table(rows: list[dict], replicas: int) -> str:
    """Markdown: one line per workload and eviction rule, the routers side by side."""
    head = " | ".join(f"{r}" for r in ROUTERS)
    lines = [f"| workload | eviction | 1 x {replicas}C (ideal) | {head} |", "|---" * (3 + len(ROUTERS)) + "|"]
    for row in rows:
        cells = []
        for run in row["runs"]:
            cells.append(f"{run['hit_rate']:.1%} ({run['hit_rate'] / row['ideal_hit_rate']:.0%}), "
                         f"{run['replica_imbalance']:.2f} / {run['windowed_imbalance']:.2f}, "
                         f"{run['predicted_within_page']:.0%}")
        lines.append(f"| {row['name']} | {row['eviction']} | {row['ideal_hit_rate']:.1%} | " + " | ".join(cells) + " |")
    lines.append(f"\nEach router: hit rate (share of the ideal), imbalance over the run / worst over "
                 f"{IMBALANCE_WINDOW:,} requests, requests whose cached tokens were predicted within a page.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
