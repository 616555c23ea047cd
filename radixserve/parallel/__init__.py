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
"""

from radixserve.parallel.group import Rendezvous, TensorParallelGroup
from radixserve.parallel.launch import TensorParallel
from radixserve.parallel.runner import TensorParallelFault, TensorParallelRunner

__all__ = ["Rendezvous", "TensorParallel", "TensorParallelFault", "TensorParallelGroup", "TensorParallelRunner"]
