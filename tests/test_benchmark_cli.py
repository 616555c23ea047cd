"""`radixserve bench simulate`: the JSON contract, sweeps, tables and plots."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.benchmark.__main__ import main as bench_main
from radixserve.benchmark.cli import parse_workload_args
from radixserve.benchmark.report import format_tokens, parse_tokens
from radixserve.cli import main

SMALL_GSP = ["--workload", "gsp", "--workload-args",
             "num_groups=6,prompts_per_group=4,system_len=128,question_len=16,output_len=4"]


def test_simulate_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert main(["bench", "simulate", *SMALL_GSP, "--capacity-tokens", "1k", "--no-progress",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("hit_rate", "optimal_hit_rate", "infinite_hit_rate", "requests", "prompt_tokens",
                "capacity_tokens", "page_size", "fraction_of_optimum", "runs"):
        assert key in result
    assert result["requests"] == 24 and result["prompt_tokens"] == 24 * 144
    assert result["capacity_tokens"] == 1000 and result["page_size"] == 16
    assert result["infinite_hit_rate"] == pytest.approx(3 * 128 / (4 * 144))
    labels = [run["label"] for run in result["runs"]]
    assert labels == ["no-cache", "fcfs/lru", "lpm/lru", "dfs-weight/lru", "lpm/priority+system-prompt",
                      "lpm/adaptive"]
    main_run = result["runs"][-1]
    assert result["hit_rate"] == main_run["hit_rate"]
    assert result["runs"][0]["hit_rate"] == 0.0
    assert 0 < result["hit_rate"] <= result["infinite_hit_rate"]


def test_sweep_writes_lists_table_and_plot(tmp_path: Path, monkeypatch, capsys) -> None:
    out, table, plot = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s.png"
    monkeypatch.setattr(sys, "argv", ["x", "simulate", *SMALL_GSP, "--capacity-tokens", "0.5k,2k",
                                      "--sequential", "--study", "--no-progress", "--json", str(out),
                                      "--markdown", str(table), "--plot", str(plot)])
    assert bench_main() == 0
    result = json.loads(out.read_text())
    assert result["capacity_tokens"] == [500, 2000] and len(result["sweep"]) == 2
    assert all(0 <= h <= o + 1e-12 for h, o in zip(result["hit_rate"], result["optimal_hit_rate"]))
    labels = [run["label"] for run in result["sweep"][0]["runs"]]
    assert labels == ["no-cache", "sequential/lru", "sequential/priority+system-prompt",
                      "sequential/adaptive", "sequential/priority+tail-demotion",
                      "sequential/priority+hit-boost", "sequential/priority+reuse-boost"]
    text = table.read_text()
    assert "| configuration | 500 | 2k |" in text and "offline optimum" in text
    assert text in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_counts_and_workload_args_parse() -> None:
    assert parse_tokens("0.5M") == 500_000 and parse_tokens("64k") == 64_000 and parse_tokens("12") == 12
    assert format_tokens(500_000) == "0.5M" and format_tokens(4_000_000) == "4M"
    assert parse_workload_args("a=1, b=0.5,c=true,d=x") == {"a": 1, "b": 0.5, "c": True, "d": "x"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_workload_args("oops")


def test_simulate_speaks_serves_policy_names() -> None:
    import argparse

    from radixserve.benchmark.cli import EVICTION_POLICIES, add_bench_parser
    from radixserve.benchmark.suite import RETENTION_RULES
    from radixserve.cli import build_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    serve_choices = {a.dest: a.choices for a in serve._actions if a.choices}
    simulate = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)][0].choices["bench"]
    simulate = next(a for a in simulate._actions if isinstance(a, argparse._SubParsersAction)).choices["simulate"]
    sim_choices = {a.dest: a.choices for a in simulate._actions if a.choices}
    # Every value `serve` takes, `simulate` takes under the same flag; the extra eviction
    # values are the simulator's retention rules, and together they cover all of them.
    for flag in ("schedule_policy", "eviction_policy"):
        assert set(serve_choices[flag]) <= set(sim_choices[flag]), flag
    assert {rule for _, rule in EVICTION_POLICIES.values()} == set(RETENTION_RULES)
    assert EVICTION_POLICIES["adaptive"] == ("adaptive", "adaptive")  # the engine's default
    args = parser.parse_args(["bench", "simulate", "--workload", "gsp", "--capacity-tokens", "1k"])
    assert (args.schedule_policy, args.eviction_policy) == ("lpm", "adaptive")


def test_simulate_with_a_host_tier_reports_both_tiers_and_the_two_tier_bound(tmp_path: Path) -> None:
    out, plot = tmp_path / "host.json", tmp_path / "host.png"
    sessions = "num_clients=6,num_turns=4,num_system_prompts=2,system_len=96,message_len=24,output_len=8"
    assert main(["bench", "simulate", "--workload", "multiturn", "--workload-args", sessions, "--page-size", "4",
                 "--capacity-tokens", "400", "--host-capacity-tokens", "0,2k", "--no-progress",
                 "--json", str(out), "--plot", str(plot)]) == 0
    result = json.loads(out.read_text())
    assert result["capacity_tokens"] == [400, 400] and result["host_capacity_tokens"] == [0, 2000]
    device_only, two_tier = result["sweep"]
    for run in result["sweep"]:
        assert run["device_hit_rate"] + run["host_hit_rate"] == pytest.approx(run["hit_rate"])
        assert run["optimal_hit_rate"] >= run["optimal_device_hit_rate"]
    assert device_only["host_hit_rate"] == 0 and device_only["offloaded_tokens"] == 0
    assert two_tier["host_hit_rate"] > 0 and two_tier["loaded_tokens"] > 0 and two_tier["offloaded_tokens"] > 0
    assert two_tier["hit_rate"] > device_only["hit_rate"]
    assert two_tier["optimal_device_hit_rate"] == device_only["optimal_hit_rate"]
    labels = [run["label"] for run in two_tier["runs"]]
    assert labels[-2:] == ["lpm/adaptive, device only", "lpm/adaptive, one cache of device+host"]
    variant = {run["label"]: run for run in two_tier["runs"]}["lpm/adaptive, device only"]
    assert variant["hit_rate"] == device_only["hit_rate"] and variant["host_capacity_tokens"] == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tiers_sizes_the_device_pool_to_a_fraction_of_the_working_set() -> None:
    from radixserve.benchmark.compare import median_summary
    from radixserve.benchmark.host_tier import pool_sizes, working_set_tokens
    from radixserve.benchmark.workloads import multi_turn

    w = multi_turn(num_clients=4, num_turns=3, num_system_prompts=2, system_len=64, message_len=16, output_len=8)
    # 2 system prompts, and per client 3 messages and 3 replies (the last one cached too).
    assert working_set_tokens(w) == 2 * 64 + 4 * 3 * (16 + 8)
    longest = max(r.prompt_len + r.output_len for r in w.requests)
    assert pool_sizes(w, 16, 0.25, 2.0) == (max(-(-416 // 4 // 16), -(-longest // 16) + 2), -(-832 // 16))
    assert median_summary([{"ttft": 1.0, "name": "a"}, {"ttft": 3.0, "name": "b"}, {"ttft": 2.0, "name": "c"}]) \
        == {"ttft": 2.0, "name": "a"}


@pytest.mark.parametrize(("policy", "label"), [("lru", "lpm/lru"), ("priority", "lpm/priority"),
                                               ("hit-boost", "lpm/priority+hit-boost")])
def test_eviction_policy_sets_the_main_configuration(tmp_path: Path, policy: str, label: str) -> None:
    out = tmp_path / "sim.json"
    assert main(["bench", "simulate", *SMALL_GSP, "--capacity-tokens", "1k", "--no-progress", "--no-baselines",
                 "--eviction-policy", policy, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["main"] == label


def _every_action(parser: argparse.ArgumentParser, path: str = "radixserve") -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _every_action(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_has_a_help_text() -> None:
    from radixserve.cli import build_parser

    undocumented = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in _every_action(build_parser())
                    if not (a.help and a.help.strip())]
    assert undocumented == []


def test_progress_bar_and_status_lines_do_not_share_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "simulate", *SMALL_GSP, "--capacity-tokens", "0.5k,1k", "--no-baselines"]) == 0
    err = capsys.readouterr().err
    assert err.count("radixserve bench: ") == 2 and "simulations" in err  # two lines and a bar
    for segment in re.split(r"[\r\n]", err):
        if "radixserve bench: " in segment:
            assert segment.startswith("radixserve bench: "), segment


def test_simulate_window_runs_full_attention_beside_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "w.json"
    args = ["bench", "simulate", "--workload", "multiturn", "--workload-args",
            "num_clients=4,num_turns=3,num_system_prompts=2,system_len=64,message_len=16,output_len=48",
            "--capacity-tokens", "100k", "--page-size", "1", "--window", "16", "--no-baselines",
            "--no-progress", "--json", str(out)]
    assert main(args) == 0
    runs = {run["label"]: run for run in json.loads(out.read_text())["runs"]}
    windowed, full = runs["lpm/adaptive, window 16"], runs["lpm/adaptive"]
    assert windowed["window"] == 16 and full["window"] is None
    assert windowed["hit_rate"] < full["hit_rate"]
    assert windowed["held_pages_peak"] < full["held_pages_peak"]
    assert windowed["cached_pages"] < full["cached_pages"]  # the replies past the window are not kept
    printed = capsys.readouterr().out
    assert "| capacity | attention | hit rate | pages cached at the end |" in printed
    assert "| 100k | sliding window (16) |" in printed and "| 100k | full |" in printed


def test_failures_are_reported_for_tiers_results_too(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench tiers` results have no transformers baseline (no token_mismatches key)."""
    from radixserve.benchmark.cli import _report_failures

    assert _report_failures({"server_failures": {}}) is False
    assert _report_failures({"server_failures": {"host tier": "exit 1"}}) is True
    assert _report_failures({"server_failures": {}, "token_mismatches": {"HTTP, cache on": "3 tokens short"}}) is True
    err = capsys.readouterr().err
    assert "server run 'host tier' failed: exit 1" in err and "'HTTP, cache on' did not do the same work" in err


def _bench_parse(argv: list[str]) -> argparse.Namespace:
    from radixserve.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_limit_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    """`--limit -1` was a Python slice (every request but the last), `--limit 0` an empty run."""
    simulate = ["simulate", "--workload", "gsp", "--capacity-tokens", "1k"]
    serve = ["serve", "--url", "http://127.0.0.1:1", "--workload", "gsp"]
    for command in (simulate, serve):
        assert _bench_parse([*command, "--limit", "3"]).limit == 3
        for bad in ("-1", "0", "x"):
            with pytest.raises(SystemExit) as exit_:
                _bench_parse([*command, "--limit", bad])
            assert exit_.value.code == 2
            assert f"argument --limit: expected a positive integer, got {bad!r}" in capsys.readouterr().err


SIMULATE = ["simulate", "--workload", "gsp", "--capacity-tokens", "1k"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--capacity-tokens", "abc"], "argument --capacity-tokens: expected token counts"),
    (["--host-capacity-tokens", "1x"], "argument --host-capacity-tokens: expected token counts"),
    (["--capacity-tokens", "0"], "argument --capacity-tokens: expected token counts of at least 1"),
    (["--capacity-tokens=-5k"], "argument --capacity-tokens: expected token counts of at least 1"),
    (["--capacity-tokens", "1k,,2k"], "argument --capacity-tokens: expected token counts"),
    (["--host-capacity-tokens=-1"], "argument --host-capacity-tokens: expected token counts of at least 0"),
    (["--page-size", "0"], "argument --page-size: expected a power of two"),
    (["--page-size", "3"], "argument --page-size: expected a power of two"),
    (["--max-running", "0"], "argument --max-running: expected a positive integer"),
    (["--max-batch-tokens", "0"], "argument --max-batch-tokens: expected a positive integer"),
    (["--request-rate", "0"], "argument --request-rate: expected a positive number"),
    (["--request-rate", "-1"], "argument --request-rate: expected a positive number"),
    (["--decode-step-ms", "nan"], "argument --decode-step-ms: expected a positive number"),
    (["--window", "0"], "argument --window: expected a positive integer"),
    (["--replicas", "0"], "argument --replicas: expected a positive integer"),
    (["--replicas", "2", "--concurrency", "0"], "argument --concurrency: expected a positive integer"),
])
def test_simulate_refuses_bad_numbers_as_it_parses(flags: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Each of these was a traceback (ValueError, IndexError, ZeroDivisionError, a stalled
    simulated server) from deep inside the run."""
    with pytest.raises(SystemExit) as exit_:
        _bench_parse([*SIMULATE, *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["serve", "--url", "http://127.0.0.1:1", "--workload", "gsp", "--concurrency", "0"],
    ["serve", "--url", "http://127.0.0.1:1", "--workload", "gsp", "--timeout-s", "0"],
    ["peers", "--concurrency", "0"],
    ["compare", "--concurrency", "0"],
])
def test_other_commands_refuse_non_positive_counts_as_they_parse(argv: list[str],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _bench_parse(argv)
    assert exit_.value.code == 2
    assert f"argument {argv[-2]}: expected a positive" in capsys.readouterr().err


def test_simulate_parses_token_counts_to_lists() -> None:
    args = _bench_parse([*SIMULATE, "--capacity-tokens", "0.5k, 2k", "--page-size", "1"])
    assert args.capacity_tokens == [500, 2000] and args.host_capacity_tokens == [0] and args.page_size == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--workload-args", "system_prompt_len=64"],
     "error: --workload-args: gsp takes no 'system_prompt_len' (it takes: num_groups, prompts_per_group,"),
    (["--capacity-tokens", "8"], "error: --capacity-tokens 8 holds no page of 16 tokens"),
    # a generator imported on use (it imports the workloads module) is checked too: a TypeError before
    (["--workload", "gapped-chat", "--workload-args", "bogus=1"],
     "error: --workload-args: gapped-chat takes no 'bogus' (it takes: num_conversations, start_rate,"),
])
def test_simulate_refuses_bad_inputs_in_one_line(flags: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *SIMULATE, "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("flags", [["--plot", "x.png"], ["--window", "32"], ["--study"], ["--cache-partial-pages"],
                                   ["--no-baselines"], ["--sequential"], ["--study", "--plot", "x.png"]])
def test_replicas_refuses_the_flags_it_would_ignore(flags: list[str], capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster simulation ran with rc 0 and silently wrote no plot, no window table, no
    study, cached no partial page and ran every router anyway."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", *SIMULATE, "--replicas", "2", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("radixserve bench: error: --replicas does not take ")
    assert all(flag in err for flag in flags if flag.startswith("--"))
    assert not (tmp_path / "x.png").exists()
