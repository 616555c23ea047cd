"""A `radixserve serve` process for the benchmarks that compare settings, each on a fresh
server (imported by the scripts beside it: `python bench/<script>.py` puts bench/ on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx


def start_server(flags: list[str], port: int, env: dict[str, str] | None = None,
                 timeout_s: float = 180.0) -> subprocess.Popen:
    """`radixserve serve --port PORT FLAGS...`, once its /health answers (its output dropped)."""
    process = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--port", str(port), *flags],
                               env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not start")
