"""`radixserve serve --replicas N [--ray-address ADDR] [--app-name NAME --route-prefix /P] [--router NAME]`:
serve on Ray Serve."""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.ports import bind_socket, cannot_listen, url_host

if TYPE_CHECKING:
    from radixserve.cluster.stop_signals import StopSignals

INSTALL_HINT = "pip install -e '.[cluster]' (or pip install 'ray[serve]')"


def serve_cluster(args: argparse.Namespace, load_tenant_keys: Callable[[], bool], engine_options: dict[str, Any],
                  app_options: dict[str, Any], async_options: dict[str, Any]) -> int:
    """Deploys the replicas (each an Engine of `engine_options` under an AsyncEngine of
    `async_options`) and the ingress (its app of `app_options`, and the tenant keys that
    `load_tenant_keys` sets on `args`, or False when they are malformed), serves until SIGINT
    or SIGTERM (stop_signals.py: even when the parent ignored or blocked them), then tears the
    app down."""
    try:
        import ray
    except ImportError:
        _say(f"error: --replicas and --ray-address need Ray Serve: {INSTALL_HINT}")
        return 2
    replicas = args.replicas if args.replicas is not None else 1
    if replicas < 1:
        _say(f"error: --replicas must be >= 1, got {replicas}")
        return 2
    # A local Ray's proxy listens here: the port is held from now until just before Serve starts
    # its proxy, as Ray picks its own agents' ports at random meanwhile (a cluster's proxies
    # listen on its nodes).
    # First, as the single server binds first: a busy port is said before seconds of imports.
    reservation: socket.socket | None = None
    if args.ray_address is None:
        try:
            reservation = bind_socket(args.host, args.port)
        except OSError as exc:
            _say(cannot_listen(args.host, args.port, exc))
            return 1
    # torch and the server load from here on (the keys' module imports them), after the hold
    if not load_tenant_keys():
        _release(reservation)
        return 2
    if args.ray_address is None and (problem := local_model_problem(args.model)) is not None:
        # A local cluster's replicas load it here: said now, not after Serve's retries (a minute and more)
        _release(reservation)
        _say(f"error: cannot load {args.model!r}: {problem}")
        return 2
    if args.ray_address is not None:
        _say(f"joining the Ray cluster at {args.ray_address} ...")
        if (problem := ray_address_problem(args.ray_address)) is not None:
            # Ray's own connect retries an address nobody answers at for many minutes, unstoppable
            _say(f"error: {problem}")
            return 1
    from radixserve.cluster.deploy import (
        ClusterOptions,
        DeployRefused,
        deploy,
        replica_failure,
        running_http_options,
        start_ray,
    )
    from radixserve.cluster.stop_signals import StopRequested, StopSignals

    options = ClusterOptions(replicas=replicas, router=args.router, engine_options=engine_options,
                             replica_cpus=args.replica_cpus, served_model_name=args.served_model_name,
                             # as many torch threads as CPUs reserved (it was always one)
                             torch_threads=max(1, int(args.replica_cpus)),
                             api_key=args.api_key, admin_api_key=args.admin_api_key,
                             tenant_keys=getattr(args, "tenant_keys", {}), app_options=app_options,
                             async_options=async_options, debug_stall_engine=args.debug_stall_engine,
                             debug_step_delay_s=args.debug_step_delay_s, log_level=args.log_level)
    # A local cluster gets enough logical CPUs for every replica, however few cores there are.
    group = max(1, args.tensor_parallel_size)  # a replica reserves a bundle per tensor-parallel rank
    local_cpus = max(os.cpu_count() or 1, int(replicas * group * args.replica_cpus + 0.999))
    stop = StopSignals(args.shutdown_timeout_s)
    # Set once deploy has passed its checks and creates the app: until then an app of this
    # name on a joined cluster is another operator's, which a stop must leave alone.
    ours = threading.Event()
    served = False  # the app is up: a stop drains its requests first
    try:
        stop.install()  # before Ray starts: a signal during the start or the deployment stops too
        try:
            start_ray(args.ray_address, num_cpus=None if args.ray_address else local_cpus)
        except ConnectionError as exc:  # no cluster at the address, or none found for "auto"
            if stop.stopping:
                raise StopRequested("signal during Ray's start") from exc
            ray.shutdown()  # (whatever part of it started)
            where = f"join the Ray cluster at {args.ray_address}" if args.ray_address else "start a local Ray"
            _say(f"error: cannot {where}: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}")
            return 1
        options.replica_gpus = replica_gpus(args.replica_gpus, args.device, args.tensor_parallel_size,
                                            ray.cluster_resources().get("GPU", 0), replicas)
        stop.install()  # again: ray.init replaced the SIGTERM handler with its crash reporter
        # A local cluster's address, for its operator: a second model joins it (docs/server.md)
        where = (f"cluster {args.ray_address}" if args.ray_address
                 else f"local Ray at {ray.get_runtime_context().gcs_address}")
        _say(f"deploying {replicas} replica(s) of {args.model!r}, router {args.router} ({where}) ...")
        try:
            _release(reservation)  # Serve's proxy binds it now
            ingress = deploy(options, host=args.host, port=args.port, keep_alive_s=args.keep_alive_timeout_s,
                             name=args.app_name, route_prefix=args.route_prefix, on_create=ours.set)
        except DeployRefused as exc:
            _say(f"error: {exc}")
            _tear_down(stop, args.app_name, shared=True, deployed=False)  # whatever runs there is not ours
            return 2
        except Exception as exc:  # a replica that cannot load its model fails the deployment
            if stop.stopping:
                # A signal's StopRequested raised inside one of Ray's C calls comes out as another
                # error (SystemError: "... returned a result with an exception set"): a stop.
                raise StopRequested("signal during the deployment") from exc
            _say(f"error: deployment failed: {replica_failure(args.app_name) or _reason(exc)}")
            _tear_down(stop, args.app_name, shared=args.ray_address is not None, deployed=ours.is_set())
            return 2
        kept_alive = running_http_options().keep_alive_timeout_s
        if kept_alive != max(1, round(args.keep_alive_timeout_s)):  # a joined cluster's Serve was started before
            _say(f"warning: the running Serve closes idle connections after {kept_alive} s; "
                 "--keep-alive-timeout-s cannot change that while it runs")
        _say_starts(ingress)
        root = f"http://{url_host(args.host)}:{args.port}{args.route_prefix.rstrip('/')}"
        _say(f"serving at {root}/v1 with {replicas} replica(s) as app {args.app_name!r} "
             f"(per-replica routing at {root}/cluster/replicas; Ctrl-C to stop)")
        served = True
        stop.wait()
    except StopRequested:
        pass
    except Exception:
        if not stop.stopping:
            raise
        # as above, from Ray's start: a stop that came out of a C call as another error
    finally:
        _release(reservation)  # a signal during Ray's start comes before the release above
    _say("stopping ...")
    _tear_down(stop, args.app_name, shared=args.ray_address is not None, deployed=ours.is_set(), drain=served)
    _say("stopped")
    return 0


RAY_CONNECT_TIMEOUT_S = 10.0


def ray_address_problem(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> str | None:
    """Why nothing answers at the Ray cluster address `address` (a TCP connection to its GCS, or
    to a ray:// client server, refused or not made within `timeout_s`), or None. "auto" is
    resolved as Ray resolves it; an address that cannot be read is left to ray.init."""
    target = address.removeprefix("ray://")
    if target == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address("auto") or ""
        except Exception:  # no cluster found, or Ray's internals moved: ray.init says it
            return None
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        return f"cannot reach the Ray cluster at {address} ({host}:{port}: {why}); is it running?"
    return None


def _say_starts(ingress: Any) -> None:
    """The single server's line on requests starting at once, from the ingress (its default
    follows the replicas' device)."""
    try:
        starts = ingress.starts_limit.remote().result(timeout_s=30)
    except Exception:  # (a fake ingress in tests, or one that does not answer: the line is not vital)
        return
    _say(f"requests starting at once (body to first token): {starts}, shared by the tenants starting some, "
         "any number for one alone" if starts else "requests starting at once: any number")


def local_model_problem(model: str) -> str | None:
    """Why `model` cannot be loaded on this machine, where a local cluster's replicas load it,
    in the loader's words (models/loader.py), or None: a local path that is missing, or no
    checkpoint directory or .gguf file, or a named model not installed. A Hub id is left to
    the replicas (they download it)."""
    from radixserve.models.gguf_checkpoint import is_gguf_file
    from radixserve.models.registry import ModelNotInstalledError, is_hub_id, resolve_model

    if model == "demo" or is_hub_id(model):
        return None
    try:
        path = resolve_model(model)
    except ModelNotInstalledError as exc:
        return str(exc)
    if is_gguf_file(path) or (path.is_dir() and (path / "config.json").is_file()):
        return None
    try:  # the loader's own message (it opens nothing more for these)
        from radixserve.models.loader import load_model

        load_model(model, device="cpu")
    except (OSError, ValueError) as exc:
        return str(exc).strip().splitlines()[0]
    return None


def _reason(error: Exception) -> str:
    """An exception's message; a Ray task's error carries the remote one (not its traceback)."""
    cause = getattr(error, "cause", None)
    return str(cause if isinstance(cause, BaseException) else error).strip()


def replica_gpus(given: float | None, device: str | None, tensor_parallel_size: int, cluster_gpus: float,
                 replicas: int) -> float:
    """GPUs each replica reserves: `given` (--replica-gpus), else, where replicas run on CUDA
    (--device cuda..., or no --device) and the cluster has GPUs, an equal share that spreads
    them over the GPUs (one each where there are enough; 1/2 each, two to a GPU, where up to
    twice as many; ...), else none. Ray shows an actor only the GPUs it reserved; one that
    reserved none sees them all, and every such replica took cuda:0. Not with tensor
    parallelism: its ranks are processes the replica spawns, which see what it sees."""
    if given is not None:
        return given
    on_cuda = device.startswith("cuda") if device else True
    if not on_cuda or cluster_gpus <= 0 or tensor_parallel_size > 1:
        return 0.0
    return 1.0 / math.ceil(replicas / int(cluster_gpus)) if cluster_gpus >= 1 else 0.0


def _release(reservation: socket.socket | None) -> None:
    if reservation is not None:
        reservation.close()  # closing twice does nothing


def _tear_down(stop: StopSignals, app_name: str, *, shared: bool, deployed: bool, drain: bool = False) -> None:
    """Deletes the Serve app `app_name` (unless this command never `deployed` it: not when a
    signal came while Ray was starting or before deploy's checks had passed) and ends this
    driver's Ray (a local cluster's processes with it). On a `shared` cluster (--ray-address)
    only our app goes: serve.shutdown() would delete every other Serve app running there too.
    With `drain` (the app served), its requests in flight first get the single server's grace
    (_drain)."""
    import ray
    from ray import serve

    stop.begin_teardown()
    if ray.is_initialized() and deployed and drain:
        _drain(app_name)
    if ray.is_initialized() and deployed:
        if shared:
            try:
                serve.delete(app_name)
            except Exception as exc:  # e.g. Serve's controller gone with the cluster: say so, end cleanly
                _say(f"warning: could not delete the app {app_name!r}: {_reason(exc)}")
        else:
            serve.shutdown()
    ray.shutdown()


def _drain(app_name: str) -> None:
    """The single server's stop for the requests in flight (cli_serve.BoundedServer), by the
    ingress (deploy.OpenAIIngress.drain): up to GRACEFUL_SHUTDOWN_S - END_REQUESTS_BEFORE_S to
    finish, then those left are ended with the 503 `server_shutting_down` (a stream's error
    event and [DONE]), END_REQUESTS_BEFORE_S to send it. Serve's deletion would cut them off."""
    from ray import serve

    from radixserve.cli_serve import END_REQUESTS_BEFORE_S, GRACEFUL_SHUTDOWN_S

    grace_s = GRACEFUL_SHUTDOWN_S - END_REQUESTS_BEFORE_S
    try:
        ended = serve.get_app_handle(app_name).drain.remote(grace_s, END_REQUESTS_BEFORE_S).result(
            timeout_s=GRACEFUL_SHUTDOWN_S + 10)
    except Exception as exc:  # the ingress gone or stuck: the deletion still ends its requests
        _say(f"warning: could not let the requests in flight finish: {_reason(exc)}")
        return
    if ended:
        _say(f"{ended} request(s) still running after {grace_s:g} s ended (503 server_shutting_down)")


def _say(message: str) -> None:
    print(f"radixserve: {message}", file=sys.stderr, flush=True)
