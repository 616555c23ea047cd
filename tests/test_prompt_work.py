"""Prompts are sized before they are tokenized, and large ones are tokenized in slots shared
fairly between tenants (server/prompt_work.py): a tenant's flood of long prompts, refused or
not, neither starves the CPU for others nor is tokenized whole when it cannot fit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import httpx
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.prompt_work import LARGE_PROMPT_CHARS, PromptWork, longest_token_chars
from radixserve.server.tenancy import Caller

KEYS = {"k-a": Caller("a", admin=False), "k-b": Caller("b", admin=False)}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Engine, str]]:
    engine = Engine(model="demo", num_pages=256)
    with running_server(create_app(AsyncEngine(engine), tenant_keys=KEYS)) as url:
        yield engine, url


def test_a_prompt_longer_than_the_context_could_hold_is_refused_before_tokenizing(
        served: tuple[Engine, str]) -> None:
    """The demo tokenizer's longest token is 15 characters and its context 4,096 tokens: a
    prompt of more than 2 x 15 x 4,096 characters is refused by its size, naming it; one
    just under is tokenized and refused by its token count, as before."""
    engine, url = served
    limit = 2 * longest_token_chars(engine.tokenizer) * engine.max_context_len
    assert limit == 2 * 15 * 4096
    with httpx.Client(base_url=url, timeout=120, headers={"Authorization": "Bearer k-a"}) as client:
        batch = client.post("/v1/completions", json={"prompt": ["hi", "x" * (limit + 1)], "max_tokens": 1})
        assert batch.status_code == 400
        error = batch.json()["error"]
        assert (error["param"], error["code"]) == ("prompt[1]", "context_length_exceeded")
        assert f"{limit + 1} characters" in error["message"]
        chat = client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
            {"role": "system", "content": "y" * limit}, {"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        assert "characters" in chat.json()["error"]["message"]
        under = client.post("/v1/completions", json={"prompt": "x " * (limit // 2 - 1), "max_tokens": 1})
        assert under.status_code == 400 and "tokens" in under.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_large_prompts_take_a_fair_slot_and_small_ones_none() -> None:
    """Three large prompts of tenant a and one of tenant b, tokenized one at a time: b's is
    second, not fourth. A small prompt takes no slot and runs beside them."""
    work = PromptWork(tokenizer=None, max_context_len=4096)
    gate = threading.Event()
    started: list[str] = []

    def job(name: str) -> str:
        started.append(name)
        if name == "a0":
            gate.wait(10)  # holds the slot until the small prompt has run beside it
        return name

    async def main() -> None:
        async with anyio.create_task_group() as group:
            for name, tenant in (("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b")):
                group.start_soon(work.run, tenant, LARGE_PROMPT_CHARS + 1, lambda name=name: job(name))
                await anyio.sleep(0.05)
            assert await work.run("a", 10, lambda: job("small")) == "small"
            assert work.slots.held("a") == 1 and work.slots.waiting("a") == 2 and work.slots.waiting("b") == 1
            gate.set()

    anyio.run(main)
    assert started == ["a0", "small", "b0", "a1", "a2"]
