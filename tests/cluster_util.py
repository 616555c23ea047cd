"""A real local Ray cluster serving 2 demo-model replicas, started once per test session
by `radixserve serve --replicas 2`, the command an operator runs.

Ray tests are marked `cluster`. Without Ray they skip — except under CI (CI=true), where
.ci/run installs the cluster extra and a missing Ray is an error, not a skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from radixserve.ports import free_port

REPLICAS = 2
NUM_PAGES = 512      # per replica; as tests/test_server.py's single engine
PAGE_SIZE = 16
REPLICA_CPUS = 0.5   # Ray CPUs: a local Ray has one per core, and a second app (tests/test_cluster_health.py's
# stalled one, test_tensor_parallel_serve.py's TP group) must fit beside the session's on two
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
    """Starts the session's cluster as an operator does: `radixserve serve --replicas 2` (a
    local Ray), run as a careless parent leaves it (tests/stop_util.py). Once it serves, the
    driver must catch both stop signals; this process then joins its Ray (Serve's API, actor
    handles) and yields its URL, port, Ray address, stats and the app's handle. At the end it
    leaves Ray and stops the command with SIGTERM while a long stream runs, checking a clean
    stop: status 0, every Ray process the command started gone, and the stream ended as the
    single server ends it (stream_across_the_stop)."""
    require_ray()
    import ray
    from ray import serve

    from radixserve.cluster.deploy import APP_NAME
    from tests.stop_util import (
        EXIT_GUARD_S,
        STOP_SIGNALS,
        health_status,
        kill_tree,
        start_hardened,
        stop_signal_dispositions,
        stops_cleanly,
    )

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    descriptor, name = tempfile.mkstemp(prefix="radixserve-session-cluster-", suffix=".log")
    os.close(descriptor)
    log = Path(name)
    process = start_hardened(
        [sys.executable, "-m", "radixserve", "serve", "--replicas", str(REPLICAS), "--port", str(port),
         "--model", "demo", "--page-size", str(PAGE_SIZE), "--num-pages", str(NUM_PAGES),
         "--replica-cpus", str(REPLICA_CPUS), "--max-request-tokens", str(CLUSTER_MAX_REQUEST_TOKENS),
         "--keep-alive-timeout-s", str(CLUSTER_KEEP_ALIVE_S), "--shutdown-timeout-s", str(EXIT_GUARD_S / 2)],
        log=log)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while health_status(url) != 200:
            assert process.poll() is None, f"serve --replicas ended: {log.read_text()}"
            assert time.monotonic() < deadline, f"serve --replicas did not serve: {log.read_text()}"
            time.sleep(0.2)
        wait_for_replicas(url, REPLICAS)
        while "radixserve: serving at" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        # The replicas' device sets the ingress's --tenant-starts default, as a single server's
        # (ReplicaInfo carries it: a CPU cluster had no limit).
        import torch

        starts = ": any number" if torch.cuda.is_available() else " (body to first token): 4, shared"
        assert f"radixserve: requests starting at once{starts}" in log.read_text(), log.read_text()
        dispositions = stop_signal_dispositions(process.pid)
        assert dispositions == {"blocked": set(), "ignored": set(), "caught": STOP_SIGNALS}, dispositions
        reported = re.search(r"local Ray at (\S+)\)", log.read_text())
        assert reported, f"serve --replicas did not say its Ray's address: {log.read_text()}"
        # "auto", as the docs say for a second app on the same machine: only a local cluster found
        # that way lends the joining process its token (Ray's token auth; an explicit address
        # would need RAY_AUTH_MODE=token). It is the Ray started last here: the command's, checked.
        # Apps deployed from this process run the source the command serves, as its own do.
        ray.init(address="auto", log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
        address = ray.get_runtime_context().gcs_address
        assert address == reported.group(1), (address, reported.group(1))
    except BaseException:
        kill_tree(process)
        raise
    try:
        yield SimpleNamespace(url=url, port=port, address=address,
                              stats=lambda: replicas_report(url)["total"], app=serve.get_app_handle(APP_NAME))
    finally:
        ray.shutdown()  # this process's connection only: the cluster is the command's
        with stream_across_the_stop(url):
            stops_cleanly(process, signal.SIGTERM, log)
        log.unlink()


@contextlib.contextmanager
def stream_across_the_stop(url: str) -> Iterator[None]:
    """A long stream runs while the body stops the server. As the single server's, it gets
    the grace and then ends with the "shutting down" error event (or by itself within the
    grace), and [DONE] either way: the cluster's stop cut it 0.2 s after the signal, mid-body.
    Beside it, short requests arrive all along: served until the stop began, then refused
    unread (503 server_shutting_down, "takes no new requests"), never served again (Serve's
    proxy took them during the grace; they were started, and ended with the stream)."""
    lines: list[str] = []
    failure: list[BaseException] = []
    streaming = threading.Event()
    arrivals: list[str] = []  # each short request's outcome, in order
    stop_arriving = threading.Event()
    first_arrival = threading.Event()  # one short request answered before the stop

    def read() -> None:
        body = {"model": "demo", "prompt": "a long answer", "max_tokens": 3500, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        streaming.set()
        except BaseException as exc:
            failure.append(exc)
        finally:
            streaming.set()

    def arrive() -> None:
        body = {"model": "demo", "prompt": "short", "max_tokens": 1}
        with httpx.Client(timeout=60) as client:
            while not stop_arriving.is_set():
                try:
                    answer = client.post(f"{url}/v1/completions", json=body)
                except httpx.TransportError:
                    arrivals.append("gone")  # the proxy stopped
                    first_arrival.set()
                    return
                try:
                    error = answer.json().get("error", {}) if answer.status_code != 200 else {}
                except ValueError:  # not ours: Serve's proxy answering for a deleted app
                    error = {}
                refused = answer.status_code == 503 and "takes no new requests" in error.get("message", "")
                arrivals.append("served" if answer.status_code == 200 else "refused" if refused
                                else f"{answer.status_code} {error.get('code')}")
                first_arrival.set()
                stop_arriving.wait(0.2)  # a pace (the grace is 4 s), not a wait for anything

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert streaming.wait(60) and not failure, failure
    arriving = threading.Thread(target=arrive, daemon=True)
    arriving.start()
    assert first_arrival.wait(60), arrivals
    try:
        yield
    finally:
        stop_arriving.set()
        arriving.join(60)
    reader.join(60)
    assert not reader.is_alive() and not failure, (failure, lines[-3:])
    assert lines[-1] == "data: [DONE]", lines[-3:]
    finished = json.loads(lines[-2].removeprefix("data: "))
    if "error" in finished:
        assert finished["error"]["code"] == "server_shutting_down", finished
        assert "refused" in arrivals, arrivals  # the grace ran its 4 s: new requests came meanwhile
    else:
        assert finished["choices"][0]["finish_reason"] == "length", finished
    assert arrivals and arrivals[0] == "served", arrivals
    first_refused = arrivals.index("refused") if "refused" in arrivals else len(arrivals)
    assert set(arrivals[:first_refused]) == {"served"}, arrivals
    assert "served" not in arrivals[first_refused:], arrivals
