"""The cache views over a real local Ray cluster (issue 22, item 6): /v1/cache/tree merges the
replicas' trees (a "replica" node each, every node labelled), /v1/cache/events merges their
event streams (each event and snapshot block labelled), and both agree with what each replica
caches. Reuses the session's cluster (cluster_util.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from cluster_util import wait_for_replicas

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(ray_cluster: SimpleNamespace) -> SimpleNamespace:
    replicas = wait_for_replicas(ray_cluster.url, 2)  # a test before may have replaced one
    with httpx.Client(base_url=ray_cluster.url, timeout=120) as client:
        for seed in range(6):  # distinct prompts: the router spreads them over both replicas
            prompt = np.random.default_rng(7000 + seed).integers(300, 1800, 120).tolist()
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert response.status_code == 200, response.text
    return SimpleNamespace(url=ray_cluster.url, app=ray_cluster.app, replicas=replicas)


def _believed(cluster: SimpleNamespace) -> dict[str, set[int]]:
    """Page hashes per replica, as the router's index (equal to the replicas' caches) holds them."""
    index = cluster.app.cache_index.remote().result()
    return {replica: {h for _, h in pages} for replica, pages in index.items()}


def _walk(node: dict) -> Iterator[dict]:
    stack = [node]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.get("children", ()))


def test_the_tree_merges_every_replica_labelled(cluster: SimpleNamespace) -> None:
    response = httpx.get(f"{cluster.url}/v1/cache/tree", params={"hashes": "true", "max_nodes": 10_000}, timeout=120)
    assert response.status_code == 200, response.text
    tree = response.json()
    replicas = tree["root"]["children"]
    assert [r["kind"] for r in replicas] == ["replica", "replica"]
    assert {r["replica"] for r in replicas} == set(cluster.replicas)
    ids = [node["id"] for node in _walk(tree["root"])]
    assert len(ids) == len(set(ids))
    believed = _believed(cluster)
    for replica_node in replicas:
        below = [n for child in replica_node.get("children", ()) for n in _walk(child)]
        assert below and all(n["replica"] == replica_node["replica"] for n in below)
        hashes = {int(n["hash"]) for n in below if n.get("hash")}
        assert hashes and hashes <= believed[replica_node["replica"]]
    assert tree["pages_total"] == sum(r["subtree_pages"] for r in replicas)


def test_the_event_stream_merges_every_replica_labelled(cluster: SimpleNamespace) -> None:
    with httpx.Client(base_url=cluster.url, timeout=120) as client, \
            client.stream("GET", "/v1/cache/events") as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        snapshot = _next_data(lines)
        assert snapshot["type"] == "snapshot"
        held: dict[str, set[int]] = {}
        for block in snapshot["blocks"]:
            held.setdefault(block["replica"], set()).update(block["hashes"])
        assert held == {r: h for r, h in _believed(cluster).items() if h}
        prompt = np.random.default_rng(7100).integers(300, 1800, 120).tolist()
        with httpx.Client(base_url=cluster.url, timeout=120) as other:
            assert other.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
        event = _next_data(lines)
    assert event["type"] == "stored" and event["replica"] in cluster.replicas
    assert event["seq"] == snapshot["seq"] + 1


def _next_data(lines: Iterator[str]) -> dict:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[len("data: "):])
    raise AssertionError("the stream ended")


def test_the_dashboard_and_replica_stats_answer(cluster: SimpleNamespace) -> None:
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        assert client.get("/dashboard").status_code == 200
        stats = client.get("/v1/cache/stats").json()
        assert stats["tiers"]["device"]["pages_cached"] > 0
        assert len(client.get("/cluster/replicas").json()["replicas"]) == 2
