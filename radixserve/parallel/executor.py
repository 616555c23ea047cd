"""Every rank's half of a step: a plan in, the metadata and inputs of its forward out.

Rank 0 and the workers run the same `PlanExecutor` on the same plans, so the metadata, the
input ids and the block tables agree on every rank by construction; only the K/V data
differ (each rank's pool holds its own heads of the same pages).
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.attention.metadata import MetadataBuilder
from radixserve.cache.pool import PagePool
from radixserve.cache.transfer import PageCopier
from radixserve.models.kv_check import verify_cached_kv
from radixserve.models.llama import CausalLM
from radixserve.parallel.group import TensorParallelGroup
from radixserve.parallel.plan import COPY_PAGE, LOAD, OFFLOAD, StepPlan, TableReplica


class PlanExecutor:
    """Turns plans into forward inputs over one rank's pool (and repeats rank 0's page copies
    on a worker's pool: `apply_kv_ops`)."""

    def __init__(self, model: CausalLM, pool: PagePool, backend: AttentionBackend, dtype: torch.dtype,
                 metadata: MetadataBuilder, host_pool: PagePool | None = None) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.dtype = dtype
        self.metadata = metadata
        self.device = metadata.device
        self.replica = TableReplica()
        self.copier = PageCopier(pool, host_pool) if host_pool is not None else None

    def prepare(self, plan: StepPlan) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """The step's metadata (backend planned), input ids and logits rows."""
        tables = self.replica.apply(plan)
        seqs = plan.sequences
        meta = self.metadata.build(seqs[:, 0].tolist(), tables, seqs[:, 1].tolist(), seqs[:, 2].tolist(),
                                   seqs[:, 3].tolist())
        self.model.plan_attention(self.backend, meta, self.dtype)
        input_ids = torch.from_numpy(plan.input_ids.astype(np.int64)).to(self.device)
        logits_indices = torch.from_numpy(plan.logits_indices.astype(np.int64)).to(self.device)
        return meta, input_ids, logits_indices

    @torch.inference_mode()
    def forward(self, meta: AttentionMetadata, input_ids: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The model over a prepared step (every rank together)."""
        return self.model(input_ids, meta, self.backend, self.pool.k_cache, self.pool.v_cache, logits_indices)

    def apply_kv_ops(self, ops: np.ndarray) -> None:
        """Repeats rank 0's page copies, in order; consecutive copies of one kind go together."""
        start = 0
        while start < len(ops):
            kind = int(ops[start, 0])
            stop = start + 1
            while stop < len(ops) and ops[stop, 0] == kind and kind != COPY_PAGE:
                stop += 1
            batch = ops[start:stop]
            if kind == COPY_PAGE:
                src, dst, slots = batch[0, 1:].tolist()
                self.pool.copy_page(src, dst, slots)
            elif self.copier is None:
                raise RuntimeError("a host-tier copy arrived, but this rank has no host pool")
            elif kind == OFFLOAD:
                self.copier.offload(batch[:, 1].tolist(), batch[:, 2].tolist())
            elif kind == LOAD:
                handle = self.copier.load(batch[:, 1].tolist(), batch[:, 2].tolist())
                if handle is not None:  # CUDA: later kernels wait for the side stream's copy
                    self.copier.fence(handle)
            else:
                raise ValueError(f"unknown KV op {kind}")
            start = stop

    def check_pages(self, group: TensorParallelGroup, tokens: list[int], pages: list[int]) -> list[int | None]:
        """This rank's `verify_cached_kv` of `tokens` against `pages` (host page h as
        pool.num_pages + h), gathered from every rank (TensorParallelRunner.check_kv; every
        rank calls it together: the fresh computation runs the sharded model)."""
        pool, host = self.pool, self.copier.host_pool if self.copier is not None else None
        k_caches, v_caches = pool.k_cache, pool.v_cache
        if host is not None:
            k_caches = [torch.cat([d, h.to(d.device)]) for d, h in zip(k_caches, host.k_cache)]
            v_caches = [torch.cat([d, h.to(d.device)]) for d, h in zip(v_caches, host.v_cache)]
        bad = verify_cached_kv(self.model, k_caches, v_caches, tokens, pages, pool.page_size)
        results = group.gather_ints([-1 if bad is None else bad])
        return [None if r[0] < 0 else r[0] for r in results]
