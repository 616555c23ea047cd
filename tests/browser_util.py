"""Headless Chromium for the dashboard tests: Debian's `chromium`, driven by Playwright.

Playwright cannot download its own browser here, so it drives the system one through
`executable_path` (.ci/run installs it with apt-get). In CI (the CI variable set) a missing
browser or Playwright fails the tests; elsewhere they are skipped with the command to install.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL_HINT = "apt-get update && apt-get install -y chromium && pip install -e '.[test]'"


def _missing(what: str) -> None:
    message = f"{what} is missing; the dashboard tests need it ({INSTALL_HINT})"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def chromium_path() -> str:
    """The Chromium binary: $RADIXSERVE_CHROMIUM, else `chromium` on the PATH."""
    path = os.environ.get("RADIXSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path or not os.access(path, os.X_OK):
        _missing("Debian's chromium")
    return path


@contextmanager
def headless_chromium() -> Iterator[Any]:
    """A Playwright Browser on the system Chromium, with a fresh profile directory."""
    try:
        from playwright.sync_api import sync_playwright
    except ModuleNotFoundError:
        _missing("the playwright Python package")
    executable = chromium_path()
    with tempfile.TemporaryDirectory(prefix="radixserve-chromium-") as profile:
        with sync_playwright() as playwright:
            # A persistent context is how Playwright takes a --user-data-dir of our choosing.
            context = playwright.chromium.launch_persistent_context(
                profile, executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
                viewport={"width": 1400, "height": 1000})
            try:
                yield context
            finally:
                context.close()


def wait_until(page: Any, predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Polls `predicate` (which may evaluate in the page) until it holds, or fails naming `what`.

    A correctness wait, not a timing assertion: the generous bound only turns a hang into a
    clear failure.
    """
    deadline_ms = timeout_s * 1000
    waited = 0
    while not predicate():
        if waited >= deadline_ms:
            state = page.evaluate("() => ({errors: radixDashboard.errors, lastError: radixDashboard.lastError})")
            raise AssertionError(f"timed out waiting for {what}; dashboard state: {state}")
        page.wait_for_timeout(50)
        waited += 50
