"""Serve mode's HTTP client against a scripted OpenAI-style streaming server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from radixserve.benchmark.optimum import WorkloadBounds
from radixserve.benchmark.serve import run_serve_benchmark
from radixserve.benchmark.workloads import generated_shared_prefix, multi_turn, with_poisson_arrivals
from radixserve.ports import free_port

CHUNK_GAP_S = 0.002


class ScriptedServer:
    """Streams `max_tokens` one-character chunks, then a usage chunk whose cached_tokens is
    the longest prefix (at most len-1) shared with any earlier prompt."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.spans: dict[tuple[int, ...], tuple[float, float]] = {}
        self.bodies: list[dict] = []

    async def completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        prompt: list[int] = body["prompt"]
        if prompt[0] == 0:
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
        started = time.perf_counter()
        cached = max((_lcp(prompt[:-1], p) for p in self.prompts), default=0)
        self.prompts.append(prompt)

        async def events():
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(CHUNK_GAP_S)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}) + "\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                     "total_tokens": len(prompt) + body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": cached}}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            self.spans[tuple(prompt)] = (started, time.perf_counter())  # before the client can see the end
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture
def server() -> Iterator[tuple[str, ScriptedServer]]:
    scripted = ScriptedServer()
    app = Starlette(routes=[Route("/v1/completions", scripted.completions, methods=["POST"])])
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "scripted server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", scripted
    uv.should_exit = True
    thread.join(timeout=10)


def test_one_at_a_time_measures_hits_tokens_and_latencies(server) -> None:
    url, scripted = server
    w = generated_shared_prefix(num_groups=3, prompts_per_group=3, system_len=40, question_len=8,
                                output_len=4)
    result = asyncio.run(run_serve_benchmark(url, w, concurrency=1))
    summary = result.summary()
    assert summary["errors"] == 0 and summary["completed"] == 9
    assert summary["prompt_tokens"] == w.prompt_tokens
    assert summary["completion_tokens"] == 9 * 4
    assert summary["hit_rate"] == pytest.approx(WorkloadBounds(w).infinite().hit_rate)
    for record in result.records:
        assert len(record.itl_s) == 3 and all(g > 0 for g in record.itl_s)
        assert record.text == "xxxx"  # the completion, kept to compare runs
        assert 0 < record.ttft_s < record.latency_s
    assert summary["request_throughput"] == pytest.approx(9 / result.duration_s)
    body = scripted.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] and body["temperature"] == 0.0 and body["max_tokens"] == 4
    assert [b["prompt"] for b in scripted.bodies] == [r.prompt_ids.tolist() for r in w.requests]


def test_a_turn_is_sent_only_after_its_parent_finished(server) -> None:
    url, scripted = server
    w = multi_turn(num_clients=3, num_turns=3, system_len=16, message_len=4, output_len=3)
    summary = asyncio.run(run_serve_benchmark(url, w, concurrency=4)).summary()
    assert summary["errors"] == 0
    for r in w.requests:
        if r.parent is not None:
            parent_end = scripted.spans[tuple(w.requests[r.parent].prompt_ids.tolist())][1]
            assert scripted.spans[tuple(r.prompt_ids.tolist())][0] >= parent_end


def test_open_loop_sends_at_arrival_times(server) -> None:
    url, scripted = server
    w = with_poisson_arrivals(generated_shared_prefix(num_groups=2, prompts_per_group=3, system_len=8,
                                                      question_len=4, output_len=2), rate=40.0, seed=2)
    start = time.perf_counter()
    result = asyncio.run(run_serve_benchmark(url, w, open_loop=True))
    assert result.summary()["errors"] == 0
    for r in w.requests:
        sent = scripted.spans[tuple(r.prompt_ids.tolist())][0] - start
        assert sent >= r.arrival_time - 0.005


def test_http_errors_are_recorded_not_raised(server) -> None:
    url, _ = server
    w = generated_shared_prefix(num_groups=1, prompts_per_group=2, system_len=4, question_len=2, output_len=2)
    w.requests[0].prompt_ids = np.zeros(6, dtype=np.int32)  # the scripted server rejects it
    result = asyncio.run(run_serve_benchmark(url, w, concurrency=2))
    summary = result.summary()
    assert summary["errors"] == 1 and summary["completed"] == 1
    assert "HTTP 400" in result.records[0].error


def test_ctrl_c_writes_what_finished_and_exits_130(server, tmp_path, capsys) -> None:
    """Ctrl-C mid-run was a KeyboardInterrupt traceback with no table and no JSON, although
    requests had finished. Now: the finished ones' summary (table and JSON, marked
    interrupted, the others counted as errors 'interrupted'), one line, rc 130."""
    import os
    import signal

    from radixserve.cli import main

    url, scripted = server
    out = tmp_path / "serve.json"

    def interrupt_after_three() -> None:
        # Two workers: the fifth request is sent only once the client has finished three.
        deadline = time.monotonic() + 30
        while len(scripted.spans) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's Ctrl-C finds it
    watcher = threading.Thread(target=interrupt_after_three, daemon=True)
    try:
        watcher.start()
        try:
            code = main(["bench", "serve", "--url", url, "--workload", "gsp", "--workload-args",
                         "num_groups=4,prompts_per_group=50,system_len=8,question_len=4,output_len=5",
                         "--concurrency", "2", "--vocab-size", "32000",  # no vocabulary probe: 5 spans are 5 requests
                         "--no-progress", "--json", str(out)])
        except KeyboardInterrupt:
            code = None
        watcher.join(timeout=30)
    finally:
        signal.signal(signal.SIGINT, previous)
    captured = capsys.readouterr()
    assert code == 130, captured.err
    summary = json.loads(out.read_text())
    assert summary["interrupted"] is True and summary["requests"] == 200
    assert 3 <= summary["completed"] < 200 and summary["completed"] + summary["errors"] == 200
    assert summary["error_messages"] == {"interrupted": summary["errors"]}
    assert summary["completion_tokens"] == 5 * summary["completed"]
    assert "| gsp |" in captured.out
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert f"interrupted: {summary['completed']} of 200 requests finished" in captured.err


def test_a_request_rate_means_an_open_loop(server, tmp_path, capsys) -> None:
    """`--request-rate R` without `--open-loop` was silently a burst of 16 concurrent requests
    (the closed loop never reads arrival times); `--concurrency` was silently ignored with
    `--open-loop`. Now the rate implies the open loop, and the contradiction is refused."""
    from radixserve.cli import main

    url, _ = server
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--url", url, "--workload", "gsp", "--workload-args",
            "num_groups=1,prompts_per_group=3,system_len=8,question_len=4,output_len=2", "--no-progress"]
    assert main([*argv, "--request-rate", "1000", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["open_loop"] is True and summary["concurrency"] is None and summary["completed"] == 3
    capsys.readouterr()
    for extra in (["--request-rate", "5"], ["--open-loop"]):
        assert main([*argv, *extra, "--concurrency", "4"]) == 2
        err = capsys.readouterr().err
        assert "error: --concurrency is the closed loop's" in err and err.count("\n") == 1
    assert main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["concurrency"] == 16


def test_token_ids_stay_in_the_default_servers_vocabulary(tmp_path, capsys) -> None:
    """The synthetic default vocabulary (32,000) is out of range for the demo model's 2,048: the
    documented synopsis against a default `radixserve serve` answered 400 to every request.
    The command now asks the server (its range error for an id past any vocabulary)."""
    from server_util import running_server

    from radixserve import AsyncEngine, Engine
    from radixserve.benchmark.serve import probe_vocab_size
    from radixserve.cli import main
    from radixserve.server import create_app

    out = tmp_path / "serve.json"
    with running_server(create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=256)))) as url:
        assert probe_vocab_size(url) == 2048
        code = main(["bench", "serve", "--url", url, "--workload", "gsp", "--workload-args",
                     "num_groups=1,prompts_per_group=3,system_len=16,question_len=4,output_len=2",
                     "--concurrency", "2", "--no-progress", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "token ids kept below the server's vocabulary size, 2048" in captured.err
    summary = json.loads(out.read_text())
    assert summary["completed"] == 3 and summary["errors"] == 0
