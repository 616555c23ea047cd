"""`bench simulate --replicas N --router R`: N simulated replicas behind the served routing code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.benchmark.cluster_sim import ClusterSimulator, run_cluster_suite, simulate_cluster
from radixserve.benchmark.simulate import SimConfig, simulate
from radixserve.benchmark.workloads import make_workload
from radixserve.cli import main

SMALL_GSP = dict(num_groups=16, prompts_per_group=8, system_len=512, question_len=64, output_len=16)
SMALL_AGENT = dict(num_agents=8, num_steps=5, system_len=512, task_len=64, tool_len=128, output_len=16)


def config(capacity: int) -> SimConfig:
    return SimConfig(capacity, page_size=16, schedule_policy="lpm", eviction_policy="priority")


@pytest.mark.parametrize("router", ["cache-aware", "power-of-two", "round-robin", "prefix-affinity"])
def test_one_replica_is_the_plain_simulator(router: str) -> None:
    workload = make_workload("gsp", **SMALL_GSP)
    plain = simulate(workload, config(6000))
    clustered = simulate_cluster(workload, config(6000), 1, router)
    assert clustered.result.hit_tokens == plain.hit_tokens > 0
    assert clustered.result.makespan_s == plain.makespan_s
    assert clustered.replica_requests == [len(workload.requests)]


def test_router_index_equals_every_simulated_tree() -> None:
    workload = make_workload("agent", **SMALL_AGENT)
    cluster = ClusterSimulator(workload, config(1600), 3, "cache-aware")
    cluster.run()
    for key, sim in cluster.sims.items():
        assert sim.tree.stats()["evicted_pages"] > 0  # removals were reported too
        assert cluster.state.index.page_set(key) == sim.tree.cached_page_hashes() != set()
    assert cluster.state.in_flight == {key: 0 for key in cluster.sims}


@pytest.mark.parametrize("name, capacity", [("gsp", 30_000), ("multiturn", 20_000), ("agent", 25_000)])
def test_cache_aware_reaches_the_ideal_where_power_of_two_does_not(name: str, capacity: int) -> None:
    """The issue's target on the default workloads: four replicas of `capacity` tokens,
    cache-aware within 5% of one replica with 4x the memory and balanced within 1.5;
    power-of-two far below (every replica must cache everything: 69-79% of the ideal under
    the engine's scheduler, which the simulator drives)."""
    workload = make_workload(name)
    result = run_cluster_suite(workload, config(capacity), 4, ["cache-aware", "power-of-two"])
    ideal = result["ideal_hit_rate"]
    cache_aware, power_of_two = result["runs"]
    assert cache_aware["hit_rate"] >= 0.95 * ideal, result
    assert cache_aware["replica_imbalance"] <= 1.5
    assert sum(cache_aware["replica_requests"]) == len(workload.requests)
    assert power_of_two["hit_rate"] < 0.8 * ideal


def test_simulate_cli_json_has_cluster_fields(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    assert main(["bench", "simulate", "--workload", "gsp", "--workload-args", "num_groups=4,prompts_per_group=4,"
                 "system_len=128,question_len=32,output_len=4", "--capacity-tokens", "2k", "--replicas", "2",
                 "--router", "round-robin,cache-aware", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["replicas"], result["router"]) == (2, "round-robin")
    assert result["replica_imbalance"] == 1.0 and 0 < result["hit_rate"] <= result["ideal_hit_rate"]
    assert [run["router"] for run in result["runs"]] == ["round-robin", "cache-aware"]
    assert main(["bench", "simulate", "--workload", "gsp", "--capacity-tokens", "2k", "--replicas", "2",
                 "--router", "random"]) == 2
