"""The bound on a request head (radixserve/server/head_limits.py), on real servers with the
CLI's uvicorn options: exact at its edges, never mistaking a body or pipelined requests for a
long head, and an attacker's endless head answered 431 and closed while an innocent client of
the real API is served beside it."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from server_util import running_server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.connections import uvicorn_options, with_deadlines
from radixserve.server.head_limits import MAX_HEAD_BYTES, MAX_HEAD_FIELDS

pytest.importorskip("httptools")  # the protocol bounded here (h11 bounds its own: the last test)

REQUEST_LINE = b"POST /echo HTTP/1.1\r\n"


async def echo(request: Request) -> PlainTextResponse:
    body = await request.body()
    return PlainTextResponse(f"{len(request.headers)} fields, {len(body)} body bytes")


@pytest.fixture(scope="module")
def echo_server() -> Iterator[tuple[str, int]]:
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    with running_server(app, **uvicorn_options()) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def head(size: int | None = None, fields: int = 3, body: bytes = b"") -> bytes:
    """A request head of exactly `size` bytes (request line to the blank line) with `fields`
    header lines (at least 3), the last padded to make up the size, and `body` after it."""
    lines = [b"Host: x", f"Content-Length: {len(body)}".encode()]
    lines += [f"X-F{i}: v".encode() for i in range(fields - len(lines))]
    raw = REQUEST_LINE + b"".join(line + b"\r\n" for line in lines) + b"\r\n"
    if size is not None:
        assert size >= len(raw)
        lines[-1] += b"a" * (size - len(raw))
        raw = REQUEST_LINE + b"".join(line + b"\r\n" for line in lines) + b"\r\n"
        assert len(raw) == size
    return raw + body


def exchange(address: tuple[str, int], data: bytes, answers: int | None = None) -> bytes:
    """Sends `data` (ignoring a reset once the server has closed) and reads until `answers`
    echo answers arrived, or else to the close (its end is shut first: uvicorn answers only the
    first of pipelined requests once it has seen the end of the input)."""
    with socket.create_connection(address) as sock:
        sock.settimeout(60)
        try:
            sock.sendall(data)
            if answers is None:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # reset, or closed by the server before the shutdown
            pass
        received = b""
        while answers is None or received.count(b" body bytes") < answers:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    return received


def assert_refused(answer: bytes) -> None:
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 431 Request Header Fields Too Large", answer[:300]
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert body == {"error": {"message": f"the request head is too large: at most {MAX_HEAD_BYTES:,} bytes of "
                                         f"target and header fields, and {MAX_HEAD_FIELDS} fields",
                              "type": "invalid_request_error", "param": None,
                              "code": "request_header_fields_too_large"}}


def test_a_head_of_the_bound_is_served_and_one_byte_more_is_431(echo_server: tuple[str, int]) -> None:
    answer = exchange(echo_server, head(MAX_HEAD_BYTES))
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"3 fields, 0 body bytes"), answer[:300]
    assert_refused(exchange(echo_server, head(MAX_HEAD_BYTES + 1)))


def test_the_field_count_is_bounded_exactly(echo_server: tuple[str, int]) -> None:
    answer = exchange(echo_server, head(fields=MAX_HEAD_FIELDS))
    assert answer.endswith(f"{MAX_HEAD_FIELDS} fields, 0 body bytes".encode()), answer[:300]
    assert_refused(exchange(echo_server, head(fields=MAX_HEAD_FIELDS + 1)))


@pytest.mark.parametrize("endless", [b"X-A: b\r\n" * 20_000, b"X-Long: " + b"v" * 200_000,
                                     b"Cookie: c\r\n" + b"X-B: " + b"w" * 100_000],
                         ids=["many-fields", "one-endless-value", "endless-value-after-a-field"])
def test_a_head_that_goes_on_and_on_is_431_and_closed(echo_server: tuple[str, int], endless: bytes) -> None:
    """Never ended: a value that grows inside httptools, unseen by any callback, is cut too."""
    assert_refused(exchange(echo_server, REQUEST_LINE + b"Host: x\r\n" + endless))
    assert_refused(exchange(echo_server, b"GET /" + b"u" * 100_000))  # an endless target


@pytest.mark.parametrize("trailer", [b"X-T: " + b"v" * 200_000, b"X-T: t\r\n" * 20_000],
                         ids=["one-endless-value", "many-fields"])
def test_a_chunked_bodys_endless_trailer_is_cut(echo_server: tuple[str, int], trailer: bytes) -> None:
    """Trailer fields follow a chunked body: an endless one grew inside httptools as a head's
    did, on the event loop, bounded only by the body deadline. The connection is closed with
    no answer (its request is under way); a chunked body with a small trailer is served."""
    start = REQUEST_LINE + b"Host: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
    assert exchange(echo_server, start + b"X-T: small\r\n\r\n").endswith(b"5 body bytes")
    assert b"HTTP/1.1" not in exchange(echo_server, start + trailer)
    # Sent on and on, it is cut after about the bound (the kernel's buffers take a few MB more).
    sent, limit = 0, 64 * MAX_HEAD_BYTES
    with socket.create_connection(echo_server) as sock:
        sock.settimeout(30)
        try:
            sock.sendall(start + trailer[:5])
            while sent < limit:
                sock.sendall(trailer[5:5 + 8192])
                sent += 8192
        except OSError:  # reset or broken pipe: closed by the server
            pass
    assert sent < limit, sent


def test_a_body_or_pipelined_requests_are_not_taken_for_a_long_head(echo_server: tuple[str, int]) -> None:
    """Read together with the head, a large body is the body; many small pipelined requests in
    one read are many small heads; a long head pipelined behind a request is refused after it."""
    body = b"b" * 300_000
    answer = exchange(echo_server, head(body=body))
    assert answer.endswith(f"3 fields, {len(body)} body bytes".encode()), answer[:300]
    small = head(fields=4)
    count = 3 * MAX_HEAD_BYTES // len(small)  # three bounds' worth, in one send
    answer = exchange(echo_server, small * count, answers=count)
    assert answer.count(b"HTTP/1.1 200 OK") == count and b"431" not in answer
    # (A head pipelined in the same read as the request before it is bounded by the second
    # count alone, which leaves out its request line's method and version: 64 bytes over, here.)
    answer = exchange(echo_server, small + head(MAX_HEAD_BYTES + 64), answers=2)
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1 ") == 2, answer[:300]
    assert_refused(answer[answer.index(b"HTTP/1.1 431"):])


def test_an_endless_head_beside_an_innocent_client_of_the_api() -> None:
    """The attacker sends header lines for as long as the server reads them: it is answered
    431 and closed after about the bound, and the innocent's chat equals its output alone."""
    app = create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=64)))
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}
    with running_server(app, **uvicorn_options()) as url:
        alone = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
        host, port = url.removeprefix("http://").split(":")
        sent = 0
        outcome: dict[str, bytes] = {}

        def attack() -> None:
            nonlocal sent
            with socket.create_connection((host, int(port))) as sock:
                sock.settimeout(60)
                try:
                    sock.sendall(REQUEST_LINE + b"Host: x\r\n")
                    while sent < 64 * MAX_HEAD_BYTES:
                        sock.sendall(b"X-A: b\r\n" * 1024)
                        sent += 8 * 1024
                except (BrokenPipeError, ConnectionResetError):
                    pass
                try:
                    outcome["answer"] = sock.recv(65536)
                except ConnectionResetError:
                    outcome["answer"] = b"reset"

        attacker = threading.Thread(target=attack)
        attacker.start()
        beside = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
        attacker.join(60)
    assert beside == alone
    # The server stopped reading at the bound: what the attacker got into the kernel's
    # buffers past it is all it could send (loopback buffers: a few MB at most).
    assert sent < 64 * MAX_HEAD_BYTES, sent
    assert outcome["answer"].startswith(b"HTTP/1.1 431") or outcome["answer"] == b"reset"


def test_h11_bounds_a_head_by_itself_at_the_same_size() -> None:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    options = {**uvicorn_options(), "http": with_deadlines(H11Protocol, 10.0)}
    with running_server(app, **options) as url:
        host, port = url.removeprefix("http://").split(":")
        address = (host, int(port))
        assert exchange(address, head(MAX_HEAD_BYTES - 1024)).endswith(b"3 fields, 0 body bytes")
        # h11 bounds the head it holds incomplete: one longer than a read (256 KiB) is refused.
        assert exchange(address, head(8 * MAX_HEAD_BYTES)).startswith(b"HTTP/1.1 400")
