"""The client examples run against a real keyed server, taking the key from RADIXSERVE_API_KEY."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app

REPO_ROOT = Path(__file__).resolve().parent.parent
KEY = "example-key"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=256)), api_key=KEY)
    with running_server(app) as base_url:
        yield base_url


def run_example(script: str, url: str, *args: str, key: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RADIXSERVE_API_KEY"}
    if key is not None:
        env["RADIXSERVE_API_KEY"] = key
    return subprocess.run([sys.executable, str(REPO_ROOT / "examples" / script), "--url", url, *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_chat_stream_uses_the_key_from_the_environment(url: str) -> None:
    done = run_example("chat_stream.py", url, "Hi", "--max-tokens", "4", key=KEY)
    assert done.returncode == 0, done.stderr
    assert "[finish_reason: " in done.stdout and "completion 4 tokens]" in done.stderr
    refused = run_example("chat_stream.py", url, "Hi", "--max-tokens", "4", key=None)
    assert refused.returncode != 0 and "error 401" in refused.stderr


def test_agent_loop_uses_the_key_from_the_environment(url: str) -> None:
    done = run_example("agent_loop.py", url, "--agents", "1", "--turns", "2", "--max-tokens", "3", key=KEY)
    assert done.returncode == 0, done.stderr
    assert "agent 0 turn 1:" in done.stdout and "agent 0 turn 2:" in done.stdout


@pytest.mark.parametrize("script", ["chat_stream.py", "agent_loop.py"])
def test_no_server_is_one_line_not_a_traceback(script: str) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        done = run_example(script, f"http://127.0.0.1:{port}", key=None)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: no server answered") and "radixserve serve" in done.stderr
