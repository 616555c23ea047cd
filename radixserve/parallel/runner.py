"""Rank 0's model runner under tensor parallelism: the seam where a step becomes a plan.

`TensorParallelRunner` keeps ModelRunner's contract towards the engine (`prepare`, then
`forward`, logits whole on rank 0): `prepare` turns the step's chunks into a StepPlan
(plan.py), sends it to every worker once, and builds its own inputs from the same plan;
`forward` runs rank 0's shard, which meets the workers in the model's all-reduces. Nothing
above the runner knows the model is split.

Faults: a collective that fails (a worker died: its sockets closed) or times out (a worker
hangs) puts the runner in a fault state, as does a worker process found dead before a step.
From then on every step raises at once, so the engine fails each request cleanly, and
`fault` says why (the server's /health answers 503 with it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.cache.pool import PagePool
from radixserve.cache.tiers import HostTier
from radixserve.engine.runner import ModelRunner
from radixserve.engine.scheduler import ScheduledChunk
from radixserve.models.loader import LoadedModel
from radixserve.parallel.executor import PlanExecutor
from radixserve.parallel.group import TIMEOUT_ENV, TensorParallelFault, TensorParallelGroup
from radixserve.parallel.plan import CHECK, SETUP, STOP, KvOpLog, PlanBuilder, StepPlan
from radixserve.parallel.processes import STOP_GRACE_S, WorkerProcesses
from radixserve.parallel.recording import record_page_copies

logger = logging.getLogger(__name__)
FAULT_EXIT_WAIT_S = 1.0  # how long a failed collective waits to see which worker exited


class TensorParallelRunner(ModelRunner):
    """ModelRunner for rank 0 of a tensor-parallel group (see the module docstring).

    `control_bytes` / `control_messages`: what the plans cost so far (for the benchmark);
    `last_plan_bytes`: the latest step's.
    """

    def __init__(self, loaded: LoadedModel, pool: PagePool, backend: AttentionBackend, group: TensorParallelGroup,
                 workers: WorkerProcesses, host_tier: HostTier | None = None, *, verify_tables: bool = False,
                 on_close: Callable[[], None] | None = None) -> None:
        # The ranks split the work with fixed thread counts (parallel/launch.py): no governor.
        super().__init__(loaded, pool, backend, verify_tables=verify_tables, adaptive_threads=False)
        self._on_close = on_close
        self.group = group
        self.workers = workers
        self._fault: str | None = None
        self.control_bytes = 0
        self.control_messages = 0
        self.last_plan_bytes = 0
        kv_log = KvOpLog()
        self.builder = PlanBuilder(kv_log, verify=verify_tables)  # the scheduler's tables, as ModelRunner checks them
        host_pool = host_tier.pool if host_tier is not None else None
        self.executor = PlanExecutor(self.model, pool, backend, self.dtype, self.metadata, host_pool)
        setup = [SETUP, pool.num_pages, pool.page_size, host_pool.num_pages if host_pool else 0, int(verify_tables)]
        self._send(np.asarray(setup, dtype=np.int32))
        group.announce("ready")
        group.wait_for_all("ready")  # every shard loaded and pool built, before any collective
        record_page_copies(pool, host_tier, kv_log)

    @property
    def fault(self) -> str | None:
        """Why the group cannot run steps (None while it can); a worker process that has
        exited counts at once, before any step notices."""
        return self._fault or self.workers.first_dead()

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """Sends the step's plan to every worker, then builds rank 0's inputs from it."""
        self._check_healthy()
        plan = self.builder.plan(chunks)
        self.last_plan_bytes = self._send(plan.encode())
        return self.executor.prepare(plan)  # an error here is raised on every rank alike

    @torch.inference_mode()
    def forward(self, meta: AttentionMetadata, input_ids: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Rank 0's shard over the prepared step, with the workers; logits are whole."""
        self._check_healthy()
        try:
            return self.executor.forward(meta, input_ids, logits_indices)
        except Exception as error:
            raise self._fail(f"a forward pass failed across the tensor-parallel group: {error}") from error

    def check_kv(self, tokens: list[int], pages: list[int]) -> list[int | None]:
        """Per rank, `verify_cached_kv` of `tokens` against `pages` of that rank's pool (host
        page h as pool.num_pages + h): None where every page holds that rank's heads of those
        tokens, else the index of the first page that does not. Every rank runs it together."""
        self._check_healthy()
        plan = StepPlan(CHECK, tails=np.asarray(pages, dtype=np.int32), input_ids=np.asarray(tokens, dtype=np.int32),
                        kv_ops=self.builder.kv_log.drain())
        self._send(plan.encode())
        return self.executor.check_pages(self.group, tokens, pages)

    def close(self) -> None:
        """Tells the workers to stop, ends them if they do not, and closes the group."""
        healthy = self.fault is None
        if healthy:
            try:
                self._send(np.asarray([STOP], dtype=np.int32))
            except TensorParallelFault:
                healthy = False
        self.workers.stop(grace_s=STOP_GRACE_S if healthy else 1.0)  # a broken group's workers may never read STOP
        self.group.close()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
        if self._fault is None:
            self._fault = "the tensor-parallel group was shut down"

    def _send(self, message: np.ndarray) -> int:
        try:
            sent = self.group.send_plan(message)
        except Exception as error:
            raise self._fail(f"sending a plan to the tensor-parallel workers failed: {error}") from error
        self.control_bytes += sent
        self.control_messages += 1
        return sent

    def _check_healthy(self) -> None:
        fault = self.fault
        if fault is not None:
            raise self._fail(fault)

    def _fail(self, reason: str) -> TensorParallelFault:
        if self._fault is None:
            # A worker that died mid-step closed its connections before its exit shows: the
            # collective's error ("Connection closed by peer") named no rank and no exit code.
            self._fault = self.workers.first_dead(wait_s=FAULT_EXIT_WAIT_S) or reason
            if "Timed out" in self._fault:  # gloo's words, naming no rank and no cause
                self._fault += (f" (a worker did not answer within the collective timeout, {self.group.timeout_s:g} s "
                                f"(${TIMEOUT_ENV}): it hangs, or its machine is overloaded)")
            logger.error("tensor parallelism failed: %s; every request from now on ends with an error", self._fault)
        return TensorParallelFault(self._fault)
