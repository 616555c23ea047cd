"""`serve --replicas` stops on SIGINT or SIGTERM whatever its parent did to the signals.

Every process here starts as a careless parent leaves it (tests/stop_util.py: SIGINT
ignored, SIGINT and SIGTERM blocked); the Ray driver used to wait forever then. These tests
drive radixserve.cluster.stop_signals without Ray, for both signals: the first signal stops,
a teardown that hangs ends at its deadline or at the next signal. On Ray (one start, the
suite's slowest test), tests/test_tensor_parallel_serve.py checks from the kernel's masks
that the serving driver still catches both signals and blocks and ignores neither, and
stops it with SIGTERM, the signal ray.init takes over.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.stop_util import (
    EXIT_GUARD_S,
    start_hardened,
)


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
    assert process.stdout is not None and process.stderr is not None
    first = process.stdout.readline()
    if first != "waiting\n":  # (seen once in a full run: say why it ended)
        process.kill()
        raise AssertionError(f"{first!r}; status {process.wait(30)}; stderr: {process.stderr.read()[-2000:]}")
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
