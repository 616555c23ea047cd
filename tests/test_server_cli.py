"""The `radixserve` command line: flags, help, and a real `serve` run stopped with Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.cli import build_parser, main
from radixserve.ports import bind_socket, free_port
from radixserve.server import create_app

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVE_FLAGS = ["--model", "--host", "--port", "--page-size", "--num-pages", "--kv-memory-gb",
               "--schedule-policy", "--eviction-policy", "--max-running", "--max-queue", "--api-key",
               "--dtype", "--device", "--served-model-name", "--no-prefix-cache", "--host-kv-memory-gb",
               "--host-num-pages", "--host-write-policy", "--host-offload-min-priority", "--stall-timeout-s",
               "--shutdown-timeout-s", "--debug-stall-engine"]


def serve_parser() -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def test_serve_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    documented = {opt: action.help for action in serve_parser()._actions for opt in action.option_strings}
    for flag in SERVE_FLAGS:
        assert flag in help_text and documented[flag], flag


def test_every_serve_flag_is_in_the_server_docs() -> None:
    """docs/server.md names every flag of `radixserve serve` (written as `--flag`)."""
    docs = (REPO_ROOT / "docs" / "server.md").read_text()
    flags = {opt for action in serve_parser()._actions for opt in action.option_strings
             if opt.startswith("--") and opt != "--help"}
    assert sorted(flag for flag in flags if f"`{flag}`" not in docs) == []


def test_serve_defaults_and_pool_flags_exclusive() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.page_size, args.schedule_policy, args.eviction_policy) == \
        ("demo", "127.0.0.1", 8000, 16, "lpm", "adaptive")
    assert args.num_pages is None and args.kv_memory_gb is None and args.max_queue is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--num-pages", "8", "--kv-memory-gb", "1"])
    assert args.host_num_pages is None and args.host_kv_memory_gb is None  # no host tier by default
    assert (args.host_write_policy, args.host_offload_min_priority) == ("write-back", 35)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--host-num-pages", "8", "--host-kv-memory-gb", "1"])


def test_bench_subcommand_present_exactly_when_its_module_is() -> None:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert ("bench" in subparsers.choices) == (importlib.util.find_spec("radixserve.benchmark.cli") is not None)


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


def start_serve(port: int, *flags: str) -> subprocess.Popen[str]:
    """`radixserve serve` on `port` in a subprocess, once /health answers (any status)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("RADIXSERVE_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--num-pages", "32",
         "--log-level", "warning", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise AssertionError(process.communicate())
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return process
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("server did not come up", process.communicate())
        time.sleep(0.1)


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.communicate()


def test_serve_runs_reports_the_pool_and_stops_on_ctrl_c() -> None:
    port = free_port()
    process = start_serve(port, "--served-model-name", "cli-demo", "--host-num-pages", "64")
    try:
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["cli-demo"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "cli", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200
        # What the process started with is frozen out of the garbage collector's full passes.
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        frozen = next(float(line.split()[1]) for line in metrics.splitlines()
                      if line.startswith("radixserve_gc_frozen_objects "))
        assert frozen > 10_000  # torch and the model alone are far more
        # A second server on the same port says so before loading anything, and fails.
        busy = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--port", str(port)],
                              capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        assert busy.returncode == 1
        assert f"cannot listen on 127.0.0.1:{port}" in busy.stderr and f"port {port}?" in busy.stderr
        assert "loading" not in busy.stderr and "serving" not in busy.stderr
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        stop(process)
    assert process.returncode == 0, stderr
    assert "KV pool: 32 pages x 16 tokens = 512 tokens, 2.0 MiB" in stderr
    assert "host tier: 64 pages = 1024 tokens" in stderr
    assert "steps: up to 512 tokens; beside decoding streams, prefill to a multiple of 128" in stderr
    assert ("requests starting at once (body to first token): 4, shared by the tenants starting some, "
            "any number for one alone") in stderr
    logged = re.search(r"radixserve: ([\d,]+) start-up objects frozen out of the garbage collector's passes", stderr)
    assert logged is not None and int(logged.group(1).replace(",", "")) > 10_000
    assert f"serving cli-demo at http://127.0.0.1:{port}/v1" in stderr
    # What runs: CI builds the CPU kernels, so they must be in use (the torch path is a fallback).
    assert "device cpu, dtype float32, attention backend TorchBackend, CPU kernels in use" in stderr
    assert "radixserve: stopped" in stderr
    # Nothing imported triton (xgrammar's dependency; building the model on the meta device
    # did, through torch._dynamo: models/layers.Embedding), whose objects leak at exit.
    assert "nanobind" not in stderr


def start_loading(port: int) -> subprocess.Popen[str]:
    """`radixserve serve` on `port` in a subprocess, once it says it is loading the model
    (printed before torch is imported: seconds before it serves)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--port", str(port),
                                "--num-pages", "32"], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    assert process.stderr is not None
    for line in process.stderr:
        if "loading model" in line:
            break
    return process


def test_the_port_listens_while_the_model_loads() -> None:
    """The port is taken listening before anything loads: held bound but not listening, it
    let another server bind it with SO_REUSEADDR and listen, and this one's own listen then
    failed silently (uvloop): it logged "serving" on a port it did not hold."""
    port = free_port()
    process = start_loading(port)
    try:
        with pytest.raises(OSError):
            other = bind_socket("127.0.0.1", port)  # as uvicorn binds, SO_REUSEADDR
            try:
                other.listen()
            finally:
                other.close()
    finally:
        stop(process)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_while_the_model_loads_stops_cleanly(stop_signal: signal.Signals) -> None:
    """Ctrl-C while loading printed a KeyboardInterrupt traceback (status 130), SIGTERM ended
    the process silently (143); both stop as they do while serving: a line, status 0."""
    process = start_loading(free_port())
    try:
        process.send_signal(stop_signal)
        _, stderr = process.communicate(timeout=60)
    finally:
        stop(process)
    assert process.returncode == 0, stderr
    assert "radixserve: stopped while loading" in stderr and "Traceback" not in stderr, stderr


def hold_a_request(port: int) -> threading.Thread:
    """Sends a request the stalled engine never answers (the client gives up when the server goes)."""
    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=300)
    worker = threading.Thread(target=send, daemon=True)
    worker.start()
    return worker


def test_stuck_engine_is_reported_and_sigterm_still_ends_the_process() -> None:
    port = free_port()
    process = start_serve(port, "--debug-stall-engine", "--stall-timeout-s", "0.5", "--shutdown-timeout-s", "2")
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}  # idle
        hold_a_request(port)
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"http://127.0.0.1:{port}/health")).status_code != 503:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.1)
        assert "has not completed a step" in health.json()["reason"]
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)  # the engine thread never stops by itself
    finally:
        stop(process)
    assert process.returncode == 1, stderr
    assert "shutdown took longer than 2 s (is a step stuck?); exiting now" in stderr


def test_second_signal_ends_a_stuck_shutdown_at_once() -> None:
    port = free_port()
    process = start_serve(port, "--debug-stall-engine", "--shutdown-timeout-s", "600")
    try:
        worker = hold_a_request(port)
        deadline = time.monotonic() + 60
        while httpx.get(f"http://127.0.0.1:{port}/metrics").text.count("radixserve_sequences_waiting 1.0") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # The first signal starts a shutdown that waits for the held request and the stuck
        # engine thread (at least 10 s); the second one ends it.
        process.send_signal(signal.SIGTERM)
        while True:  # the server stops listening once the first signal was handled
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            except httpx.TransportError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        worker.join(timeout=30)
    finally:
        stop(process)
    assert process.returncode == 1, stderr
    assert "second SIGTERM: exiting now" in stderr


def test_bench_serve_sends_the_key_and_fails_loudly_without_it(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    engine = Engine(model="demo", page_size=16, num_pages=128)
    app = create_app(AsyncEngine(engine), api_key="bench-key")
    with running_server(app) as url:
        args = ["bench", "serve", "--url", url, "--workload", "gsp", "--vocab-size", "2048", "--no-progress",
                "--workload-args", "num_groups=1,prompts_per_group=3,system_len=16,question_len=4,output_len=2"]
        monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
        assert main(args) == 1
        out, err = capsys.readouterr()
        assert out == ""  # no table of zeros
        assert "FAILED: 3 of 3 requests failed (none completed: no table); errors:" in err
        assert "3 x HTTP 401: " in err and "invalid_api_key" in err
        monkeypatch.setenv("RADIXSERVE_API_KEY", "bench-key")  # the default of --api-key
        assert main(args) == 0
        out, err = capsys.readouterr()
        assert "FAILED" not in err and "| gsp |" in out
        assert main([*args, "--api-key", "wrong"]) == 1
        assert "3 x HTTP 401" in capsys.readouterr().err


# ---------------------------------------------------------------- first-use rough edges (issue 21)


def test_version_and_deprecated_host_tier_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("radixserve ")
    old = build_parser().parse_args(["serve", "--host-num-pages", "8", "--host-write-policy",
                                     "write-through-selective", "--host-offload-min-priority", "40"])
    new = build_parser().parse_args(["serve", "--host-tier-pages", "8", "--host-tier-write-policy",
                                     "write-through-selective", "--host-tier-min-priority", "40"])
    assert vars(old) == vars(new)
    with pytest.raises(SystemExit):
        main(["serve", "--host-num-pages=8", "--help"])
    assert "warning: --host-num-pages is deprecated; use --host-tier-pages" in capsys.readouterr().err


@pytest.mark.parametrize("given,old,new", [
    ("--host-num-p=8", "--host-num-pages", "--host-tier-pages"),  # an abbreviation argparse accepts
    ("--host-kv-memory=1", "--host-kv-memory-gb", "--host-tier-memory-gb"),
    ("--host-offload-min", "--host-offload-min-priority", "--host-tier-min-priority"),
])
def test_abbreviated_deprecated_flags_warn_too(capsys: pytest.CaptureFixture[str], given: str, old: str,
                                                new: str) -> None:
    argv = ["serve", given] + ([] if "=" in given else ["40"])
    build_parser().parse_args(argv)
    assert f"warning: {old} is deprecated; use {new}" in capsys.readouterr().err
    build_parser().parse_args(["serve", "--host-tier-p=8", "--host-tier-min=3"])  # new names, abbreviated
    assert "deprecated" not in capsys.readouterr().err


ServeRuns = dict[tuple[str, ...], tuple[int, str]]  # exit code and stderr, by the flags each run was given


def refuse_in_process(*flag_lists: tuple[str, ...]) -> ServeRuns:
    """`radixserve serve --port <free> *flags` for each of `flag_lists`, run in this process:
    a refusal comes before anything is served, and a subprocess each would spend half a minute
    importing torch on two cores. A run that did start serving would hang here, and an
    uncaught exception fails the fixture: both are the defects these runs look for."""
    done: ServeRuns = {}
    for flags in flag_lists:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = main(["serve", "--port", str(free_port()), *flags])
        done[flags] = (code, stderr.getvalue())
    return done


IMPOSSIBLE_SETTINGS = [
    (("--num-pages", "100000000"), "--num-pages: a KV cache of 100000000 pages"),
    (("--kv-memory-gb", "100000"), "--kv-memory-gb: a KV cache of 100000 GiB"),
    (("--host-tier-pages", "100000000"), "--host-tier-pages: a KV cache of 100000000 pages"),
    (("--model", "no-such-model"), "model not found: 'no-such-model'"),
    (("--api-key", ""), "API keys: an API key must not be empty"),
    (("--replicas", "1", "--api-key", ""), "API keys: an API key must not be empty"),
    (("--max-request-tokens", "0"), "--max-request-tokens must be >= 1, got 0"),
    # Checked before the load: a traceback after it (or a server refusing every request) before.
    (("--max-queue", "0"), "--max-queue must be >= 1, got 0 (every request would be refused)"),
    (("--stream-buffer-tokens", "0"), "--stream-buffer-tokens must be >= 1, got 0"),
    (("--cache-event-buffer", "-1"), "--cache-event-buffer must be >= 1, got -1"),
    (("--stream-read-timeout-s", "0"), "--stream-read-timeout-s must be > 0 seconds, got 0.0"),
    (("--cache-events-idle-timeout-s", "nan"), "--cache-events-idle-timeout-s must be > 0 seconds, got nan"),
    (("--turn-memory-tokens", "-1"), "--turn-memory-tokens must be >= 0 (0: off), got -1"),
    (("--kv-memory-gb", "inf"), "--kv-memory-gb must be a finite number of GiB, got inf"),
    (("--host-tier-memory-gb", "nan"), "--host-tier-memory-gb must be a finite number of GiB, got nan"),
    (("--port", "70000"), "--port must be in 1..65535, got 70000"),
    (("--no-prefix-cache", "--host-tier-pages", "64"), "--no-prefix-cache caches nothing, so a host tier"),
    (("--public-cache-hashes", "--cache-hash-secret", "s3cret"), "--public-cache-hashes publishes unkeyed hashes"),
    (("--max-connections-per-client", "-1"), "--max-connections-per-client must be >= 0"),
    (("--refusals-per-s", "-1"), "--refusals-per-s must be >= 0 (0: none)"),
    (("--tenant-starts", "-1"), "--tenant-starts must be >= 0 (0: none)"),
    (("--grammar-paced-share", "0"), "--grammar-paced-share: must be in (0, 1] (1: no pacing), got 0.0"),
    (("--short-prompt-tokens", "-1"), "--short-prompt-tokens: must be >= 0 (0: off), got -1"),
    # Flags where they would have no effect (cli_serve._ignored_here): refused, not dropped.
    (("--router", "power-of-two", "--replica-cpus", "2"), "--router and --replica-cpus: only for a cluster"),
    (("--replica-gpus", "0.5"), "--replica-gpus: only for a cluster (give --replicas N or --ray-address)"),
    (("--app-name", "small", "--route-prefix", "/small"), "--app-name and --route-prefix: only for a cluster"),
    (("--replicas", "1", "--route-prefix", "small"), "--route-prefix must start with '/', got 'small'"),
    (("--replicas", "1", "--route-prefix", "/small/"), "--route-prefix must not end with '/'"),
    (("--replicas", "1", "--route-prefix", "/{model}"), "--route-prefix cannot hold path parameters"),
    (("--replicas", "1", "--app-name", ""), "--app-name must not be empty"),
    # Before Ray starts (Ray refused a negative one only after its start; nan and inf were tracebacks).
    (("--replicas", "1", "--replica-cpus", "nan"), "--replica-cpus must be a finite number >= 0, got nan"),
    (("--replicas", "1", "--replica-cpus", "inf"), "--replica-cpus must be a finite number >= 0, got inf"),
    (("--replicas", "1", "--replica-cpus", "-1"), "--replica-cpus must be a finite number >= 0, got -1.0"),
    (("--replicas", "1", "--replica-gpus", "-1"), "--replica-gpus must be a finite number >= 0, got -1.0"),
    (("--debug-step-delay-s", "-1"), "--debug-step-delay-s must be a finite number >= 0, got -1.0"),
    (("--replicas", "1", "--route-prefix", "/small?x=1"), "--route-prefix is a path: it cannot hold '?' or '#'"),
    (("--ray-address", "auto", "--api-key", "s3cret"), "--api-key on the command line is recorded in the Ray "
                                                        "cluster's job table, which every user of the cluster can "
                                                        "read: give it as $RADIXSERVE_API_KEY"),
    (("--ray-address", "auto", "--cache-hash-secret", "s3cret"), "give it as $RADIXSERVE_CACHE_HASH_SECRET"),
    (("--replicas", "2", "--head-timeout-s", "3", "--max-connections", "90"),
     "--head-timeout-s and --max-connections: only for the single server; on a cluster Ray Serve's proxy"),
    (("--ray-address", "auto", "--max-connections-per-client", "0"), "--max-connections-per-client: only for the single"),
    (("--replicas", "2", "--refusals-per-s", "0"), "--refusals-per-s: only for the single server"),
    (("--host-tier-min-priority", "10"), "--host-tier-min-priority: no host tier to apply to"),
    (("--host-write-policy", "exclusive"), "--host-tier-write-policy: no host tier to apply to"),
    (("--tensor-parallel-size", "2", "--device", "cuda:1"),
     "--device cuda:1: with --tensor-parallel-size rank r runs on GPU r"),
]
def test_a_secret_on_a_joined_clusters_command_line_is_refused_though_the_variable_holds_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the command line gave counts, not the value: `--admin-api-key "$VAR"` puts the
    secret in the job table as surely as the literal does; the variable alone does not."""
    from radixserve.cli_serve import _contradiction

    monkeypatch.setenv("RADIXSERVE_ADMIN_API_KEY", "s3cret")
    parser = build_parser()  # the variables are its defaults
    for given in (["--admin-api-key", "s3cret"], ["--admin-api", "s3cret"]):  # argparse takes an abbreviation
        args = parser.parse_args(["serve", "--ray-address", "auto", *given])
        assert _contradiction(args) == ("--admin-api-key on the command line is recorded in the Ray cluster's job "
                                        "table, which every user of the cluster can read: give it as "
                                        "$RADIXSERVE_ADMIN_API_KEY"), given
    from_environment = parser.parse_args(["serve", "--ray-address", "auto"])
    assert from_environment.admin_api_key == "s3cret" and _contradiction(from_environment) is None


CUDA_ON_CPU = ("--device", "cuda")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def refused_serves() -> ServeRuns:
    """The runs of the impossible settings below, and of --device cuda where torch has no
    CUDA (with CUDA it would serve, not fail), one after another (refuse_in_process)."""
    cuda_run = [] if importlib.util.find_spec("torch") is None or cuda_available() else [CUDA_ON_CPU]
    return refuse_in_process(*[flags for flags, _ in IMPOSSIBLE_SETTINGS], *cuda_run)


@pytest.mark.parametrize("flags, says", IMPOSSIBLE_SETTINGS)
def test_impossible_settings_are_one_line_errors(refused_serves: ServeRuns, flags: tuple[str, ...],
                                                 says: str) -> None:
    code, stderr = refused_serves[flags]
    assert code == 2, stderr
    error = [line for line in stderr.splitlines() if "error" in line]
    assert len(error) == 1 and says in error[0], stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_cuda_on_a_cpu_only_torch_names_what_is_available(refused_serves: ServeRuns) -> None:
    if cuda_available():
        pytest.skip("this machine has CUDA")
    code, stderr = refused_serves[CUDA_ON_CPU]
    assert code == 2
    assert "--device: 'cuda' is not available" in stderr and "available: cpu" in stderr


def test_a_busy_port_is_found_before_torch_is_imported() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        script = ("import sys, radixserve.cli as cli; code = cli.main(['serve', '--port', sys.argv[1]]); "
                  "print('torch' in sys.modules); sys.exit(code)")
        done = subprocess.run([sys.executable, "-c", script, str(port)], capture_output=True, text=True,
                              cwd=REPO_ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 1 and "cannot listen" in done.stderr
    assert done.stdout.strip() == "False"


def test_serve_defaults_to_the_engines_step_budget() -> None:
    """`serve --max-batch-tokens`, `--mixed-prefill-tokens` and `--short-prompt-tokens` default to the engine's own
    (two constants each, since the CLI does not import the engine: they must not drift apart)."""
    import inspect

    from radixserve.engine.engine import DEFAULT_MAX_BATCH_TOKENS

    args = build_parser().parse_args(["serve", "--model", "demo"])
    assert args.max_batch_tokens == DEFAULT_MAX_BATCH_TOKENS == 512
    assert inspect.signature(Engine).parameters["max_batch_tokens"].default == DEFAULT_MAX_BATCH_TOKENS
    from radixserve.cli_serve_flags import DEFAULT_CPU_MIXED_PREFILL_TOKENS as CLI_MIXED
    from radixserve.engine.engine import DEFAULT_CPU_MIXED_PREFILL_TOKENS

    assert args.mixed_prefill_tokens is None  # the engine's own default for its device
    assert CLI_MIXED == DEFAULT_CPU_MIXED_PREFILL_TOKENS == Engine(model="demo", num_pages=8, device="cpu").scheduler.mixed_prefill_tokens
    from radixserve.cli_serve_flags import DEFAULT_SHORT_PROMPT_TOKENS as CLI_SHORT
    from radixserve.engine.engine import DEFAULT_SHORT_PROMPT_TOKENS

    assert args.short_prompt_tokens == CLI_SHORT == DEFAULT_SHORT_PROMPT_TOKENS == 128
    assert inspect.signature(Engine).parameters["short_prompt_tokens"].default == DEFAULT_SHORT_PROMPT_TOKENS
    from radixserve.engine.grammar_pace import PACED_SHARE

    assert args.grammar_paced_share == PACED_SHARE == inspect.signature(Engine).parameters["grammar_paced_share"].default


def test_a_corrupt_checkpoint_is_a_one_line_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A truncated safetensors file or GGUF file is named as such in one line (exit 2), not a
    SafetensorError or an IndexError traceback from the readers."""
    checkpoint = tmp_path / "truncated"
    shutil.copytree(tiny_llama_dir, checkpoint)
    weights = next(checkpoint.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:200])
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    runs = refuse_in_process(("--model", str(checkpoint)), ("--model", str(gguf)))
    for model, (code, stderr) in zip((weights, gguf), runs.values()):
        assert code == 2 and "Traceback" not in stderr, stderr
        assert f"{model}: not a readable" in stderr and "(corrupt or truncated?)" in stderr, stderr
