"""One forward pass over a batch of chunks: page indices in, logits out."""

from __future__ import annotations

import time

import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.attention.metadata import MetadataBuilder
from radixserve.cache.pool import PagePool
from radixserve.engine.scheduler import ScheduledChunk
from radixserve.engine.thread_governor import ThreadGovernor
from radixserve.models.loader import LoadedModel


class ModelRunner:
    """Builds the step's metadata once and runs the model over the pool's pages.

    The seam below the scheduler: it sees token ids, block tables and lengths, never the
    tree or the queues. Block tables are mirrored as arrays between steps (keyed by
    `SequenceState.seq_id`, see `attention/metadata.py`), so preparing a step costs time in the
    batch size and the new pages, not the whole context. `verify_tables` (the engine's debug
    checks) compares each mirror with its list every step.

    On the CPU in float32, decode steps run with the thread count `governor` finds fastest
    (all of torch's threads, or one on a machine busy with other work: thread_governor.py);
    `adaptive_threads=False` keeps torch's count.
    """

    def __init__(self, loaded: LoadedModel, pool: PagePool, backend: AttentionBackend, *,
                 verify_tables: bool = False, adaptive_threads: bool = True) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.pool = pool
        self.backend = backend
        self.metadata = MetadataBuilder(pool.page_size, loaded.device, verify=verify_tables)
        # float32 on the CPU: every decode op is a kernel whose results do not depend on the
        # thread count, so the governor changes speed only, never tokens.
        governed = adaptive_threads and loaded.device.type == "cpu" and loaded.dtype == torch.float32
        self.governor = ThreadGovernor(max(1, torch.get_num_threads())) if governed else None

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """The step's metadata (backend planned), input ids and logits rows: all the host
        work before the forward pass."""
        # One pass over the chunks (this runs for every sequence on every step).
        input_ids: list[int] = []
        logits_indices: list[int] = []
        seq_ids, tables, kv_lens, num_new, out_of_window = [], [], [], [], []
        for chunk in chunks:
            seq, new = chunk.seq, chunk.num_new
            start, end = seq.num_computed, seq.num_computed + new
            tokens = seq.token_ids
            if new == 1:
                input_ids.append(tokens[start])
            else:
                input_ids += tokens[start:end]
            if end == len(tokens):  # the chunk reaches the last token: it yields logits
                logits_indices.append(len(input_ids) - 1)
            seq_ids.append(seq.seq_id)
            tables.append(seq.block_table)
            kv_lens.append(end)
            num_new.append(new)
            out_of_window.append(seq.pages_out_of_window)
        meta = self.metadata.build(seq_ids, tables, kv_lens, num_new, out_of_window)
        self.model.plan_attention(self.backend, meta, self.dtype)
        return (meta, torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(logits_indices, dtype=torch.int64, device=self.device))

    @torch.inference_mode()
    def forward(self, meta: AttentionMetadata, input_ids: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """The model over a prepared step; float32 logits [len(logits_indices), vocab]."""
        governor = self.governor
        rows = input_ids.numel()
        if governor is None or rows != len(meta.cpu.qo_lens):  # not governed, or not every row decodes
            return self.model(input_ids, meta, self.backend, self.pool.k_cache, self.pool.v_cache,
                              logits_indices)
        threads = governor.threads_for_step(rows)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        start = time.perf_counter()
        logits = self.model(input_ids, meta, self.backend, self.pool.k_cache, self.pool.v_cache,
                            logits_indices)
        governor.record(threads, rows, time.perf_counter() - start)
        if governor.current != threads:  # a trial ended (or switched: then the rest follows)
            torch.set_num_threads(governor.current)
        return logits

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Runs every chunk; returns float32 logits [number of chunks needing logits, vocab]."""
        return self.forward(*self.prepare(chunks))
