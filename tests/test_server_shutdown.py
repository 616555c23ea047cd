"""Stopping `radixserve serve` with requests running: what the clients and the log see."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
from server_util import running_server
from test_server_cli import start_serve, stop

from radixserve import AsyncEngine, Engine
from radixserve.ports import free_port
from radixserve.server import create_app

LONG = {"prompt": "a", "max_tokens": 400, "ignore_eos": True}  # 400 steps, 20 s at least: past the 5 s grace


def test_requests_left_when_the_grace_runs_out_answer_503_and_the_log_stays_clean() -> None:
    """uvicorn cancels what still runs when its grace (5 s) is over: a stream stopped without
    its last event or [DONE], a whole response was a cut connection, and the log showed a
    CancelledError traceback per request. Ended by the engine a moment before, each is
    answered with a 503 `server_shutting_down` (in a stream: an error event, then [DONE])."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_serve(port, "--debug-step-delay-s", "0.05", "--num-pages", "64")  # 20 steps a second at most
    answers: dict[str, Any] = {}

    def streamed() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=120) as response:
            answers["stream"] = response.status_code, [line for line in response.iter_lines() if line]

    def whole() -> None:
        response = httpx.post(f"{url}/v1/completions", json=LONG, timeout=120)
        answers["whole"] = response.status_code, response.json()

    clients = [threading.Thread(target=send) for send in (streamed, whole)]
    try:
        for client in clients:
            client.start()
        deadline = time.monotonic() + 120
        while "radixserve_sequences_running 2.0" not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(timeout=120)
        _, stderr = process.communicate(timeout=60)
    finally:
        stop(process)
    assert process.returncode == 0, stderr
    assert "radixserve: stopped" in stderr
    assert "Traceback" not in stderr and "Cancel" not in stderr, stderr
    status, lines = answers["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("server_shutting_down", "server_error")
    tokens = [line for line in lines[:-2] if json.loads(line.removeprefix("data: "))["choices"][0]["text"]]
    assert 0 < len(tokens) < LONG["max_tokens"]  # it was cut, after some tokens
    status, body = answers["whole"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down", body


def test_a_request_that_reaches_the_engine_after_the_end_is_answered_503() -> None:
    """One that waited (for a grammar compile, its prompt's tokenizing) past the end would
    have started generating, to be cancelled mid-response a moment later."""
    app = create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=64)))
    with running_server(app) as url:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
        app.state.server.end_requests()
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True})
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_shutting_down"
