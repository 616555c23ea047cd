"""Tensor parallelism over torch.distributed: one model split over N ranks.

Rank 0 is the engine's process: server, scheduler, radix tree and sampler, as without
parallelism. Each step its runner sends a compact plan (plan.py) to ranks 1..N-1, and every
rank runs its shard of the model (sharding.py) over its own KV pool, whose pages have the
same ids on every rank. See ARCHITECTURE.md, "Tensor parallelism".

- group.py: ranks, rendezvous (torchrun's variables), collectives
- layers.py, sharding.py, loading.py: the sharded model and reading only a rank's slices
- plan.py, executor.py, recording.py: what a step sends and how every rank runs it
- runner.py: rank 0's runner (the seam under the engine); worker.py: ranks >= 1
- launch.py, processes.py: starting and ending the group

Names are imported on first use (as radixserve's own): the fork server's preload imports
`radixserve.parallel.forkserver_env` first, and its settings (signals, BLAS threads) must come
before torch and numpy load, which an eager package import did first.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Rendezvous": "radixserve.parallel.group",
    "TensorParallelGroup": "radixserve.parallel.group",
    "TensorParallel": "radixserve.parallel.launch",
    "TensorParallelFault": "radixserve.parallel.runner",
    "TensorParallelRunner": "radixserve.parallel.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'radixserve.parallel' has no attribute {name!r}")
