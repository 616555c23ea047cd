"""`serve --replicas` stops on SIGINT or SIGTERM whatever its parent did to the signals.

A non-interactive shell starts a background job with SIGINT ignored, and a parent may start
a process with signals blocked (the mask survives exec); the Ray driver used to wait forever
then. Every process here starts that way: SIGINT ignored, SIGINT and SIGTERM blocked.
The Ray test (marked `cluster`) serves one demo replica and checks a clean stop: status 0,
`stopped` said, every process the driver started gone. The others drive
radixserve.cluster.stop_signals without Ray: a teardown that hangs ends at its deadline or at
the next signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from cluster_util import require_ray

from tests.server_util import wait_for
from tests.test_server_cli import REPO_ROOT, free_port
from tests.test_tensor_parallel_serve import EXIT_GUARD_S, STARTUP_TIMEOUT_S, health_status

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def as_a_careless_parent_leaves_it() -> None:
    """Popen's preexec_fn: what a background job of a non-interactive shell gets (SIGINT
    ignored), and worse (both stop signals blocked)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def start_hardened(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            preexec_fn=as_a_careless_parent_leaves_it)


def kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.cluster
@pytest.mark.timeout(900)  # a Ray start on a loaded machine
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_replicas_stop_cleanly_on_a_signal_the_parent_ignored_or_blocked(sig: signal.Signals) -> None:
    require_ray()
    port = free_port()
    # A stop deadline well inside the exit guard: a slow teardown on a loaded machine is not
    # the failure looked for here, a driver that never notices the signal is.
    process = start_hardened(
        [sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--model", "demo",
         "--replicas", "1", "--num-pages", "32", "--shutdown-timeout-s", str(EXIT_GUARD_S / 2)])
    started: list[psutil.Process] = []
    try:
        assert wait_for(lambda: health_status(f"http://127.0.0.1:{port}") == 200, STARTUP_TIMEOUT_S)
        started = psutil.Process(process.pid).children(recursive=True)  # Ray's daemons and workers
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=EXIT_GUARD_S)
        assert process.returncode == 0, stderr
        assert "radixserve: stopping ..." in stderr and "radixserve: stopped" in stderr
        _, alive = psutil.wait_procs(started, timeout=EXIT_GUARD_S)
        assert not alive, [p.pid for p in alive]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        kill_all(started)


HUNG_TEARDOWN = textwrap.dedent("""
    import sys, threading
    from radixserve.cluster.stop_signals import StopRequested, StopSignals

    stop = StopSignals(shutdown_timeout_s=float(sys.argv[1]))
    try:
        stop.install()
        print("waiting", flush=True)
        stop.wait()
    except StopRequested as request:
        print(f"stopping on {request}", flush=True)
    stop.begin_teardown()
    threading.Event().wait()  # a teardown that never ends
""")


def start_hung_teardown(shutdown_timeout_s: float) -> subprocess.Popen[str]:
    process = start_hardened([sys.executable, "-c", HUNG_TEARDOWN, str(shutdown_timeout_s)])
    assert process.stdout is not None
    assert process.stdout.readline() == "waiting\n"
    return process


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_hung_teardown_ends_at_the_deadline(sig: signal.Signals) -> None:
    process = start_hung_teardown(shutdown_timeout_s=1.0)
    try:
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=EXIT_GUARD_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1
    assert stdout == f"stopping on {sig.name}\n"
    assert "stopping took longer than 1 s (Serve or Ray did not answer); exiting now" in stderr


def test_a_signal_during_the_teardown_exits_at_once() -> None:
    process = start_hung_teardown(shutdown_timeout_s=3600.0)  # the deadline plays no part
    try:
        assert process.stdout is not None
        process.send_signal(signal.SIGINT)
        assert process.stdout.readline() == "stopping on SIGINT\n"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=EXIT_GUARD_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1
    assert "radixserve: SIGTERM while stopping: exiting now" in stderr
