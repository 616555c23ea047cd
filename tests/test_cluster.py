"""The OpenAI API on a real local Ray cluster: 2 demo-model replicas behind the ingress.

The single server's end-to-end tests (test_server.py) run here again, unchanged, against the
cluster; then what only a cluster has: routing by the replicas' real caches, sessions,
an index equal to each replica's cache, and a replica killed under load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import test_server as single
from cluster_util import replicas_report, wait_for_replicas
from server_util import sse_chunks

from radixserve import Engine, SamplingParams

pytestmark = pytest.mark.cluster

# The single server's tests, run against the cluster (same names, this module's fixtures).
SHARED_TESTS = [
    "test_chat_non_streaming_counts_tokens", "test_chat_streaming_sse_framing",
    "test_chat_without_usage_option_has_no_usage_chunk", "test_chat_logprobs",
    "test_greedy_completion_equals_engine_generate", "test_completions_streaming_matches_non_streaming",
    "test_stop_string_truncates", "test_seeded_sampling_reproduces",
    "test_shared_system_prompt_hits_cache_unless_salted", "test_session_close",
    "test_bad_request_names_the_field", "test_server_serves_after_bad_requests",
    "test_oversized_body_is_413", "test_unknown_route_and_method", "test_models",
    "test_disconnect_mid_stream_frees_pages",
    "test_disconnect_while_waiting_non_streaming_aborts", "test_64_concurrent_streams_complete",
    "test_invalid_utf8_body_and_neutral_logit_bias",
]
globals().update({name: getattr(single, name) for name in SHARED_TESTS})

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server(ray_cluster: SimpleNamespace) -> SimpleNamespace:
    tokenizer = Engine(model="demo", num_pages=8).tokenizer
    return SimpleNamespace(url=ray_cluster.url, stats=ray_cluster.stats, tokenizer=tokenizer,
                           app=ray_cluster.app)


@pytest.fixture
def client(server: SimpleNamespace) -> Iterator[httpx.Client]:
    # Beyond the server's own limits: a replica's first grammar starts a compile worker, niced,
    # which may wait for a loaded machine's CPU longer than a minute (its start is allowed 120 s).
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def routed(server: SimpleNamespace) -> dict[str, int]:
    return replicas_report(server.url)["routed"]


def completion(client: httpx.Client, prompt: list[int] | str, max_tokens: int = 2, **extra: Any) -> dict:
    r = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                       "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def distinct_prompt(seed: int, length: int = 200) -> list[int]:
    """Random ordinary token ids: prompts of different seeds share no page."""
    return np.random.default_rng(seed).integers(300, 1800, length).tolist()


def replica_handle() -> Any:
    from ray import serve

    return serve.get_deployment_handle("EngineReplica", app_name="radixserve")


def index_matches_caches(server: SimpleNamespace) -> bool:
    believed = server.app.cache_index.remote().result()
    engines = replica_handle()
    real = {r: engines.cache_page_hashes.remote(replica=r).result() for r in believed}
    return believed == real and len(believed) == 2


def test_every_replica_takes_the_ingress_elsewhere_call(server: SimpleNamespace) -> None:
    """The call the ingress pins to a replica whose prompt the router sent elsewhere
    (cluster/duel_pool.py: the replica's adaptive rule replays it) is one the replicas take."""
    engines = replica_handle()
    replicas = server.app.cache_index.remote().result()
    assert len(replicas) == 2
    for replica in replicas:
        assert engines.elsewhere.remote(distinct_prompt(7), None, None, replica=replica).result() is None


def test_a_constrained_request_is_served_and_a_bad_one_is_a_400(client: httpx.Client) -> None:
    """The ingress has no grammar engine (the replicas do): a grammar request was a 500
    (AttributeError) on every cluster. A replica compiles it when it takes the request."""
    chat = {"messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/chat/completions", json={**chat, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    r = client.post("/v1/chat/completions", json={**chat, "guided_grammar": "root ::= root"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error", r.text


def test_the_serve_flags_of_the_app_reach_the_ingress(client: httpx.Client) -> None:
    """`radixserve serve --replicas` dropped the app's flags (--max-request-tokens,
    --expose-cache-tokens, --body-timeout-s, ...): the ingress ran on create_app's defaults.
    The cluster here has --max-request-tokens 4096: 2 x 3,000 tokens is over it."""
    body = {"prompt": "hi", "n": 2, "max_tokens": 3000, "ignore_eos": True}
    r = client.post(COMPLETIONS, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "request_too_large" and "4096" in r.json()["error"]["message"], r.text
    assert client.post(COMPLETIONS, json={**body, "max_tokens": 2}).status_code == 200


def test_the_proxy_closes_idle_connections_after_the_keep_alive_timeout(server: SimpleNamespace) -> None:
    """--keep-alive-timeout-s reaches Serve's proxy (it kept idle connections 90 s)."""
    import socket
    import time

    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        sock.settimeout(60)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        idle_since = time.monotonic()
        sock.settimeout(60)
        assert sock.recv(4096) == b""  # closed by the proxy
        assert time.monotonic() - idle_since < 30  # 5 s asked for; Serve's default would be 90


def test_metrics_cover_every_replica(client: httpx.Client, server: SimpleNamespace) -> None:
    """/metrics sums the replicas: twice one engine's pages (single server: NUM_PAGES)."""
    from prometheus_client.parser import text_string_to_metric_families

    before = server.stats()["prompt_tokens"]
    client.post(COMPLETIONS, json={"prompt": "metrics", "max_tokens": 3, "ignore_eos": True, "stream": True})
    # Replicas report their stats periodically: wait until this request is in them.
    assert single.wait_for(lambda: server.stats()["prompt_tokens"] > before), server.stats()
    single.assert_idle(server)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}

    def value(name: str, sample: str | None = None) -> float:
        return next(s.value for s in families[name].samples if s.name == (sample or name))

    assert value("radixserve_kv_pool_pages") == 2 * single.NUM_PAGES
    assert value("radixserve_kv_page_size_tokens") == single.PAGE_SIZE
    assert value("radixserve_kv_pages_locked") == 0
    assert value("radixserve_prompt_tokens", "radixserve_prompt_tokens_total") == server.stats()["prompt_tokens"] > 0
    assert value("radixserve_time_to_first_token_seconds", "radixserve_time_to_first_token_seconds_count") >= 1
    assert families["radixserve_kv_age_at_hit_seconds"].type == "histogram"
    assert any(s.labels == {"endpoint": "completions", "status": "200"}
               for s in families["radixserve_http_requests"].samples)


# ---------------------------------------------------------------- routing by the real cache


def test_hits_equal_one_engine_with_the_same_memory_per_replica(client: httpx.Client,
                                                                 server: SimpleNamespace) -> None:
    """Each repeated prompt lands where it is cached: the cluster hits exactly what one
    engine hits on the same sequence (it fits one replica), though its first sends spread."""
    prompts = [distinct_prompt(1000 + i) for i in range(6)]
    sequence = prompts + prompts[::-1] + [p + [5, 6, 7] for p in prompts]
    reference = Engine(model="demo", page_size=16, num_pages=512)
    expected = [reference.generate([p], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
                .cached_tokens for p in sequence]
    # A repeat finds all its prompt but the last token: the first run's partial page is cached too.
    assert expected[:6] == [0] * 6 and expected[6:12] == [len(p) - 1 for p in prompts[::-1]]
    before = routed(server)
    got = [completion(client, p)["usage"]["prompt_tokens_details"]["cached_tokens"] for p in sequence]
    assert got == expected
    after = routed(server)
    assert sum(after.values()) - sum(before.values()) == len(sequence)


def test_a_burst_of_new_prefixes_spreads_evenly(server: SimpleNamespace) -> None:
    """16 requests with distinct new prompts at once: the balance guard alternates them."""
    before = routed(server)

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post(COMPLETIONS, json={
                "prompt": distinct_prompt(2000 + i, 64), "max_tokens": 4, "ignore_eos": True})
                for i in range(16)))
        return [r.status_code for r in rs]

    assert asyncio.run(main()) == [200] * 16
    after = routed(server)
    per_replica = sorted(after.get(r, 0) - before.get(r, 0) for r in after)
    assert sum(per_replica) == 16 and per_replica[-1] - per_replica[0] <= 2, per_replica


def test_session_sticks_to_its_replica(client: httpx.Client, server: SimpleNamespace) -> None:
    before = routed(server)
    for turn in range(4):  # unrelated prompts: only the session keeps them together
        completion(client, distinct_prompt(3000 + turn, 40), session_id="sticky-session")
    delta = {r: n - before.get(r, 0) for r, n in routed(server).items()}
    assert sorted(delta.values()) == [0, 4], delta
    assert client.post("/v1/sessions/sticky-session/close").json()["closed"] is True


def test_router_index_equals_every_replica_cache(client: httpx.Client, server: SimpleNamespace) -> None:
    for i in range(4):
        completion(client, distinct_prompt(4000 + i, 100), cache_salt=f"tenant-{i % 2}")
    single.assert_idle(server)
    assert single.wait_for(lambda: index_matches_caches(server), timeout=20)
    assert [r["in_flight"] for r in replicas_report(server.url)["replicas"]] == [0, 0]


# ---------------------------------------------------------------- faults


def long_stream(url: str, prompt: list[int], max_tokens: int, first_chunk: asyncio.Event) -> Any:
    async def run() -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        text = ""
        async with httpx.AsyncClient(base_url=url, timeout=300) as c, c.stream("POST", COMPLETIONS, json=body) as r:
            assert r.status_code == 200
            async for piece in r.aiter_text():
                text += piece
                if "data: " in text:
                    first_chunk.set()
        chunks = sse_chunks(text)
        errors = [c["error"] for c in chunks if "error" in c]
        usage = chunks[-1].get("usage") if chunks and not errors else None
        return {"errors": errors, "usage": usage}
    return run()


def test_killed_replica_fails_cleanly_and_a_new_one_takes_traffic(server: SimpleNamespace) -> None:
    import ray

    url = server.url
    old = set(wait_for_replicas(url, 2))
    before = routed(server)
    prompts = [distinct_prompt(5000 + i, 48) for i in range(6)]
    max_tokens = 400

    async def main() -> tuple[list[dict[str, Any]], str, dict[str, int]]:
        started = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(long_stream(url, p, max_tokens, e)) for p, e in zip(prompts, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        # Every stream has sent a chunk: nothing of them can be retried elsewhere.
        on = {r: n - before.get(r, 0) for r, n in (await asyncio.to_thread(routed, server)).items()}
        victim = max(on, key=on.get)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::radixserve#EngineReplica#{victim}", namespace="serve"),
                 no_restart=True)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        return results, victim, on

    results, victim, on = asyncio.run(main())
    failed = [r for r in results if r["errors"]]
    finished = [r for r in results if not r["errors"]]
    assert len(failed) == on[victim] >= 1 and len(finished) == len(prompts) - on[victim]
    assert all(e["type"] == "server_error" for r in failed for e in r["errors"])
    assert all(r["usage"]["completion_tokens"] == max_tokens for r in finished)

    # Right away, before anything noticed: requests still succeed (retried elsewhere).
    with httpx.Client(base_url=url, timeout=120) as c:
        for p in prompts:
            completion(c, p)
    # Serve starts a replacement; it joins with an empty cache and takes new prefixes first.
    new = set(wait_for_replicas(url, 2, exclude=frozenset({victim}))) - old
    assert len(new) == 1
    (fresh,) = new
    report = {r["id"]: r for r in replicas_report(url)["replicas"]}
    assert report[fresh]["pages_cached"] == 0
    before = routed(server)
    with httpx.Client(base_url=url, timeout=120) as c:
        first = completion(c, distinct_prompt(6000, 64))
        again = completion(c, distinct_prompt(6000, 64))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 63
    assert routed(server).get(fresh, 0) - before.get(fresh, 0) == 2
    single.assert_idle(server)
    assert single.wait_for(lambda: index_matches_caches(server), timeout=20)
