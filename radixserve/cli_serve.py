"""`radixserve serve`: bind the port, load the engine, report the KV pool, serve until Ctrl-C.

The command behind cli_serve_flags.py's flags: it checks what argparse cannot, hands a
cluster to cluster/cli.py and a torchrun worker rank to parallel/worker.py, and otherwise runs
uvicorn over one engine with a shutdown that cannot hang (`BoundedServer`). Torch is imported
only once the port is bound, so a busy port is reported at once.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from radixserve.host_names import host_names
from radixserve.ports import bind_socket, cannot_listen, url_host

GRACEFUL_SHUTDOWN_S = 5  # open streams get this long to finish after Ctrl-C
END_REQUESTS_BEFORE_S = 1.0  # then those left are ended this long before the grace is over
LISTEN_BACKLOG = 2048  # uvicorn's default: connections waiting to be accepted


def serve_command(args: argparse.Namespace) -> int:
    """`radixserve serve`: bind, load, report the KV pool, serve until Ctrl-C or SIGTERM."""
    for flag in ("stall_timeout_s", "shutdown_timeout_s", "head_timeout_s", "body_timeout_s", "keep_alive_timeout_s",
                 "grammar_compile_timeout_s"):
        if getattr(args, flag) <= 0:
            say(f"error: --{flag.replace('_', '-')} must be > 0")
            return 2
    contradiction = _contradiction(args)
    if contradiction:
        say(f"error: {contradiction}")
        return 2
    if args.tensor_parallel_size < 1:
        say(f"error: --tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
        return 2
    if args.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0:  # torchrun: a worker rank
        from radixserve.parallel.worker import main as worker_main

        worker_main(["--model", args.model, "--tensor-parallel-size", str(args.tensor_parallel_size),
                     "--dtype", args.dtype, *(["--device", args.device] if args.device else [])])
        return 0
    if args.replicas is not None or args.ray_address is not None:
        from radixserve.cluster.cli import serve_cluster

        return serve_cluster(args, lambda: _load_tenant_keys(args), engine_options(args), app_options(args),
                             async_engine_options(args))
    try:  # first, so that a busy port is reported before minutes of loading
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        say(cannot_listen(args.host, args.port, exc))
        return 1
    try:
        # Listening at once: a bound socket that does not listen lets another server (uvicorn,
        # a second radixserve) bind the port with SO_REUSEADDR and listen; this one's listen
        # then failed inside uvloop without a word, and it said "serving" on nothing.
        # Connections made meanwhile wait in the backlog until the model is loaded.
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        say(cannot_listen(args.host, args.port, exc))
        return 1
    sock.set_inheritable(True)
    if not _load_tenant_keys(args):  # after the bind: the keys' module imports torch
        sock.close()
        return 2
    # Ctrl-C or SIGTERM while loading stops as it does while serving (a KeyboardInterrupt
    # traceback, or a silent exit 143, before): uvicorn takes the signals over once it serves.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    engine: Any = None
    try:
        say(f"loading model {args.model!r} (device: {args.device or 'auto'}, dtype: {args.dtype}) ...")
        started = time.perf_counter()
        from radixserve import (  # torch loads here, after the port is ours
            AsyncEngine,
            Engine,
        )
        from radixserve.parallel.group import TensorParallelFault
        from radixserve.server import create_app
        from radixserve.server.connection_limits import connection_limits, raise_descriptor_limit
        from radixserve.server.connections import uvicorn_options
        from radixserve.server.refusal_pacing import RefusalPacer
        from radixserve.server.startup_gc import freeze_startup_objects
        from torch import OutOfMemoryError

        try:
            engine = Engine(**engine_options(args))
        except OutOfMemoryError as exc:  # a RuntimeError, not a MemoryError: the model or KV pool is too big
            sock.close()
            say(f"error: cannot load {args.model!r}: out of memory: {_first_line(exc)}")
            return 2
        except (OSError, ValueError, MemoryError, TensorParallelFault) as exc:  # a worker's death included
            sock.close()
            say(f"error: cannot load {args.model!r}: {_as_flags(_first_line(exc))}")
            return 2
        stats = engine.stats()
        say(f"loaded {engine.model_name} in {time.perf_counter() - started:.1f} s, "
             f"context {engine.max_context_len} tokens")
        say(engine.describe())
        say(f"KV pool: {stats['pages_total']} pages x {stats['page_size']} tokens = "
             f"{stats['kv_tokens_capacity']} tokens, {_format_bytes(stats['kv_bytes'])}")
        scheduler = engine.scheduler
        say(f"steps: up to {scheduler.max_batch_tokens} tokens" + (
            f"; beside decoding streams, prefill to a multiple of {scheduler.mixed_prefill_tokens}"
            if scheduler.mixed_prefill_tokens is not None else "") + (
            f"; prompts of up to {scheduler.short_prompt_tokens} new tokens run beside a long prefill"
            if scheduler.short_prompt_tokens else ""))
        if stats["host_pages_total"]:
            say(f"host tier: {stats['host_pages_total']} pages = {stats['host_pages_total'] * stats['page_size']} "
                 f"tokens, {_format_bytes(stats['host_kv_bytes'])} ({args.host_write_policy})")
        step_hook = (threading.Event().wait if args.debug_stall_engine  # waits forever
                     else functools.partial(time.sleep, args.debug_step_delay_s) if args.debug_step_delay_s
                     else None)
        pacer = RefusalPacer(args.refusals_per_s) if args.refusals_per_s else None
        try:
            app = create_app(AsyncEngine(engine, step_hook=step_hook, **async_engine_options(args)),
                             served_model_name=args.served_model_name, api_key=args.api_key,
                             admin_api_key=args.admin_api_key, tenant_keys=args.tenant_keys, refusal_pacer=pacer,
                             **app_options(args))
        except ValueError as exc:  # flags the model contradicts (a tool-call parser its template cannot feed)
            sock.close()
            engine.close()
            say(f"error: {_first_line(exc)}")
            return 2
        starts = app.state.server.starts.limit
        say(f"requests starting at once (body to first token): {starts}, shared by the tenants starting some, "
            "any number for one alone" if starts else "requests starting at once: any number")
        frozen = freeze_startup_objects()  # after the model and the app: they live as long as the process
        say(f"{frozen:,} start-up objects frozen out of the garbage collector's passes")
        descriptors = raise_descriptor_limit()  # before the caps are derived from it
        if args.max_connections and args.max_connections > descriptors:
            say(f"warning: --max-connections {args.max_connections:,} is more than this process's "
                f"{descriptors:,} file descriptors (ulimit -n): past them new connections fail, unanswered")
        limits = connection_limits(args.max_connections_per_client, args.max_connections)
        if limits is not None:
            app.state.server.metrics.watch_connections(limits)
            say(f"open connections: at most {_cap(limits.per_address)} from one address, "
                f"{_cap(limits.total)} in all (then 429 / 503)")
        if pacer is not None:
            say(f"an address refused (4xx) more than {pacer.burst:g} times in a burst is held to "
                f"{pacer.rate:g} refusals a second")
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                **uvicorn_options(args.head_timeout_s, args.keep_alive_timeout_s,
                                                  write_timeout_s=2 * args.stream_read_timeout_s, limits=limits,
                                                  pacer=pacer))
        server = BoundedServer(config, shutdown_timeout_s=args.shutdown_timeout_s,
                               end_requests=app.state.server.end_requests)
    except KeyboardInterrupt:
        sock.close()
        if engine is not None:
            engine.close()
        say("stopped while loading")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    say(f"serving {args.served_model_name or engine.model_name} at http://{url_host(args.host)}:{port}/v1 "
         f"(metrics at /metrics, dashboard at /dashboard; Ctrl-C to stop)")
    # uvicorn re-raises the signals it caught once it has stopped: let them land here quietly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if app.state.engine_stopped is False:
        # No close(): a tensor-parallel STOP waits on a group that the stuck step holds (10 s
        # and more, past --shutdown-timeout-s); _exit_now kills the workers instead.
        say("the engine thread did not stop (a step is stuck); exiting anyway")
        _exit_now(1)
    engine.close()  # ends tensor-parallel workers, if any
    say("stopped")
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM as Ctrl-C: the load stops where it is."""
    raise KeyboardInterrupt


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """Engine's keyword arguments from `radixserve serve`'s flags."""
    return {"model": args.model, "page_size": args.page_size, "num_pages": args.num_pages,
            "kv_memory_gb": args.kv_memory_gb, "device": args.device,
            "schedule_policy": args.schedule_policy, "eviction_policy": args.eviction_policy,
            "dtype": args.dtype, "max_running": args.max_running, "max_queue": args.max_queue,
            "max_batch_tokens": args.max_batch_tokens, "mixed_prefill_tokens": args.mixed_prefill_tokens,
            "tenant_step_rows": args.tenant_step_rows, "short_prompt_tokens": args.short_prompt_tokens,
            "grammar_paced_share": args.grammar_paced_share,
            "enable_prefix_cache": not args.no_prefix_cache,
            "host_kv_memory_gb": args.host_kv_memory_gb, "host_num_pages": args.host_num_pages,
            "host_write_policy": args.host_write_policy, "host_offload_min_priority": args.host_offload_min_priority,
            "generation_config": args.generation_config, "fair_share": not args.no_fair_share,
            "cache_hash_secret": cache_hash_secret(args),
            "tensor_parallel_size": args.tensor_parallel_size, "adaptive_threads": not args.fixed_threads,
            "grammar_compile_timeout_s": args.grammar_compile_timeout_s}


def async_engine_options(args: argparse.Namespace) -> dict[str, object]:
    """AsyncEngine's keyword arguments (the watchdog's and the streams' settings) from the
    flags: the single server's and every cluster replica's alike."""
    return {"stall_timeout_s": args.stall_timeout_s, "stream_buffer_tokens": args.stream_buffer_tokens,
            "stream_read_timeout_s": args.stream_read_timeout_s}


def _contradiction(args: argparse.Namespace) -> str | None:
    """A flag out of range, or flags that cannot all be honoured: refused at start rather than
    one silently dropped."""
    for flag in ("max_connections_per_client", "max_connections", "refusals_per_s", "tenant_starts"):
        if (getattr(args, flag) or 0) < 0:
            return f"--{flag.replace('_', '-')} must be >= 0 (0: none)"
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    at_least_one = {"max_queue": "every request would be refused", "stream_buffer_tokens": "no stream could send",
                    "cache_event_buffer": "no event could be kept"}
    for flag, why in at_least_one.items():
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            return f"--{flag.replace('_', '-')} must be >= 1, got {value} ({why})"
    for flag in ("stream_read_timeout_s", "cache_events_idle_timeout_s"):
        value = getattr(args, flag, None)
        if value is not None and not value > 0:  # (NaN too)
            return f"--{flag.replace('_', '-')} must be > 0 seconds, got {value}"
    for flag in ("replica_cpus", "replica_gpus", "debug_step_delay_s"):  # (before Ray starts, for a cluster's)
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            return f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}"
    if args.turn_memory_tokens < 0:
        return f"--turn-memory-tokens must be >= 0 (0: off), got {args.turn_memory_tokens}"
    for flag in ("kv_memory_gb", "host_kv_memory_gb"):
        value = getattr(args, flag, None)
        if value is not None and not math.isfinite(value):
            return f"--{flag.replace('_', '-').replace('host-kv', 'host-tier')} must be a finite number of GiB, got {value}"
    if args.max_request_tokens < 1:
        return f"--max-request-tokens must be >= 1, got {args.max_request_tokens} (every request would be refused)"
    if args.no_prefix_cache and (args.host_kv_memory_gb or args.host_num_pages):
        return "--no-prefix-cache caches nothing, so a host tier (--host-tier-memory-gb / --host-tier-pages) has nothing to hold"
    if args.public_cache_hashes and args.cache_hash_secret:
        return ("--public-cache-hashes publishes unkeyed hashes, and a cache hash secret is given "
                "(--cache-hash-secret or $RADIXSERVE_CACHE_HASH_SECRET): give one or the other")
    if args.tensor_parallel_size > 1 and args.device and args.device.partition(":")[2] not in ("", "0"):
        return (f"--device {args.device}: with --tensor-parallel-size rank r runs on GPU r (or LOCAL_RANK's "
                "under torchrun); choose the GPUs with CUDA_VISIBLE_DEVICES, and give --device cuda")
    return (_ignored_here(args) or _app_placement_problem(args.app_name, args.route_prefix)
            or _secret_in_a_shared_job_table(args))


SECRET_VARIABLES = {"api_key": "RADIXSERVE_API_KEY", "admin_api_key": "RADIXSERVE_ADMIN_API_KEY",
                    "cache_hash_secret": "RADIXSERVE_CACHE_HASH_SECRET"}


def _secret_in_a_shared_job_table(args: argparse.Namespace) -> str | None:
    """A secret given on the command line when joining a cluster (--ray-address): Ray records
    the driver's command line as its job's entrypoint, which every user of the cluster can read
    (`ray list jobs`, the Ray dashboard), so it must come from the environment there."""
    if args.ray_address is None:  # a local cluster's job table shows no more than `ps` here does
        return None
    for flag, variable in SECRET_VARIABLES.items():
        if flag in getattr(args, "given_on_command_line", ()):  # (even with the variable's value)
            return (f"--{flag.replace('_', '-')} on the command line is recorded in the Ray cluster's job "
                    f"table, which every user of the cluster can read: give it as ${variable}")
    return None


def _app_placement_problem(app_name: str, route_prefix: str) -> str | None:
    """Why Serve would refuse the app's name or route prefix: said before Ray starts, so that
    a typo costs no cluster start."""
    if not app_name:
        return "--app-name must not be empty"
    if not route_prefix.startswith("/"):
        return f"--route-prefix must start with '/', got {route_prefix!r}"
    if route_prefix != "/" and route_prefix.endswith("/"):
        return f"--route-prefix must not end with '/' (but for '/' itself), got {route_prefix!r}"
    if "{" in route_prefix or "}" in route_prefix:
        return f"--route-prefix cannot hold path parameters ('{{' or '}}'), got {route_prefix!r}"
    if "?" in route_prefix or "#" in route_prefix:  # a request's path never holds them: nothing would match
        return f"--route-prefix is a path: it cannot hold '?' or '#', got {route_prefix!r}"
    return None


CLUSTER_ONLY = ("router", "replica_cpus", "replica_gpus", "app_name", "route_prefix")
# Ray Serve's proxy holds a cluster's connections: these settings of our own protocol have
# nothing to act on there.
SINGLE_SERVER_ONLY = ("head_timeout_s", "max_connections_per_client", "max_connections", "refusals_per_s")
HOST_TIER_POLICY = ("host_write_policy", "host_offload_min_priority")


def _ignored_here(args: argparse.Namespace) -> str | None:
    """A flag given (not at its default) where it would have no effect: refused rather than
    silently dropped, naming what it needs."""
    given = [dest for dest, (_, default) in args.flag_defaults.items() if getattr(args, dest) != default]

    def named(dests: tuple[str, ...]) -> str | None:
        flags = [args.flag_defaults[dest][0] for dest in given if dest in dests]
        return " and ".join(flags) or None

    in_cluster = args.replicas is not None or args.ray_address is not None
    if not in_cluster and (flags := named(CLUSTER_ONLY)):
        return f"{flags}: only for a cluster (give --replicas N or --ray-address)"
    if in_cluster and (flags := named(SINGLE_SERVER_ONLY)):
        return (f"{flags}: only for the single server; on a cluster Ray Serve's proxy holds the "
                "connections (its keep-alive is --keep-alive-timeout-s)")
    if not (args.host_kv_memory_gb or args.host_num_pages) and (flags := named(HOST_TIER_POLICY)):
        return f"{flags}: no host tier to apply to (give --host-tier-memory-gb or --host-tier-pages)"
    return None


def app_options(args: argparse.Namespace) -> dict[str, object]:
    """create_app's keyword arguments from `radixserve serve`'s flags, but for the model name
    and the keys: the single server's and a cluster's ingress's alike."""
    return {"expose_cache_tokens": args.expose_cache_tokens, "cache_event_buffer": args.cache_event_buffer,
            "cache_events_idle_timeout_s": args.cache_events_idle_timeout_s,
            "turn_memory_tokens": args.turn_memory_tokens, "body_timeout_s": args.body_timeout_s,
            "tool_call_parser": args.tool_call_parser, "max_request_tokens": args.max_request_tokens,
            "tenant_starts": args.tenant_starts, "allowed_hosts": host_names(args.host, args.allowed_hosts)}


def cache_hash_secret(args: argparse.Namespace) -> str | None:
    """The secret the engine (every replica of a cluster) keys published page hashes with:
    --cache-hash-secret, else a random one; None with --public-cache-hashes."""
    if args.public_cache_hashes:
        return None
    return args.cache_hash_secret or secrets.token_hex(32)


def _load_tenant_keys(args: argparse.Namespace) -> bool:
    """Sets `args.tenant_keys`; False (said why) when the keys file or variable is malformed,
    or a key is empty or given twice for different callers."""
    from radixserve.server.tenancy import ApiKeys

    try:
        args.tenant_keys = tenant_keys(args)
        ApiKeys.of(api_key=args.api_key, admin_api_key=args.admin_api_key, tenant_keys=args.tenant_keys)
    except (OSError, ValueError) as exc:
        say(f"error: API keys: {exc}")
        return False
    return True


def tenant_keys(args: argparse.Namespace) -> dict[str, Any]:
    """The tenant keys of --api-keys-file and $RADIXSERVE_API_KEYS (tenancy.py's format)."""
    from radixserve.server.tenancy import load_keys

    return load_keys(args.api_keys_file, dict(os.environ))


class BoundedServer(uvicorn.Server):
    """uvicorn's Server whose shutdown cannot hang: after the first SIGINT/SIGTERM it exits
    with status 1 once `shutdown_timeout_s` have passed, and at once on a second signal.
    Requests still running shortly before the grace (GRACEFUL_SHUTDOWN_S) runs out are
    ended by `end_requests` (the app's), so that they answer with an error instead of
    being cancelled."""

    def __init__(self, config: uvicorn.Config, *, shutdown_timeout_s: float,
                 end_requests: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.end_requests = end_requests

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn cancels the requests still running when its grace is over: a stream then
        # stopped without its last event or [DONE], and the log showed a CancelledError
        # traceback per request. Ended by the engine a little before, each answers a 503
        # (an error event and [DONE], in a stream) and returns by itself.
        ending = None
        if self.end_requests is not None:
            ending = asyncio.get_running_loop().call_later(GRACEFUL_SHUTDOWN_S - END_REQUESTS_BEFORE_S,
                                                           self.end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            if ending is not None:
                ending.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            say(f"second {signal.Signals(sig).name}: exiting now")
            _exit_now(1)
        super().handle_exit(sig, frame)
        deadline = threading.Timer(self.shutdown_timeout_s, _shutdown_overdue, args=(self.shutdown_timeout_s,))
        deadline.daemon = True
        deadline.start()


def _shutdown_overdue(timeout_s: float) -> None:
    say(f"shutdown took longer than {timeout_s:g} s (is a step stuck?); exiting now")
    _exit_now(1)


def _exit_now(status: int) -> None:
    """Ends the process without waiting for any thread (a stuck engine thread included),
    killing its tensor-parallel workers first: os._exit runs no close() and no atexit, and a
    hung rank (with the fork server) outlived the server."""
    processes = sys.modules.get("radixserve.parallel.processes")  # not imported: no workers
    if processes is not None:
        processes.kill_all()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _cap(cap: int) -> str:
    return f"{cap:,}" if cap else "any number"


def _as_flags(message: str) -> str:
    """An Engine error names its argument ("num_pages: ..."); the command line knows it as a
    flag ("--num-pages: ...")."""
    name, colon, rest = message.partition(": ")
    flag = _ENGINE_FLAGS.get(name)
    return f"{flag}: {rest}" if colon and flag else message


_ENGINE_FLAGS = {"num_pages": "--num-pages", "kv_memory_gb": "--kv-memory-gb", "device": "--device",
                 "page_size": "--page-size", "dtype": "--dtype", "max_running": "--max-running",
                 "max_batch_tokens": "--max-batch-tokens",
                 "mixed_prefill_tokens": "--mixed-prefill-tokens", "tenant_step_rows": "--tenant-step-rows",
                 "short_prompt_tokens": "--short-prompt-tokens",
                 "grammar_paced_share": "--grammar-paced-share",
                 "host_num_pages": "--host-tier-pages",
                 "host_kv_memory_gb": "--host-tier-memory-gb", "host_write_policy": "--host-tier-write-policy",
                 "host_offload_min_priority": "--host-tier-min-priority",
                 "generation_config": "--generation-config"}


def _first_line(error: BaseException) -> str:
    """An error's message on one line (torch's allocation errors run over several)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def say(message: str) -> None:
    print(f"radixserve: {message}", file=sys.stderr, flush=True)


def _format_bytes(num_bytes: float) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
