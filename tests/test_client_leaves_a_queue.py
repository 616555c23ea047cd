"""A request whose client leaves while it waits for one of the server's bounded slots (a large
prompt's tokenizing, a schema check, a grammar compile) leaves that queue at once: it does not
wait for its turn and then do the work for nobody. uvicorn serves on a real port in the test's
own event loop, so the test can hold every slot of a kind (the slots are event-loop objects)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import httpx
import uvicorn

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.fair_slots import FairSlots
from radixserve.server.prompt_work import LARGE_PROMPT_CHARS
from radixserve.server.tenancy import Caller

KEYS = {"k-a": Caller("a", admin=False), "k-b": Caller("b", admin=False)}
LARGE = "word " * (LARGE_PROMPT_CHARS // 5 + 1)


def _json_schema(name: str) -> dict[str, Any]:
    """A schema of its own (one compiled for an earlier case would take no compile slot)."""
    schema = {"type": "object", "properties": {name: {"type": "integer"}}}
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


# (which slots the test holds, the waiting request's path and body, its answer once waited for:
# a large prompt of the demo's small vocabulary is more tokens than its context)
WAITS: dict[str, tuple[Callable[[Any], FairSlots], str, dict[str, Any], int]] = {
    "completion prompt": (lambda server: server.prompt_work.slots, "/v1/completions",
                          {"prompt": LARGE, "max_tokens": 1}, 400),
    "chat prompt": (lambda server: server.prompt_work.slots, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": LARGE}], "max_tokens": 1}, 400),
    "schema check": (lambda server: server.request_checks, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                      "response_format": _json_schema("check")}, 200),
    "grammar compile": (lambda server: server.grammar_compiles.slots, "/v1/completions",
                        {"prompt": "hi", "max_tokens": 1, "response_format": _json_schema("compile")}, 200),
}


def test_a_request_leaves_the_queue_of_its_slot_when_its_client_leaves() -> None:
    """For each kind of slot in turn (one server for all): every slot held, a request queues,
    its client gives up, the queue is empty again; then the same request, waited for, is
    answered as usual."""
    app = create_app(AsyncEngine(Engine(model="demo", num_pages=64)), tenant_keys=KEYS)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    left: list[str] = []

    async def until(predicate: Callable[[], bool]) -> None:
        while not predicate():
            await anyio.sleep(0.01)

    async def leave_and_come_back(client: httpx.AsyncClient, wait: str) -> None:
        held_slots, path, body, status = WAITS[wait]
        slots = held_slots(app.state.server)
        async with AsyncExitStack() as held:  # every slot: b's, the reserve c's
            for holder in ["b"] * (slots.slots - slots.reserve) + ["c"] * slots.reserve:
                await held.enter_async_context(slots.hold(holder))
            async with anyio.create_task_group() as request:
                request.start_soon(lambda: client.post(path, json=body, headers={"Authorization": "Bearer k-a"}))
                await until(lambda: slots.waiting("a") == 1)
                request.cancel_scope.cancel()  # the client gives up: its connection closes
            # Still queued until b's slots come back, had it not left.
            with anyio.move_on_after(30):
                await until(lambda: slots.waiting("a") == 0)
            if slots.waiting("a") == 0:
                left.append(wait)
        # The server carries on: the same request, waited for, is answered.
        answer = await client.post(path, json=body, headers={"Authorization": "Bearer k-a"})
        assert answer.status_code == status, answer.text

    async def run() -> None:
        async with anyio.create_task_group() as serving:
            serving.start_soon(server.serve, [sock])
            with anyio.fail_after(200):
                await until(lambda: server.started)
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    for wait in WAITS:
                        await leave_and_come_back(client, wait)
            server.should_exit = True

    anyio.run(run)
    assert left == list(WAITS)
