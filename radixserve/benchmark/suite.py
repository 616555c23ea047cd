"""A simulate run with its baselines and bounds: what `radixserve bench simulate` reports.

At each capacity the main configuration runs next to the baselines (no cache; fcfs, lpm and
dfs-weight under LRU; system-prompt retention) and, with `study`, every retention rule; the
offline optimum and the infinite-cache bound put each hit rate in proportion. With a host
tier every run has it, and two variants of the main configuration join them: without the
host tier ("device only") and as one device cache of the combined size ("one cache").
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from radixserve.benchmark.optimum import WorkloadBounds
from radixserve.benchmark.retention import (
    AdaptiveBoost,
    DefaultRetention,
    HitBoost,
    RetentionRule,
    ReuseBoost,
    SharedPrefixRetention,
    TailDemotion,
)
from radixserve.benchmark.simulate import SimConfig, SimResult, simulate
from radixserve.benchmark.workloads import Workload

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
REUSE_BOOST_WINDOW = 16  # history window, in multiples of the cache's pages
RETENTION_RULES = ("default", "system-prompt", "tail-demotion", "hit-boost", "reuse-boost", "adaptive")
STUDY_RULES = ("tail-demotion", "hit-boost", "reuse-boost")


def make_retention(name: str, *, page_size: int, capacity_tokens: int) -> RetentionRule:
    """A fresh retention rule by name (rules keep per-run state, so one per run)."""
    if name == "default":
        return DefaultRetention()
    if name == "system-prompt":
        return SharedPrefixRetention()
    if name == "tail-demotion":
        return TailDemotion()
    if name == "hit-boost":
        return HitBoost()
    if name == "reuse-boost":
        return ReuseBoost(page_size, REUSE_BOOST_WINDOW * max(capacity_tokens // page_size, 1))
    if name == "adaptive":
        return AdaptiveBoost(page_size, REUSE_BOOST_WINDOW * max(capacity_tokens // page_size, 1))
    raise ValueError(f"retention: unknown {name!r}, expected one of {sorted(RETENTION_RULES)}")


def suite_configs(main: SimConfig, retention: str, *, baselines: bool = True,
                  study: bool = False) -> list[tuple[SimConfig, str]]:
    """(config, retention rule name) pairs to run: the main one, baselines, study rules.

    Retention rules are built per run by name (`make_retention`), since they keep state.
    """
    plan: list[tuple[SimConfig, str]] = []
    if baselines:
        plan.append((replace(main, use_cache=False), "default"))
        if main.sequential:
            plan.append((replace(main, eviction_policy="lru"), "default"))
        else:
            plan += [(replace(main, schedule_policy=p, eviction_policy="lru"), "default") for p in SCHEDULE_POLICIES]
        plan.append((replace(main, eviction_policy="priority"), "system-prompt"))
    plan.append((main, retention))
    if main.window:  # next to the same model without a window
        plan.append((replace(main, window=None), retention))
    if main.host_num_pages:
        plan.append((replace(main, host_capacity_tokens=0, tag="device only"), retention))
        plan.append((replace(main, capacity_tokens=main.capacity_tokens + main.host_capacity_tokens,
                             host_capacity_tokens=0, tag="one cache of device+host"), retention))
    if study:
        plan += [(replace(main, eviction_policy="priority"), rule) for rule in STUDY_RULES]
    unique: dict[str, tuple[SimConfig, str]] = {}
    for config, rule in plan:
        key = config.label(rule)
        unique.setdefault(key, (config, rule))
    return list(unique.values())


def run_suite(workload: Workload, capacity_tokens: int, main: SimConfig, retention: str,
              bounds: WorkloadBounds, *, dfs_bounds: WorkloadBounds | None = None,
              baselines: bool = True, study: bool = False, host_capacity_tokens: int = 0,
              on_result: Callable[[SimResult], None] | None = None) -> dict[str, object]:
    """Simulates every configuration of the suite at `capacity_tokens` of device memory
    (plus `host_capacity_tokens` of host tier); returns the JSON object `radixserve bench
    simulate` writes for one capacity.

    `optimal_hit_rate` is the offline optimum in arrival order at the whole capacity (device
    plus host: one cache of that size bounds two tiers of it), a bound for every eviction
    policy when requests run in that order; a scheduler that reorders a batch can beat it,
    so for batch workloads `dfs_bounds` (the same requests in DFS order) adds
    `optimal_dfs_hit_rate`, the optimum once requests sharing a prefix run together.
    `fraction_of_optimum` divides by the larger of the two. With a host tier,
    `optimal_device_hit_rate` is the optimum of the device capacity alone.
    """
    main = replace(main, capacity_tokens=capacity_tokens, host_capacity_tokens=host_capacity_tokens)
    device_capacity = main.num_pages * main.page_size
    effective_capacity = device_capacity + main.host_num_pages * main.page_size
    optimum = bounds.optimum(effective_capacity).hit_rate
    optimum_device = bounds.optimum(device_capacity).hit_rate if main.host_num_pages else optimum
    optimum_dfs = dfs_bounds.optimum(effective_capacity).hit_rate if dfs_bounds else None
    reference = max(optimum, optimum_dfs or 0.0)  # what "fraction of the optimum" divides by
    infinite = bounds.infinite().hit_rate
    runs: list[dict[str, object]] = []
    main_entry: dict[str, object] = {}
    for config, rule in suite_configs(main, retention, baselines=baselines, study=study):
        config = replace(config, retention=make_retention(
            rule, page_size=config.page_size, capacity_tokens=config.capacity_tokens + config.host_capacity_tokens))
        result = simulate(workload, config)
        entry = result.to_dict()
        entry["fraction_of_optimum"] = result.hit_rate / reference if reference else None
        runs.append(entry)
        if entry["label"] == main.label(retention):
            main_entry = entry
        if on_result is not None:
            on_result(result)
    return {
        "workload": workload.name, "workload_params": workload.params,
        "requests": len(workload.requests), "prompt_tokens": workload.prompt_tokens,
        "capacity_tokens": capacity_tokens, "host_capacity_tokens": host_capacity_tokens,
        "page_size": main.page_size, "num_pages": main.num_pages, "host_num_pages": main.host_num_pages,
        "hit_rate": main_entry["hit_rate"], "device_hit_rate": main_entry["device_hit_rate"],
        "host_hit_rate": main_entry["host_hit_rate"], "offloaded_tokens": main_entry["offloaded_tokens"],
        "loaded_tokens": main_entry["loaded_tokens"],
        "optimal_hit_rate": optimum, "optimal_device_hit_rate": optimum_device, "optimal_dfs_hit_rate": optimum_dfs,
        "infinite_hit_rate": infinite,
        "fraction_of_optimum": main_entry["fraction_of_optimum"], "main": main_entry["label"],
        "runs": runs,
    }
