"""A request that fails inside the engine: streams end with an error event, non-streaming
requests get a 500, both in OpenAI's error shape; the server carries on (issue 9, item 2).

The failure is real: a checkpoint whose output layer has a NaN row. Greedy decoding works
(argmax picks the NaN token), sampling cannot (every probability is NaN), so a sampled
request fails in the engine's step and the engine ends it with finish_reason "error".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_util import parse_sse, running_server
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app

NAN_TOKEN = 7
PROMPT = list(range(40, 60))


@pytest.fixture(scope="module")
def nan_checkpoint(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        model.lm_head.weight[NAN_TOKEN] = float("nan")
    directory = tmp_path_factory.mktemp("nan_row_llama")
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(nan_checkpoint: Path) -> Iterator[SimpleNamespace]:
    engine = Engine(model=str(nan_checkpoint), page_size=4, num_pages=128, debug_checks=True)
    app = create_app(AsyncEngine(engine))
    with running_server(app) as url:
        yield SimpleNamespace(url=url, stats=app.state.server.engine.stats)
    engine.check_invariants()


@pytest.fixture
def client(server: SimpleNamespace) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


ENGINE_ERROR = {"type": "server_error", "param": None, "code": "engine_error"}


def test_failed_stream_ends_with_an_error_event_before_done(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200  # the headers went out before the step failed
    payloads = parse_sse(r.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error | {"message": ""} == ENGINE_ERROR | {"message": ""} and error["message"]
    # Nothing but the error event follows the content: no usage chunk, no finish_reason "error".
    assert all("error" not in json.loads(p) for p in payloads[:-2])
    assert all(c["finish_reason"] != "error" for p in payloads[:-2] for c in json.loads(p)["choices"])


def test_failed_request_without_streaming_is_a_500(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "n": 2})
    assert r.status_code == 500
    assert r.json()["error"] | {"message": ""} == ENGINE_ERROR | {"message": ""}


def failures_counted(client: httpx.Client) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return next((s.value for f in families for s in f.samples if s.name == "radixserve_http_requests_total"
                 and s.labels == {"endpoint": "completions", "status": "500"}), 0.0)


def test_server_carries_on_after_failures(client: httpx.Client, server: SimpleNamespace) -> None:
    counted = failures_counted(client)
    for stream in (False, True):
        client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0,
                                             "stream": stream})
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                             "logprobs": 0, "return_tokens_as_token_ids": True})
    assert r.status_code == 200
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{NAN_TOKEN}"] * 4
    stats = server.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["pages_locked"] == 0
    assert client.get("/health").json() == {"status": "ok"}
    assert failures_counted(client) == counted + 1  # the stream's 200 went out before it failed
