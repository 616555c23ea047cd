"""bench compare: the in-process mode (the engine replays a workload without HTTP) and the
servers it launches."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from radixserve import Engine
from radixserve.benchmark.compare import hf_static_batches, launch_server, run_comparison, token_mismatch
from radixserve.benchmark.inprocess import breakdown_table, run_in_process
from radixserve.benchmark.lengths import spread_lengths, with_varied_output_lengths, with_varied_prompt_lengths
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


def test_varied_output_lengths_keep_the_total_and_the_prompts() -> None:
    workload = make_workload("gsp", num_groups=4, prompts_per_group=50, system_len=4, question_len=2,
                             output_len=20, seed=1)
    varied = with_varied_output_lengths(workload, seed=3)
    lengths = np.array([r.output_len for r in varied.requests])
    assert lengths.sum() == 200 * 20  # the same tokens, spread
    assert lengths.min() >= 1 and lengths.max() <= 39 and len(set(lengths.tolist())) > 20
    assert lengths.min() <= 2 and lengths.max() >= 38  # evenly over 1 .. 39
    assert all(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(workload.requests, varied.requests))
    assert [r.output_len for r in with_varied_output_lengths(workload, seed=3).requests] == lengths.tolist()
    assert [r.output_len for r in with_varied_output_lengths(workload, seed=4).requests] != lengths.tolist()


def test_spread_lengths_keep_the_sum_exactly_and_lognormal_has_a_long_tail() -> None:
    rng = np.random.default_rng(0)
    for lengths in (np.full(1000, 64), np.full(7, 3), np.array([1, 1, 1]), np.arange(1, 40)):
        for distribution in ("uniform", "lognormal"):
            spread = spread_lengths(lengths, distribution, rng)
            assert spread.sum() == lengths.sum() and spread.min() >= 1 and len(spread) == len(lengths)
    assert spread_lengths(np.array([1, 1, 1]), "uniform", rng).tolist() == [1, 1, 1]
    tail = spread_lengths(np.full(1000, 64), "lognormal", rng)
    # lognormal(sigma 1) scaled to mean 64: median about 0.6 x 64, about 5% above 3 x 64.
    assert 30 <= np.median(tail) <= 48 and 25 <= (tail > 3 * 64).sum() <= 90
    flat = spread_lengths(np.full(1000, 64), "uniform", rng)
    assert 56 <= np.median(flat) <= 72 and flat.min() <= 2 and flat.max() == 127 and (flat > 3 * 64).sum() == 0
    with pytest.raises(ValueError, match="distribution"):
        spread_lengths(np.full(3, 4), "zipf", rng)
    with pytest.raises(ValueError, match=">= 1"):
        spread_lengths(np.array([0, 4]), "uniform", rng)


@pytest.mark.parametrize("distribution", ["uniform", "lognormal"])
def test_varied_prompts_keep_the_total_and_the_shared_prefixes(distribution: str) -> None:
    workload = make_workload("gsp", num_groups=4, prompts_per_group=25, system_len=32, question_len=16,
                             output_len=5, seed=2, vocab_size=500)
    varied = with_varied_prompt_lengths(workload, vocab_size=500, seed=1, distribution=distribution)
    assert varied.prompt_tokens == workload.prompt_tokens
    questions = np.array([r.prompt_len - 32 for r in varied.requests])
    assert questions.min() >= 1 and len(set(questions.tolist())) > 15 and questions.max() >= 2 * 16 - 1
    for before, after in zip(workload.requests, varied.requests):
        assert np.array_equal(after.prompt_ids[:32], before.prompt_ids[:32])  # the system prompt
        cut = min(before.prompt_len, after.prompt_len)
        assert np.array_equal(after.prompt_ids[:cut], before.prompt_ids[:cut])  # cut or extended
        assert after.prompt_ids.dtype == np.int32 and after.prompt_ids.min() >= 10 and after.prompt_ids.max() < 500
        assert (after.shared_len, after.group_id, after.output_len) == (32, before.group_id, 5)
    # Reuse is what it was: members of a group share their system prompt and nothing more.
    firsts = {(r.group_id, int(r.prompt_ids[32])) for r in varied.requests}
    assert len(firsts) == 100
    with pytest.raises(ValueError, match="earlier turns"):
        with_varied_prompt_lengths(make_workload("multiturn", num_clients=2, num_turns=2), 32000)


def test_static_batches_count_useful_tokens_only(tiny_llama_dir: Path) -> None:
    """Padding and the tokens a row generates past its own output length (to its batch's
    longest) are work, not throughput: both sides must count the same tokens."""
    workload = with_varied_output_lengths(with_varied_prompt_lengths(small_gsp(), 300, seed=0), seed=0)
    prompts = [r.prompt_len for r in workload.requests]
    outputs = [r.output_len for r in workload.requests]
    assert len(set(prompts)) > 1 and len(set(outputs)) > 1
    hf = hf_static_batches(tiny_llama_dir, workload, batch_size=4).summary()
    assert hf["prompt_tokens"] == sum(prompts) and hf["completion_tokens"] == sum(outputs)
    assert hf["computed_tokens"] == 4 * (max(prompts[:4]) + max(outputs[:4])) + 2 * (max(prompts[4:]) + max(outputs[4:]))
    engine = Engine(str(tiny_llama_dir), page_size=4, num_pages=256)
    run = run_in_process(engine, workload, concurrency=3).summary()
    assert token_mismatch(run, hf) is None
    assert token_mismatch({**run, "completion_tokens": hf["computed_tokens"]}, hf) is not None


def test_launched_servers_take_no_api_key_from_the_environment(tiny_llama_dir: Path, monkeypatch) -> None:
    """bench compare and bench tiers talk to their own servers without a key: an operator's
    RADIXSERVE_API_KEY must not make every request a 401."""
    monkeypatch.setenv("RADIXSERVE_API_KEY", "operator-secret")
    with launch_server(tiny_llama_dir, ["--num-pages", "16"]) as url:
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200


def test_a_run_that_completed_nothing_is_reported_not_a_crash() -> None:
    """Every HTTP request refused (say, the server wants an API key): `_median_ratios`
    divided by the run's None latency (TypeError) and 0 tok/s, and the command wrote no table,
    no JSON. Now its ratios are left out, its row is marked and the failure is reported. (The
    summaries as `run_comparison` has them, without launching three servers for it.)"""
    from radixserve.benchmark.cli_compare import _report_failures, _row_label
    from radixserve.benchmark.compare import _median_ratios, failed_requests, median_summary
    from radixserve.benchmark.serve import RequestRecord, ServeResult

    refused = ServeResult("u", "gsp", [RequestRecord(i, error="HTTP 401") for i in range(2)], 0.5)
    done = ServeResult("u", "gsp", [RequestRecord(i, prompt_tokens=12, completion_tokens=2, ttft_s=0.1,
                                                  latency_s=0.2, finished_s=0.2) for i in range(2)], 0.5)
    rounds = [{"transformers": done.summary(), "http, cache on": refused.summary(), "http, cache off": done.summary()}]
    ratios = _median_ratios(rounds)
    assert ratios == {"throughput: http, cache on / transformers": 0.0,  # no latency ratio: it had none
                      "throughput: http, cache off / transformers": 1.0, "throughput: http, cache on / cache off": 0.0}
    on = median_summary([rounds[0]["http, cache on"]])
    assert _row_label("radixserve http, cache on", on) == "radixserve http, cache on (FAILED: 0 of 2 completed)"
    assert failed_requests(refused) == "2 of 2 requests failed, e.g. HTTP 401"
    assert _report_failures({"server_failures": {}, "request_failures": {"http, cache on": failed_requests(refused)}})


def test_host_tier_ratios_skip_a_side_that_completed_nothing() -> None:
    from radixserve.benchmark.host_tier import tier_ratios
    from radixserve.benchmark.serve import RequestRecord, ServeResult

    failed = ServeResult("u", "w", [RequestRecord(0, error="HTTP 401")], 1.0).summary()
    done = ServeResult("u", "w", [RequestRecord(0, prompt_tokens=4, completion_tokens=2, ttft_s=0.1,
                                                latency_s=0.2)], 1.0).summary()
    ratios = tier_ratios(done, failed, None, None)
    assert ratios == {"ttft mean: device only / host tier": None, "ttft p99: device only / host tier": None,
                      "throughput: host tier / device only": 0.0,
                      "prefill time per token / copy time per token": None}
    assert tier_ratios(failed, done, None, None)["throughput: host tier / device only"] is None


def test_sigterm_stops_the_server_the_benchmark_launched(tiny_llama_dir: Path) -> None:
    """`timeout`, a CI cancel or `kill PID` send SIGTERM, whose default handler ends Python
    without running `launch_server`'s `finally`: the `radixserve serve` it started was left
    running, reparented to PID 1."""
    import signal
    import subprocess
    import sys

    import psutil

    script = ("import signal, sys\n"
              "from radixserve.benchmark.compare import launch_server\n"
              "with launch_server(sys.argv[1], ['--num-pages', '16', '--page-size', '4']) as url:\n"
              "    print(url, flush=True)\n"
              "    signal.pause()\n")
    bench = subprocess.Popen([sys.executable, "-c", script, str(tiny_llama_dir)], stdout=subprocess.PIPE,
                             text=True)
    server = None
    try:
        url = bench.stdout.readline().strip()  # printed once the server answers /health
        assert url.startswith("http://127.0.0.1:"), url
        (server,) = psutil.Process(bench.pid).children()
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=120) == 128 + signal.SIGTERM
        try:
            server.wait(timeout=20)  # the fixed code has waited for it before exiting
        except psutil.TimeoutExpired:
            pytest.fail(f"server {server.pid} still running after the benchmark's SIGTERM")
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        if server is not None and server.is_running():
            server.kill()


def test_latency_ratio_counts_queueing_on_both_sides(tiny_llama_dir: Path) -> None:
    """transformers' latency ran from the run's start (the wait for earlier batches included),
    the engine's from the request's release by the closed loop (its wait behind --concurrency
    left out): an engine slower than transformers showed a 4.6x "better" latency."""
    workload = small_gsp()
    engine = Engine(str(tiny_llama_dir), page_size=4, num_pages=256)
    records = run_in_process(engine, workload, concurrency=1).result.records
    # One at a time: request i ends after every earlier request's whole latency.
    for i, record in enumerate(records):
        assert record.finished_s >= sum(r.latency_s for r in records[:i + 1]) - 1e-9
    result = run_comparison(workload, tiny_llama_dir, concurrency=1, batch_size=3, modes=("in-process",),
                            server_args=["--page-size", "4"])
    (name,) = [n for n in result["ratios"] if n.startswith("latency")]
    assert name == "latency mean from the run's start: transformers / in-process, cache on"
    per_round = result["per_repeat"][0]
    on, hf = per_round["in-process, cache on"], per_round["transformers"]
    assert result["ratios"][name] == hf["latency_from_start_mean_s"] / on["latency_from_start_mean_s"]
    assert on["latency_from_start_mean_s"] > on["latency_mean_s"]  # six requests in a row


def test_repeats_keep_every_rounds_ttfts_and_every_runs_figures(tiny_llama_dir: Path) -> None:
    """`ttfts[label] = ...` kept the last round's only (the --plot CDF and the JSON's ttft_s
    showed one round next to medians of N); a figure missing from the first round (None: the
    run completed nothing then) stayed None; a run absent from round 1 had no row."""
    from radixserve.benchmark.compare import median_summary

    result = run_comparison(small_gsp(), tiny_llama_dir, concurrency=2, batch_size=3, modes=("in-process",),
                            repeat=2, server_args=["--page-size", "4"])
    assert {len(ttfts) for ttfts in result["ttft_s"].values()} == {2 * 6}
    assert median_summary([{"ttft_mean_s": None, "errors": 2, "url": "u"},
                           {"ttft_mean_s": 0.5, "errors": 0, "url": "u", "new": 4}]) \
        == {"ttft_mean_s": 0.5, "errors": 1.0, "url": "u", "new": 4.0}
