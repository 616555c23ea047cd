"""Workload families (benchmark/families.py) and the policy matrix (`bench matrix --quick`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from radixserve.benchmark.families import FAMILIES
from radixserve.benchmark.cli_simulate import EVICTION_POLICIES
from radixserve.benchmark.cluster_sim import simulate_cluster
from radixserve.benchmark.matrix import Cell, build_workload, matrix_summary, matrix_workloads, routing_shares, run_cell
from radixserve.benchmark.optimum import WorkloadBounds
from radixserve.benchmark.simulate import SimConfig, simulate
from radixserve.benchmark.suite import make_retention
from radixserve.benchmark.workloads import WORKLOADS, make_workload
from radixserve.cli import main

SMALL = dict(scale=1 / 16, token_scale=1 / 16)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_is_seeded_registered_and_well_formed(name: str) -> None:
    assert name in WORKLOADS
    first, again = make_workload(name, **SMALL), make_workload(name, **SMALL)
    other = make_workload(name, **SMALL, seed=1)
    assert [r.prompt_ids.tolist() for r in first.requests] == [r.prompt_ids.tolist() for r in again.requests]
    assert [r.prompt_ids.tolist() for r in first.requests] != [r.prompt_ids.tolist() for r in other.requests]
    times = [r.arrival_time for r in first.requests]
    assert times == sorted(times) and all(r.index == i for i, r in enumerate(first.requests))
    for r in first.requests:
        if r.parent is not None:  # a turn extends its parent's prompt and reply, and comes later
            parent = first.requests[r.parent]
            assert r.parent < r.index and r.arrival_time >= parent.arrival_time
            history = np.concatenate([parent.prompt_ids, parent.output_ids])
            assert np.array_equal(r.prompt_ids[: len(history)], history)
        assert r.client_id == -1  # like a trace: no declared session


def test_the_scan_never_repeats_and_chats_pause_for_minutes() -> None:
    scan = make_workload("scan", **SMALL)
    assert WorkloadBounds(scan).infinite().hit_tokens == 0
    chat = make_workload("chat-gaps", scale=1 / 4, token_scale=1 / 16)
    gaps = [r.arrival_time - chat.requests[r.parent].arrival_time for r in chat.requests if r.parent is not None]
    assert np.median(gaps) > 60 and max(gaps) > 10 * np.median(gaps)  # heavy-tailed, in minutes


def test_zipf_documents_are_popular_by_rank() -> None:
    docs = make_workload("zipf-docs", scale=1 / 4, token_scale=1 / 16)
    counts = np.bincount([r.group_id for r in docs.requests])
    assert counts[0] > 4 * np.median(counts[counts > 0])


def test_every_matrix_workload_builds_scaled() -> None:
    for name in matrix_workloads():
        full, small = build_workload(name, 1 / 16), build_workload(name, 1 / 32)
        assert full.requests and small.prompt_tokens < full.prompt_tokens, name


def test_matrix_quick_runs_every_kind_of_cell(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m.json"
    # One workload: every kind of cell is there (zipf-docs would add 12 s and no kind of cell).
    assert main(["bench", "matrix", "--quick", "--workloads", "gsp", "--no-progress", "--json", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    shapes = {(c["workload"], c["host_tokens"] > 0, c["replicas"]) for c in cells}
    assert shapes == {(w, host, n) for w in ("gsp",) for host, n in ((False, 1), (False, 4), (True, 1))}
    for c in cells:
        assert set(c["hit_rates"]) == {"adaptive", "lru", "reuse-boost"}
        assert c["hit_rates"]["adaptive"] > 0  # the quick lengths leave gsp's system prompt pages to hit
        assert all(0 <= rate <= c["optimum"] + 1e-9 for rate in c["hit_rates"].values()) or c["replicas"] > 1
        assert c["below_lru"] == (c["hit_rates"]["adaptive"] < c["hit_rates"]["lru"])
        assert (c["imbalance"] is None) == (c["replicas"] == 1)
    printed = capsys.readouterr().out
    assert "| workload | capacity | tiers | replicas | default (adaptive) |" in printed and "cells:" in printed


def test_the_summary_sets_replicas_against_one_cache_of_their_memory() -> None:
    """Each multi-replica cell meets its own ideal (one replica of the combined memory, the
    same serving loop); one-replica cells and cells without an ideal are left out. The
    request balance is counted over every multi-replica cell."""
    def cell(name: str, capacity: int, replicas: int, rate: float, ideal: float | None = None,
             imbalance: float | None = None) -> Cell:
        return Cell(name, capacity, 0, replicas, {"adaptive": rate, "lru": rate}, ideal=ideal, imbalance=imbalance)

    cells = [cell("a", 1000, 4, 0.45, ideal=0.50, imbalance=1.2), cell("a", 4000, 1, 0.99),
             cell("a", 2000, 4, 0.58, ideal=0.60, imbalance=1.5), cell("a", 4000, 4, 0.7, imbalance=1.75),
             cell("b", 1000, 4, 0.0, ideal=0.0, imbalance=1.1)]
    shares = routing_shares(cells)
    assert [(c.capacity_tokens, round(share, 4)) for c, share in shares] == [(1000, 0.9), (2000, 0.9667)]
    summary = matrix_summary(cells)
    assert "at least 95% of its hit rate in 1 of 2 cells; lowest 90.0% (a 1k x 4: 45.0% vs 50.0%)" in summary
    # The balance half of the target counts every cell of several replicas (a scan's too).
    assert "over any 1,000 routings at most 1.5 in 3 of 4 cells; worst 1.75 (a 4k x 4)." in summary


def test_a_replicas_cell_is_measured_against_one_cache_serving_the_same_requests() -> None:
    """The ideal of a multi-replica cell is one replica of the combined memory under the
    same serving loop, not the sequential one-replica cell of that capacity (which pays no
    serving loop): on zipf-docs the two differ, and the cell's ideal is the serving one."""
    workload = build_workload("zipf-docs", 1 / 32, 1 / 16)  # 250 requests
    bounds = WorkloadBounds(workload)
    split = run_cell(workload, Cell("zipf-docs", 1953, 0, 4), bounds, ["adaptive", "lru"], 16)
    sequential = run_cell(workload, Cell("zipf-docs", 4 * 1953, 0, 1), bounds, ["adaptive", "lru"], 16)
    assert sequential.ideal is None and split.to_dict()["ideal"] == split.ideal
    eviction, retention = EVICTION_POLICIES["adaptive"]
    # Its imbalance is the default rule's run's worst window.
    run = simulate_cluster(workload, SimConfig(1953, page_size=16, eviction_policy=eviction), 4, "cache-aware",
                           retention=retention)
    assert run.result.hit_rate == split.default and split.imbalance == run.windowed_imbalance >= 1.0
    assert sequential.imbalance is None and split.to_dict()["imbalance"] == split.imbalance
    serving = simulate(workload, SimConfig(4 * 1953, page_size=16, eviction_policy=eviction,
                                           retention=make_retention(retention, page_size=16,
                                                                    capacity_tokens=4 * 1953))).hit_rate
    assert split.ideal == serving
    assert abs(serving - sequential.default) > 0.02
    assert routing_shares([split, sequential]) == [(split, split.default / serving)]


def test_matrix_host_cells_copy_by_the_write_policy_asked_for(tmp_path: Path) -> None:
    """The trace's first quarter at 16M (scaled) with an 8M host: exclusive tiers held more
    of it than write-back's (13.36%), whose loaded pages kept their host copies; with a host
    smaller than the device, those copies now give way to the pages the device evicts, and
    write-back holds as much as exclusive (exact rates: the simulation is deterministic)."""
    rates = {}
    for policy in ("write-back", "exclusive"):
        out = tmp_path / f"{policy}.json"
        assert main(["bench", "matrix", "--workloads", "mooncake", "--capacity-tokens", "16M", "--replicas", "1",
                     "--fixed-rules", "lru", "--host-write-policy", policy, "--no-progress", "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["host_write_policy"] == policy
        (host_cell,) = [c for c in report["cells"] if c["host_tokens"]]
        rates[policy] = round(100 * host_cell["hit_rates"]["lru"], 2)
    assert rates == {"write-back": 14.16, "exclusive": 14.16}


def test_every_quick_row_measures_the_cache() -> None:
    """At the old quick settings (lengths 1/256, page 16) gsp's system prompt was 8 tokens and
    zipf-docs' documents about 12, under one page: gsp hit 0% in every cell against an 83.3%
    optimum, and one-replica zipf-docs stayed at 27.6% at any capacity. Each quick workload
    now hits, and more with the larger quick capacity."""
    from radixserve.benchmark.cli_matrix import QUICK_CAPACITIES, QUICK_COUNT_SCALE, QUICK_SCALE, QUICK_WORKLOADS
    from radixserve.benchmark.report import parse_tokens

    small, large = (int(parse_tokens(c) * QUICK_SCALE * QUICK_COUNT_SCALE) for c in QUICK_CAPACITIES.split(","))
    for name in QUICK_WORKLOADS:
        workload = build_workload(name, QUICK_SCALE, QUICK_COUNT_SCALE)
        bounds = WorkloadBounds(workload)
        rates = [run_cell(workload, Cell(name, capacity, 0, 1), bounds, ["adaptive"], 16).default
                 for capacity in (small, large)]
        assert 0 < rates[0] < rates[1], (name, rates)


def test_quick_refuses_the_flags_it_sets(capsys) -> None:
    """--quick silently replaced --capacity-tokens, --scale and --count-scale."""
    for flags in (["--capacity-tokens", "1M"], ["--scale", "0.1"], ["--count-scale", "0.5"]):
        assert main(["bench", "matrix", "--quick", "--workloads", "gsp", "--no-progress", *flags]) == 2
        err = capsys.readouterr().err
        assert f"error: --quick sets {flags[0]} itself" in err and err.count("\n") == 1
