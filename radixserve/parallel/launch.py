"""Starting a tensor-parallel group from rank 0: start the workers, meet them, load rank 0's
shard; later, hand the engine its runner."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.cache.pool import PagePool
from radixserve.cache.tiers import HostTier
from radixserve.models.loader import LoadedModel, resolve_device
from radixserve.parallel.group import (
    Rendezvous,
    TensorParallelGroup,
    collective_timeout_s,
)
from radixserve.parallel.loading import check_split, load_shard
from radixserve.parallel.processes import WorkerProcesses
from radixserve.parallel.runner import TensorParallelRunner
from radixserve.parallel.worker import WorkerSpec, run_started_worker


def launched_externally() -> bool:
    """Whether torchrun (or a hand launch with its variables) starts the ranks: then rank 0
    spawns no workers and meets them at MASTER_ADDR:MASTER_PORT."""
    return bool(os.environ.get("MASTER_PORT")) and os.environ.get("RANK") is not None


@dataclass
class TensorParallel:
    """Rank 0's handle on its group: the group, the worker processes and rank 0's shard."""

    group: TensorParallelGroup
    workers: WorkerProcesses
    loaded: LoadedModel
    backend: str | None
    threads_before: int  # this process's torch threads before the group took its share

    @classmethod
    def start(cls, model: str, size: int, *, dtype: str | torch.dtype | None, device: str | None,
              backend: str | None, timeout_s: float | None = None) -> TensorParallel:
        """Starts ranks 1..size-1 (unless launched externally), joins them as rank 0 and loads
        rank 0's shard. On the CPU each rank gets an equal share of the cores. `timeout_s`:
        the collective timeout (default: `collective_timeout_s()`)."""
        timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
        if size < 2:
            raise ValueError(f"tensor_parallel_size: must be >= 2 to start a group, got {size}")
        if model == "demo":
            raise ValueError("tensor parallelism needs a checkpoint (a directory or .gguf file), not the demo model")
        torch_device = resolve_device(device)
        if torch_device.index not in (None, 0):  # rank r runs on GPU r: a second rank would share this one
            raise ValueError(f"device: rank r of a tensor-parallel group runs on GPU r; give cuda, not "
                             f"{torch_device} (choose the GPUs with CUDA_VISIBLE_DEVICES)")
        check_split(model, size)  # before any worker starts: one error, not one per rank
        external = launched_externally()
        if external and int(os.environ["RANK"]) != 0:
            raise ValueError("only rank 0 builds the engine; start the other ranks with radixserve.parallel.worker")
        listener = None
        if external:
            rendezvous = Rendezvous.from_env(size)
        else:
            rendezvous, listener = Rendezvous.local(size)
        assert rendezvous is not None
        threads = max(1, (os.cpu_count() or 1) // size) if torch_device.type == "cpu" else None
        spec = WorkerSpec(model, dtype, torch_device.type, backend, rendezvous, timeout_s, threads)
        workers, group = WorkerProcesses(), None
        threads_before = torch.get_num_threads()
        try:
            if not external:
                workers = WorkerProcesses.start(run_started_worker, size, spec, on_cpu=torch_device.type == "cpu")
            if threads is not None:
                torch.set_num_threads(threads)
            group = TensorParallelGroup(rendezvous, 0, torch_device, timeout_s=timeout_s,
                                        peers_failed=workers.first_dead, listener=listener)
            loaded = load_shard(model, group, dtype=dtype, device=torch_device)
        except BaseException:
            workers.stop(grace_s=0.0)
            if group is not None:
                group.close()
            elif listener is not None and listener.fileno() != -1:
                listener.close()
            torch.set_num_threads(threads_before)
            raise
        return cls(group, workers, loaded, backend, threads_before)

    def runner(self, pool: PagePool, host_tier: HostTier | None, attention: AttentionBackend, *,
               verify_tables: bool) -> TensorParallelRunner:
        """Rank 0's runner over the engine's pool; sizes the workers' pools to match (a
        failure, a worker's included, leaves the group to the caller's `abandon`)."""
        return TensorParallelRunner(self.loaded, pool, attention, self.group, self.workers, host_tier,
                                    verify_tables=verify_tables,
                                    on_close=lambda: torch.set_num_threads(self.threads_before))

    def abandon(self) -> None:
        """Ends the workers and the group of an engine that will not be built after all (its
        construction failed after the group started: else the workers lived on until rank 0's
        half-built engine was collected, then died with a gloo traceback each)."""
        self.workers.stop(grace_s=1.0)
        self.group.close()
        torch.set_num_threads(self.threads_before)
