"""bench compare: the in-process mode (the engine replays a workload without HTTP) and the
servers it launches."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from radixserve import Engine
from radixserve.benchmark.compare import launch_server, run_comparison, with_varied_output_lengths
from radixserve.benchmark.inprocess import breakdown_table, run_in_process
from radixserve.benchmark.workloads import make_workload
from radixserve.engine.timing import SECTIONS


def small_gsp(vocab_size: int = 300):
    return make_workload("gsp", num_groups=2, prompts_per_group=3, system_len=16, question_len=4,
                         output_len=3, seed=0, vocab_size=vocab_size)


def test_in_process_replay_completes_every_request_and_reports_its_breakdown(tiny_llama_dir: Path) -> None:
    workload = small_gsp()
    runs = {}
    for label, cache, isolate in (("on", True, False), ("off", False, False), ("isolated", True, True)):
        engine = Engine(str(tiny_llama_dir), page_size=4, num_pages=256, enable_prefix_cache=cache,
                        debug_checks=True)
        runs[label] = run_in_process(engine, workload, concurrency=2, isolate=isolate).summary()
    for summary in runs.values():
        assert summary["completed"] == summary["requests"] == 6 and summary["errors"] == 0
        assert summary["completion_tokens"] == 6 * 3
        assert summary["prompt_tokens"] == workload.prompt_tokens
        breakdown = summary["step_breakdown_s"]
        assert set(breakdown) == {*SECTIONS, "steps"} and breakdown["steps"] > 0
        assert all(breakdown[s] >= 0 for s in SECTIONS)
        assert sum(breakdown[s] for s in SECTIONS) <= summary["step_time_s_total"] + 1e-6
    # Two groups of three share a 16-token system prompt: every later member hits it
    # (page size 4, so all 16 tokens), whatever the order.
    assert runs["on"]["cached_tokens"] == 4 * 16
    assert runs["off"]["cached_tokens"] == runs["isolated"]["cached_tokens"] == 0
    table = breakdown_table({"on": runs["on"]})
    assert table.startswith("| run | steps | schedule | metadata | model |") and "| on |" in table


def test_comparison_in_process_takes_medians_and_ratios_per_round(tiny_llama_dir: Path) -> None:
    result = run_comparison(small_gsp(), tiny_llama_dir, concurrency=2, batch_size=3,
                            modes=("in-process",), repeat=2, server_args=["--page-size", "4"])
    assert set(result["runs"]) == {"in-process, cache on", "in-process, cache off", "in-process, cache on, 0% reuse"}
    assert len(result["per_repeat"]) == 2
    ratios = result["ratios"]
    for run in result["runs"]:
        per_round = [r[run]["total_token_throughput"] / r["transformers"]["total_token_throughput"]
                     for r in result["per_repeat"]]
        assert ratios[f"throughput: {run} / transformers"] == float(np.median(per_round))
    assert result["runs"]["in-process, cache on"]["hit_rate"] > 0
    assert result["hf_static_batches"]["requests"] == 6


def test_varied_output_lengths_keep_the_mean_and_the_prompts() -> None:
    workload = make_workload("gsp", num_groups=4, prompts_per_group=50, system_len=4, question_len=2,
                             output_len=20, seed=1)
    varied = with_varied_output_lengths(workload, seed=3)
    lengths = np.array([r.output_len for r in varied.requests])
    assert lengths.min() >= 1 and lengths.max() <= 39 and len(set(lengths.tolist())) > 20
    assert abs(lengths.mean() - 20) < 2
    assert all(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(workload.requests, varied.requests))
    assert [r.output_len for r in with_varied_output_lengths(workload, seed=3).requests] == lengths.tolist()


def test_launched_servers_take_no_api_key_from_the_environment(tiny_llama_dir: Path, monkeypatch) -> None:
    """bench compare and bench tiers talk to their own servers without a key: an operator's
    RADIXSERVE_API_KEY must not make every request a 401."""
    monkeypatch.setenv("RADIXSERVE_API_KEY", "operator-secret")
    with launch_server(tiny_llama_dir, ["--num-pages", "16"]) as url:
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
