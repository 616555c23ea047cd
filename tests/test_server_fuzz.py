"""Fuzz: a few hundred seeded hostile bodies against one real server, over shared keep-alive
connections. None may get a 5xx (or an error event mid-stream), none may go unanswered, and
afterwards the server serves a normal request with nothing running, waiting or locked."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from server_util import parse_sse, running_server

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app

SEED = 9
NUM_BODIES = 300
CONCURRENCY = 16
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

ODD_STRINGS = ["", " ", "\u0000", "\ud800", "\uffff", "🙂" * 40, "\u202e evil", "a" * 3000, "é" * 500,
               "<|im_start|>system\n", "<|endoftext|>", "\n\n\n", "data: [DONE]\n\n", "null", "{}"]
ODD_NUMBERS: list[Any] = [0, -1, 1, 2, 16, 17, 2**31, 2**63, -(2**63), 2**64, 10**30, 1e-300, -1e-300, 1e300,
                          0.5, -0.0, 1e-45, 1.0000001, 2.0000001]
ODD_VALUES: list[Any] = [None, True, False, [], {}, [1, 2], ["a"], {"a": 1}, [[[[[]]]]], *ODD_NUMBERS,
                         *ODD_STRINGS]

# In-range values that push sampling and scheduling to their edges: every one must work.
EDGE_VALUES: dict[str, list[Any]] = {
    "temperature": [0, 1e-300, 1e-6, 1e-5, 0.01, 1.0, 2.0],
    "top_p": [1e-300, 1e-45, 1e-8, 0.5, 1.0],
    "top_k": [-1, 0, 1, 2, 10**9],
    "min_p": [0.0, 1e-300, 0.5, 1.0],
    "seed": [0, -(2**63), 2**63 - 1, 10**30, -1],
    "n": [1, 2, 4],
    "max_tokens": [1, 2, 3, 4],
    "priority": [-100, -1, 0, 100],  # the documented range; outside it: a 400
    "stop": [["🙂"], ["\u0000"], ["a" * 512], ["a", "b", "c", "d"], "é", " "],
    "stop_token_ids": [[0], [1, 2, 3], list(range(256))],
    "ignore_eos": [True, False],
    "cache_salt": ["s", "🙂" * 64, "x" * 256],
    "session_id": ["s", "é" * 256],
    "user": ["", "u" * 256],
    "retention_priority": [0, 100],
    "logit_bias": [{"5": 0}, {str(i): 0 for i in range(500)}],
    "response_format": [{"type": "text"}],
    "stream_options": [{"include_usage": True}],
    "return_tokens_as_token_ids": [True],
}
CHAT_EDGES = {"logprobs": [True], "top_logprobs": [0, 20], "max_completion_tokens": [1, 3],
              "system_retention_priority": [0, 100]}
COMPLETION_EDGES = {"logprobs": [0, 20], "echo": [False], "suffix": [None, ""]}


def chat_messages(rng: random.Random) -> list[dict[str, Any]]:
    roles = ["system", "developer", "user", "assistant", "tool"]
    return [{"role": rng.choice(roles), "content": rng.choice(["hi", "Tell me about pages.", "🙂", "é" * 20,
                                                                 [{"type": "text", "text": "parts"}]])}
            for _ in range(rng.randint(1, 4))]


def valid_body(rng: random.Random, path: str) -> dict[str, Any]:
    """A request that must succeed, with some parameters at the edges of their ranges."""
    if path == CHAT:
        body: dict[str, Any] = {"messages": chat_messages(rng)}
        edges = {**EDGE_VALUES, **CHAT_EDGES}
    else:
        body = {"prompt": rng.choice(["hi", "é" * 30, "🙂 " * 10, [5, 6, 7], [[1, 2], [3]], ["a", "b c"],
                                      list(range(300, 700)), "word " * 300])}
        edges = {**EDGE_VALUES, **COMPLETION_EDGES}
    body["max_tokens"] = rng.randint(1, 4)
    for name in rng.sample(sorted(edges), rng.randint(1, 6)):
        body[name] = rng.choice(edges[name])
    if "top_logprobs" in body:
        body["logprobs"] = True
    body["stream"] = rng.random() < 0.4
    if not body["stream"]:
        body.pop("stream_options", None)  # only with stream: true (a 400 otherwise)
    return body


def hostile_body(rng: random.Random, path: str) -> bytes:
    """Malformed JSON, wrong types, out-of-range and odd values, deep or huge structures."""
    kind = rng.randrange(6)
    base = valid_body(rng, path)
    if kind == 0:  # a field (known or not) set to something odd
        for _ in range(rng.randint(1, 3)):
            base[rng.choice([*base, *EDGE_VALUES, "model", "tools", "name", "x"])] = rng.choice(ODD_VALUES)
        return json.dumps(base).encode()
    if kind == 1:  # a required field gone or mistyped
        key = "messages" if path == CHAT else "prompt"
        if rng.random() < 0.5:
            base.pop(key)
        else:
            base[key] = rng.choice(ODD_VALUES + [[{"role": "user"}], [{"content": "x"}], [None], [-1], [[]]])
        return json.dumps(base).encode()
    if kind == 2:  # nesting: deep lists or objects, in a known field or an unknown one
        depth = rng.choice([50, 999, 1000, 1001, 5000, 20000])
        opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        inner = opener * depth + (b"1" if opener != b"[" else b"") + closer * depth
        field = rng.choice([b"messages", b"prompt", b"stop", b"x", b"logit_bias"])
        return b'{"' + field + b'": ' + inner + b', "max_tokens": 1}'
    raw = json.dumps(base).encode()
    if kind == 3:  # truncated or corrupted bytes
        cut = rng.randrange(len(raw))
        if rng.random() < 0.5:
            return raw[:cut]
        return raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
    if kind == 4:  # not JSON text at all, or not UTF-8, or JSON's non-standard numbers
        return rng.choice([b"", b"null", b"[]", b"\xef\xbb\xbf" + raw, b"\xff\xfe" + raw, raw + b"garbage",
                           raw.replace(b'"max_tokens": ', b'"max_tokens": NaN, "x": '),
                           raw.replace(b'"max_tokens": ', b'"max_tokens": 1e999, "x": '),
                           b'{"prompt": "\\ud800\\udc00\\udfff", "max_tokens": 1}', raw * 2])
    # huge values within the body limit
    base[rng.choice(["stop", "user", "session_id", "cache_salt", "model", "prompt", "x"])] = \
        rng.choice(["z" * rng.choice([257, 513, 50_000, 200_000]), ["s"] * 1000, list(range(5000)),
                    [0] * 40_000])
    return json.dumps(base).encode()


def generate_bodies(seed: int, count: int) -> list[tuple[str, bytes, bool]]:
    """(path, body, streaming) triples: about a third valid-but-extreme, the rest hostile."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        path = rng.choice([CHAT, COMPLETIONS])
        if rng.random() < 0.35:
            body = valid_body(rng, path)
            bodies.append((path, json.dumps(body).encode(), body["stream"]))
        else:
            raw = hostile_body(rng, path)
            bodies.append((path, raw, b'"stream": true' in raw))
    return bodies


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    engine = Engine(model="demo", page_size=16, num_pages=512, max_running=32)
    app = create_app(AsyncEngine(engine))
    with running_server(app) as url:
        yield SimpleNamespace(url=url, stats=app.state.server.engine.stats)
    engine.check_invariants()


def check(status: int, text: str, streaming: bool) -> str | None:
    """Why an answer is wrong, or None."""
    if status >= 500:
        return f"status {status}: {text[:300]}"
    if status != 200:
        error = json.loads(text)["error"]
        return None if set(error) == {"message", "type", "param", "code"} else f"error shape: {text[:300]}"
    if not streaming:
        json.loads(text)
        return None
    payloads = parse_sse(text)
    if payloads[-1] != "[DONE]":
        return f"stream without [DONE]: {text[-200:]}"
    errors = [p for p in payloads[:-1] if "error" in json.loads(p)]
    return f"error event: {errors[0][:300]}" if errors else None


def test_hostile_bodies_get_no_5xx_and_leave_the_server_clean(server: SimpleNamespace) -> None:
    bodies = generate_bodies(SEED, NUM_BODIES)
    assert sum(1 for _, _, streaming in bodies if streaming) >= 30  # both kinds of answer are fuzzed

    async def send_all() -> list[tuple[int, str | None, bytes]]:
        gate = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:

            async def one(path: str, body: bytes, streaming: bool) -> tuple[int, str | None, bytes]:
                async with gate:
                    try:
                        r = await client.post(path, content=body, headers={"content-type": "application/json"})
                    except httpx.TransportError as exc:  # no answer at all
                        return 0, f"{type(exc).__name__}: {exc}", body[:200]
                    return r.status_code, check(r.status_code, r.text, streaming and r.status_code == 200), \
                        body[:200]

            return await asyncio.gather(*(one(*b) for b in bodies))

    results = asyncio.run(send_all())
    failures = [(status, why, body) for status, why, body in results if why is not None]
    assert failures == []
    statuses = {status for status, _, _ in results}
    assert 200 in statuses and 400 in statuses  # the fuzz reached both the engine and the checks
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post(CHAT, json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    stats = server.stats()
    assert (stats["running"], stats["waiting"], stats["pages_locked"]) == (0, 0, 0), stats
    assert stats["pages_used"] == stats["pages_cached"], stats  # every used page is cache: none leaked
