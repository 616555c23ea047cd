"""A request that fails inside the engine: a stream that has started ends with an error event
before [DONE], anything else gets a 500, both in OpenAI's error shape; other requests and
the server carry on (issue 9, item 2).

The failures are real: a PyTorch forward hook on the model's embedding raises whenever a
chosen "poison" token is among a step's input tokens. The engine then ends the request whose
token it is with finish_reason "error" (and only that one).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_util import parse_sse, running_server, sse_chunks, wait_for

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.server import create_app

BAD_PROMPT = list(range(40, 60))
INNOCENT_PROMPT = list(range(100, 120))
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE_ERROR = {"type": "server_error", "param": None, "code": "engine_error"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[SimpleNamespace]:
    reference = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128)
    bad, innocent = reference.generate([BAD_PROMPT, INNOCENT_PROMPT], GREEDY)
    # The bad request's 4th token: it is generated and streamed, then the step that feeds it
    # back in raises (the stream has started by then).
    poison = bad.token_ids[3]
    assert poison not in BAD_PROMPT + bad.token_ids[:3] + INNOCENT_PROMPT + innocent.token_ids
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128, debug_checks=True)

    def raise_on_poison(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if bool((args[0] == poison).any()):
            raise RuntimeError("poisoned step")
        return output

    handle = engine.loaded.model.model.embed_tokens.register_forward_hook(raise_on_poison)
    app = create_app(AsyncEngine(engine))
    try:
        with running_server(app) as url:
            yield SimpleNamespace(url=url, stats=app.state.server.engine.stats, poison=poison,
                                  innocent_text=innocent.text, bad_tokens=bad.token_ids)
    finally:
        handle.remove()
    engine.check_invariants()


@pytest.fixture
def client(server: SimpleNamespace) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def body(prompt: list[int], **extra: object) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}


def test_stream_that_fails_midway_ends_with_an_error_event_before_done(client: httpx.Client,
                                                                      server: SimpleNamespace) -> None:
    r = client.post("/v1/completions", json=body(BAD_PROMPT, stream=True, stream_options={"include_usage": True},
                                                logprobs=0, return_tokens_as_token_ids=True))
    assert r.status_code == 200  # the headers went out with the first token
    payloads = parse_sse(r.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error | {"message": ""} == ENGINE_ERROR | {"message": ""} and error["message"]
    chunks = [json.loads(p) for p in payloads[:-2]]
    # The tokens before the failure arrived; nothing else follows them but the error event:
    # no finish_reason "error", no usage chunk.
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == [f"token_id:{t}" for t in server.bad_tokens[:4]]  # the 4th is the poison
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in chunks)


def test_failure_before_any_token_is_a_500_even_when_streaming(client: httpx.Client,
                                                              server: SimpleNamespace) -> None:
    for stream in (False, True):
        r = client.post("/v1/completions", json=body([5, server.poison, 6], stream=stream, n=2))
        assert r.status_code == 500
        assert r.json()["error"] | {"message": ""} == ENGINE_ERROR | {"message": ""}


def test_failure_midway_without_streaming_is_a_500(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json=body(BAD_PROMPT))
    assert r.status_code == 500
    assert r.json()["error"] | {"message": ""} == ENGINE_ERROR | {"message": ""}


def failures_counted(client: httpx.Client) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return next((s.value for f in families for s in f.samples if s.name == "radixserve_http_requests_total"
                 and s.labels == {"endpoint": "completions", "status": "500"}), 0.0)


def test_failing_requests_beside_an_innocent_stream_leave_it_untouched(client: httpx.Client,
                                                                      server: SimpleNamespace) -> None:
    counted = failures_counted(client)
    statuses: list[int] = []

    def attack() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for prompt in (BAD_PROMPT, [server.poison] * 3, BAD_PROMPT):
                statuses.append(c.post("/v1/completions", json=body(prompt)).status_code)

    with client.stream("POST", "/v1/completions", json=body(INNOCENT_PROMPT, stream=True)) as innocent:
        lines = innocent.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        attacker = threading.Thread(target=attack)
        attacker.start()
        attacker.join(timeout=120)
        raw = first + "\n" + "".join(line + "\n" for line in lines)
    assert statuses == [500, 500, 500]
    assert "".join(c["choices"][0]["text"] for c in sse_chunks(raw)) == server.innocent_text
    assert wait_for(lambda: server.stats()["running"] == 0 and server.stats()["waiting"] == 0)
    assert server.stats()["pages_locked"] == 0
    assert client.get("/health").json() == {"status": "ok"}
    assert failures_counted(client) == counted + 3
