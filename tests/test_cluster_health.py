"""What a cluster does with a replica that cannot serve, and with a deployment that would
land where nobody looks or replace someone else's app: on the session's real Ray cluster.

A second app (`stall`: one replica, no ingress, whose engine thread never finishes its first
step, a stall timeout of 1 s) is deployed beside the session's, and deleted after; the
session's app must not notice either.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from cluster_util import NUM_PAGES, PAGE_SIZE, REPLICA_CPUS, STARTUP_TIMEOUT_S, replicas_report

from radixserve.cluster.deploy import (
    APP_NAME,
    ENGINE_DEPLOYMENT,
    ClusterOptions,
    SERVED_ROOTS,
    DeployRefused,
    deploy,
    engine_deployment,
    prefix_conflict,
    running_engine_replicas,
    running_http_options,
)
from radixserve.cluster.protocol import ReplicaRequest
from radixserve.engine.params import SamplingParams
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
    created: list[bool] = []  # on_create: from then on a stop deletes an app of that name (cluster/cli.py)
    with pytest.raises(DeployRefused, match=f"already runs on this cluster at 127.0.0.1:{running.port}.*"
                                            f"give --host 127.0.0.1 --port {running.port}"):
        deploy(options(), port=elsewhere, on_create=lambda: created.append(True))
    with pytest.raises(DeployRefused, match=f"already serves an app called '{APP_NAME}'"):
        deploy(options(), port=running.port, on_create=lambda: created.append(True))
    with pytest.raises(DeployRefused, match=f"the app '{APP_NAME}' is served at route prefix '/' on this cluster: "
                                            "give this one another --route-prefix"):
        deploy(options(), port=running.port, name="beside", route_prefix="/", on_create=lambda: created.append(True))
    # Nested with the session's app at /: /v1 would take its API (Serve matches the longest prefix).
    with pytest.raises(DeployRefused, match=f"route prefix '/v1' lies inside the app '{APP_NAME}' at '/': Serve "
                                            "would send that app's /v1 paths to this one"):
        deploy(options(), port=running.port, name="beside", route_prefix="/v1", on_create=lambda: created.append(True))
    assert created == []
    assert list(serve.status().applications) == [APP_NAME]
    assert len(replicas_report(ray_cluster.url)["replicas"]) == 2  # the session's app, untouched
    served(ray_cluster.url)


def test_a_stalled_replica_fails_its_health_check_and_is_replaced(ray_cluster: SimpleNamespace) -> None:
    """A replica whose engine loop has had work and no finished step for the stall timeout
    fails Serve's health check (EngineReplica.check_health) and Serve starts another in its
    place, instead of routing to it for good. The stall is --debug-stall-engine's: the first
    step of every replica of the app waits forever. The app is the replicas' deployment
    alone, reached through its handle (an ingress in front would add nothing checked here)."""
    from ray import serve

    handle = serve.run(engine_deployment(options(async_options={"stall_timeout_s": STALL_TIMEOUT_S},
                                                 debug_stall_engine=True)),
                       name=STALL_APP, route_prefix=None)
    try:
        (stalled,) = running_engine_replicas(STALL_APP)
        assert handle.info.remote().result(timeout_s=60).page_size == PAGE_SIZE
        assert _replica_states() == {"RUNNING": 1}  # no work yet: nothing has stalled
        started = time.monotonic()
        stuck = handle.generate.options(stream=True).remote(
            ReplicaRequest(request_id="stall", prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=2)))
        reader = threading.Thread(target=_wait_and_give_up, args=(stuck,), daemon=True)
        reader.start()  # its step never ends
        deadline = started + STARTUP_TIMEOUT_S
        while not (live := running_engine_replicas(STALL_APP)) or stalled in live:
            assert time.monotonic() < deadline, f"not replaced: {live}, {_replica_states()}"
            time.sleep(0.5)
        print(f"replaced {time.monotonic() - started:.1f} s after the request")
        served(ray_cluster.url)  # the session's app carries on
    finally:
        serve.delete(STALL_APP)
    # Its reader ends with the app: no thread of this process is left inside Ray's gRPC calls
    # (a later test's fork beside one lost its child: gRPC skips its fork handlers then).
    stuck.cancel()
    reader.join(60)
    assert not reader.is_alive()
    assert list(serve.status().applications) == [APP_NAME]


def _replica_states() -> dict[str, int]:
    from ray import serve

    deployment = serve.status().applications[STALL_APP].deployments[ENGINE_DEPLOYMENT]
    return dict(deployment.replica_states)  # state name: count


def _wait_and_give_up(stuck: Any) -> None:
    # It ends with an error: the replica it waited on was replaced, or the app deleted under it.
    with contextlib.suppress(Exception):
        for _ in stuck:
            pass


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


@pytest.mark.parametrize("prefix, other_prefix, refused", [
    ("/v1", "/", "lies inside the app 'other' at '/': Serve would send that app's /v1 paths to this one"),
    ("/a/dashboard", "/a", "lies inside the app 'other' at '/a': Serve would send that app's /dashboard paths"),
    ("/", "/metrics", "holds the app 'other' at '/metrics': Serve would send this app's /metrics paths to that one"),
    ("/small", "/", None), ("/", "/small", None), ("/a/small", "/a", None),  # siblings of what either serves
    ("/v1x", "/", None), ("/av1", "/a", None), ("/a", "/b", None), ("/", "/", None),  # not nested by segment
])
def test_nested_route_prefixes_are_refused_where_one_app_would_take_the_others_paths(
        prefix: str, other_prefix: str, refused: str | None) -> None:
    conflict = prefix_conflict(prefix, "other", other_prefix)
    assert (conflict is None) if refused is None else (conflict is not None and refused in conflict), conflict


def test_served_roots_are_the_first_segments_of_the_ingress_routes() -> None:
    """SERVED_ROOTS, what prefix_conflict protects, is every path the app answers: the single
    server's routes and the ingress's /cluster."""
    from radixserve import AsyncEngine, Engine
    from radixserve.server import create_app

    app = create_app(AsyncEngine(Engine(model="demo", page_size=PAGE_SIZE, num_pages=8)))
    roots = {route.path.strip("/").split("/")[0] for route in app.routes}
    assert roots | {"cluster"} == SERVED_ROOTS
