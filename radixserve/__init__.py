"""radixserve: an LLM serving runtime with a radix-tree prefix cache over paged KV memory.

    from radixserve import Engine, SamplingParams
    engine = Engine(model="demo")
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

Names are imported on first use, so `radixserve.cache` (and the simulator) load without
torch models or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "radixserve.engine.engine",
    "AsyncEngine": "radixserve.engine.async_engine",
    "SamplingParams": "radixserve.engine.params",
    "RequestOutput": "radixserve.engine.params",
    "StreamDelta": "radixserve.engine.params",
    "TokenLogprob": "radixserve.engine.params",
    "QueueFull": "radixserve.engine.params",
    "PromptTooLong": "radixserve.engine.params",
    "Retention": "radixserve.cache.radix",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
