"""Hostile output constraints on a real server (real sockets, httpx), beside an innocent client.

A JSON Schema `pattern` with a large counted repetition (`.{0,8000}`, a few bytes of the 64 KiB
a schema may have) took xgrammar's schema converter ~26 s of CPU, quadratic in the count, in a
worker thread that nobody can stop (a disconnect changes nothing), and a schema's patterns add
up: a thousand of them, hours. It is a 400 naming the field at once, wherever the patterns sit
(response_format, guided_json's patternProperties, a tool's parameters, several properties). A grammar that matches no text at all
(`root ::= root`, `[^\\s\\S]`) masked every token, so the engine failed the request at its first
step (a 500 and a traceback in the log): it is a 400 naming the field. A grammar that can
start but never finish, or whose every step is slower than the last, ends its own request with
a 400 naming the field too (its client's fault, not the server's), within a step or so. The
innocent client's output is unchanged, and the server ends clean.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from server_util import running_server, wait_for

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app

INNOCENT = {"messages": [{"role": "user", "content": "an innocent question"}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
ATTACK_TIMEOUT_S = 20.0  # far above what a refusal takes; far below what compiling would take


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    engine = AsyncEngine(Engine(model="demo", page_size=16, num_pages=256))
    with running_server(create_app(engine)) as url:
        yield SimpleNamespace(url=url, engine=engine)


def _chat(url: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 8, **body}, timeout=timeout)


def _assert_clean(server: SimpleNamespace) -> None:
    assert wait_for(lambda: server.engine.stats()["running"] == 0 and server.engine.stats()["waiting"] == 0)
    stats = server.engine.stats()
    assert stats["pages_locked"] == 0, stats
    server.engine.engine.check_invariants()


def _pattern_schema(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}, "required": ["code"]}


SLOW_PATTERN = ".{0,8000}"
HOSTILE_PATTERNS = {
    "response_format.json_schema.schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": _pattern_schema(SLOW_PATTERN)}}},
    "guided_json": {"guided_json": {"type": "object", "patternProperties": {SLOW_PATTERN: {"type": "integer"}}}},
    "tools[0].function.parameters": {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": _pattern_schema(SLOW_PATTERN)}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}},
    # Many small repetitions add up as one large one does.
    "structured_outputs.json": {"structured_outputs": {"json": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": ".{0,1500}"} for i in range(30)}}}},
}


def test_a_pattern_that_would_compile_for_minutes_is_a_400_and_the_innocent_is_unaffected(
        server: SimpleNamespace) -> None:
    alone = _chat(server.url, INNOCENT)
    assert alone.status_code == 200, alone.text
    answers: dict[str, httpx.Response | BaseException] = {}

    def attack(param: str, body: dict[str, Any]) -> None:
        try:
            answers[param] = _chat(server.url, body, timeout=ATTACK_TIMEOUT_S)
        except httpx.TimeoutException as exc:
            answers[param] = exc

    attackers = [threading.Thread(target=attack, args=item) for item in HOSTILE_PATTERNS.items()]
    started = time.monotonic()
    for thread in attackers:
        thread.start()
    beside = _chat(server.url, INNOCENT)
    for thread in attackers:
        thread.join()
    assert beside.status_code == 200 and beside.json()["choices"] == alone.json()["choices"]
    for param, answer in answers.items():
        assert isinstance(answer, httpx.Response), f"{param}: no answer within {ATTACK_TIMEOUT_S} s"
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_value"), error
        assert "repeat" in error["message"]
    assert time.monotonic() - started < ATTACK_TIMEOUT_S
    _assert_clean(server)


def test_a_modest_pattern_still_constrains_the_output(server: SimpleNamespace) -> None:
    r = _chat(server.url, {"max_tokens": 40, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": _pattern_schema("[a-z]{2,6}")}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert re.fullmatch("[a-z]{2,6}", json.loads(choice["message"]["content"])["code"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("field", "value"), [("guided_grammar", "root ::= root"), ("guided_regex", r"[^\s\S]")])
def test_a_grammar_that_matches_nothing_is_a_400_not_an_engine_failure(
        server: SimpleNamespace, field: str, value: str, stream: bool) -> None:
    r = _chat(server.url, {field: value, "stream": stream})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", field, "invalid_value")
    assert "matches no text" in error["message"]
    beside = _chat(server.url, INNOCENT)
    assert beside.status_code == 200
    _assert_clean(server)


AMBIGUOUS_REGEX = "((a|aa|aaa){0,100}){0,100}(b|a){300}"  # each fill slower than the last


def test_an_ambiguous_grammar_ends_its_own_request_and_does_not_stall_the_others(
        server: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    """Before: every mask fill of this regex took longer than the one before (0.1 s, then
    seconds) on the engine thread, so the innocent stream beside it waited for minutes and the
    attacker's disconnect was not even seen. Now the request whose fill passes the budget ends
    alone (a 400 naming the field: its grammar is at fault), within a step or so."""
    innocent = {"prompt": "an innocent prompt", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{server.url}/v1/completions", json=innocent, timeout=120)
    assert alone.status_code == 200, alone.text
    answers: dict[str, httpx.Response | BaseException] = {}

    def attack() -> None:
        try:
            answers["attack"] = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "prompt": "a", "max_tokens": 200, "n": 4, "temperature": 0, "guided_regex": AMBIGUOUS_REGEX})
        except httpx.TimeoutException as exc:
            answers["attack"] = exc

    attacker = threading.Thread(target=attack)
    attacker.start()
    assert wait_for(lambda: server.engine.stats()["running"] >= 4 or "attack" in answers, timeout=60)
    started = time.monotonic()
    try:
        beside = httpx.post(f"{server.url}/v1/completions", json=innocent, timeout=60)
    finally:
        attacker.join()
    assert beside.status_code == 200 and beside.json()["choices"] == alone.json()["choices"]
    assert time.monotonic() - started < 30
    answer = answers["attack"]
    assert isinstance(answer, httpx.Response), "the attacker's request did not end within 60 s"
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "guided_regex", "invalid_value")
    assert error["message"].startswith("guided_regex: the request's output constraint took over 50 ms of CPU")
    # Its rows end before the batch is sampled: the others are not sampled row by row for it,
    # and the log holds no traceback for a fault that is the request's (a third attack round
    # found 209 of them).
    assert "batched sampling failed" not in caplog.text and "sampling failed for request" not in caplog.text
    _assert_clean(server)


DEAD_END = 'root ::= "a" rest\nrest ::= rest'  # "a" may start it; nothing can ever follow


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_can_start_but_never_finish_is_a_400_not_an_engine_failure(
        server: SimpleNamespace, stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    """It passes the compile-time check (a first token is allowed), then allows nothing at
    all: the request ends with a 400 on its field, streaming or not (no token was sent yet),
    instead of the 500 of a server failure; the log says so in a line, not a server
    failure's traceback (any client could fill the log with them)."""
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": "a", "max_tokens": 8, "temperature": 0, "guided_grammar": DEAD_END, "stream": stream})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "guided_grammar", "invalid_value")
    assert "allows no next token" in error["message"]
    assert not [record for record in caplog.records if record.exc_info], caplog.text
    beside = _chat(server.url, INNOCENT)
    assert beside.status_code == 200
    _assert_clean(server)


def test_a_beam_search_its_grammar_cannot_fill_is_a_400_naming_the_field(server: SimpleNamespace) -> None:
    """n=4 beams over a choice of two: the request's own constraint is at fault, so its client
    gets a 400 naming the field (was a 500 engine_error, "retrying may succeed"), streamed or not."""
    body = {"prompt": "a", "max_tokens": 5, "guided_choice": ["a", "b"], "use_beam_search": True,
            "beam_width": 4, "n": 4}
    for stream in (False, True):
        response = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("guided_choice", "invalid_value"), error
        assert "fewer than n=4" in error["message"]
    _assert_clean(server)


@pytest.mark.parametrize("tools, says", [
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "tools: at most 128, got 129"),
    ([{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "description": "x" * 60_000}}} for i in range(5)], "add up to 300"),
])
def test_too_many_tools_or_too_much_schema_is_a_400(server: SimpleNamespace, tools: list, says: str) -> None:
    """Each tool's parameters are checked as a JSON Schema, in time proportional to their size:
    a request's tools are bounded in number (OpenAI's 128) and in their schemas' total size."""
    response = _chat(server.url, {"tools": tools})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("tools", "invalid_value") and says in error["message"], error
