"""Beam search over HTTP: the extension fields reach the engine; a stream carries each final
beam whole once the search ends. Real uvicorn, real httpx.

Which beams are right is tested against transformers in test_beam_search.py; here the
server's beams must equal Engine.generate's on the same model and prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
from server_util import running_server, sse_chunks

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.server import create_app

PROMPT = [72, 101, 108, 108, 111, 44, 32, 112, 97, 103, 101, 115]
BEAM = {"use_beam_search": True, "n": 2, "beam_width": 3, "max_tokens": 6, "ignore_eos": True,
        "length_penalty": 0.5, "early_stopping": "never"}


@pytest.fixture(scope="module")
def expected() -> list:
    """The two best of three beams, from the engine directly."""
    engine = Engine(model="demo", page_size=4, num_pages=128)
    params = SamplingParams(max_tokens=6, beam_width=3, n=2, ignore_eos=True, length_penalty=0.5,
                            early_stopping="never")
    return engine.generate([PROMPT], params)


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    engine = Engine(model="demo", page_size=4, num_pages=128, debug_checks=True)
    with running_server(create_app(AsyncEngine(engine))) as url:
        yield SimpleNamespace(url=url)
    engine.check_invariants()


@pytest.fixture
def client(server: SimpleNamespace) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_completions_return_the_best_beams(client: httpx.Client, expected: list) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, **BEAM})
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["text"] for c in data["choices"]] == [o.text for o in expected]
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in data["choices"]] == ["length", "length"]
    assert data["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in expected)


def test_a_stream_carries_each_final_beam_in_one_chunk(client: httpx.Client, expected: list) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, **BEAM, "stream": True})
    assert r.status_code == 200, r.text
    chunks = sse_chunks(r.text)
    choices = [c["choices"][0] for c in chunks]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (i, o.text, "length") for i, o in enumerate(expected)]


def test_chat_beam_width_defaults_to_n(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Which page holds token 5?"}], "max_tokens": 5,
            "use_beam_search": True, "n": 2, "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert len(texts) == 2 and texts[0] != texts[1]  # two distinct beams, best first
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = sse_chunks(r.text)
    streamed = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert [streamed[0], streamed[1]] == texts


@pytest.mark.parametrize("extra,param", [
    ({"beam_width": 2}, "beam_width"),                                   # without use_beam_search
    ({"use_beam_search": True, "n": 3, "beam_width": 2}, "n"),
    ({"use_beam_search": True, "beam_width": 2, "stop": "x"}, "stop"),
    ({"use_beam_search": True, "beam_width": 2, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "beam_width": 2, "early_stopping": "soon"}, "early_stopping"),
    ({"use_beam_search": True, "beam_width": 17}, "beam_width"),
])
def test_bad_beam_fields_are_a_400_naming_the_field(client: httpx.Client, extra: dict, param: str) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_beam_search_with_a_json_schema_returns_valid_documents(client: httpx.Client) -> None:
    """response_format with use_beam_search (once refused with a 400): every beam validates."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
              "required": ["ok", "size"]}
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "use_beam_search": True, "n": 2, "beam_width": 3,
        "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
