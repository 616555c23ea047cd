"""One load of a slow-to-load model per test session, shared by every Engine the tests build.

Reading the real SmolLM2 GGUF (its 49k-token vocabulary parsed field by field, every tensor
dequantized) takes seconds each time; the real-model tests build several engines of it (pools
of other page sizes and sizes, a server's). The weights are read-only once loaded and the
model keeps no state between forwards, so engines built one after another can share one
LoadedModel: each still has its own pool, tree and scheduler. The loader itself is still run
(once) and checked by what the tests assert about `engine.loaded`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import radixserve.engine.engine as engine_module
from radixserve.models.loader import LoadedModel

LoadKey = tuple[str, str | torch.dtype | None, str | None]


class SharedLoads:
    """LoadedModels by (model, dtype, device), for the models named at construction only."""

    def __init__(self, models: frozenset[str]) -> None:
        self.models = models
        self.loaded: dict[LoadKey, LoadedModel] = {}
        self.loads = 0  # how many times the real loader ran (the tests' own check of the sharing)

    @contextmanager
    def patched(self) -> Iterator[None]:
        """While open, Engine(model=...) of one of `models` reuses the first load of it."""
        original = engine_module.load_model

        def load(model: str = "demo", *, dtype: str | torch.dtype | None = None,
                 device: str | None = None) -> LoadedModel:
            if model not in self.models:
                return original(model, dtype=dtype, device=device)
            key = (model, dtype, device)
            if key not in self.loaded:
                self.loads += 1
                self.loaded[key] = original(model, dtype=dtype, device=device)
            return self.loaded[key]

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(engine_module, "load_model", load)
            yield
