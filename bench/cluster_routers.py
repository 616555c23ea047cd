"""Routers compared on a local Ray cluster: `radixserve bench serve` against N replicas.

For each workload, on fresh deployments of the demo model (empty caches), one after another:
- "1 replica, N x memory": the ideal a cluster's hit rate is measured against;
- N replicas with the memory each, routed by radixserve's cache-aware router, by Ray Serve's
  default power-of-two router, and by Ray Serve LLM's PrefixCacheAffinityRouter.
Each row is `bench serve`'s summary: hit rate, TTFT mean/p99, throughput, and the requests
each replica served (imbalance = max/min). Medians over --repeats runs.

    python bench/cluster_routers.py --replicas 4 --num-pages 320 [--size large --repeats 3] \
        [--router-kwargs cached_balance_abs=4] --json bench/results/cluster_routers.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from radixserve.benchmark.serve import run_serve_benchmark
from radixserve.benchmark.workloads import make_workload
from radixserve.cluster.deploy import APP_NAME, ClusterOptions, deploy, start_ray
from radixserve.cluster.routing import parse_routing_config
from radixserve.models.demo import DEMO_VOCAB_SIZE

# CPU-sized versions of the three workloads (the demo model prefills ~10-30k tokens/s here).
# "small" runs in minutes; in "large" each shared prefix serves 4x as many requests, so the
# one-off cost of computing it on a second replica weighs as it does at full size.
WORKLOADS = {
    "small": {
        "gsp": dict(num_groups=16, prompts_per_group=16, system_len=512, question_len=64, output_len=8),
        "multiturn": dict(num_clients=16, num_turns=3, num_system_prompts=4, system_len=256,
                          message_len=64, output_len=8),
        "agent": dict(num_agents=8, num_steps=4, system_len=512, task_len=64, tool_len=96, output_len=8),
    },
    "large": {
        "gsp": dict(num_groups=16, prompts_per_group=64, system_len=512, question_len=64, output_len=8),
        "multiturn": dict(num_clients=32, num_turns=6, num_system_prompts=4, system_len=256,
                          message_len=64, output_len=8),
        "agent": dict(num_agents=16, num_steps=6, system_len=512, task_len=64, tool_len=96, output_len=8),
    },
}
ROUTERS = ["cache-aware", "power-of-two", "prefix-affinity"]
FIGURES = ["hit_rate", "ttft_mean_s", "ttft_p99_s", "total_token_throughput", "replica_imbalance"]


def run_one(options: ClusterOptions, workload_name: str, size: str, concurrency: int,
            port: int) -> dict[str, Any]:
    from ray import serve

    workload = make_workload(workload_name, vocab_size=DEMO_VOCAB_SIZE, **WORKLOADS[size][workload_name])
    deploy(options, port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_replicas(url, options.replicas)
        result = asyncio.run(run_serve_benchmark(url, workload, concurrency=concurrency, model=None))
        return result.summary()
    finally:
        serve.delete(APP_NAME)


def _wait_for_replicas(url: str, count: int) -> None:
    import time

    import httpx

    for _ in range(600):
        body = httpx.get(f"{url}/cluster/replicas", timeout=30).json()
        if len(body["replicas"]) == count:
            return
        time.sleep(0.2)
    raise TimeoutError("replicas did not report")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--num-pages", type=int, default=320, help="KV pages per replica (16 tokens each)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS["small"]))
    parser.add_argument("--size", choices=sorted(WORKLOADS), default="small",
                        help="workload sizes (see WORKLOADS; default: small)")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--router-kwargs", default="", metavar="K=V,...",
                        help="cache-aware thresholds (CacheAwareConfig's fields), e.g. cached_balance_abs=4")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    start_ray(num_cpus=max(args.replicas, 2) + 1)
    engine = dict(model="demo", page_size=16, max_batch_tokens=2048)
    router_kwargs = asdict(parse_routing_config(args.router_kwargs)) if args.router_kwargs else {}
    results: dict[str, dict[str, Any]] = {}
    for workload in args.workloads.split(","):
        configs = {f"1 replica, {args.replicas}x memory": ClusterOptions(
            replicas=1, engine_options={**engine, "num_pages": args.num_pages * args.replicas})}
        for router in args.routers.split(","):
            configs[f"{args.replicas} replicas, {router}"] = ClusterOptions(
                replicas=args.replicas, router=router, engine_options={**engine, "num_pages": args.num_pages},
                router_kwargs=router_kwargs if router == "cache-aware" else {})
        for label, options in configs.items():
            runs = [run_one(options, workload, args.size, args.concurrency, args.port)
                    for _ in range(args.repeats)]
            row = {key: statistics.median(r[key] for r in runs) for key in FIGURES if runs[0].get(key) is not None}
            row.update(errors=sum(r["errors"] for r in runs), runs=runs)
            results.setdefault(workload, {})[label] = row
            print(f"{workload:10s} {label:40s} " + "  ".join(
                f"{k}={row[k]:.3g}" for k in FIGURES if k in row) + f"  errors={row['errors']}",
                file=sys.stderr, flush=True)
    print(markdown(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(replicas=args.replicas, num_pages=args.num_pages, size=args.size,
                                             workloads={w: WORKLOADS[args.size][w] for w in results},
                                             results=results), indent=2) + "\n")
    return 0


def markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| workload | configuration | hit rate | TTFT mean | TTFT p99 | tok/s | imbalance |",
             "|---|---|---|---|---|---|---|"]
    for workload, rows in results.items():
        for label, row in rows.items():
            imbalance = row.get("replica_imbalance")
            lines.append(f"| {workload} | {label} | {row['hit_rate']:.1%} | {row['ttft_mean_s'] * 1000:.0f} ms | "
                         f"{row['ttft_p99_s'] * 1000:.0f} ms | {row['total_token_throughput']:.0f} | "
                         + ("–" if imbalance is None or label.startswith("1 replica") else f"{imbalance:.2f}")
                         + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
