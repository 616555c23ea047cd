"""`serve --replicas`' driver (radixserve/cluster/cli.py) in this process, Ray replaced by fakes:
what it hands the deployment, what it refuses before Ray starts, how it reads a failed
deployment, and a stop signal that reaches it inside one of Ray's C calls. No Ray starts here
(tests/test_cluster.py and cluster_util.py run the real one)."""

from __future__ import annotations

import contextlib
import io
import signal
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from cluster_util import require_ray

from radixserve.ports import free_port


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """Ray's start and Serve's deployment replaced: `calls.deploy(options)` (set by the test)
    runs in deploy's place; `calls.started` counts Ray starts. The driver's signal handlers
    are put back afterwards, and this process's Ray (a session cluster's, joined) is left alone."""
    require_ray()
    import ray

    from radixserve.cluster import deploy as deploy_module

    calls = SimpleNamespace(started=0, options=None, deploy=None)

    def start_ray(address: str | None = None, *, num_cpus: int | None = None) -> None:
        calls.started += 1

    def deploy(options: Any, **kwargs: Any) -> None:
        calls.options = options
        assert calls.deploy is not None
        return calls.deploy(options)

    monkeypatch.setattr(deploy_module, "start_ray", start_ray)
    monkeypatch.setattr(deploy_module, "deploy", deploy)
    monkeypatch.setattr(deploy_module, "replica_failure", lambda app="radixserve": None, raising=False)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:1"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield calls
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def serve_replicas(*flags: str) -> tuple[int, str]:
    """`radixserve serve --replicas 1 *flags` in this process: its status and stderr. A stop's
    deadline (os._exit) is put far beyond the test."""
    from radixserve.cli import main

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(["serve", "--replicas", "1", "--port", str(free_port()), "--shutdown-timeout-s", "1e6", *flags])
    return code, stderr.getvalue()


def refused(options: Any) -> None:
    from radixserve.cluster.deploy import DeployRefused

    raise DeployRefused("refused by the test")


def test_each_replica_gets_the_step_delay(fake_ray: SimpleNamespace) -> None:
    """--debug-step-delay-s reaches the replicas (it was accepted and dropped) and slows every
    step there, as the single server's; --debug-stall-engine's hook still stalls."""
    from radixserve.cluster.deploy import engine_deployment

    fake_ray.deploy = refused
    code, stderr = serve_replicas("--debug-step-delay-s", "0.25")
    assert code == 2 and "refused by the test" in stderr, stderr
    assert getattr(fake_ray.options, "debug_step_delay_s", None) == 0.25
    from radixserve.cluster.replica import debug_step_hook

    bound = engine_deployment(fake_ray.options)
    assert bound._bound_deployment.init_args[-1] == 0.25  # EngineReplica(engine_options, threads, async, stall, delay)
    hook = debug_step_hook(False, 0.25)
    assert hook is not None
    started = time.monotonic()
    hook()
    assert time.monotonic() - started >= 0.25
    assert debug_step_hook(False, 0.0) is None
    assert getattr(debug_step_hook(True, 0.25), "__name__", "") == "wait"


def test_a_signal_inside_rays_c_code_during_the_deployment_is_a_stop(fake_ray: SimpleNamespace) -> None:
    """A SIGINT or SIGTERM that lands in a C call of Ray's comes out of it as SystemError ("...
    returned a result with an exception set"), the StopRequested as its context: the driver
    stops (status 0), not "deployment failed" (status 2)."""
    from radixserve.cluster.stop_signals import StopRequested

    def signalled_in_c(options: Any) -> None:
        try:
            signal.raise_signal(signal.SIGTERM)  # the driver's handler raises StopRequested
        except StopRequested as stop:
            raise SystemError("<built-in method __new__ of type object> returned a result with an exception "
                              "set") from stop
        raise AssertionError("the driver's handler did not raise")

    fake_ray.deploy = signalled_in_c
    code, stderr = serve_replicas()
    assert code == 0, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("radixserve: ")]
    assert lines[-2:] == ["radixserve: stopping ...", "radixserve: stopped"], stderr
    assert "deployment failed" not in stderr and "error" not in stderr


@pytest.mark.parametrize("model, says", [
    ("/nonexistent/model", "model not found: '/nonexistent/model' is no checkpoint directory"),
    ("no-such-model", "model not found: 'no-such-model'"),
])
def test_a_model_a_local_cluster_cannot_load_is_refused_before_ray_starts(fake_ray: SimpleNamespace, model: str,
                                                                           says: str) -> None:
    """The single server's message, at once: it came after a minute and more of Serve's
    retries, as "Failed to update the deployments ['EngineReplica']"."""
    fake_ray.deploy = refused
    code, stderr = serve_replicas("--model", model)
    assert code == 2 and fake_ray.started == 0, stderr
    (line,) = stderr.splitlines()
    assert line.startswith(f"radixserve: error: cannot load {model!r}: {says}"), line


def test_a_failed_deployment_says_the_replicas_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's status holds the replica's traceback; its last error line is what is said."""
    require_ray()
    from ray import serve

    from radixserve.cluster import deploy as deploy_module

    message = ("The deployment failed to start 6 times in a row. This may be due to a problem with its constructor "
               "or initial health check failing. See controller logs for details. Error:\n"
               "Traceback (most recent call last):\n  File \"replica.py\", line 1, in __init__\n"
               "ray.exceptions.RayTaskError(JSONDecodeError): ray::ServeReplica:radixserve:EngineReplica "
               "(pid=1)\n  File \"loader.py\", line 2\n"
               "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n")
    status = SimpleNamespace(applications={"radixserve": SimpleNamespace(deployments={
        "OpenAIIngress": SimpleNamespace(message=""), "EngineReplica": SimpleNamespace(message=message)})})
    monkeypatch.setattr(serve, "status", lambda: status)
    assert deploy_module.replica_failure("radixserve") == (
        "EngineReplica could not start: JSONDecodeError: Expecting value: line 1 column 1 (char 0)")
    assert deploy_module.replica_failure("other") is None
    assert deploy_module.last_error_line("Failed to update the deployments ['EngineReplica'].") is None


def test_the_tenant_starts_default_of_cpu_replicas_is_the_single_cpu_servers() -> None:
    """The ingress's default --tenant-starts comes from the replicas' device, which ReplicaInfo
    carries: 4 on CPU replicas, as on a single CPU server (it was no limit)."""
    require_ray()
    import torch

    from radixserve.cluster.replica import EngineReplica
    from radixserve.server.start_shares import DEFAULT_CPU_TENANT_STARTS, default_tenant_starts

    def replica_on(device: str) -> Any:
        engine = SimpleNamespace(model_name="demo", max_context_len=64, max_sequence_len=64, page_size=16,
                                 tokenizer=None, sampling_defaults={}, device=torch.device(device), max_queue=None)
        return SimpleNamespace(engine=engine)

    cluster_engine: Callable[[str], Any] = lambda device: SimpleNamespace(engine=EngineReplica.info(replica_on(device)))
    assert default_tenant_starts(cluster_engine("cpu")) == DEFAULT_CPU_TENANT_STARTS == 4
    assert default_tenant_starts(cluster_engine("meta")) == 0  # (not a CPU: as a GPU's, no limit)


def test_a_ray_address_nobody_answers_at_is_a_one_line_error_before_ray_init(fake_ray: SimpleNamespace) -> None:
    """ray.init retried an unreachable GCS for many minutes (20 tries of 40 s), saying only Ray's
    own C++ warnings, and a Ctrl-C waited for the try under way: the driver now tries a
    connection first, and says what it is doing."""
    import socket

    with socket.socket() as closed:  # a port bound and not listening: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        fake_ray.deploy = refused
        code, stderr = serve_replicas("--ray-address", address)
        assert code == 1 and fake_ray.started == 0, stderr
        assert stderr.splitlines() == [
            f"radixserve: joining the Ray cluster at {address} ...",
            f"radixserve: error: cannot reach the Ray cluster at {address} ({address}: Connection refused); "
            "is it running?"], stderr
        from radixserve.cluster.cli import ray_address_problem

        assert ray_address_problem(f"ray://{address}") is not None
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert ray_address_problem(f"127.0.0.1:{listening.getsockname()[1]}") is None


def test_a_ray_cluster_that_cannot_be_joined_is_a_one_line_error(fake_ray: SimpleNamespace,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.init's ConnectionError (no cluster found for "auto", or none answering at an address
    that takes connections) was a traceback."""
    from radixserve.cluster import deploy as deploy_module

    def no_cluster(address: str | None = None, *, num_cpus: int | None = None) -> None:
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to.")

    monkeypatch.setattr(deploy_module, "start_ray", no_cluster)
    code, stderr = serve_replicas("--ray-address", "auto")
    assert code == 1, stderr
    assert stderr.splitlines()[-1] == ("radixserve: error: cannot join the Ray cluster at auto: Could not find any "
                                       "running Ray instance. Please specify the one to connect to."), stderr
