"""The host tier over HTTP: a real uvicorn server with a small device pool and a host tier.

A prompt whose pages were pushed off the device comes back from the host tier, and the
response says so in `usage.prompt_tokens_details.cached_tokens`; /metrics splits the hits.
"""

from __future__ import annotations

import random

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.benchmark.host_tier import scrape_counters
from radixserve.server import create_app

PAGE_SIZE = 16


def completion(client: httpx.Client, prompt: list[int], max_tokens: int = 2) -> dict:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0.0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_request_after_offload_reports_the_host_tier_hit_in_cached_tokens() -> None:
    engine = Engine(model="demo", page_size=PAGE_SIZE, num_pages=24, max_running=1, host_num_pages=200,
                    debug_checks=True)
    rng = random.Random(2)
    conversation = [rng.randrange(20, 1000) for _ in range(10 * PAGE_SIZE)]
    fillers = [[rng.randrange(20, 1000) for _ in range(300)] for _ in range(4)]
    app = create_app(AsyncEngine(engine))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        first = completion(client, conversation)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for filler in fillers:  # each needs most of the 24 device pages: the conversation goes to host
            completion(client, filler)
        again = completion(client, conversation)
        # 159 tokens may hit: 9 full pages, loaded back from the host tier.
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 9 * PAGE_SIZE
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}

        def value(name: str) -> float:
            return next(s.value for s in families[name].samples if s.name in (name, f"{name}_total"))

        assert value("radixserve_host_cached_tokens") == 9 * PAGE_SIZE
        assert value("radixserve_kv_pages_loaded") == 9
        assert value("radixserve_kv_pages_offloaded") >= 10
        assert value("radixserve_host_kv_pool_pages") == 200
        assert value("radixserve_cache_host_hit_tokens") >= 9 * PAGE_SIZE
        assert value("radixserve_kv_loaded_bytes") == 9 * engine.host_tier.bytes_per_page
        assert value("radixserve_cached_tokens") == value("radixserve_host_cached_tokens") + value(
            "radixserve_device_cached_tokens")
        counters = scrape_counters(url)  # what `bench tiers` reads from a server
        assert counters["kv_pages_loaded"] == 9 and counters["host_cached_tokens"] == 9 * PAGE_SIZE
        assert counters["kv_load_seconds"] > 0 and counters["prefill_tokens"] > 0
    engine.check_invariants()
