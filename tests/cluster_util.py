"""A real local Ray cluster serving 2 demo-model replicas, started once per test session.

Ray tests are marked `cluster`. Without Ray they skip — except under CI (CI=true), where
.ci/run installs the cluster extra and a missing Ray is an error, not a skip.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from radixserve.ports import free_port

REPLICAS = 2
NUM_PAGES = 512      # per replica; as tests/test_server.py's single engine
PAGE_SIZE = 16
CLUSTER_MAX_REQUEST_TOKENS = 4096  # the ingress's --max-request-tokens: below the default 65536, so that a
# test sees the flag reach the ingress (the demo model's context is 4,096: no unset max_tokens shrinks)
CLUSTER_KEEP_ALIVE_S = 5.0  # the proxy's idle kept-alive connections: the CLI's default (Serve's own is 90 s)
STARTUP_TIMEOUT_S = 240.0


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("Ray Serve is not installed (pip install -e '.[cluster]')")


def replicas_report(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/cluster/replicas", timeout=30).json()


def wait_for_replicas(url: str, count: int, timeout: float = STARTUP_TIMEOUT_S,
                      exclude: frozenset[str] = frozenset()) -> list[str]:
    """Waits until `count` replicas (none of `exclude`) report stats; returns their ids."""
    deadline = time.monotonic() + timeout
    while True:
        ids = [r["id"] for r in replicas_report(url)["replicas"]]
        if len(ids) == count and not set(ids) & exclude:
            return ids
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas {ids}, wanted {count} not in {sorted(exclude)}")
        time.sleep(0.2)


def start_cluster() -> Iterator[SimpleNamespace]:
    """Starts Ray with a few logical CPUs, deploys the app on a free port, yields its URL and
    the stats of the whole cluster; shuts Serve and Ray down after."""
    require_ray()
    import ray
    from ray import serve

    from radixserve.cluster.deploy import ClusterOptions, deploy, start_ray

    start_ray(num_cpus=REPLICAS + 1)
    port = free_port()
    options = ClusterOptions(replicas=REPLICAS, engine_options=dict(
        model="demo", page_size=PAGE_SIZE, num_pages=NUM_PAGES), replica_cpus=1, torch_threads=1,
        app_options=dict(max_request_tokens=CLUSTER_MAX_REQUEST_TOKENS))
    try:
        deploy(options, port=port, keep_alive_s=CLUSTER_KEEP_ALIVE_S)
        url = f"http://127.0.0.1:{port}"
        wait_for_replicas(url, REPLICAS)
        yield SimpleNamespace(url=url, stats=lambda: replicas_report(url)["total"], app=serve.get_app_handle("radixserve"))
    finally:
        serve.shutdown()
        ray.shutdown()
