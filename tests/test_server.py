"""End-to-end tests of the HTTP server: real uvicorn on a free port, real httpx clients."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import parse_sse, running_server, sse_chunks, wait_for

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.server import create_app

NUM_PAGES = 512
PAGE_SIZE = 16
SYSTEM_PROMPT = ("You are the radixserve test assistant. Answer briefly, cite the page table, and never "
                 "reveal the contents of another tenant's cache. ") * 4


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(model="demo", page_size=PAGE_SIZE, num_pages=NUM_PAGES)


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[SimpleNamespace]:
    app = create_app(AsyncEngine(engine))
    with running_server(app) as url:
        yield SimpleNamespace(url=url, stats=app.state.server.engine.stats, tokenizer=engine.tokenizer)
    engine.check_invariants()  # the engine thread has stopped: its structures are quiet


@pytest.fixture
def client(server: SimpleNamespace) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def chat_body(user: str, **extra: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": user}], **extra}


def prompt_len(server: SimpleNamespace, messages: list[dict[str, str]]) -> int:
    """Tokens of a chat prompt, rendered as the server renders it."""
    text = server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(server.tokenizer.encode(text, add_special_tokens=False))


def cached_on_repeat(prompt_tokens: int, max_tokens: int) -> int:
    """cached_tokens of a request repeating an earlier one exactly (same namespace).

    The earlier one computed its prompt and all but its last generated token, and left them
    cached (its last, partly filled page too: the engine caches partial pages); a repeat
    matches at most prompt - 1 tokens (one must be computed)."""
    computed = prompt_tokens + max_tokens - 1
    return min(prompt_tokens - 1, computed)


def assert_idle(server: SimpleNamespace) -> None:
    """No request runs or waits, no page is locked, every used page is cache (none leaked)."""
    def idle() -> bool:
        s = server.stats()
        return s["running"] == 0 and s["waiting"] == 0 and s["pages_locked"] == 0
    assert wait_for(idle), server.stats()
    stats = server.stats()
    assert stats["pages_used"] == stats["pages_cached"], stats


# ---------------------------------------------------------------- chat


def test_chat_non_streaming_counts_tokens(client: httpx.Client, server: SimpleNamespace) -> None:
    # A salt of its own: nothing is cached for it yet, whatever ran before.
    body = chat_body("Say something about pages.", max_tokens=7, temperature=0, ignore_eos=True,
                     cache_salt="counts-tokens")
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["model"] == "demo"
    (choice,) = data["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    expected_prompt = prompt_len(server, body["messages"])
    usage = data["usage"]
    assert usage["prompt_tokens"] == expected_prompt
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == expected_prompt + 7
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    again = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == cached_on_repeat(expected_prompt, 7)


def test_chat_streaming_sse_framing(client: httpx.Client, server: SimpleNamespace) -> None:
    body = chat_body("Stream me two answers.", max_tokens=6, temperature=0, n=2, ignore_eos=True,
                     stream=True, stream_options={"include_usage": True}, cache_salt="sse-framing")
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(r.text)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a fresh salt
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    per_choice: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert chunk["usage"] is None  # include_usage: null until the last chunk
        (choice,) = chunk["choices"]
        per_choice[choice["index"]].append(choice)
    non_stream = client.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None}).json()
    prompt_tokens = prompt_len(server, body["messages"])
    assert non_stream["usage"]["prompt_tokens"] == prompt_tokens  # counted once for n = 2
    assert non_stream["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_on_repeat(prompt_tokens, 6)
    for index, choices in per_choice.items():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in choices[1:])
        assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1]["finish_reason"] == "length"
        streamed = "".join(c["delta"].get("content", "") for c in choices)
        assert streamed == non_stream["choices"][index]["message"]["content"]


def test_chat_without_usage_option_has_no_usage_chunk(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=3, stream=True, ignore_eos=True))
    chunks = sse_chunks(r.text)
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs(client: httpx.Client, server: SimpleNamespace) -> None:
    body = chat_body("Logprobs please", max_tokens=4, temperature=0, ignore_eos=True,
                     logprobs=True, top_logprobs=3)
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == 4
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    for entry in entries:
        assert len(entry["top_logprobs"]) == 3
        assert entry["bytes"] == list(entry["token"].encode())  # whole characters here
        # Greedy: the chosen token is the most likely one.
        assert entry["logprob"] == pytest.approx(max(t["logprob"] for t in entry["top_logprobs"]), abs=1e-5)
    # Asked for, a choice whose content has no token has an empty list (not null: OpenAI's
    # clients read `.content`).
    empty = client.post("/v1/chat/completions", json={**body, "guided_regex": "", "ignore_eos": False}).json()
    assert empty["choices"][0]["message"]["content"] == ""
    assert empty["choices"][0]["logprobs"] == {"content": []}


def test_completion_top_logprobs_list_the_sampled_token(client: httpx.Client) -> None:
    """OpenAI lists the sampled token among `top_logprobs` (up to logprobs + 1 entries), also
    when sampling chose one outside the top: with logprobs 0, only it."""
    for logprobs in (0, 1):
        r = client.post("/v1/completions", json={"prompt": "Sampled", "max_tokens": 8, "temperature": 2.0,
                                                 "seed": 7, "logprobs": logprobs})
        got = r.json()["choices"][0]["logprobs"]
        for token, logprob, top in zip(got["tokens"], got["token_logprobs"], got["top_logprobs"]):
            assert top[token] == logprob and len(top) <= logprobs + 1
            if logprobs == 0:
                assert list(top) == [token]


def test_completion_logprobs_name_partial_characters_by_their_bytes(client: httpx.Client) -> None:
    """Tokens holding part of a character are named `bytes:\\xNN...` (OpenAI's legacy format),
    their bytes joined give the text back, and `text_offset` counts the characters completed
    before each token (each token decoded alone counted one U+FFFD a piece: offsets ran past
    the end of the text)."""
    r = client.post("/v1/completions", json={"prompt": "Emoji:", "max_tokens": 16, "temperature": 0,
                                             "logprobs": 0, "guided_choice": ["😀😃"]})
    choice = r.json()["choices"][0]
    assert choice["text"] == "😀😃"
    got = choice["logprobs"]
    raw = b"".join(bytes.fromhex(t[len("bytes:"):].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
                   for t in got["tokens"])
    assert raw == "😀😃".encode() and any(t.startswith("bytes:") for t in got["tokens"])
    offsets = got["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= 1
    assert set(offsets) == {0, 1}  # the second emoji's tokens start once the first is complete


# ---------------------------------------------------------------- completions and engine parity


def greedy_ids_over_http(client: httpx.Client, prompt: str | list[int], max_tokens: int) -> tuple[list[int], str]:
    r = client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    return ids, choice["text"]


def test_greedy_completion_equals_engine_generate(client: httpx.Client, server: SimpleNamespace) -> None:
    reference = Engine(model="demo", page_size=PAGE_SIZE, num_pages=64)
    prompt_ids = server.tokenizer.encode("The parity check between HTTP and the offline engine")
    (expected,) = reference.generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0.0))
    ids, text = greedy_ids_over_http(client, prompt_ids, 12)
    assert ids == expected.token_ids
    assert text == expected.text
    # A text prompt is tokenized the same way.
    text_prompt_ids, _ = greedy_ids_over_http(client, "The parity check between HTTP and the offline engine", 12)
    assert text_prompt_ids == expected.token_ids


def test_completions_streaming_matches_non_streaming(client: httpx.Client) -> None:
    body = {"prompt": "Paged attention reads the block table", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["object"] == "text_completion" and whole["usage"]["completion_tokens"] == 8
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_chunks(r.text)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"] | {
        "prompt_tokens_details": chunks[-1]["usage"]["prompt_tokens_details"]}
    text_chunks = chunks[:-1]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])


def test_stop_string_truncates(client: httpx.Client) -> None:
    body = {"prompt": "A stop string test for the server", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    choice = client.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop"


def test_seeded_sampling_reproduces(client: httpx.Client) -> None:
    body = {"prompt": "Seeds make sampling repeatable", "max_tokens": 10, "temperature": 1.0,
            "seed": 1234, "ignore_eos": True}
    first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    second = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert first == second


# ---------------------------------------------------------------- prefix cache through HTTP


def test_shared_system_prompt_hits_cache_unless_salted(client: httpx.Client, server: SimpleNamespace) -> None:
    system = "Cache-sharing system prompt: " + "every tenant shares these instructions. " * 12

    def messages(user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def cached(user: str, **extra: Any) -> int:
        body = {"messages": messages(user), "max_tokens": 2, **extra}
        if user in EARLIER:  # enough tokens that its cached pages cover everything it shares
            body.update(max_tokens=EARLIER_TOKENS, ignore_eos=True)
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def ids(user: str) -> list[int]:
        text = server.tokenizer.apply_chat_template(messages(user), tokenize=False, add_generation_prompt=True)
        return server.tokenizer.encode(text, add_special_tokens=False)

    def hit(earlier: str, later: str) -> int:
        """What `later` finds of `earlier`: their common prefix, as far as `earlier` computed
        (its last, partly filled page is cached too)."""
        a, b = ids(earlier), ids(later)[:-1]
        shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return min(shared, len(a) + EARLIER_TOKENS - 1)

    EARLIER, EARLIER_TOKENS = ("first question", "third question", "sixth question"), 16

    system_tokens = len(server.tokenizer.encode(
        server.tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False),
        add_special_tokens=False))
    assert hit("first question", "second question") >= system_tokens  # the system prompt is shared
    # Token-deep: the hit ends inside a page (its partial page is copied), not on a boundary.
    assert hit("first question", "second question") % PAGE_SIZE != 0
    # A salt of its own: nothing is cached for it yet, not even the template's role header.
    assert cached("first question", cache_salt="tenant-a") == 0
    assert cached("second question", cache_salt="tenant-a") == hit("first question", "second question")
    assert cached("third question", cache_salt="tenant-b") == 0
    assert cached("fourth question", cache_salt="tenant-b") == hit("third question", "fourth question")
    assert cached("fifth question", cache_salt="tenant-c", system_retention_priority=90) == 0
    # Unsalted requests share too (other tests' chats share at most the role header with these).
    cached("sixth question")
    assert cached("seventh question") == hit("sixth question", "seventh question")


def test_session_close(client: httpx.Client, server: SimpleNamespace) -> None:
    body = chat_body("A session turn", max_tokens=2, session_id="sess-42")
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert wait_for(lambda: server.stats()["sessions_open"] >= 1)  # stats publish after the step
    r = client.post("/v1/sessions/sess-42/close")
    assert r.status_code == 200 and r.json()["closed"] is True
    r = client.post("/v1/sessions/sess-42/close")
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
    # An id with slashes closes too, as sent or percent-encoded (the route matched no "/").
    for sent in ("a/b/close", "a%2Fb%2Fclose"):
        body = chat_body("A session turn", max_tokens=2, session_id="a/b/close")
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert wait_for(lambda: server.stats()["sessions_open"] >= 1)
        r = client.post(f"/v1/sessions/{sent}/close")
        assert r.status_code == 200 and r.json()["id"] == "a/b/close", r.text


# ---------------------------------------------------------------- bad input


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type"),
    (CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": "5"}, 400, "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "temperature": -0.1}, 400, "temperature"),
    (CHAT, {"messages": USER, "temperature": 2.5}, 400, "temperature"),
    (CHAT, {"messages": USER, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": USER, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": USER, "n": 0}, 400, "n"),
    (CHAT, {"messages": USER, "n": 17}, 400, "n"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "stop": [""]}, 400, "stop"),
    (CHAT, {"messages": USER, "stop": [f"s{i}" for i in range(5)]}, 400, "stop"),
    (CHAT, {"messages": USER, "stop": "x" * 513}, 400, "stop"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["ok", "y" * 200_000]}, 400, "stop"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": list(range(257))}, 400, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [2**64 - 1], "use_beam_search": True, "n": 2}, 400,
     "stop_token_ids"),
    (CHAT, {"messages": USER, "logit_bias": {"x": 0}}, 400, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"-3": 0}}, 400, "logit_bias"),
    (CHAT, {"messages": USER, "session_id": "s" * 257}, 400, "session_id"),
    (CHAT, {"messages": USER, "cache_salt": "s" * 257}, 400, "cache_salt"),
    (CHAT, {"messages": USER, "cache_salt": "acme\x00x"}, 400, "cache_salt"),  # a NUL would alias a namespace id
    (CHAT, {"messages": USER, "user": "u" * 257}, 400, "user"),
    (CHAT, {"messages": USER, "model": "m" * 257}, 400, "model"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": "n" * 257}]}, 400, "messages[0].name"),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": USER, "response_format": {}}, 400, "response_format.type"),
    (CHAT, b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "messages[0]"),
    (CHAT, b'{"x": ' + b'{"a": ' * 1200 + b"1" + b"}" * 1200 + b', "messages": []}', 400, None),
    (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400, None),
    (CHAT, {"messages": USER, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": USER, "presence_penalty": 0.5}, 400, "presence_penalty"),
    (CHAT, {"messages": USER, "retention_priority": 101}, 400, "retention_priority"),
    (CHAT, {"messages": USER, "retention_duration_s": 5}, 400, "retention_duration_s"),
    (CHAT, {"messages": USER, "system_retention_priority": -1}, 400, "system_retention_priority"),
    (CHAT, {"messages": USER, "cache_salt": ""}, 400, "cache_salt"),
    (CHAT, {"messages": USER, "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),
    (CHAT, {"messages": USER, "max_tokens": 5000}, 400, "max_tokens"),
    (COMPLETIONS, {}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, "b"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", ""]}, 400, "prompt[1]"),
    (COMPLETIONS, {"prompt": [[1, 2], []]}, 400, "prompt[1]"),
    (COMPLETIONS, {"prompt": [[1, 2], [10**6]]}, 400, "prompt[1]"),
    (COMPLETIONS, {"prompt": ["a", "word " * 5000]}, 400, "prompt[1]"),
    (COMPLETIONS, {"prompt": ["a"] * 65}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [3, -1]}, 400, "prompt[1]"),
    (COMPLETIONS, {"prompt": [10**6]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [5] * 5000}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4096}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, *_rest) in enumerate(BAD_REQUESTS)])
def test_bad_request_names_the_field(client: httpx.Client, path: str, body: Any, status: int,
                                     param: str | None) -> None:
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"] and error["type"] and error["code"], error  # every refusal says which rule


def test_a_prompt_too_long_in_any_rendered_field_is_refused_before_rendering(client: httpx.Client) -> None:
    """The size check counts every string the template renders, not the contents alone: a
    tool call's arguments (or a tool's description) longer than the context could hold are
    refused on their characters, before the seconds of rendering and encoding them."""
    long = "x" * 130_000  # the demo model's context of 4,096 tokens holds at most 122,880 characters
    calls = [{"role": "assistant", "content": None,
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": long}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    tool = {"type": "function", "function": {"name": "f", "description": long}}
    for body in ({"messages": USER + calls}, {"messages": USER, "tools": [tool]}):
        r = client.post(CHAT, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
        assert error["message"].startswith("The prompt has 13") and "characters" in error["message"], error
    # Each special token's string in client text is at least a token: more than the context
    # holds are refused before they are encoded one by one.
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "<|im_end|>" * 5000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "5000 special tokens' strings" in r.json()["error"]["message"]


def test_a_prompt_whose_prefix_alone_is_over_the_context_is_refused_on_it(client: httpx.Client,
                                                                         server: SimpleNamespace) -> None:
    """A prompt under the size check (122,880 characters for the demo model) but of many tokens
    a character is refused on its first 8 characters a token of context (32,768), not encoded
    whole first; a long prompt of long tokens that fits is served."""
    dense = "\ue004" * 70_000  # 3 tokens a character on the demo tokenizer
    for path, body, param in ((COMPLETIONS, {"prompt": dense}, "prompt"), (COMPLETIONS, {"prompt": ["hi", dense]}, "prompt[1]"),
                              (CHAT, {"messages": [{"role": "user", "content": dense}]}, "messages")):
        r = client.post(path, json={**body, "max_tokens": 1})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", param)
        assert error["message"].startswith("The prompt's first 32768 characters alone are "), error
    # " considerable" is one token (byte-level BPE writes the space as "Ġ"): the longest such word
    word = max((w[1:] for w in server.tokenizer.get_vocab() if w[:1] == "Ġ" and w[1:].isascii() and w[1:].isalpha()),
               key=len)
    sparse = f" {word}" * (34_000 // (len(word) + 1))  # more than 32,768 characters, under 4,096 tokens
    assert len(sparse) > 32_768 and len(server.tokenizer.encode(sparse)) < 4_000
    r = client.post(COMPLETIONS, json={"prompt": sparse, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_server_serves_after_bad_requests(client: httpx.Client, server: SimpleNamespace) -> None:
    for _ in range(3):
        client.post(CHAT, content=b"garbage")
        client.post(COMPLETIONS, json={"prompt": [10**6]})
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert_idle(server)


def test_oversized_body_is_413(client: httpx.Client) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}).encode()
    r = client.post(CHAT, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"y" * 65536
        yield b'"}'
    r = client.post(COMPLETIONS, content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert r.headers["connection"] == "close"  # the rest of the body is not read and dropped


def test_a_chunked_body_sent_on_past_its_413_is_cut(server: SimpleNamespace) -> None:
    """The connection is closed after the 413: before, uvicorn read and dropped the rest of a
    body sent on and on (3.1 GB in 4 s over loopback)."""
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    chunk = b"%x\r\n" % 2**20 + b"y" * 2**20 + b"\r\n"
    sent, limit = 0, 256 * 2**20
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(60)
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            while sent < limit:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset or broken pipe: closed by the server
            pass
    assert sent < limit, sent


def test_unknown_route_and_method(client: httpx.Client) -> None:
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get(CHAT)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- models, health, metrics


def test_models(client: httpx.Client) -> None:
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["demo"] and data["data"][0]["max_model_len"] == 4096


def test_model_retrieve(client: httpx.Client) -> None:
    r = client.get("/v1/models/demo")  # what the openai client's models.retrieve("demo") asks
    assert r.status_code == 200
    assert r.json() == client.get("/v1/models").json()["data"][0]
    for missing in ("gpt-4", "org/some-model"):
        r = client.get(f"/v1/models/{missing}")
        assert r.status_code == 404
        assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                        "param": "model", "code": "model_not_found"}


def test_response_format_text_is_the_default(client: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = client.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    r = client.post(CHAT, json={**body, "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain
    r = client.post(CHAT, json={**body, "response_format": {"type": "json_schema", "json_schema": {}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "json_schema" in r.json()["error"]["message"]


def test_completions_batch_of_prompts(client: httpx.Client, server: SimpleNamespace) -> None:
    prompts = ["Batches are answered", "by index, prompt after prompt"]
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2}
    singles = [client.post(COMPLETIONS, json={**body, "prompt": p, "n": 1}).json() for p in prompts]
    batch = client.post(COMPLETIONS, json={**body, "prompt": prompts})
    assert batch.status_code == 200, batch.text
    data = batch.json()
    # OpenAI's numbering: choice j of prompt i has index i * n + j.
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in data["choices"]] == [singles[i]["choices"][0]["text"] for i in (0, 0, 1, 1)]
    prompt_tokens = sum(single["usage"]["prompt_tokens"] for single in singles)
    assert data["usage"]["prompt_tokens"] == prompt_tokens and data["usage"]["completion_tokens"] == 12
    # The same prompts as token ids, streamed.
    ids = [server.tokenizer.encode(p) for p in prompts]
    r = client.post(COMPLETIONS, json={**body, "prompt": ids, "stream": True,
                                       "stream_options": {"include_usage": True}})
    chunks = sse_chunks(r.text)
    streamed = {i: "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i)
                for i in range(4)}
    assert streamed == {c["index"]: c["text"] for c in data["choices"]}
    finals = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finals) == [0, 1, 2, 3]
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_tokens
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    # One prompt of the batch is refused: nothing of the others is left behind.
    r = client.post(COMPLETIONS, json={**body, "prompt": ["fine", "word " * 5000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    assert_idle(server)


def test_metrics_exposes_engine_and_latency(client: httpx.Client) -> None:
    client.post(COMPLETIONS, json={"prompt": "metrics", "max_tokens": 3, "ignore_eos": True, "stream": True})
    # A prompt of several pages, twice: the second hits the first's pages (the age histogram
    # must not depend on which of this module's tests ran before on this worker).
    for _ in range(2):
        client.post(COMPLETIONS, json={"prompt": "a page of metrics " * 20, "max_tokens": 1})
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    def value(name: str, sample: str | None = None) -> float:
        return next(s.value for s in families[name].samples if s.name == (sample or name))
    assert value("radixserve_kv_pool_pages") == NUM_PAGES
    assert value("radixserve_kv_page_size_tokens") == PAGE_SIZE
    assert value("radixserve_kv_pages_locked") == 0
    assert value("radixserve_prompt_tokens", "radixserve_prompt_tokens_total") > 0
    assert value("radixserve_time_to_first_token_seconds", "radixserve_time_to_first_token_seconds_count") >= 1
    assert value("radixserve_inter_token_latency_seconds", "radixserve_inter_token_latency_seconds_count") >= 2
    assert families["radixserve_kv_age_at_hit_seconds"].type == "histogram"
    assert value("radixserve_kv_age_at_hit_seconds", "radixserve_kv_age_at_hit_seconds_count") >= 1
    assert any(s.labels == {"endpoint": "completions", "status": "200"}
               for s in families["radixserve_http_requests"].samples)
    # The stats route reads the same TTFT histogram (from it alone, not the whole registry).
    ttft = client.get("/v1/cache/stats").json()["ttft"]
    assert ttft == {"count": value("radixserve_time_to_first_token_seconds",
                                   "radixserve_time_to_first_token_seconds_count"),
                    "sum": value("radixserve_time_to_first_token_seconds", "radixserve_time_to_first_token_seconds_sum")}


# ---------------------------------------------------------------- disconnects and load


def test_disconnect_mid_stream_frees_pages(server: SimpleNamespace) -> None:
    aborted_before = server.stats()["requests_aborted"]
    body = {"prompt": "A very long generation that the client abandons", "max_tokens": 3000,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", COMPLETIONS, json=body) as r:
            lines = r.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert len(received) >= 3
            # polled: a cluster's stats are the replicas' last reports, which lag on a busy machine
            assert wait_for(lambda: server.stats()["running"] == 1)
    assert wait_for(lambda: server.stats()["requests_aborted"] == aborted_before + 1)
    assert_idle(server)


def test_disconnect_while_waiting_non_streaming_aborts(server: SimpleNamespace) -> None:
    aborted_before = server.stats()["requests_aborted"]
    body = {"prompt": "A non-streaming request whose client times out", "max_tokens": 3000, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post(COMPLETIONS, json=body)
    assert wait_for(lambda: server.stats()["requests_aborted"] == aborted_before + 1)
    assert_idle(server)


def test_health_is_prompt_during_long_generation(server: SimpleNamespace) -> None:
    started = threading.Event()
    stop = threading.Event()

    def long_stream() -> None:
        body = {"prompt": "Keep the engine busy", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", COMPLETIONS, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                if stop.is_set():
                    return

    worker = threading.Thread(target=long_stream)
    worker.start()
    try:
        assert started.wait(20)
        with httpx.Client(base_url=server.url, timeout=5) as c:
            for _ in range(5):
                t0 = time.perf_counter()
                assert c.get("/health").json() == {"status": "ok"}
                assert time.perf_counter() - t0 < 0.5  # a 3000-token generation takes ~10 s
                assert server.stats()["running"] == 1  # the generation is still going
    finally:
        stop.set()
        worker.join()
    assert_idle(server)


def test_64_concurrent_streams_complete(server: SimpleNamespace) -> None:
    max_tokens = 12

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str | None, str]:
        body = {"prompt": f"Client {i} asks about radix trees", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
        r = await c.post(COMPLETIONS, json=body)
        assert r.status_code == 200, r.text
        chunks = sse_chunks(r.text)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        return chunks[-1]["usage"]["completion_tokens"], finish[-1], "".join(
            c["choices"][0]["text"] for c in chunks if c["choices"])

    async def main() -> list[tuple[int, str | None, str]]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(main())
    assert [tokens for tokens, _, _ in results] == [max_tokens] * 64
    assert {finish for _, finish, _ in results} == {"length"}
    assert_idle(server)


def test_sse_parser_rejects_bad_framing() -> None:
    assert parse_sse('data: {"a": 1}\n\ndata: [DONE]\n\n') == ['{"a": 1}', "[DONE]"]
    for bad in ('data: x\n', 'data: x\nmore\n\n', 'event: x\n\n'):
        with pytest.raises(AssertionError):
            parse_sse(bad)


def test_invalid_utf8_body_and_neutral_logit_bias(client: httpx.Client, server: SimpleNamespace) -> None:
    r = client.post(COMPLETIONS, content=b'{"prompt": "\xff\xfe", "max_tokens": 2}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post(CHAT, content=b'{"max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}',
                    headers={"content-type": "application/json"})  # msgspec: "truncated", so near the end
    assert r.status_code == 400 and "surrogate pair" in r.json()["error"]["message"], r.text
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, "logit_bias": {"5": 0}})
    assert r.status_code == 200
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, "logit_bias": {"5": 3}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert_idle(server)
