"""Starting `radixserve serve` as a careless parent would, and checking that it stops cleanly.

A non-interactive shell starts a background job with SIGINT ignored, and a parent may start
a process with signals blocked (the mask survives exec); the Ray driver used to wait forever
then. `start_hardened` starts a process that way (SIGINT ignored, SIGINT and SIGTERM
blocked); `stops_cleanly` signals it and checks a clean stop: status 0, `stopped` said,
every process it had started gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import psutil

from tests.test_server_cli import REPO_ROOT

EXIT_GUARD_S = 120.0  # generous: turns a hang into a failure
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def health_status(url: str) -> int | None:
    """GET /health's status, or None while it does not answer (a server still starting)."""
    try:
        return httpx.get(f"{url}/health", timeout=30).status_code
    except httpx.HTTPError:
        return None


def as_a_careless_parent_leaves_it() -> None:
    """Popen's preexec_fn: what a background job of a non-interactive shell gets (SIGINT
    ignored), and worse (both stop signals blocked)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def start_hardened(command: list[str], log: Path | None = None) -> subprocess.Popen[str]:
    """`command` in the repository, started as a careless parent leaves it. Its output is
    piped, or written to `log`, for a process that outlives the test that started it: nobody
    reads a pipe meanwhile, and a full one would stop the process at its next line."""
    output = subprocess.PIPE if log is None else log.open("w")
    try:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.PIPE if log is None else subprocess.STDOUT,
                                text=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                preexec_fn=as_a_careless_parent_leaves_it)  # noqa: PLW1509 (the point)
    finally:
        if log is not None:
            output.close()  # the child holds its own copy


def stop_signal_dispositions(pid: int) -> dict[str, set[signal.Signals]]:
    """Which stop signals process `pid` (its main thread) has blocked, ignored and caught, from
    the kernel's own masks (/proc/PID/status: SigBlk, SigIgn, SigCgt; bit n-1 is signal n)."""
    masks = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("SigBlk", "SigIgn", "SigCgt"):
            mask = int(value, 16)
            masks[name] = {sig for sig in STOP_SIGNALS if mask >> (sig - 1) & 1}
    return {"blocked": masks["SigBlk"], "ignored": masks["SigIgn"], "caught": masks["SigCgt"]}


def kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def kill_tree(process: subprocess.Popen[str]) -> None:
    """Kills `process` and everything it started (a server that never came up)."""
    try:
        started = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        started = []
    if process.poll() is None:
        process.kill()
    process.communicate()
    kill_all(started)


def stops_cleanly(process: subprocess.Popen[str], sig: signal.Signals, log: Path | None = None) -> None:
    """Sends `sig` to a running `serve` and asserts a clean stop: status 0, both stop
    messages (on its stderr, or in the `log` it was started with), and every process it had
    started (Ray's daemons and workers, TP ranks) gone within EXIT_GUARD_S. Whatever is left
    is killed, pass or fail."""
    started = psutil.Process(process.pid).children(recursive=True)
    try:
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=EXIT_GUARD_S)
        if log is not None:
            stderr = log.read_text()
        assert process.returncode == 0, stderr
        assert "radixserve: stopping ..." in stderr and "radixserve: stopped" in stderr
        _, alive = psutil.wait_procs(started, timeout=EXIT_GUARD_S)
        assert not alive, [p.pid for p in alive]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        kill_all(started)
