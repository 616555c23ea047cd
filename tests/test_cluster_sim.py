"""`bench simulate --replicas N --router R`: N simulated replicas behind the served routing code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.benchmark.cluster_sim import ClosedLoop, ClusterSimulator, run_cluster_suite, simulate_cluster
from radixserve.benchmark.simulate import SimConfig, simulate
from radixserve.benchmark.workloads import make_workload
from radixserve.cli import main
from radixserve.cluster.routing import CacheAwareConfig

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


@pytest.mark.parametrize("name, capacity, params", [("gsp", 7_500, {"num_groups": 16}), ("multiturn", 20_000, {}),
                                                    ("agent", 25_000, {})])
def test_cache_aware_reaches_the_ideal_where_power_of_two_does_not(name: str, capacity: int, params: dict) -> None:
    """The issue's target on the default workloads: four replicas of `capacity` tokens,
    cache-aware within 5% of one replica with 4x the memory and balanced within 1.5;
    power-of-two far below (every replica must cache everything: 69-79% of the ideal under
    the engine's scheduler, which the simulator drives). gsp at a quarter of its groups and a
    quarter of the memory: the same pressure per group, in a quarter of the time (96.7% of
    the ideal, power-of-two 64.2%; at half of both 98.9% and 75.8%)."""
    workload = make_workload(name, **params)
    result = run_cluster_suite(workload, config(capacity), 4, ["cache-aware", "power-of-two"])
    ideal = result["ideal_hit_rate"]
    cache_aware, power_of_two = result["runs"]
    assert cache_aware["hit_rate"] >= 0.95 * ideal, result
    assert cache_aware["replica_imbalance"] <= 1.5
    assert sum(cache_aware["replica_requests"]) == len(workload.requests)
    assert power_of_two["hit_rate"] < 0.8 * ideal


def test_closed_loop_releases_as_bench_serve_does() -> None:
    """Three clients over two 2-turn chats (A1 B1 A2 B2): A1 and B1 go at once, the third
    client holds A2 until A1 ends, and B2 waits for B1 though a client is free."""
    workload = make_workload("multiturn", num_clients=2, num_turns=2, num_system_prompts=1, system_len=32,
                             message_len=8, output_len=4)
    a1, b1, a2, b2 = workload.requests
    assert (a2.parent, b2.parent) == (a1.index, b1.index)
    loop = ClosedLoop(workload, 3)
    assert loop.start() == [(0.0, a1.index), (0.0, b1.index)]
    assert loop.ended(a1, 5.0) == [(5.0, a2.index)]
    assert loop.ended(b1, 6.0) == [(6.0, b2.index)]
    assert loop.ended(a2, 7.0) == loop.ended(b2, 8.0) == []
    single = ClosedLoop(workload, 1)
    assert single.start() == [(0.0, a1.index)]
    assert single.ended(a1, 1.0) == [(1.0, b1.index)]
    with pytest.raises(ValueError, match="concurrency"):
        ClosedLoop(workload, 0)


LARGE_MULTITURN = dict(num_clients=32, num_turns=6, num_system_prompts=4, system_len=256, message_len=64,
                       output_len=8)
SLOW_HALF = [1.0, 0.5, 1.0, 0.5]


def test_conversation_guard_balances_replicas_of_unequal_speed() -> None:
    """Served-like: 32 chats at 16 in flight over 4 replicas of which two run at half speed.
    Placed by requests in flight alone (no conversation guard, no time-decayed balance, cached slack 3), the slow
    replicas' clients advance slower, the fast ones look free and start more conversations,
    whose turns all follow them: 36 to 60 requests per replica (1.67). Balancing the
    conversations started gives 48 each, at the ideal's hit rate."""
    workload = make_workload("multiturn", vocab_size=512, **LARGE_MULTITURN)
    cfg = SimConfig(5120, page_size=16, max_batch_tokens=2048, prefill_tokens_per_s=20_000)
    result = run_cluster_suite(workload, cfg, 4, ["cache-aware"], concurrency=16, speeds=SLOW_HALF)
    assert result["runs"][0]["replica_requests"] == [48, 48, 48, 48]
    assert result["hit_rate"] >= 0.99 * result["ideal_hit_rate"]
    unguarded = simulate_cluster(workload, cfg, 4, "cache-aware", concurrency=16, speeds=SLOW_HALF,
                                 routing=CacheAwareConfig(share_abs=float("inf"), cached_balance_abs=3,
                                                          recent_abs=float("inf")))
    assert unguarded.replica_imbalance > 1.5


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
    closed = tmp_path / "closed.json"
    assert main(["bench", "simulate", "--workload", "gsp", "--workload-args", "num_groups=4,prompts_per_group=4,"
                 "system_len=128,question_len=32,output_len=4", "--capacity-tokens", "2k", "--replicas", "2",
                 "--concurrency", "3", "--replica-speeds", "1,0.5", "--router-kwargs", "share_abs=inf",
                 "--no-progress", "--json", str(closed)]) == 0
    result = json.loads(closed.read_text())
    assert (result["concurrency"], result["replica_speeds"]) == (3, [1.0, 0.5])
    assert sum(result["runs"][0]["replica_requests"]) == 16
    for bad in (["--replica-speeds", "1,0"], ["--replica-speeds", "1"], ["--replica-speeds", "x,1"],
                ["--router-kwargs", "no_such=1"]):  # (--concurrency 0: an argparse error, test_benchmark_cli)
        assert main(["bench", "simulate", "--workload", "gsp", "--capacity-tokens", "2k", "--replicas", "2",
                     *bad]) == 2, bad
    assert main(["bench", "simulate", "--workload", "gsp", "--capacity-tokens", "2k", "--concurrency", "2"]) == 2


@pytest.mark.parametrize("num_toolsets", [2, 3, 4])
def test_a_closed_loop_of_tool_agents_is_routed_at_least_as_well_as_round_robin(num_toolsets: int) -> None:
    """64 tool-calling agents started together, each step resending its conversation: every
    replica's clients finish in step. Round robin keeps each agent on one replica by its strict
    order; the cache-aware rule must not do worse. Before the busy guard's margin of the mean
    in flight and the in-flight share, it moved next turns of the replica whose clients were
    served first (89.97% vs 90.76% with two toolsets) and spread each toolset over every replica."""
    workload = make_workload("tools", num_agents=64, num_toolsets=num_toolsets)
    result = run_cluster_suite(workload, SimConfig(500_000), 4, ["cache-aware", "round-robin"])
    cache_aware, round_robin = result["runs"]
    assert cache_aware["hit_rate"] >= round_robin["hit_rate"]
    assert cache_aware["windowed_imbalance"] <= 1.2
