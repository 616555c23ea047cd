"""What a cluster does with a replica that cannot serve, and with a deployment that would
land where nobody looks or replace someone else's app: on the session's real Ray cluster.

A second app (`stall`, one replica whose engine thread never finishes its first step, a
stall timeout of 1 s) is deployed beside the session's, at its own route prefix, and
deleted after; the session's app must not notice either.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from cluster_util import NUM_PAGES, PAGE_SIZE, REPLICA_CPUS, replicas_report, wait_for_replicas

from radixserve.cluster.deploy import APP_NAME, ClusterOptions, DeployRefused, deploy, running_http_options
from radixserve.ports import free_port

pytestmark = pytest.mark.cluster

STALL_APP = "stall"
STALL_TIMEOUT_S = 1.0


def options(**changes: object) -> ClusterOptions:
    base = ClusterOptions(replicas=1, engine_options=dict(model="demo", page_size=PAGE_SIZE, num_pages=NUM_PAGES),
                          replica_cpus=REPLICA_CPUS, torch_threads=1)
    for name, value in changes.items():
        setattr(base, name, value)
    return base


def served(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "health", "max_tokens": 2, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_deployment_that_would_land_elsewhere_or_replace_an_app_changes_nothing(
        ray_cluster: SimpleNamespace) -> None:
    """Serve keeps the address of its first start: a deployment asking for another one would be
    served where the operator does not look (Ray only logs it), and one under a running app's
    name would replace that app; another app cannot share a running app's route prefix. Each
    is refused before anything on the cluster changes."""
    from ray import serve

    running = running_http_options()
    assert f"http://127.0.0.1:{running.port}" == ray_cluster.url
    elsewhere = free_port()
    with pytest.raises(DeployRefused, match=f"already runs on this cluster at 127.0.0.1:{running.port}.*"
                                            f"give --host 127.0.0.1 --port {running.port}"):
        deploy(options(), port=elsewhere)
    with pytest.raises(DeployRefused, match=f"already serves an app called '{APP_NAME}'"):
        deploy(options(), port=running.port)
    with pytest.raises(DeployRefused, match=f"the app '{APP_NAME}' is served at route prefix '/' on this cluster: "
                                            "give this one another --route-prefix"):
        deploy(options(), port=running.port, name="beside", route_prefix="/")
    assert list(serve.status().applications) == [APP_NAME]
    assert len(replicas_report(ray_cluster.url)["replicas"]) == 2  # the session's app, untouched
    served(ray_cluster.url)


def test_a_stalled_replica_fails_its_health_check_and_is_replaced(ray_cluster: SimpleNamespace) -> None:
    """A replica whose engine loop has had work and no finished step for the stall timeout
    fails Serve's health check (EngineReplica.check_health) and Serve starts another in its
    place, instead of routing to it for good. The stall is --debug-stall-engine's: the first
    step of every replica of the app waits forever."""
    from ray import serve

    port = running_http_options().port
    url = f"http://127.0.0.1:{port}/{STALL_APP}"
    deploy(options(async_options={"stall_timeout_s": STALL_TIMEOUT_S}, debug_stall_engine=True),
           port=port, name=STALL_APP, route_prefix=f"/{STALL_APP}")
    stuck_request = threading.Thread(target=_send_and_give_up, args=(url,), daemon=True)
    try:
        (stalled,) = wait_for_replicas(url, 1)
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 200  # no work yet: nothing has stalled
        started = time.monotonic()
        stuck_request.start()  # its first step never ends
        (replacement,) = wait_for_replicas(url, 1, exclude=frozenset({stalled}))
        assert replacement != stalled
        print(f"replaced {time.monotonic() - started:.1f} s after the request")
        served(ray_cluster.url)  # the session's app carries on
    finally:
        serve.delete(STALL_APP)
    assert list(serve.status().applications) == [APP_NAME]


def _send_and_give_up(url: str) -> None:
    try:
        httpx.post(f"{url}/v1/completions", json={"prompt": "stall", "max_tokens": 2}, timeout=60)
    except httpx.HTTPError:
        pass  # the replica it waited on was replaced, or the app deleted under it


def test_serve_start_waits_past_serves_fixed_proxy_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine Serve's proxy can take longer than serve.start's fixed 60 s to come
    up (seen with four CPU hogs beside the tests): start_serve calls it again, which joins the
    controller the first call created. Any other timeout is not swallowed."""
    from ray import serve

    from radixserve.cluster.deploy import start_serve

    calls: list[dict] = []

    def slow_proxy(**options: object) -> None:
        calls.append(options)
        if len(calls) == 1:
            raise TimeoutError("HTTP proxies not available after 60s.")

    monkeypatch.setattr(serve, "start", slow_proxy)
    start_serve({"port": 1}, None)
    assert calls == [{"http_options": {"port": 1}, "logging_config": None}] * 2

    def other_timeout(**options: object) -> None:
        raise TimeoutError("something else")

    monkeypatch.setattr(serve, "start", other_timeout)
    with pytest.raises(TimeoutError, match="something else"):
        start_serve({"port": 1}, None)
