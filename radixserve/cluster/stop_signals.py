"""How the `serve --replicas` driver is stopped: SIGINT or SIGTERM, whatever its parent did to them.

The driver only waits while Ray Serve runs the app, so nothing but these signals ends it. Two
things a parent passes on would leave it waiting for good: a non-interactive shell starts a
background job with SIGINT *ignored* (Python then installs no KeyboardInterrupt handler), and
a parent may start it with SIGINT or SIGTERM *blocked* (the mask survives exec: the signal
stays pending). `StopSignals.install` sets its own handler for both and unblocks them in the
main thread. Install before Ray starts (a signal during the minutes of deployment stops it
too) and again after: `ray.init`'s core worker replaces the SIGTERM handler with its crash
reporter, which kills the process without tearing the app down.

The first signal raises `StopRequested` in the main thread wherever it waits, and arms a
deadline: if the teardown that follows takes longer than `shutdown_timeout_s` (a hung Serve
controller, an unreachable GCS), the process exits with status 1. A signal during the
teardown exits at once (status 1), as a second Ctrl-C does in the single-process server
(cli_serve.BoundedServer). Ray's local head processes die with the driver (Ray starts them
fate-shared), so an exit without the teardown leaves no cluster behind.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from radixserve.cli_serve import _exit_now, say

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


class StopRequested(BaseException):
    """Raised in the main thread by the first SIGINT/SIGTERM. A BaseException, like
    KeyboardInterrupt, so that a handler of a failed deployment's Exception lets it through."""


class StopSignals:
    """The driver's SIGINT/SIGTERM handling: stop on the first, with a deadline; exit on the next."""

    def __init__(self, shutdown_timeout_s: float) -> None:
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stopping = False  # a signal came, or the teardown began: the next signal exits at once

    def install(self) -> None:
        """Handles both signals from now on, and unblocks them; call from the main thread."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def wait(self) -> None:
        """Blocks until a stop signal raises StopRequested."""
        threading.Event().wait()

    def begin_teardown(self) -> None:
        """From now on a signal does not interrupt: the teardown is under way, so it exits at once."""
        self.stopping = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            try:  # the handler may interrupt a print of the main thread: reentrant, it can raise
                say(f"{name} while stopping: exiting now")
            finally:
                _exit_now(1)
        self.stopping = True
        deadline = threading.Timer(self.shutdown_timeout_s, self._overdue)
        deadline.daemon = True
        deadline.start()
        raise StopRequested(name)

    def _overdue(self) -> None:
        say(f"stopping took longer than {self.shutdown_timeout_s:g} s (Serve or Ray did not answer); exiting now")
        _exit_now(1)
