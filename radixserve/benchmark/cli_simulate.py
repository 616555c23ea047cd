"""`radixserve bench simulate`: its arguments and the command."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from radixserve.benchmark.cli_common import (
    add_workload_args,
    interruptible,
    load_workload,
    output_file,
    positive_float,
    positive_int,
    power_of_two,
    progress_bar,
    say,
    token_counts,
    write_json,
)
from radixserve.benchmark.report import (
    format_capacity,
    format_tokens,
    percent,
    plot_hit_rate_vs_capacity,
    plot_hit_rate_vs_host_capacity,
    sweep_table,
    window_table,
)
from radixserve.benchmark.workloads import Workload


# `--eviction-policy` names, shared with `radixserve serve`: (tree eviction, retention rule).
# The last three are retention rules only the simulator has (the eviction study).
EVICTION_POLICIES: dict[str, tuple[str, str]] = {
    "adaptive": ("adaptive", "adaptive"),
    "reuse-boost": ("priority", "reuse-boost"),
    "priority": ("priority", "default"),
    "lru": ("lru", "default"),
    "system-prompt": ("priority", "system-prompt"),
    "tail-demotion": ("priority", "tail-demotion"),
    "hit-boost": ("priority", "hit-boost"),
}
# `--host-write-policy` names (cache/tiers.py's WRITE_POLICIES, not imported: it loads torch).
HOST_WRITE_POLICIES = ["write-back", "write-through-selective", "exclusive"]


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="replay a workload through the real cache and policies, no model")
    add_workload_args(p)
    p.add_argument("--capacity-tokens", required=True, type=token_counts(1), metavar="N[,N...]",
                   help="cache capacity in tokens, e.g. 1M or a sweep 0.5M,1M,2M,4M")
    p.add_argument("--host-capacity-tokens", default="0", type=token_counts(0), metavar="N[,N...]",
                   help="host tier capacity in tokens, e.g. 8M or a sweep 0,2M,8M (default: none); "
                        "with several device and host capacities every pair runs")
    p.add_argument("--host-write-policy", default="write-back", choices=HOST_WRITE_POLICIES,
                   help="when pages go to the host tier (default: %(default)s)")
    p.add_argument("--host-offload-min-priority", type=int, default=35,
                   help="device-only pages below this retention priority are dropped, not offloaded "
                        "(default: %(default)s)")
    p.add_argument("--load-tokens-per-s", type=positive_float, default=1_000_000.0,
                   help="simulated speed of loads from the host tier (default: %(default)s)")
    p.add_argument("--page-size", type=power_of_two, default=16, help="tokens per page (default: %(default)s)")
    p.add_argument("--schedule-policy", default="lpm", choices=["lpm", "dfs-weight", "fcfs"],
                   help="schedule policy of the main configuration, as `radixserve serve --schedule-policy` "
                        "(default: %(default)s)")
    p.add_argument("--eviction-policy", default="adaptive", choices=list(EVICTION_POLICIES),
                   help="eviction policy of the main configuration, as `radixserve serve --eviction-policy` "
                        "(adaptive, reuse-boost, priority, lru); the simulator also has the retention rules "
                        "system-prompt, tail-demotion and hit-boost over priority eviction "
                        "(default: %(default)s)")
    p.add_argument("--sequential", action="store_true",
                   help="one request at a time in arrival order (the Mooncake README's setting)")
    p.add_argument("--window", type=positive_int, default=None, metavar="N",
                   help="simulate a model with a sliding window of N tokens on every layer (pages that "
                        "leave the window are released), next to the same model with full attention")
    p.add_argument("--cache-partial-pages", action="store_true",
                   help="also cache a finished request's last, partly filled page, as the engine does "
                        "(default: full pages only, as in the published tables)")
    p.add_argument("--no-baselines", action="store_true", help="run the main configuration only")
    p.add_argument("--study", action="store_true", help="also run every retention rule (eviction study)")
    p.add_argument("--max-running", type=positive_int, default=64,
                   help="sequences decoding at once, as in `radixserve serve` (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=8192,
                   help="tokens per simulated forward step (default: %(default)s)")
    p.add_argument("--prefill-tokens-per-s", type=positive_float, default=100_000.0,
                   help="simulated prefill speed (default: %(default)s)")
    p.add_argument("--decode-step-ms", type=positive_float, default=20.0,
                   help="simulated time of one forward step (default: %(default)s)")
    p.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="simulate N replicas of --capacity-tokens each behind a router, next to one "
                        "replica with N times the memory (the ideal)")
    p.add_argument("--router", default="cache-aware", metavar="NAME[,NAME...]",
                   help="with --replicas: cache-aware, power-of-two, round-robin, prefix-affinity "
                        "(the routing code the server uses; several: compared, the first reported "
                        "at the top of the JSON; default: %(default)s)")
    p.add_argument("--concurrency", type=positive_int, default=None, metavar="N",
                   help="with --replicas: release the requests as `bench serve` does, by a closed loop "
                        "of N clients taking them in order (default: as the workload says)")
    p.add_argument("--router-kwargs", default="", metavar="K=V,...",
                   help="with --replicas: the cache-aware rule's thresholds (CacheAwareConfig's fields), "
                        "e.g. cached_balance_abs=3,share_abs=inf")
    p.add_argument("--replica-speeds", default=None, metavar="S,S,...",
                   help="with --replicas: each replica's speed relative to the simulated timings, "
                        "e.g. 1,1,1,0.5 (replicas sharing cores; default: all 1)")
    p.add_argument("--json", type=output_file, help="write the results here")
    p.add_argument("--markdown", type=output_file, help="write the hit-rate table here")
    p.add_argument("--plot", type=output_file, help="write the hit rate vs capacity plot (PNG) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=interruptible(simulate_command))


def simulate_command(args: argparse.Namespace) -> int:
    """`radixserve bench simulate`."""
    from radixserve.benchmark.optimum import WorkloadBounds, dfs_order, trace_block_bounds
    from radixserve.benchmark.simulate import SimConfig
    from radixserve.benchmark.suite import run_suite, suite_configs

    capacities, host_capacities = args.capacity_tokens, args.host_capacity_tokens
    if args.replicas is not None:
        ignored = [flag for flag, given in (
            ("--sequential", args.sequential), ("--window", args.window is not None), ("--study", args.study),
            ("--cache-partial-pages", args.cache_partial_pages), ("--no-baselines", args.no_baselines),
            ("--plot", args.plot is not None)) if given]
        if ignored:
            say(f"error: --replicas does not take {', '.join(ignored)} (the cluster simulation runs the routers "
                "given and one replica of their memory, in the serving loop, and writes --json and --markdown)")
            return 2
    points = [(device, host) for device in capacities for host in host_capacities]
    if min(capacities) < args.page_size:
        say(f"error: --capacity-tokens {min(capacities)} holds no page of {args.page_size} tokens")
        return 2
    try:
        workload = load_workload(args)
    except ValueError as error:
        say(f"error: {error}")
        return 2
    if args.replicas is not None:
        if len(host_capacities) != 1:
            say("error: --replicas takes one --host-capacity-tokens (per replica)")
            return 2
        return _simulate_cluster(args, workload, capacities, host_capacities[0])
    if args.concurrency is not None or args.replica_speeds is not None or args.router_kwargs:
        say("error: --concurrency, --replica-speeds and --router-kwargs go with --replicas")
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
    bounds = WorkloadBounds(workload)
    batch_in_dfs_order = None if args.sequential else dfs_order(workload)
    dfs_bounds = WorkloadBounds(batch_in_dfs_order) if batch_in_dfs_order else None
    total = sum(len(suite_configs(replace(main, host_capacity_tokens=host), retention,
                                  baselines=not args.no_baselines, study=args.study)) for _, host in points)
    bar = None if args.no_progress else progress_bar(total, "simulations")
    sweep = []
    for capacity, host in points:
        obj = run_suite(workload, capacity, main, retention, bounds, dfs_bounds=dfs_bounds,
                        baselines=not args.no_baselines, study=args.study, host_capacity_tokens=host,
                        on_result=(lambda _: bar.update(1)) if bar else None)
        sweep.append(obj)
        say(f"{format_capacity(capacity, host)}: " + ", ".join(
            f"{e['label']} {percent(e['hit_rate'])}{_recomputed(e)}" for e in obj["runs"])
            + f"; optimum {percent(obj['optimal_hit_rate'])}, infinite {percent(obj['infinite_hit_rate'])}"
            + _skipped_status(obj["runs"], len(workload.requests)), bar)
    if bar:
        bar.close()
    skipped = {format_capacity(capacity, host): _most_skipped(obj["runs"])
               for (capacity, host), obj in zip(points, sweep)}
    if (hopeless := [point for point, count in skipped.items() if count == len(workload.requests)]):
        # Every policy would show 0% next to a non-zero optimum: nothing was measured.
        say(f"error: at --capacity-tokens {', '.join(hopeless)} every request is too long for the pool "
            f"(the longest needs {_longest_request(workload)} tokens and a page to spare); give a larger capacity")
        return 2
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
    if any(skipped.values()):
        table += "\n" + _skipped_note(skipped, len(workload.requests))
    print(table)
    if args.json:
        write_json(args.json, result)
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


def _most_skipped(runs: list[dict[str, Any]]) -> int:
    """The most requests any of a point's runs skipped (too long for its pool)."""
    return max((int(run.get("skipped", 0)) for run in runs), default=0)


def _skipped_status(runs: list[dict[str, Any]], requests: int) -> str:
    """", N of M requests skipped (...)" for a status line where a run skipped requests."""
    count = _most_skipped(runs)
    return f", {count} of {requests} requests skipped (too long for the pool)" if count else ""


def _skipped_note(skipped: dict[str, int], requests: int) -> str:
    """The table's note on skipped requests: the hit rates count their prompt tokens as
    misses, while the optimum and infinite bounds assume they ran."""
    where = ", ".join(f"{count} at {point}" for point, count in skipped.items() if count)
    return (f"Note: requests too long for the pool were skipped ({where}, of {requests}): their prompt "
            "tokens count as misses in every hit rate, while the optimum and infinite bounds assume they "
            "ran.\n")


def _longest_request(workload: Workload) -> int:
    """Prompt plus output tokens of the workload's longest request."""
    return max(r.prompt_len + max(r.output_len, 1) for r in workload.requests)


def _recomputed(run: dict[str, Any]) -> str:
    """", recomputed x%" for a run that recomputed tokens after preemptions, else nothing."""
    if not run.get("recomputed_tokens"):
        return ""
    return f" (recomputed {percent(run['recomputed_share'])} of computed tokens)"


def _simulate_cluster(args: argparse.Namespace, workload: Workload, capacities: list[int], host_capacity: int) -> int:
    """`bench simulate --replicas N --router R`: N simulated replicas behind the router, each
    with `host_capacity` tokens of host tier (0: none)."""
    from radixserve.benchmark.cluster_sim import cluster_table, run_cluster_suite
    from radixserve.benchmark.simulate import SimConfig
    from radixserve.cluster.routing import ROUTERS, parse_routing_config

    routers = args.router.split(",")
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        say(f"error: --router must be among {list(ROUTERS)}")
        return 2
    try:
        speeds = [float(x) for x in args.replica_speeds.split(",")] if args.replica_speeds else None
    except ValueError:
        speeds = []
    if speeds is not None and (len(speeds) != args.replicas or min(speeds, default=0) <= 0):
        say(f"error: --replica-speeds needs {args.replicas} positive numbers, got {args.replica_speeds!r}")
        return 2
    try:
        routing = parse_routing_config(args.router_kwargs)
    except ValueError as error:
        say(f"error: {error}")
        return 2
    eviction, retention = EVICTION_POLICIES[args.eviction_policy]
    results = []
    for capacity in capacities:
        config = SimConfig(capacity, page_size=args.page_size, schedule_policy=args.schedule_policy,
                           eviction_policy=eviction, max_running=args.max_running,
                           max_batch_tokens=args.max_batch_tokens, prefill_tokens_per_s=args.prefill_tokens_per_s,
                           decode_step_s=args.decode_step_ms / 1000, host_capacity_tokens=host_capacity,
                           host_write_policy=args.host_write_policy,
                           host_offload_min_priority=args.host_offload_min_priority,
                           load_tokens_per_s=args.load_tokens_per_s)
        result = run_cluster_suite(workload, config, args.replicas, routers, retention=retention, seed=args.seed,
                                   concurrency=args.concurrency, speeds=speeds, routing=routing)
        results.append(result)
        say(f"{format_tokens(capacity)} x {args.replicas}: " + ", ".join(
            f"{r['router']} {percent(r['hit_rate'])} (imbalance {r['replica_imbalance']:.2f}, "
            f"per {r['imbalance_window']} {r['windowed_imbalance']:.2f})" for r in result["runs"])
            + f"; one replica with {args.replicas}x memory {percent(result['ideal_hit_rate'])}"
            + _skipped_status(result["runs"], len(workload.requests)))
    table = cluster_table(results)
    print(table)
    if args.json:
        write_json(args.json, results[0] if len(results) == 1 else {"sweep": results})
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    return 0
