"""`radixserve bench {simulate,serve,compare}`: argument parsing and output files."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from radixserve.benchmark.lengths import LENGTH_DISTRIBUTIONS
from radixserve.benchmark.report import (
    format_capacity,
    format_tokens,
    parse_tokens,
    percent,
    plot_hit_rate_vs_capacity,
    plot_hit_rate_vs_host_capacity,
    plot_ttft_cdf,
    serve_table,
    sweep_table,
    window_table,
)
from radixserve.benchmark.workloads import WORKLOADS, Workload, make_workload, mooncake_trace, with_poisson_arrivals


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds `bench` and its subcommands to the top-level `radixserve` parser."""
    bench = subparsers.add_parser("bench", help="prefix-hit-rate benchmarks (simulated or against a server)",
                                  description="Prefix-cache benchmarks: simulate the cache offline, drive a "
                                              "running server, or compare cache on/off/transformers.")
    sub = bench.add_subparsers(dest="bench_command", metavar="MODE", required=True)
    _add_simulate(sub)
    _add_serve(sub)
    _add_compare(sub)
    _add_tiers(sub)


def _add_workload_args(parser: argparse.ArgumentParser, *, trace: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--workload", choices=sorted(WORKLOADS), help="synthetic workload")
    if trace:
        group.add_argument("--trace", type=Path, help="Mooncake trace (JSONL) to replay")
    parser.add_argument("--workload-args", default="", metavar="K=V,...",
                        help="generator overrides, e.g. num_groups=8,prompts_per_group=4")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="Poisson arrivals at this many requests/s (synthetic workloads arrive at t=0 otherwise)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")


# `--eviction-policy` names, shared with `radixserve serve`: (tree eviction, retention rule).
# The last three are retention rules only the simulator has (the eviction study).
EVICTION_POLICIES: dict[str, tuple[str, str]] = {
    "reuse-boost": ("priority", "reuse-boost"),
    "priority": ("priority", "default"),
    "lru": ("lru", "default"),
    "system-prompt": ("priority", "system-prompt"),
    "tail-demotion": ("priority", "tail-demotion"),
    "hit-boost": ("priority", "hit-boost"),
}


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="replay a workload through the real cache and policies, no model")
    _add_workload_args(p)
    p.add_argument("--capacity-tokens", required=True, metavar="N[,N...]",
                   help="cache capacity in tokens, e.g. 1M or a sweep 0.5M,1M,2M,4M")
    p.add_argument("--host-capacity-tokens", default="0", metavar="N[,N...]",
                   help="host tier capacity in tokens, e.g. 8M or a sweep 0,2M,8M (default: none); "
                        "with several device and host capacities every pair runs")
    p.add_argument("--host-write-policy", default="write-back", choices=["write-back", "write-through-selective"],
                   help="when pages go to the host tier (default: %(default)s)")
    p.add_argument("--host-offload-min-priority", type=int, default=35,
                   help="device-only pages below this retention priority are dropped, not offloaded "
                        "(default: %(default)s)")
    p.add_argument("--load-tokens-per-s", type=float, default=1_000_000.0,
                   help="simulated speed of loads from the host tier (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default: %(default)s)")
    p.add_argument("--schedule-policy", default="lpm", choices=["lpm", "dfs-weight", "fcfs"],
                   help="schedule policy of the main configuration, as `radixserve serve --schedule-policy` "
                        "(default: %(default)s)")
    p.add_argument("--eviction-policy", default="reuse-boost", choices=list(EVICTION_POLICIES),
                   help="eviction policy of the main configuration, as `radixserve serve --eviction-policy` "
                        "(reuse-boost, priority, lru); the simulator also has the retention rules "
                        "system-prompt, tail-demotion and hit-boost over priority eviction "
                        "(default: %(default)s)")
    p.add_argument("--sequential", action="store_true",
                   help="one request at a time in arrival order (the Mooncake README's setting)")
    p.add_argument("--window", type=int, default=None, metavar="N",
                   help="simulate a model with a sliding window of N tokens on every layer (pages that "
                        "leave the window are released), next to the same model with full attention")
    p.add_argument("--cache-partial-pages", action="store_true",
                   help="also cache a finished request's last, partly filled page, as the engine does "
                        "(default: full pages only, as in the published tables)")
    p.add_argument("--no-baselines", action="store_true", help="run the main configuration only")
    p.add_argument("--study", action="store_true", help="also run every retention rule (eviction study)")
    p.add_argument("--max-running", type=int, default=64,
                   help="sequences decoding at once, as in `radixserve serve` (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="tokens per simulated forward step (default: %(default)s)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=100_000.0,
                   help="simulated prefill speed (default: %(default)s)")
    p.add_argument("--decode-step-ms", type=float, default=20.0,
                   help="simulated time of one forward step (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="simulate N replicas of --capacity-tokens each behind a router, next to one "
                        "replica with N times the memory (the ideal)")
    p.add_argument("--router", default="cache-aware", metavar="NAME[,NAME...]",
                   help="with --replicas: cache-aware, power-of-two, round-robin, prefix-affinity "
                        "(the routing code the server uses; several: compared, the first reported "
                        "at the top of the JSON; default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="with --replicas: release the requests as `bench serve` does, by a closed loop "
                        "of N clients taking them in order (default: as the workload says)")
    p.add_argument("--router-kwargs", default="", metavar="K=V,...",
                   help="with --replicas: the cache-aware rule's thresholds (CacheAwareConfig's fields), "
                        "e.g. cached_balance_abs=3,share_abs=inf")
    p.add_argument("--replica-speeds", default=None, metavar="S,S,...",
                   help="with --replicas: each replica's speed relative to the simulated timings, "
                        "e.g. 1,1,1,0.5 (replicas sharing cores; default: all 1)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--markdown", type=Path, help="write the hit-rate table here")
    p.add_argument("--plot", type=Path, help="write the hit rate vs capacity plot (PNG) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=simulate_command)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="drive a running server over HTTP (/v1/completions, token ids)")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    _add_workload_args(p)
    p.add_argument("--concurrency", type=int, default=16,
                   help="requests in flight (closed loop; default: %(default)s)")
    p.add_argument("--open-loop", action="store_true",
                   help="send each request at its arrival time (trace timestamps or --request-rate)")
    p.add_argument("--model", default=None, help="model name to put in requests")
    p.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $RADIXSERVE_API_KEY, else none)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="keep token ids below the model's vocabulary size (synthetic default: 32000; "
                        "trace ids are rehashed into it)")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="per-request timeout in seconds (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=serve_command)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="cache on vs off vs transformers generate, on a random bench Llama")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsp",
                   help="synthetic workload (default: %(default)s)")
    p.add_argument("--workload-args", default="num_groups=4,prompts_per_group=8,system_len=512,"
                                              "question_len=64,output_len=16",
                   help="generator overrides (default: a CPU-sized gsp)")
    p.add_argument("--model-dir", type=Path, default=Path("bench/results/bench-llama"),
                   help="bench model directory, built if missing (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="requests in flight against each server (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="transformers static batch size")
    p.add_argument("--server-args", default="", help="extra `radixserve serve` flags, space separated "
                                                     "(--dtype and --page-size apply in process too)")
    p.add_argument("--mode", choices=["both", "in-process", "http"], default="both",
                   help="the engine in this process (no HTTP), the server over HTTP, or both "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of every run, in process and servers (default: torch's choice)")
    p.add_argument("--vary-output", action="store_true",
                   help="redraw output lengths around the workload's (same total; see --length-dist)")
    p.add_argument("--vary-prompt", action="store_true",
                   help="redraw the unique part of every prompt (gsp/fewshot's question) around the "
                        "workload's length, shared prefixes kept (same total; see --length-dist)")
    p.add_argument("--length-dist", choices=LENGTH_DISTRIBUTIONS, default="uniform",
                   help="distribution of varied lengths of mean m: uniform (about 1 .. 2m-1) or "
                        "lognormal (sigma 1, a ShareGPT-like long tail) (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every run; figures are medians, ratios are taken within a round "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write the TTFT distribution (PNG) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=compare_command)


def _add_tiers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tiers", help="multi-turn chat on a device pool too small for it, with and without "
                                     "the host tier, on a random bench Llama")
    p.add_argument("--workload", choices=["multiturn", "agent"], default="multiturn",
                   help="the conversation workload (default: %(default)s)")
    p.add_argument("--workload-args", default="num_clients=16,num_turns=6,num_system_prompts=2,system_len=128,"
                                              "message_len=48,output_len=24",
                   help="generator overrides (default: a CPU-sized multiturn)")
    p.add_argument("--device-fraction", type=float, default=0.25,
                   help="device pool as a fraction of the working set (default: %(default)s)")
    p.add_argument("--host-factor", type=float, default=2.0,
                   help="host tier as a multiple of the working set (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    p.add_argument("--model-dir", type=Path, default=Path("bench/results/bench-llama"),
                   help="bench model directory, built if missing (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="conversations in flight at once (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each server, alternating; medians are reported (default: %(default)s)")
    p.add_argument("--server-args", default="", help="extra `radixserve serve` flags, space separated")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write the TTFT distribution (PNG) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=tiers_command)


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


def simulate_command(args: argparse.Namespace) -> int:
    """`radixserve bench simulate`."""
    from radixserve.benchmark.optimum import WorkloadBounds, dfs_order, trace_block_bounds
    from radixserve.benchmark.simulate import SimConfig
    from radixserve.benchmark.suite import run_suite, suite_configs

    capacities = [parse_tokens(c) for c in args.capacity_tokens.split(",")]
    host_capacities = [parse_tokens(c) for c in args.host_capacity_tokens.split(",")]
    points = [(device, host) for device in capacities for host in host_capacities]
    workload = load_workload(args)
    if args.replicas is not None:
        if host_capacities != [0]:
            _say("error: --host-capacity-tokens is not simulated with --replicas yet")
            return 2
        return _simulate_cluster(args, workload, capacities)
    if args.concurrency is not None or args.replica_speeds is not None or args.router_kwargs:
        _say("error: --concurrency, --replica-speeds and --router-kwargs go with --replicas")
        return 2
    eviction, retention = EVICTION_POLICIES[args.eviction_policy]
    main = SimConfig(capacities[0], page_size=args.page_size, schedule_policy=args.schedule_policy,
                     eviction_policy=eviction, sequential=args.sequential,
                     max_running=args.max_running, max_batch_tokens=args.max_batch_tokens,
                     prefill_tokens_per_s=args.prefill_tokens_per_s, decode_step_s=args.decode_step_ms / 1000,
                     host_write_policy=args.host_write_policy,
                     host_offload_min_priority=args.host_offload_min_priority,
                     load_tokens_per_s=args.load_tokens_per_s, window=args.window,
                     cache_partial_pages=args.cache_partial_pages)
    if args.window is not None and args.window < 1:
        _say("error: --window must be >= 1")
        return 2
    bounds = WorkloadBounds(workload)
    batch_in_dfs_order = None if args.sequential else dfs_order(workload)
    dfs_bounds = WorkloadBounds(batch_in_dfs_order) if batch_in_dfs_order else None
    total = sum(len(suite_configs(replace(main, host_capacity_tokens=host), retention,
                                  baselines=not args.no_baselines, study=args.study)) for _, host in points)
    bar = None if args.no_progress else _tqdm(total, "simulations")
    sweep = []
    for capacity, host in points:
        obj = run_suite(workload, capacity, main, retention, bounds, dfs_bounds=dfs_bounds,
                        baselines=not args.no_baselines, study=args.study, host_capacity_tokens=host,
                        on_result=(lambda _: bar.update(1)) if bar else None)
        sweep.append(obj)
        _say(f"{format_capacity(capacity, host)}: " + ", ".join(
            f"{e['label']} {percent(e['hit_rate'])}" for e in obj["runs"])
            + f"; optimum {percent(obj['optimal_hit_rate'])}, infinite {percent(obj['infinite_hit_rate'])}",
            bar)
    if bar:
        bar.close()
    if len(sweep) == 1:
        result: dict[str, Any] = sweep[0]
    else:
        result = {key: sweep[0][key] for key in ("workload", "workload_params", "requests", "prompt_tokens",
                                                 "page_size", "infinite_hit_rate")}
        for key in ("capacity_tokens", "host_capacity_tokens", "hit_rate", "device_hit_rate", "host_hit_rate",
                    "offloaded_tokens", "loaded_tokens", "optimal_hit_rate", "optimal_device_hit_rate",
                    "optimal_dfs_hit_rate", "fraction_of_optimum"):
            result[key] = [run[key] for run in sweep]
        result["sweep"] = sweep
    if args.trace is not None:
        result["block512_optimal_hit_rate"] = trace_block_bounds(args.trace, capacities) \
            if args.limit is None and host_capacities == [0] else None
    table = sweep_table(sweep)
    if args.window:
        table += "\n" + window_table(sweep, main.label(retention), replace(main, window=None).label(retention))
    print(table)
    if args.json:
        _write_json(args.json, result)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        if len(host_capacities) > 1:
            plot_hit_rate_vs_host_capacity(sweep, args.plot, title=f"{workload.name}: hit rate vs host tier "
                                                                   f"capacity (page size {args.page_size})")
        else:
            plot_hit_rate_vs_capacity(sweep, args.plot, title=f"{workload.name}: hit rate vs capacity "
                                                              f"(page size {args.page_size})")
    return 0


def _simulate_cluster(args: argparse.Namespace, workload: Workload, capacities: list[int]) -> int:
    """`bench simulate --replicas N --router R`: N simulated replicas behind the router."""
    from radixserve.benchmark.cluster_sim import cluster_table, run_cluster_suite
    from radixserve.benchmark.simulate import SimConfig
    from radixserve.cluster.routing import ROUTERS, parse_routing_config

    routers = args.router.split(",")
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown or args.sequential or args.replicas < 1:
        _say(f"error: --router must be among {list(ROUTERS)}, --replicas >= 1, without --sequential")
        return 2
    try:
        speeds = [float(x) for x in args.replica_speeds.split(",")] if args.replica_speeds else None
    except ValueError:
        speeds = []
    if speeds is not None and (len(speeds) != args.replicas or min(speeds, default=0) <= 0):
        _say(f"error: --replica-speeds needs {args.replicas} positive numbers, got {args.replica_speeds!r}")
        return 2
    if args.concurrency is not None and args.concurrency < 1:
        _say("error: --concurrency must be >= 1")
        return 2
    try:
        routing = parse_routing_config(args.router_kwargs)
    except ValueError as error:
        _say(f"error: {error}")
        return 2
    eviction, retention = EVICTION_POLICIES[args.eviction_policy]
    results = []
    for capacity in capacities:
        config = SimConfig(capacity, page_size=args.page_size, schedule_policy=args.schedule_policy,
                           eviction_policy=eviction, max_running=args.max_running,
                           max_batch_tokens=args.max_batch_tokens, prefill_tokens_per_s=args.prefill_tokens_per_s,
                           decode_step_s=args.decode_step_ms / 1000)
        result = run_cluster_suite(workload, config, args.replicas, routers, retention=retention, seed=args.seed,
                                   concurrency=args.concurrency, speeds=speeds, routing=routing)
        results.append(result)
        _say(f"{format_tokens(capacity)} x {args.replicas}: " + ", ".join(
            f"{r['router']} {percent(r['hit_rate'])} (imbalance {r['replica_imbalance']:.2f})" for r in result["runs"])
            + f"; one replica with {args.replicas}x memory {percent(result['ideal_hit_rate'])}")
    table = cluster_table(results)
    print(table)
    if args.json:
        _write_json(args.json, results[0] if len(results) == 1 else {"sweep": results})
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    """`radixserve bench serve`."""
    from radixserve.benchmark.serve import run_serve_benchmark

    extra = {"vocab_size": args.vocab_size} if args.vocab_size is not None and args.workload else {}
    workload = load_workload(args, **extra)
    result = asyncio.run(run_serve_benchmark(args.url, workload, concurrency=args.concurrency,
                                             open_loop=args.open_loop, model=args.model,
                                             timeout_s=args.timeout_s, progress=not args.no_progress,
                                             api_key=args.api_key))
    summary = result.summary()
    if summary["completed"]:
        print(serve_table({workload.name: summary}))
    if args.json:
        _write_json(args.json, summary | {"error_messages": dict(result.errors())})
    if summary["errors"]:
        _say(f"FAILED: {summary['errors']} of {summary['requests']} requests failed"
             + ("" if summary["completed"] else " (none completed: no table)") + "; errors:")
        for message, count in result.errors()[:5]:
            _say(f"  {count} x {message}")
        return 1
    return 0


def compare_command(args: argparse.Namespace) -> int:
    """`radixserve bench compare`."""
    from radixserve.benchmark.compare import MODES, build_bench_model, model_vocab_size, run_comparison
    from radixserve.benchmark.lengths import with_varied_output_lengths, with_varied_prompt_lengths
    from radixserve.benchmark.inprocess import breakdown_table

    model_dir = build_bench_model(args.model_dir)
    params = {"seed": args.seed, "vocab_size": model_vocab_size(model_dir),
              **parse_workload_args(args.workload_args)}
    workload = make_workload(args.workload, **params)
    if args.vary_prompt:
        workload = with_varied_prompt_lengths(workload, params["vocab_size"], args.seed, args.length_dist)
    if args.vary_output:
        workload = with_varied_output_lengths(workload, args.seed, args.length_dist)
    result = run_comparison(workload, model_dir, concurrency=args.concurrency, batch_size=args.batch_size,
                            server_args=args.server_args.split(),
                            modes=MODES if args.mode == "both" else (args.mode,), repeat=args.repeat,
                            log_dir=args.json.parent if args.json else None, progress=not args.no_progress,
                            threads=args.threads)
    rows = {f"radixserve {label}": summary for label, summary in result["runs"].items()}
    rows["transformers generate, static batches"] = result["hf_static_batches"]
    if args.repeat > 1:
        print(f"medians of {args.repeat} rounds; ratios taken within each round, then the median\n")
    print(serve_table(rows))
    hf = result["hf_static_batches"]
    useful = hf["prompt_tokens"] + hf["completion_tokens"]
    print(f"transformers ran {hf['computed_tokens']:.0f} token positions for {useful:.0f} useful tokens "
          f"({hf['computed_tokens'] / useful - 1:.0%} padding and tokens past a request's own length)\n")
    print("\n".join(f"{name}: {value:.2f}x" for name, value in result["ratios"].items()))
    in_process = {label: s for label, s in result["runs"].items() if label.startswith("in-process")}
    if in_process:
        print("\nEngine step time per batch step (in process), by section:\n")
        print(breakdown_table(in_process))
    failed = _report_failures(result)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_ttft_cdf(result["ttft_s"], args.plot, title=f"TTFT, {workload.name}: prefix cache on vs off")
    if args.json:
        _write_json(args.json, result)
    return 1 if failed else 0


def _report_failures(result: dict) -> bool:
    """Says on stderr which server runs failed and which runs did other work than
    transformers (compare only); True if any did."""
    for label, reason in result["server_failures"].items():
        _say(f"server run '{label}' failed: {reason}")
    mismatches = result.get("token_mismatches", {})
    for label, reason in mismatches.items():
        _say(f"run '{label}' did not do the same work as transformers: {reason}")
    return bool(result["server_failures"] or mismatches)


def tiers_command(args: argparse.Namespace) -> int:
    """`radixserve bench tiers`."""
    from radixserve.benchmark.compare import build_bench_model, model_vocab_size
    from radixserve.benchmark.host_tier import run_host_tier_comparison

    model_dir = build_bench_model(args.model_dir)
    params = {"seed": args.seed, "vocab_size": model_vocab_size(model_dir), **parse_workload_args(args.workload_args)}
    workload = make_workload(args.workload, **params)
    result = run_host_tier_comparison(workload, model_dir, page_size=args.page_size,
                                      device_fraction=args.device_fraction, host_factor=args.host_factor,
                                      concurrency=args.concurrency, repeat=args.repeat,
                                      server_args=args.server_args.split(),
                                      log_dir=args.json.parent if args.json else None,
                                      progress=not args.no_progress)
    _say(f"working set {result['working_set_tokens']} tokens: device pool {result['device_pages']} pages, "
         f"host tier {result['host_pages']} pages of {args.page_size}")
    print(serve_table(result["servers"]))  # medians of the runs
    for name, value in result.get("ratios", {}).items():
        if value is not None:
            print(f"{name}: {value:.2f}x")
    if "identical_outputs" in result:
        print(f"identical outputs: {result['identical_outputs']} ({result['mismatched_requests']} differ)")
        copy, prefill = result["copy_s_per_token"], result["prefill_s_per_token"]
        if copy and prefill:
            print(f"copy from host: {1e6 * copy:.2f} us/token; prefill: {1e6 * prefill:.2f} us/token")
    failed = _report_failures(result)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_ttft_cdf(result["ttft_s"], args.plot, title=f"TTFT, {workload.name}: device pool "
                                                         f"{args.device_fraction:g} of the working set")
    if args.json:
        _write_json(args.json, result)
    return 1 if failed else 0


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _tqdm(total: int, desc: str):  # -> tqdm
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)


def _say(message: str, bar: Any = None) -> None:
    """A status line on stderr; with a progress `bar` running, on a line of its own above it."""
    line = f"radixserve bench: {message}"
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)
