"""The `radixserve` command line: flags, help, and a real `serve` run stopped with Ctrl-C."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radixserve.cli import build_parser, main

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVE_FLAGS = ["--model", "--host", "--port", "--page-size", "--num-pages", "--kv-memory-gb",
               "--schedule-policy", "--eviction-policy", "--max-running", "--max-queue", "--api-key",
               "--dtype", "--device", "--served-model-name", "--no-prefix-cache", "--host-kv-memory-gb",
               "--host-num-pages", "--host-write-policy", "--host-offload-min-priority"]


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


def test_serve_defaults_and_pool_flags_exclusive() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.page_size, args.schedule_policy, args.eviction_policy) == \
        ("demo", "127.0.0.1", 8000, 16, "lpm", "reuse-boost")
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_runs_reports_the_pool_and_stops_on_ctrl_c() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("RADIXSERVE_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--num-pages", "32",
         "--host-num-pages", "64", "--served-model-name", "cli-demo", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["cli-demo"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "cli", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert "KV pool: 32 pages x 16 tokens = 512 tokens" in stderr
    assert "host tier: 64 pages = 1024 tokens" in stderr
    assert f"http://127.0.0.1:{port}/v1" in stderr
    assert "radixserve: stopped" in stderr
