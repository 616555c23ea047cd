"""The Ray Serve application: N EngineReplica replicas behind one OpenAI-API ingress.

    ingress (Starlette app of radixserve.server over a ClusterEngine)
        └── DeploymentHandle ── request router (cache-aware | power-of-two | prefix-affinity)
                                   └── EngineReplica × N (Engine + AsyncEngine each)

Ray Serve places the replicas on the cluster's nodes, restarts one that dies, and runs the
HTTP proxy on `host:port`. `start_ray` joins an existing cluster (`address`) or starts a
local one.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import radixserve
from radixserve.cluster.drain_gate import DrainGate, PostsInFlight
from radixserve.cluster.engine import ClusterEngine
from radixserve.cluster.replica import EngineReplica
from radixserve.cluster.router import ROUTER_CLASSES
from radixserve.server import create_app
from radixserve.server.tenancy import Caller, admin_only

APP_NAME = "radixserve"
ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"
MAX_ONGOING_REQUESTS = 1024   # the engine queues and schedules; Serve should not hold requests back
SHUTDOWN_TIMEOUT_S = 3.0      # event streams never end on their own: do not wait long for them
HEALTH_CHECK_PERIOD_S = 2.0   # how soon Serve notices a dead replica and starts another
HEALTH_CHECK_TIMEOUT_S = 30.0  # a replica busy with long CPU steps still answers within this
# The first path segments the ingress answers (create_app's routes and /cluster): another app's
# route prefix must not nest with this one's at any of them (prefix_conflict).
SERVED_ROOTS = frozenset({"v1", "health", "metrics", "dashboard", "cluster"})


@dataclass
class ClusterOptions:
    """How to deploy: replica count, router, per-replica Engine options and resources."""

    replicas: int = 2
    router: str = "cache-aware"
    engine_options: dict[str, Any] = field(default_factory=dict)
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    torch_threads: int | None = 1
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    served_model_name: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    tenant_keys: dict[str, Caller] = field(default_factory=dict)  # tenancy.py: the keys file's
    # The ingress app's other settings (create_app's keywords: cli_serve.app_options).
    app_options: dict[str, Any] = field(default_factory=dict)
    # Each replica's AsyncEngine's (cli_serve.async_engine_options), --debug-stall-engine and
    # --debug-step-delay-s (replica.debug_step_hook).
    async_options: dict[str, Any] = field(default_factory=dict)
    debug_stall_engine: bool = False
    debug_step_delay_s: float = 0.0
    log_level: str | None = None  # Serve's logging of the app's deployments (None: Serve's INFO)
    # The ingress keeps the cluster's reuse history and sends it to the replicas' adaptive
    # rule (duel_pool.ClusterReuse); False turns both messages off, for an A/B.
    cluster_reuse: bool = True


DRAIN_POLL_S = 0.05


class OpenAIIngress:
    """The ingress deployment: the single server's Starlette app over a ClusterEngine, plus
    GET /cluster/replicas (requests routed per replica, and each replica's stats: an admin's
    key's, when the server has keys), and `drain`, a stop's first step."""

    async def __init__(self, engines: DeploymentHandle, options: ClusterOptions) -> None:
        info = await engines.info.remote()
        self.engine = ClusterEngine(engines, info, app_name=serve.get_replica_context().app_name,
                                    deployment=ENGINE_DEPLOYMENT,
                                    hash_secret=options.engine_options.get("cache_hash_secret"),
                                    cluster_reuse=options.cluster_reuse,
                                    session_ttl_s=options.engine_options.get("session_ttl_s"))
        self._app = create_app(self.engine, served_model_name=options.served_model_name, api_key=options.api_key,
                               admin_api_key=options.admin_api_key, tenant_keys=options.tenant_keys,
                               **options.app_options)
        self._app.router.routes.append(Route("/cluster/replicas", self._replicas, methods=["GET"]))
        self._gate = DrainGate()
        self._app.add_middleware(PostsInFlight, gate=self._gate)

    async def drain(self, grace_s: float, flush_s: float) -> int:
        """A stop's first step, the single server's (cli_serve.BoundedServer): the requests in
        flight get up to `grace_s` to finish; those still running are then ended by their
        replicas and answered as the single server answers them (a 503 `server_shutting_down`:
        in a stream, its error event and [DONE]), which gets up to `flush_s` to be sent.
        Returns how many were still running at the grace's end. Requests that arrive meanwhile
        are refused unread (drain_gate: Serve's proxy still takes them, the single server's
        closed socket would not)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        self._gate.closed = True
        while self._gate.in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = self._gate.in_flight
        if not left:
            return 0
        self._app.state.server.stopping = True  # an aborted request is now answered as ended by the server
        await self.engine.on_every_replica("end_requests")
        deadline = loop.time() + flush_s
        while self._gate.in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return left

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    async def _replicas(self, request: Request) -> JSONResponse:
        admin_only(self._app.state.server._authorize(request))
        stats = self.engine.view.replica_stats()
        routed = self.engine.view.routed_counts()
        in_flight = self.engine.view.in_flight_counts()
        return JSONResponse({"replicas": [
            {"id": r, "routed": routed.get(r, 0), "in_flight": in_flight.get(r, 0),
             "requests_finished": s.get("requests_finished", 0),
             "prompt_tokens": s.get("prompt_tokens", 0), "cached_tokens": s.get("cached_tokens", 0),
             "pages_total": s.get("pages_total", 0), "pages_free": s.get("pages_free", 0),
             "pages_cached": s.get("pages_cached", 0), "waiting": s.get("waiting", 0),
             "running": s.get("running", 0)}
            for r, s in sorted(stats.items())], "routed": routed,
            "total": {k: v for k, v in self.engine.stats().items() if k != "histograms"}})

    def starts_limit(self) -> int:
        """The app's --tenant-starts (its default from the replicas' device: start_shares.py)."""
        return self._app.state.server.starts.limit

    def reuse_messages(self) -> dict[str, int | bool]:
        """What the cluster's reuse history has sent the replicas (ClusterReuse.messages)."""
        return self.engine.reuse.messages()

    def cache_index(self) -> dict[str, list[tuple[str, int]]]:
        """What the router believes each replica caches (for tests: it must be exact)."""
        index = self.engine.view.state.index
        with self.engine.view.lock:
            return {r: sorted(index.page_set(r)) for r in self.engine.view.replicas}


def build_app(options: ClusterOptions) -> serve.Application:
    """The Serve application for `options` (not started)."""
    ingress = serve.deployment(
        serve.ingress()(OpenAIIngress), name=INGRESS_DEPLOYMENT, num_replicas=1,
        max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=SHUTDOWN_TIMEOUT_S, graceful_shutdown_wait_loop_s=0.5,
    ).bind(engine_deployment(options), options)
    return ingress


def engine_deployment(options: ClusterOptions) -> serve.Application:
    """The replicas' deployment alone, bound (build_app puts the ingress in front of it)."""
    if options.router not in ROUTER_CLASSES:
        raise ValueError(f"router: unknown {options.router!r}, expected one of {sorted(ROUTER_CLASSES)}")
    if options.replicas < 1:
        raise ValueError(f"replicas: must be >= 1, got {options.replicas}")
    router_config = RequestRouterConfig(request_router_class=ROUTER_CLASSES[options.router],
                                        request_router_kwargs=dict(options.router_kwargs))
    return serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=options.replicas,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        **tensor_parallel_placement(options),
        graceful_shutdown_timeout_s=SHUTDOWN_TIMEOUT_S, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        request_router_config=router_config,
    ).bind(options.engine_options, options.torch_threads, options.async_options, options.debug_stall_engine,
           options.debug_step_delay_s)


def tensor_parallel_placement(options: ClusterOptions) -> dict[str, Any]:
    """Deployment options that reserve a whole TP group per replica: a placement group of N
    bundles (the replica actor takes the first; its N-1 worker processes, spawned by the
    engine, run on the others' reservation), packed on one node, since the workers are local
    processes (multi-node groups: torchrun, README). None for tensor_parallel_size 1."""
    size = int(options.engine_options.get("tensor_parallel_size", 1))
    if size <= 1:
        return {}
    bundle = {"CPU": options.replica_cpus, **({"GPU": options.replica_gpus} if options.replica_gpus else {})}
    return {"placement_group_bundles": [dict(bundle) for _ in range(size)], "placement_group_strategy": "STRICT_PACK"}


def start_ray(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Joins the Ray cluster at `address`, or starts a local one (workers import this same
    radixserve: its parent directory goes on their PYTHONPATH)."""
    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return
    # Serve restarts a proxy not ready within 5 s; on a busy machine a new worker process
    # takes longer than that just to start, and serve.start then fails. The local cluster's
    # processes inherit this environment (an operator's own value wins).
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    source = str(Path(radixserve.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    # "local": a new cluster, as asked, even where RAY_ADDRESS or a `ray start` elsewhere on
    # this machine would make Ray join that one (and refuse num_cpus for it).
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})


def deploy(options: ClusterOptions, *, host: str = "127.0.0.1", port: int = 8000,
           keep_alive_s: float | None = None, name: str = APP_NAME, route_prefix: str = "/",
           on_create: Callable[[], object] = lambda: None) -> DeploymentHandle:
    """Starts Serve's HTTP proxy on host:port (closing idle kept-alive connections after
    `keep_alive_s`; None: Serve's 90 s) and deploys the app as `name` at `route_prefix`;
    returns the ingress handle once every replica is up. DeployRefused, before anything on the
    cluster changed, when Serve already runs there at another address (Ray only logs it, and
    the app would be served where nobody looks), already runs an app called `name` (it would
    be replaced: another operator's, on a shared cluster) or another app at or nested with
    `route_prefix` (prefix_conflict). `on_create` is called once the checks have passed, just
    before the app is created: from then on an app called `name` is this caller's to delete."""
    http_options: dict[str, Any] = {"host": host, "port": port}
    if keep_alive_s is not None:
        http_options["keep_alive_timeout_s"] = max(1, round(keep_alive_s))  # Serve takes whole seconds
    logging_config = {"log_level": options.log_level.upper()} if options.log_level else None
    start_serve(http_options, logging_config)
    running = running_http_options()
    if (running.host, running.port) != (host, port):
        raise DeployRefused(f"Ray Serve already runs on this cluster at {running.host}:{running.port}, and its "
                             f"address cannot change while it runs: give --host {running.host} --port {running.port}")
    if name in serve.status().applications:
        raise DeployRefused(f"this cluster already serves an app called {name!r}: stop it first "
                            f"(serve.delete({name!r})), or serve this one beside it under another "
                            "--app-name and --route-prefix")
    prefixes = app_route_prefixes()
    if (holder := next((app for app, prefix in prefixes.items() if prefix == route_prefix), None)) is not None:
        raise DeployRefused(f"the app {holder!r} is served at route prefix {route_prefix!r} on this cluster: "
                            "give this one another --route-prefix")
    for other, other_prefix in prefixes.items():
        if (conflict := prefix_conflict(route_prefix, other, other_prefix)) is not None:
            raise DeployRefused(conflict)
    on_create()
    return serve.run(build_app(options), name=name, route_prefix=route_prefix, logging_config=logging_config)


def start_serve(http_options: dict[str, Any], logging_config: dict[str, Any] | None) -> None:
    """serve.start, past its fixed 60 s wait for the HTTP proxy: on a loaded machine a new
    proxy process can take longer just to import its code (seen with four CPU hogs beside the
    tests on two cores), and Serve raised although the proxy was still starting. A second call
    joins the controller the first one created; serve.run then waits for the proxy again."""
    try:
        serve.start(http_options=http_options, logging_config=logging_config)
    except TimeoutError as exc:
        if "HTTP proxies not available" not in str(exc):
            raise
        serve.start(http_options=http_options, logging_config=logging_config)


def replica_failure(app: str = APP_NAME) -> str | None:
    """Why the app's deployments failed to start, from Serve's status (serve.run's error says
    only "Failed to update the deployments [...]"): the last error line of the first failed
    deployment's message, which ends with its replica's traceback; None when there is none."""
    try:
        status = serve.status().applications.get(app)
    except Exception:  # the controller gone with the cluster: say what serve.run said
        return None
    if status is None:
        return None
    for name in (ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT):
        deployment = status.deployments.get(name)
        if deployment is not None and (line := last_error_line(deployment.message or "")) is not None:
            return f"{name} could not start: {line}"
    return None


_ERROR_LINE = re.compile(r"(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): .*")


def last_error_line(message: str) -> str | None:
    """The last line of a traceback that names an exception and its message ("FileNotFoundError:
    model not found: ..."), its module path dropped; None when no line does."""
    lines = [match for line in message.splitlines() if (match := _ERROR_LINE.fullmatch(line.strip()))]
    if not lines:
        return None
    last = lines[-1]
    return last.group(0)[last.start(1):]


class DeployRefused(RuntimeError):
    """The app cannot be deployed as asked, and nothing on the cluster was changed."""


def running_http_options() -> Any:
    """The HTTP options (host, port, keep_alive_timeout_s, ...) of the Serve running on the
    cluster this process joined: the first start's, whatever later starts asked for."""
    from ray.serve.context import _get_global_client  # Serve keeps them only on its client

    return _get_global_client().http_config


def app_route_prefixes() -> dict[str, str]:
    """Each running app's route prefix on the cluster this process joined (apps without one,
    reached only through handles, left out)."""
    from ray.serve.context import _get_global_client

    applications = _get_global_client().get_serve_details().get("applications", {})
    return {name: app["route_prefix"] for name, app in applications.items() if app.get("route_prefix")}


def prefix_conflict(route_prefix: str, other: str, other_prefix: str) -> str | None:
    """Why an app at `route_prefix` cannot be served beside the app `other` at `other_prefix`:
    Serve's proxy sends a request to the app of the longest prefix that matches whole path
    segments, so of two nested prefixes the inner one takes the outer app's paths below it.
    Refused where those are paths this server answers (SERVED_ROOTS): an app at /v1 beside
    one at / would take the other's whole API, and its clients' keys with it; one at / beside
    one at /v1 would lose its own. A sibling such as /small beside / takes nothing."""
    outer, inner = sorted((route_prefix, other_prefix), key=len)
    if inner == outer or (outer != "/" and not inner.startswith(outer + "/")):
        return None  # the same (deploy refuses that first) or not nested
    segment = inner[len(outer):].strip("/").split("/")[0]
    if segment not in SERVED_ROOTS:
        return None
    if inner == route_prefix:
        return (f"route prefix {route_prefix!r} lies inside the app {other!r} at {other_prefix!r}: Serve would "
                f"send that app's /{segment} paths to this one; give another --route-prefix")
    return (f"route prefix {route_prefix!r} holds the app {other!r} at {other_prefix!r}: Serve would send this "
            f"app's /{segment} paths to that one; give another --route-prefix")


def running_engine_replicas(app: str = APP_NAME) -> list[str]:
    """The replica ids of the app's EngineReplica replicas that Serve has running (for fault
    tests: whether one was replaced). From Serve's controller: Ray's state API needs the
    dashboard, which this package's clusters run without."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details().get("applications", {}).get(app)
    replicas = details["deployments"][ENGINE_DEPLOYMENT]["replicas"] if details else []
    return [r["replica_id"] for r in replicas if r["state"] == "RUNNING"]
