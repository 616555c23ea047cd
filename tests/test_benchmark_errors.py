"""`radixserve bench`: what the commands say about inputs they cannot measure well — requests
skipped by the simulator, flags that contradict each other, bad arguments — each a line on
stderr rather than silently wrong numbers or a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main


def _trace(path: Path, lengths: list[int]) -> Path:
    """A Mooncake-style trace of requests sharing their first 512-token block."""
    rows = [{"timestamp": i, "input_length": n, "output_length": 4, "hash_ids": list(range(-(-n // 512)))}
            for i, n in enumerate(lengths)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_simulate_says_how_many_requests_were_too_long_for_the_pool(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The skipped requests were in the JSON only: their prompt tokens counted as misses in
    every hit rate, next to bounds that assume they ran, with nothing on screen."""
    trace = _trace(tmp_path / "t.jsonl", [300, 300, 2000])
    markdown = tmp_path / "t.md"
    assert main(["bench", "simulate", "--trace", str(trace), "--capacity-tokens", "1k", "--no-progress",
                 "--markdown", str(markdown)]) == 0
    captured = capsys.readouterr()
    assert "1 of 3 requests skipped (too long for the pool)" in captured.err
    assert "Note: requests too long for the pool were skipped (1 at 1k, of 3)" in captured.out
    assert "Note: requests too long" in markdown.read_text()


def test_simulate_refuses_a_capacity_every_request_is_too_long_for(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """It showed 0.0% for every policy next to a non-zero optimum, rc 0."""
    trace = _trace(tmp_path / "t.jsonl", [2000, 2000])
    out = tmp_path / "out.json"
    assert main(["bench", "simulate", "--trace", str(trace), "--capacity-tokens", "1k", "--no-progress",
                 "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: at --capacity-tokens 1k every request is too long for the pool (the longest needs 2004" in err
    assert not out.exists()


def _bench_parse(argv: list[str]):  # -> argparse.Namespace
    from radixserve.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


@pytest.fixture
def fake_bench_model(tmp_path: Path) -> Path:
    """A directory `build_bench_model` takes as built (it only reads config.json's vocabulary)."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    return tmp_path


def test_compare_and_tiers_default_arguments_fit_every_workload(fake_bench_model: Path) -> None:
    """The default --workload-args were gsp's for compare and multiturn's for tiers, given to
    whichever generator was chosen: `tiers --workload agent` (one of its two choices) and
    `compare --workload` anything but gsp raised TypeError."""
    from radixserve.benchmark.cli_compare import _bench_model_and_workload
    from radixserve.benchmark.workloads import WORKLOADS

    cases = [("compare", name) for name in sorted(WORKLOADS)] + [("tiers", "multiturn"), ("tiers", "agent")]
    for command, name in cases:
        args = _bench_parse([command, "--workload", name, "--model-dir", str(fake_bench_model)])
        _, workload, _ = _bench_model_and_workload(args)
        # CPU-sized: tens of requests, none longer than the bench model's 8,192 positions.
        assert 1 <= len(workload.requests) <= 100, (command, name)
        assert max(r.prompt_len + r.output_len for r in workload.requests) <= 4096, (command, name)
    # --workload-args override the workload's defaults, one key at a time
    args = _bench_parse(["compare", "--workload", "gsp", "--workload-args", "output_len=3",
                         "--model-dir", str(fake_bench_model)])
    _, workload, params = _bench_model_and_workload(args)
    assert params["output_len"] == 3 and params["system_len"] == 512 and len(workload.requests) == 32


@pytest.mark.parametrize(("argv", "message"), [
    (["compare", "--workload-args", "bogus=1"], "error: --workload-args: gsp takes no 'bogus'"),
    (["compare", "--workload-args", "num_groups"], "error: --workload-args: expected KEY=VALUE"),
    (["compare", "--workload-args", "system_len=abc"], "error: --workload-args 'system_len=abc': "),
    (["compare", "--workload-args", "num_groups=2.5"], "error: --workload-args 'num_groups=2.5': "),
    (["tiers", "--workload", "agent", "--workload-args", "num_clients=4"],
     "error: --workload-args: agent takes no 'num_clients'"),
])
def test_compare_and_tiers_refuse_bad_workload_arguments_in_one_line(
        argv: list[str], message: str, fake_bench_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each was a traceback (TypeError, ValueError, numpy's _UFuncNoLoopError)."""
    assert main(["bench", *argv, "--model-dir", str(fake_bench_model), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def _strict(text: str):  # -> Any
    """json.loads refusing the NaN/Infinity tokens, as JSON.parse, Go and serde_json do."""
    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_json_files_write_null_for_infinite_or_undefined_figures(tmp_path: Path) -> None:
    """write_json wrote bare Infinity (a replica imbalance of ∞) and NaN (an undefined peers
    figure), which no strict JSON reader accepts."""
    import numpy as np

    from radixserve.benchmark.cli_common import write_json

    path = tmp_path / "out" / "x.json"
    write_json(path, {"imbalance": float("inf"), "itl": [float("nan"), 1.5, -float("inf")],
                      "array": np.array([np.inf, 2.0]), "scalar": np.float64("nan"), "count": np.int64(3),
                      "nested": {"ok": 0.25, "t": (1, None, "x", True)}})
    assert _strict(path.read_text()) == {"imbalance": None, "itl": [None, 1.5, None], "array": [None, 2.0],
                                         "scalar": None, "count": 3,
                                         "nested": {"ok": 0.25, "t": [1, None, "x", True]}}


def test_the_documented_prefix_affinity_run_writes_strict_json(tmp_path: Path) -> None:
    """prefix-affinity's imbalance is ∞ when a replica gets nothing (the docs' own table)."""
    out = tmp_path / "agent.json"
    assert main(["bench", "simulate", "--workload", "gsp", "--workload-args",
                 "num_groups=1,prompts_per_group=4,system_len=32,question_len=8,output_len=2",
                 "--capacity-tokens", "1k", "--replicas", "4", "--router", "prefix-affinity",
                 "--no-progress", "--json", str(out)]) == 0
    _strict(out.read_text())


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--trace", "/nonexistent.jsonl"], "argument --trace: /nonexistent.jsonl: no such file"),
    (["serve", "--url", "http://127.0.0.1:1", "--trace", "/nonexistent.jsonl"],
     "argument --trace: /nonexistent.jsonl: no such file"),
    (["simulate", "--trace", "/"], "argument --trace: /: is a directory"),
    (["simulate", "--workload", "gsp", "--json", "/proc/nope/x.json"], "argument --json: /proc/nope/x.json: cannot write"),
    (["simulate", "--workload", "gsp", "--markdown", "/"], "argument --markdown: /: is a directory"),
    (["compare", "--json", "/proc/nope/x.json"], "argument --json: /proc/nope/x.json: cannot write"),
    (["compare", "--plot", "/proc/nope/x.png"], "argument --plot: /proc/nope/x.png: cannot write"),
    (["compare", "--repeat", "0"], "argument --repeat: expected a positive integer"),
    (["compare", "--repeat", "-2"], "argument --repeat: expected a positive integer"),
    (["compare", "--threads", "-1"], "argument --threads: expected a positive integer"),
    (["tiers", "--device-fraction", "0"], "argument --device-fraction: expected a positive number"),
    (["tiers", "--device-fraction", "-1"], "argument --device-fraction: expected a positive number"),
    (["tiers", "--page-size", "3"], "argument --page-size: expected a power of two"),
    (["matrix", "--capacity-tokens", "abc"], "argument --capacity-tokens: expected token counts"),
    (["matrix", "--replicas", "x"], "argument --replicas: expected positive integers"),
    (["matrix", "--replicas", "0"], "argument --replicas: expected positive integers"),
    (["matrix", "--fixed-rules", "bogus"], "argument --fixed-rules: expected names among"),
    (["matrix", "--host-capacity-tokens=-1"], "argument --host-capacity-tokens: expected token counts of at least 0"),
    (["matrix", "--count-scale", "0"], "argument --count-scale: expected a positive number"),
    (["matrix", "--scale", "-1"], "argument --scale: expected a positive number"),
    (["matrix", "--json", "/proc/nope/x.json"], "argument --json: /proc/nope/x.json: cannot write"),
    (["peers", "--server", "a=http://h:1", "--repeat", "0"], "argument --repeat: expected a positive integer"),
    (["peers", "--server", "a=http://h:1", "--repeat", "-1"], "argument --repeat: expected a positive integer"),
    (["peers", "--server", "a=http://h:1", "--requests", "0"], "argument --requests: expected a positive integer"),
    (["peers", "--server", "a=http://h:1", "--max-tokens", "0"], "argument --max-tokens: expected a positive"),
    (["peers", "--server", "a=http://h:1", "--timeout-s", "0"], "argument --timeout-s: expected a positive"),
    (["peers", "--server", "a=http://h:1", "--system-chars=-5"], "argument --system-chars: expected a positive"),
    (["peers", "--server", "a=http://h:1", "--json", "/proc/nope/x.json"], "argument --json: /proc/nope/x.json"),
])
def test_bad_arguments_are_refused_as_the_command_line_is_read(argv: list[str], message: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Each was a traceback (FileNotFoundError, IsADirectoryError, IndexError, RuntimeError,
    KeyError, ValueError: the --json one after the whole run) or accepted silently (rc 0 with
    an empty table for peers --repeat 0, duplicated cells for a negative host tier)."""
    if argv[0] == "simulate":
        argv = [*argv, "--capacity-tokens", "1k"]
    with pytest.raises(SystemExit) as exit_:
        _bench_parse(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("lines", "message"), [
    ('{"timestamp": 0, "input_length": 10}\n', "a record has no 'output_length' (a Mooncake trace's records have"),
    ("not json\n", "Expecting value"),
    ("", "no requests"),
])
def test_a_bad_trace_is_one_line_naming_the_file(lines: str, message: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(lines)
    assert main(["bench", "simulate", "--trace", str(trace), "--capacity-tokens", "1k", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: --trace {trace}: " in err and message in err and err.count("\n") == 1


@pytest.mark.parametrize(("workload_args", "message"), [
    ("system_len=abc", "error: --workload-args 'system_len=abc': "),
    ("num_groups=2.5", "error: --workload-args 'num_groups=2.5': "),
    ("num_groups=0", "error: the workload has no requests (--workload-args 'num_groups=0')"),
])
def test_simulate_refuses_workload_arguments_the_generator_cannot_use(workload_args: str, message: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Tracebacks (numpy's _UFuncNoLoopError, TypeError), or for 0 requests an all-0% table, rc 0."""
    assert main(["bench", "simulate", "--workload", "gsp", "--workload-args", workload_args,
                 "--capacity-tokens", "1k", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_compare_refuses_vary_prompt_on_turns_in_one_line(fake_bench_model: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "compare", "--workload", "multiturn", "--vary-prompt", "--model-dir",
                 str(fake_bench_model), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error: multiturn: prompts extend earlier turns" in err and err.count("\n") == 1


def test_ctrl_c_in_simulate_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """Ctrl-C in simulate (and compare, tiers, matrix, peers) printed a KeyboardInterrupt
    traceback; only `bench serve` ended with one line and rc 130."""
    import signal
    import subprocess
    import sys

    capacities = ",".join(f"{n}k" for n in range(1, 41))  # long enough to be mid-sweep at the signal
    bench = subprocess.Popen(
        [sys.executable, "-m", "radixserve.benchmark", "simulate", "--workload", "gsp", "--workload-args",
         "num_groups=16,prompts_per_group=8,system_len=256,question_len=32,output_len=8",
         "--capacity-tokens", capacities, "--no-progress", "--json", str(tmp_path / "x.json")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = bench.stderr.readline()  # the first capacity's status line: the sweep is running
        assert first.startswith("radixserve bench: 1k: "), first
        bench.send_signal(signal.SIGINT)
        rest = bench.stderr.read()
        assert bench.wait(timeout=60) == 130
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
    assert rest.splitlines()[-1] == f"radixserve bench: interrupted: no results kept (nothing written to {tmp_path / 'x.json'})"


def test_the_modules_usage_lines_name_a_command_that_runs(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """They read `usage: python -m radixserve.benchmark bench [-h] MODE ...`, and the copied
    `python -m radixserve.benchmark bench simulate ...` fails with invalid choice 'bench'."""
    import sys

    from radixserve.benchmark.__main__ import main as bench_main

    for argv, usage in ((["simulate"], "usage: python -m radixserve.benchmark simulate [-h]"),
                        ([], "usage: python -m radixserve.benchmark [-h] MODE ...")):
        monkeypatch.setattr(sys, "argv", ["x", *argv])
        with pytest.raises(SystemExit) as exit_:
            bench_main()
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(usage) and " bench " not in err.splitlines()[0]
    from radixserve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "simulate"])
    assert capsys.readouterr().err.startswith("usage: radixserve bench simulate [-h]")


def test_matrix_checks_the_mooncake_trace_before_the_first_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Installed from the wheel (no bench/data), the default matrix ran the other workloads for
    minutes, then failed with FileNotFoundError on mooncake."""
    from radixserve.benchmark import matrix

    monkeypatch.setattr(matrix, "TRACE", tmp_path / "absent.jsonl")
    assert main(["bench", "matrix", "--quick", "--workloads", "gsp,mooncake", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: --workloads mooncake: {tmp_path / 'absent.jsonl'} not found" in err and err.count("\n") == 1
    from radixserve.benchmark.cli_matrix import available_workloads

    names, note = available_workloads(["gsp", "mooncake", "scan"], named=False)
    assert names == ["gsp", "scan"] and note is not None and note.startswith("mooncake skipped: ")
