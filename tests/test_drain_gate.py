"""The cluster ingress's drain gate (radixserve/cluster/drain_gate.py) on a real server,
without Ray: POSTs in flight are counted from arrival to the response's end, streamed or
not; once the gate closes (a stop's drain began) a new POST is refused unread with a 503
that says it was never started, while those in flight finish and GETs pass. The session
cluster's stop checks the same through Serve's proxy (cluster_util.stream_across_the_stop)."""

from __future__ import annotations

import asyncio
import threading

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from radixserve.cluster.drain_gate import DrainGate, PostsInFlight
from tests.server_util import running_server, wait_for


def test_a_closed_gate_refuses_new_posts_and_lets_those_in_flight_finish() -> None:
    release = asyncio.Event()
    loop: list[asyncio.AbstractEventLoop] = []
    reached: list[str] = []  # the routes a request got to

    async def slow(request: Request) -> Response:
        loop.append(asyncio.get_running_loop())
        reached.append("slow")

        async def body():  # type: ignore[no-untyped-def]
            yield b"first\n"
            await release.wait()
            yield b"last\n"
        return StreamingResponse(body())

    async def quick(request: Request) -> Response:
        reached.append("quick")
        return PlainTextResponse("ok")

    gate = DrainGate()
    app = Starlette(routes=[Route("/slow", slow, methods=["POST"]), Route("/quick", quick, methods=["POST", "GET"])])
    app.add_middleware(PostsInFlight, gate=gate)
    with running_server(app) as url:
        assert httpx.post(f"{url}/quick").text == "ok" and gate.in_flight == 0
        lines: list[str] = []
        with httpx.stream("POST", f"{url}/slow", timeout=30) as stream:
            reader = threading.Thread(target=lambda: lines.extend(stream.iter_lines()), daemon=True)
            reader.start()
            assert wait_for(lambda: lines == ["first"])
            assert gate.in_flight == 1  # its body is still being sent
            gate.closed = True
            refused = httpx.post(f"{url}/quick", json={"prompt": "x"})
            assert httpx.get(f"{url}/quick").text == "ok"  # GETs (health, event streams) pass
            loop[0].call_soon_threadsafe(release.set)
            reader.join(30)
        assert lines == ["first", "last"] and gate.in_flight == 0
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json() == {"error": {
        "message": "The server is shutting down and takes no new requests; retry on another server or once this "
                   "one is back.", "type": "server_error", "param": None, "code": "server_shutting_down"}}
    assert reached == ["quick", "slow", "quick"]  # the refused POST reached no route
