"""Hostile input and a stuck engine on a real server: nobody else may be hurt, and the
operator can see and stop it (issue 9)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import running_server, sse_chunks, wait_for
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.server import create_app
from radixserve.server.guard import RequestGuard
from radixserve.server.metrics import ServerMetrics

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


class StepGate:
    """A step hook that holds the engine thread inside its next step until released: a real
    stuck step, as a frozen kernel or a runaway computation would leave it."""

    def __init__(self) -> None:
        self.closed = False
        self.holding = threading.Event()
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        self._open.clear()
        self.closed = True

    def release(self) -> None:
        self.closed = False
        self._open.set()

    def __call__(self) -> None:
        if self.closed:
            self.holding.set()
            self._open.wait()
            self.holding.clear()


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    gate = StepGate()
    engine = AsyncEngine(Engine(model="demo", page_size=16, num_pages=256), stall_timeout_s=0.5, step_hook=gate)
    app = create_app(engine)
    try:
        with running_server(app, log_level="info") as url:
            yield SimpleNamespace(url=url, engine=engine, gate=gate)
    finally:
        gate.release()
    engine.engine.check_invariants()


@pytest.fixture
def client(server: SimpleNamespace) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_idle(server: SimpleNamespace) -> None:
    def idle() -> bool:
        s = server.engine.stats()
        return s["running"] == 0 and s["waiting"] == 0 and s["pages_locked"] == 0
    assert wait_for(idle), server.engine.stats()


def post_in_background(url: str, body: dict[str, Any]) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    """Posts a completion from a thread; the response lands in the dict under "response"."""
    result: dict[str, httpx.Response] = {}

    def request() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            result["response"] = c.post(COMPLETIONS, json=body)

    worker = threading.Thread(target=request)
    worker.start()
    return worker, result


def metric(client: httpx.Client, name: str, labels: dict[str, str] | None = None) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and (labels is None or sample.labels == labels):
                return sample.value
    return 0.0


def local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


# ---------------------------------------------------------------- stop strings (item 1)


def test_huge_stop_string_is_400_and_a_concurrent_request_is_unaffected(server: SimpleNamespace) -> None:
    prompt = "An innocent request streams beside an attacker"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = Engine(model="demo", page_size=16, num_pages=64).generate([prompt], params)[0].text
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as innocent, httpx.Client(base_url=server.url,
                                                                                 timeout=60) as attacker:
        with innocent.stream("POST", COMPLETIONS, json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            for stop in (["a" * 200_000], ["x", "y", "z", "w", "v"]):
                r = attacker.post(COMPLETIONS, json={"prompt": "attack", "max_tokens": 4, "stop": stop})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "stop" and r.json()["error"]["code"] == "invalid_value"
            raw = first + "\n" + "".join(line + "\n" for line in lines)
    chunks = sse_chunks(raw)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert_idle(server)


def test_longest_allowed_stop_string_still_stops(client: httpx.Client) -> None:
    body = {"prompt": "A stop string test for the server", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = client.post(COMPLETIONS, json=body).json()["choices"][0]["text"]
    middle = len(full) // 2
    stop = full[middle - 8: middle]
    longest = "q" * (512 - len(stop)) + stop  # 512 characters: allowed
    assert stop.strip() and "q" not in full, full
    choice = client.post(COMPLETIONS, json={**body, "stop": [longest, stop]}).json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)] and choice["finish_reason"] == "stop"
    r = client.post(COMPLETIONS, json={**body, "stop": ["q" + longest]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


# ---------------------------------------------------------------- malformed bodies (item 3)


HOSTILE_BODIES = [
    # JSON nested past the decoder's recursion limit: was a 500 (RecursionError).
    (CHAT, b'{"x": ' + b'{"a": ' * 1200 + b"1" + b"}" * 1200 + b"}", 400, "invalid_json"),
    # The three bodies that got no answer: each followed a 500 on the same keep-alive
    # connection, which uvicorn closed after the 500 without saying so.
    (CHAT, b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "invalid_value"),
    (CHAT, json.dumps({"messages": USER, "session_id": "s" * 200_000}).encode(), 400, "invalid_value"),
    (COMPLETIONS, b'{"prompt": "' + b"\\u00e9" * 100_000 + b'", "max_tokens": 2}', 400, "context_length_exceeded"),
    (COMPLETIONS, b"[" * 1000 + b"]" * 1000, 400, "invalid_value"),
    (CHAT, b'{"x": ' + b"[" * 1100 + b"]" * 1100 + b', "messages": []}', 400, "invalid_json"),
]


def test_hostile_bodies_each_get_a_4xx_on_one_keep_alive_connection(client: httpx.Client) -> None:
    ports = set()
    for _ in range(2):
        for path, body, status, code in HOSTILE_BODIES:
            r = client.post(path, content=body, headers=JSON)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (body[:60], r.text)
            assert r.headers.get("connection") != "close"
            ports.add(local_port(r))
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2})
    assert r.status_code == 200
    ports.add(local_port(r))
    assert len(ports) == 1  # one connection served them all: none was dropped


def test_unexpected_exception_is_a_json_500_that_keeps_the_connection() -> None:
    async def broken(request: Request) -> Response:
        raise RuntimeError("a bug in a handler")

    async def fine(request: Request) -> Response:
        return Response("ok")

    metrics = ServerMetrics(dict)
    app = Starlette(routes=[Route("/v1/completions", broken, methods=["POST"]), Route("/ok", fine)],
                    middleware=[Middleware(RequestGuard, metrics=metrics, endpoints={"/v1/completions": "completions"})])
    with running_server(app) as url, httpx.Client(base_url=url) as c:
        r = c.post("/v1/completions", json={})
        assert r.status_code == 500 and r.headers.get("connection") != "close"
        assert r.json()["error"] == {"message": "Internal server error: RuntimeError: a bug in a handler",
                                     "type": "server_error", "param": None, "code": "internal_error"}
        again = c.get("/ok")
        assert again.text == "ok" and local_port(again) == local_port(r)
    assert metrics.requests.labels("completions", "500")._value.get() == 1


def run_guarded(app: Any, send_fails_on: str | None) -> None:
    """Runs one POST through a RequestGuard around `app`, with a send that raises (as uvloop's
    closed transport does) on the message type `send_fails_on`."""
    scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": [], "client": ("127.0.0.1", 1)}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == send_fails_on:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    guard = RequestGuard(app, metrics=ServerMetrics(dict), endpoints={"/v1/completions": "completions"})
    asyncio.run(guard(scope, receive, send))


def test_a_connection_failing_under_a_write_is_one_line_and_a_bug_keeps_its_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    async def streams(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})

    async def breaks_mid_stream(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise ValueError("a bug mid-stream")

    with caplog.at_level(logging.INFO, logger="radixserve.server"):
        run_guarded(streams, send_fails_on="http.response.body")
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert record.getMessage() == ("response to /v1/completions not sent: its connection failed "
                                   "(unable to perform operation on <TCPTransport closed=True>)")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="radixserve.server"):
        run_guarded(breaks_mid_stream, send_fails_on=None)
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.getMessage() == "request to /v1/completions failed after its response started"


# ---------------------------------------------------------------- metrics agree with the log (item 7)


class AccessLog(logging.Handler):
    """Collects uvicorn's access-log lines as (path, status)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        _client, _method, path, _version, status = record.args  # type: ignore[misc]
        self.lines.append((path, status))


def test_request_counters_agree_with_the_access_log(server: SimpleNamespace, client: httpx.Client) -> None:
    log = AccessLog()
    logger = logging.getLogger("uvicorn.access")
    level = logger.level
    logger.setLevel(logging.INFO)  # every uvicorn.Config in this process sets it anew
    logger.addHandler(log)
    before = {(e, s): metric(client, "radixserve_http_requests_total", {"endpoint": e, "status": s})
              for e in ("chat", "completions") for s in ("200", "400", "404", "405", "413")}
    gone_before = metric(client, "radixserve_http_disconnects_total", {"endpoint": "completions"})
    try:
        client.post(CHAT, json={"messages": USER, "max_tokens": 2})
        client.post(CHAT, content=b"{", headers=JSON)
        client.post(COMPLETIONS, json={"prompt": "x", "model": "nope"})
        client.get(COMPLETIONS)
        client.post(COMPLETIONS, content=b"x" * (5 * 2**20), headers=JSON)
        client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "stream": True})
        # A client that leaves while sending its body, and one that leaves before its answer:
        # neither gets a line in the access log.
        with httpx.Client(base_url=server.url, timeout=0.5) as impatient:
            def body() -> Iterator[bytes]:
                yield b'{"prompt": "'
                raise RuntimeError("the client gives up mid-body")
            with pytest.raises(RuntimeError):
                impatient.post(COMPLETIONS, content=body(), headers=JSON)
            server.gate.close()
            with pytest.raises(httpx.ReadTimeout):
                impatient.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2})
        assert wait_for(lambda: metric(client, "radixserve_http_disconnects_total",
                                       {"endpoint": "completions"}) == gone_before + 2)
    finally:
        server.gate.release()
        logger.removeHandler(log)
        logger.setLevel(level)
    assert_idle(server)
    logged: dict[tuple[str, str], int] = {}
    for path, status in log.lines:
        endpoint = {CHAT: "chat", COMPLETIONS: "completions"}.get(path)
        if endpoint:
            logged[endpoint, str(status)] = logged.get((endpoint, str(status)), 0) + 1
    counted = {key: metric(client, "radixserve_http_requests_total", {"endpoint": key[0], "status": key[1]})
               - before[key] for key in before}
    assert logged == {("chat", "200"): 1, ("chat", "400"): 1, ("completions", "404"): 1,
                      ("completions", "405"): 1, ("completions", "413"): 1, ("completions", "200"): 1}
    assert {key: value for key, value in counted.items() if value} == logged


# ---------------------------------------------------------------- the watchdog (item 4)


def test_stuck_step_makes_health_503_and_metrics_show_it(server: SimpleNamespace, client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    server.gate.close()
    worker, result = post_in_background(server.url, {"prompt": "held", "max_tokens": 3, "ignore_eos": True})
    try:
        assert server.gate.holding.wait(30)  # the engine thread is inside a step, and stays there
        assert wait_for(lambda: client.get("/health").status_code == 503)
        health = client.get("/health").json()
        assert health["status"] == "unhealthy"
        assert "has not completed a step" in health["reason"] and "bound: 0.5 s" in health["reason"]
        assert metric(client, "radixserve_engine_stalled") == 1
        assert metric(client, "radixserve_engine_seconds_since_last_step") > 0.5
    finally:
        server.gate.release()
        worker.join(timeout=60)
    assert result["response"].status_code == 200
    assert result["response"].json()["usage"]["completion_tokens"] == 3
    assert_idle(server)
    assert wait_for(lambda: client.get("/health").json() == {"status": "ok"})
    assert metric(client, "radixserve_engine_stalled") == 0


def test_paused_engine_is_stalled_only_while_work_waits(server: SimpleNamespace, client: httpx.Client) -> None:
    assert_idle(server)
    server.engine.pause()
    try:
        assert client.get("/health").status_code == 200  # paused but idle: nothing waits
        worker, result = post_in_background(server.url, {"prompt": "waits", "max_tokens": 2, "ignore_eos": True})
        assert wait_for(lambda: client.get("/health").status_code == 503)
        assert server.engine.stats()["waiting"] == 1
    finally:
        server.engine.resume()
        worker.join(timeout=60)
    assert result["response"].status_code == 200
    assert_idle(server)
    assert wait_for(lambda: client.get("/health").status_code == 200)


# ---------------------------------------------------------------- maps and fields with no effect (issue 22, item 7)


def test_logit_bias_is_capped_and_best_of_is_refused_unless_it_equals_n(client: httpx.Client) -> None:
    neutral = {str(i): 0 for i in range(1024)}
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, "logit_bias": neutral})
    assert r.status_code == 200, r.text
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, "logit_bias": {**neutral, "1024": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    for body, status in (({"best_of": 2}, 400), ({"best_of": 3, "n": 2}, 400), ({"best_of": 2, "n": 2}, 200),
                         ({"best_of": 1}, 200)):
        r = client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == status, (body, r.text)
        if status == 400:
            assert r.json()["error"]["param"] == "best_of" and r.json()["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_options_without_stream_is_refused_not_ignored(client: httpx.Client, path: str) -> None:
    """As OpenAI: include_usage asks for a last chunk that only a stream has."""
    body = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    for stream, status in ((None, 400), (False, 400), (True, 200)):
        r = client.post(path, json={**body, "max_tokens": 2, "stream": stream,
                                    "stream_options": {"include_usage": True}})
        assert r.status_code == status, (stream, r.text)
        if status == 400:
            assert r.json()["error"]["param"] == "stream_options" and r.json()["error"]["code"] == "invalid_value"
    assert client.post(path, json={**body, "max_tokens": 2, "stream_options": None}).status_code == 200


def test_a_large_body_is_decoded_off_the_event_loop(server: SimpleNamespace, client: httpx.Client,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies past DECODE_IN_THREAD_BYTES are decoded in a worker thread (seen by the thread
    that runs the decoder), smaller ones on the loop; both answer the same."""
    import msgspec

    from radixserve.server import app as app_module

    threads: list[str] = []
    real = app_module._CHAT_DECODER

    class Spy:
        def decode(self, body: bytes) -> Any:
            threads.append(threading.current_thread().name)
            return real.decode(body)

    monkeypatch.setattr(app_module, "_CHAT_DECODER", Spy())
    padding = "x" * app_module.DECODE_IN_THREAD_BYTES
    for user in ("y", padding):
        r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, "user": "u", "metadata": user})
        assert r.status_code == 200, r.text
    loop_thread = threads[0]
    assert threads[1] != loop_thread and len(threads) == 2
    assert isinstance(real, msgspec.json.Decoder)


def test_a_large_response_is_built_off_the_event_loop(client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole response past OFFLOAD_RESPONSE_ENTRIES tokens and logprob alternatives is
    formatted and encoded in a worker thread (a 36 MB body of logprobs held the event loop, and
    every other client's stream, for 3 s); a small one on the loop. Seen by the thread that
    encodes it."""
    from radixserve.server import app as app_module

    threads: list[str] = []
    real = app_module._json

    def spy(value: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(value)

    monkeypatch.setattr(app_module, "_json", spy)
    small = {"prompt": "hi", "max_tokens": 2, "logprobs": 20}
    large = {"prompt": "hi", "max_tokens": 64, "n": 4, "logprobs": 20, "ignore_eos": True, "temperature": 1.0}
    assert 4 * 64 * 20 > app_module.OFFLOAD_RESPONSE_ENTRIES
    answers = [client.post(COMPLETIONS, json=body) for body in (small, large)]
    assert [r.status_code for r in answers] == [200, 200], answers[1].text
    assert [len(c["logprobs"]["tokens"]) for c in answers[1].json()["choices"]] == [64] * 4
    assert len(threads) == 2 and threads[1] != threads[0]


# ---------------------------------------------------------------- slow clients (issue 22, item 7)


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_slow_heads_are_cut_and_slow_bodies_get_408_while_others_are_served(parser: str) -> None:
    import socket
    import time

    from radixserve.server.connections import with_deadlines

    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    app = create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=64)), body_timeout_s=1.0)
    with running_server(app, http=with_deadlines(base, 0.5)) as url:
        host, port = url.removeprefix("http://").split(":")
        # A connection that sends half a head and stalls is closed by the server.
        loris = socket.create_connection((host, int(port)))
        loris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        loris.settimeout(60)
        started = time.monotonic()
        assert loris.recv(1024) == b""  # closed, without an answer
        loris.close()
        # A body that stops halfway gets a 408 in OpenAI's error shape.
        slow = socket.create_connection((host, int(port)))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        slow.settimeout(60)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = slow.recv(4096)
            if not chunk:
                break
            answer += chunk
        slow.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert (error["code"], error["type"]) == ("request_timeout", "invalid_request_error")  # the client's doing
        # Others are served all along, and a client that keeps its connection idle between
        # requests is not mistaken for a slow one while it sends promptly.
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(2):
                assert client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert time.monotonic() - started < 60


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_client_that_reads_nothing_is_cut_and_a_slow_reader_is_not(parser: str) -> None:
    """A whole response is written to the transport at once: a client that never reads kept
    it in the server's memory for good. Writes paused past the deadline abort the connection;
    a client that reads, however slowly, keeps resetting it."""
    import socket
    import time

    from radixserve.server.connections import with_deadlines

    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    big, small = b"x" * (32 << 20), b"y" * (512 << 10)

    async def body(request: Request) -> Response:
        return Response(big if request.path_params["size"] == "big" else small)

    def connect(url: str) -> socket.socket:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes pause
        sock.connect((host, int(port)))
        sock.settimeout(30)
        return sock

    def read_all(sock: socket.socket, pause_s: float = 0.0, size: int = 65536) -> int:
        received = 0
        try:
            while chunk := sock.recv(size):
                received += len(chunk)
                time.sleep(pause_s)
        except ConnectionResetError:
            pass
        return received

    # Every time below is a multiple of the write deadline (halved from 1.0 s with the reader's
    # pause, the ratio kept: 25 pauses of the slow reader to a deadline).
    write_timeout_s = 0.5
    deadlines = with_deadlines(base, 10.0, write_timeout_s=write_timeout_s)
    pauses: list[float] = []  # how long each pause of the server's writes lasted

    class Timed(deadlines):  # type: ignore[valid-type, misc]
        _paused_at = 0.0

        def pause_writing(self) -> None:
            self._paused_at = time.monotonic()
            super().pause_writing()

        def resume_writing(self) -> None:
            pauses.append(time.monotonic() - self._paused_at)
            super().resume_writing()

    app = Starlette(routes=[Route("/{size}", body)])
    # Small kernel buffers on both ends: the server's writes pause after little output.
    with running_server(app, send_buffer=8192, http=Timed) as url:
        # The idle client and the slow reader at once (their times overlap, the checks do not).
        with connect(url) as idle, connect(url) as slow:
            idle.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            idle_since = time.monotonic()
            # 512 KiB, 4 KiB every 20 ms: paused for several deadlines, never idle one
            slow.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            started = time.monotonic()
            assert read_all(slow, pause_s=write_timeout_s / 25, size=4096) > len(small)  # the whole body, and its head
            assert time.monotonic() - started > 3 * write_timeout_s
            # The idle one reads nothing, well past the deadline (4 of them, as before)...
            time.sleep(max(0.0, idle_since + 4 * write_timeout_s - time.monotonic()))
            with pytest.raises(ConnectionResetError):  # ... and is cut, the kernel's buffers dropped too (a reset)
                while idle.recv(65536):
                    pass
        assert max(pauses) > 3 * write_timeout_s  # paused for several deadlines while it read: the case is tested


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_pipelined_requests_outlive_the_head_deadline(parser: str) -> None:
    """A pipelined request sent its head with the first: it must not be cut by the deadline
    while it runs longer than the deadline."""
    import asyncio
    import socket

    from radixserve.server.connections import with_deadlines

    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    async def slow(request: Request) -> Response:
        await asyncio.sleep(0.6)
        return Response("done")

    app = Starlette(routes=[Route("/slow", slow)])
    with running_server(app, http=with_deadlines(base, 0.2)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
            sock.settimeout(30)
            received = b""
            while received.count(b"done") < 2:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                received += chunk
    assert received.count(b"HTTP/1.1 200") == 2, received
