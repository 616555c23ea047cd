"""Shared fixtures: tiny random checkpoints of every supported architecture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.model_helpers import TINY_MODEL_NAMES, write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> directory of a saved tiny random model (config, safetensors, tokenizer)
    for each of model_helpers.TINY_MODEL_NAMES (llama, llama3_rope, llama_tied_bias,
    mistral, qwen2, qwen3)."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {name: write_tiny_checkpoint(name, root / name) for name in TINY_MODEL_NAMES}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoints: dict[str, Path]) -> Path:
    """Directory of the plain tiny Llama checkpoint (the usual engine-test model)."""
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[SimpleNamespace]:
    """A local Ray cluster serving 2 demo-model replicas behind the OpenAI API (cluster_util)."""
    from cluster_util import start_cluster

    yield from start_cluster()
