"""Routers compared on a local Ray cluster: `radixserve bench serve` against N replicas.

For each workload, on fresh deployments of the demo model (empty caches), one after another:
- "1 replica, N x memory": the ideal a cluster's hit rate is measured against;
- N replicas with the memory each, routed by radixserve's cache-aware router, by Ray Serve's
  default power-of-two router, and by Ray Serve LLM's PrefixCacheAffinityRouter.
Each row is `bench serve`'s summary: hit rate, TTFT mean/p99, throughput, and the requests
each replica served (imbalance = max/min). Medians over --repeats runs (the configurations
take turns: repeat 1 of each, the ideal last, then repeat 2, ...).

    python bench/cluster_routers.py --replicas 4 --num-pages 320 [--size large --repeats 3] \
        [--router-kwargs cached_balance_abs=4] --json bench/results/cluster_routers.json

The matrix's families (benchmark/families.py: zipf-docs, chat-crowd, ...) run as `bench
matrix` scales them (`--token-scale`, `--count-scale`: a capacity of C tokens there is
C x token-scale x count-scale here), at their arrival times with `--open-loop` (as the
matrix's 4-replica cells), and `--cluster-reuse on,off` adds a cache-aware row with the
cluster's reuse history off (ClusterOptions.cluster_reuse), `--lru` one with the replicas
on LRU: the served A/B of the simulation's zipf-docs 0.5M x 4 cell is

    python bench/cluster_routers.py --workloads zipf-docs --num-pages 244 --open-loop \
        --routers cache-aware --cluster-reuse on,off --repeats 3 --json bench/results/served_reuse.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from radixserve.benchmark.families import FAMILIES
from radixserve.benchmark.serve import run_serve_benchmark
from radixserve.benchmark.workloads import Workload, make_workload
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


def workload_params(name: str, size: str, token_scale: float, count_scale: float) -> dict[str, Any]:
    """make_workload's arguments for `name`: this script's CPU sizes, or a matrix family
    scaled as `bench matrix` scales it (benchmark/matrix.py build_workload)."""
    if name in FAMILIES:
        return dict(token_scale=token_scale, scale=count_scale)
    return dict(WORKLOADS[size][name])


def run_one(options: ClusterOptions, workload: Workload, concurrency: int, port: int,
            open_loop: bool = False) -> dict[str, Any]:
    """One `bench serve` run on a fresh deployment of `options`: its summary, plus what the
    cluster's reuse history sent the replicas ("reuse_messages": ClusterReuse.messages)."""
    from ray import serve

    ingress = deploy(options, port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_replicas(url, options.replicas)
        result = asyncio.run(run_serve_benchmark(url, workload, concurrency=concurrency, open_loop=open_loop,
                                                 model=None))
        return {**result.summary(), "reuse_messages": ingress.reuse_messages.remote().result()}
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
    parser.add_argument("--open-loop", action="store_true",
                        help="send each request at its arrival time (as the matrix's cluster cells), not closed loop")
    parser.add_argument("--token-scale", type=float, default=1 / 32, help="a matrix family's lengths (bench matrix --scale)")
    parser.add_argument("--count-scale", type=float, default=1 / 4, help="... and its counts (bench matrix --count-scale)")
    parser.add_argument("--cluster-reuse", default="on", metavar="on[,off]",
                        help="cache-aware rows with the cluster's reuse history on and/or off (ClusterOptions.cluster_reuse; "
                             "empty: neither)")
    parser.add_argument("--lru", action="store_true", help="one more cache-aware row, its replicas on LRU")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="start no run that would end past this many seconds, by the longest run so far")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    reuse = [{"on": True, "off": False}[v] for v in args.cluster_reuse.split(",") if v]
    engine = dict(model="demo", page_size=16, max_batch_tokens=2048)
    router_kwargs = asdict(parse_routing_config(args.router_kwargs)) if args.router_kwargs else {}
    params = {w: workload_params(w, args.size, args.token_scale, args.count_scale) for w in args.workloads.split(",")}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in params}
    start_ray(num_cpus=max(args.replicas, 2) + 1)
    started, longest = time.monotonic(), 0.0
    try:
        for workload_name, wparams in params.items():
            workload = make_workload(workload_name, vocab_size=DEMO_VOCAB_SIZE, **wparams)
            configs = cluster_configs(args.replicas, args.num_pages, args.routers.split(","), engine,
                                      router_kwargs, reuse, args.lru)
            # The ideal last in each round: a time budget cuts it before the clusters' rows.
            order = sorted(configs, key=lambda label: label.startswith("1 replica"))
            for repeat in range(args.repeats):
                for label in order:
                    options = configs[label]
                    if args.time_budget_s is not None and time.monotonic() - started + longest > args.time_budget_s:
                        print(f"time budget: not starting {workload_name} / {label} #{repeat + 1}",
                              file=sys.stderr, flush=True)
                        continue
                    t0 = time.monotonic()
                    try:
                        run = run_one(options, workload, args.concurrency, args.port, args.open_loop)
                    except Exception as exc:  # a deployment that failed: the other runs still count
                        print(f"{workload_name} / {label} #{repeat + 1} failed: {exc!r}", file=sys.stderr, flush=True)
                        continue
                    longest = max(longest, time.monotonic() - t0)
                    runs[workload_name].setdefault(label, []).append(run)
                    print(f"{workload_name:10s} {label:48s} #{repeat + 1} hit_rate={run['hit_rate']:.4f} "
                          f"errors={run['errors']} imbalance={run.get('replica_imbalance')} "
                          f"reuse={run['reuse_messages']} ({time.monotonic() - t0:.0f} s)",
                          file=sys.stderr, flush=True)
                    results = summarize(runs)
                    if args.json:  # after every run: a cut-short session keeps what it measured
                        args.json.parent.mkdir(parents=True, exist_ok=True)
                        args.json.write_text(json.dumps(dict(
                            replicas=args.replicas, num_pages=args.num_pages, size=args.size, open_loop=args.open_loop,
                            concurrency=None if args.open_loop else args.concurrency, workloads=params,
                            results=results), indent=2) + "\n")
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    print(markdown(summarize(runs)))
    return 0


def cluster_configs(replicas: int, num_pages: int, routers: list[str], engine: dict[str, Any],
                    router_kwargs: dict[str, Any], reuse: list[bool], lru: bool) -> dict[str, ClusterOptions]:
    """The deployments one workload runs on, by label: the ideal (one replica with all the
    memory), then `replicas` replicas behind each router (cache-aware: once per `reuse`
    value, and once more on LRU with `lru`)."""
    configs = {f"1 replica, {replicas}x memory": ClusterOptions(
        replicas=1, engine_options={**engine, "num_pages": num_pages * replicas})}
    each = {**engine, "num_pages": num_pages}
    for router in routers:
        if router != "cache-aware":
            configs[f"{replicas} replicas, {router}"] = ClusterOptions(replicas=replicas, router=router,
                                                                      engine_options=each)
            continue
        for on in reuse:
            label = f"{replicas} replicas, {router}" + ("" if on else ", no cluster reuse history")
            configs[label] = ClusterOptions(replicas=replicas, router=router, engine_options=each,
                                            router_kwargs=router_kwargs, cluster_reuse=on)
        if lru:
            configs[f"{replicas} replicas, {router}, LRU"] = ClusterOptions(
                replicas=replicas, router=router, engine_options={**each, "eviction_policy": "lru"},
                router_kwargs=router_kwargs)
    return configs


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Each configuration's row: the medians of FIGURES over its runs, errors summed, the runs."""
    results: dict[str, dict[str, Any]] = {}
    for workload, by_label in runs.items():
        for label, done in by_label.items():
            row = {key: statistics.median(r[key] for r in done) for key in FIGURES if done[0].get(key) is not None}
            row.update(errors=sum(r["errors"] for r in done), runs=done)
            results.setdefault(workload, {})[label] = row
    return results


def markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| workload | configuration | hit rate | TTFT mean | TTFT p99 | tok/s | imbalance | hit rate of each run |",
             "|---|---|---|---|---|---|---|---|"]
    for workload, rows in results.items():
        for label, row in rows.items():
            imbalance = row.get("replica_imbalance")
            lines.append(f"| {workload} | {label} | {row['hit_rate']:.1%} | {row['ttft_mean_s'] * 1000:.0f} ms | "
                         f"{row['ttft_p99_s'] * 1000:.0f} ms | {row['total_token_throughput']:.0f} | "
                         + ("–" if imbalance is None or label.startswith("1 replica") else f"{imbalance:.2f}")
                         + " | " + ", ".join(f"{r['hit_rate']:.1%}" for r in row["runs"]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
