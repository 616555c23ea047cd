"""`serve --replicas` stops on SIGINT or SIGTERM whatever its parent did to the signals.

Every process here starts as a careless parent leaves it (tests/stop_util.py: SIGINT
ignored, SIGINT and SIGTERM blocked); the Ray driver used to wait forever then. The Ray test
(marked `cluster`) serves one demo replica and stops it with SIGINT, the signal a background
job ignores; SIGTERM on a Ray replica is tests/test_tensor_parallel_serve.py's (one Ray start
each: they are the suite's slowest tests). The others drive radixserve.cluster.stop_signals
without Ray, for both signals: a teardown that hangs ends at its deadline or at the next
signal.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from cluster_util import STARTUP_TIMEOUT_S, require_ray

from tests.server_util import wait_for
from tests.stop_util import (
    EXIT_GUARD_S,
    health_status,
    kill_tree,
    start_hardened,
    stops_cleanly,
)
from tests.test_server_cli import free_port


@pytest.mark.cluster
@pytest.mark.timeout(900)  # a Ray start on a loaded machine
def test_replicas_stop_cleanly_on_a_sigint_the_parent_ignored_and_blocked() -> None:
    require_ray()
    port = free_port()
    # A stop deadline well inside the exit guard: a slow teardown on a loaded machine is not
    # the failure looked for here, a driver that never notices the signal is.
    process = start_hardened(
        [sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--model", "demo",
         "--replicas", "1", "--num-pages", "32", "--shutdown-timeout-s", str(EXIT_GUARD_S / 2)])
    try:
        assert wait_for(lambda: health_status(f"http://127.0.0.1:{port}") == 200, STARTUP_TIMEOUT_S)
    except BaseException:
        kill_tree(process)
        raise
    stops_cleanly(process, signal.SIGINT)


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
