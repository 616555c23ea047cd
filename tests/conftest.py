"""Shared fixtures: tiny random checkpoints of every supported architecture.

Nothing heavy is imported at the top: pytest's controlling process (under -n, one that runs no
test) reads this file too, and would otherwise spend seconds importing torch and transformers
before it starts the workers."""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime (which reads this once), here and in every server or
# worker process a test starts: under the README's `-n 2` each of two workers has a thread
# pool as wide as the machine, and an idle pool's threads spin, waiting for the next parallel
# region, on the core the other worker computes on (a fifth of the CPU time of the
# compute-heavy tests, measured side by side). A passive wait sleeps instead. Timing is not
# what the tests check; a value already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.shared_loads import SharedLoads


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> directory of a saved tiny random model (config, safetensors, tokenizer)
    for each of model_helpers.TINY_MODEL_NAMES (llama, llama3_rope, llama_tied_bias,
    mistral, qwen2, qwen3)."""
    from tests.model_helpers import TINY_MODEL_NAMES, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {name: write_tiny_checkpoint(name, root / name) for name in TINY_MODEL_NAMES}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoints: dict[str, Path]) -> Path:
    """Directory of the plain tiny Llama checkpoint (the usual engine-test model)."""
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def real_model_loads() -> SharedLoads:
    """The session's one load of the real model ("smollm2"), shared by the real-model modules'
    engines (tests/shared_loads.py); a module opens `real_model_loads.patched()` around its tests."""
    from tests.shared_loads import SharedLoads

    return SharedLoads(frozenset({"smollm2"}))


@pytest.fixture(scope="module")
def shared_real_model(real_model_loads: SharedLoads) -> Iterator[None]:
    """For a module's `pytestmark = pytest.mark.usefixtures("shared_real_model")`: while its
    tests and fixtures run, every Engine(model="smollm2") reuses the session's one load."""
    with real_model_loads.patched():
        yield


class _SessionCluster:
    """The session's Ray cluster, stopped right after the last test that uses it rather than at
    the session's end: idle, its processes (replicas reporting their stats, Ray's own daemons)
    would keep taking CPU from every later test."""

    def __init__(self) -> None:
        self._running: Iterator[SimpleNamespace] | None = None
        self.last_user: pytest.Item | None = None

    def start(self) -> SimpleNamespace:
        from cluster_util import start_cluster

        self._running = start_cluster()
        return next(self._running)

    def stop(self) -> None:
        """Stops the cluster's command and checks that it stopped cleanly (start_cluster's
        `finally`: a failed check is an error in the last user's teardown); again, it does
        nothing."""
        running, self._running = self._running, None
        if running is not None:
            running.close()


_CLUSTER = _SessionCluster()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[SimpleNamespace]:
    """A local Ray cluster serving 2 demo-model replicas behind the OpenAI API, started by
    `radixserve serve --replicas 2` (cluster_util)."""
    try:
        yield _CLUSTER.start()
    finally:
        _CLUSTER.stop()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    users = [item for item in items if "ray_cluster" in getattr(item, "fixturenames", ())]
    _CLUSTER.last_user = users[-1] if users else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if item is _CLUSTER.last_user:
        _CLUSTER.stop()


def pytest_itemcollected(item: pytest.Item) -> None:
    """Under `-n 2 --dist loadgroup` (the README's command), the tests that must share a worker:
    every test that starts Ray, one after another in collection order (one cluster at a time,
    the session's stopped after its last user, as in a serial run), and the real-model modules,
    on their one load of the model. Every other test goes to whichever worker is free."""
    if not getattr(item.config.option, "loadgroup", False):  # what xdist sets in its workers
        return
    fixtures = getattr(item, "fixturenames", ())
    if item.get_closest_marker("cluster") or "ray_cluster" in fixtures:
        item.add_marker(pytest.mark.xdist_group("ray"))
    elif "shared_real_model" in fixtures:
        item.add_marker(pytest.mark.xdist_group("real_model"))
