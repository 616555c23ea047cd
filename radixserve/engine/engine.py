"""The serving engine: requests in, tokens out, over a paged KV pool with a prefix cache."""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import replace
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from radixserve.attention.base import create_backend
from radixserve.cache.events import CacheEvent, CacheEventHub
from radixserve.cache.invariants import InvariantError, SequenceView, check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import PagesFreed, RadixTree, Retention
from radixserve.cache.reuse import ReuseHistory
from radixserve.cache.tiers import DEFAULT_OFFLOAD_MIN_PRIORITY, WRITE_BACK, HostTier
from radixserve.engine.beam import BeamGroup, Candidate, Hypothesis
from radixserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from radixserve.engine.params import (PromptTooLong, QueueFull, RequestOutput, SamplingParams,
                                      StreamDelta, TokenLogprob)
from radixserve.engine.policy import make_policy
from radixserve.engine.request import Request, Sequence
from radixserve.engine.runner import ModelRunner
from radixserve.engine.sampler import compute_logprobs, sample, sampling_seed
from radixserve.engine.scheduler import ScheduledChunk, Scheduler
from radixserve.engine.sessions import SESSION_PRIORITY, Session, SessionTable
from radixserve.engine.timing import StepTimings
from radixserve.models.loader import load_model

logger = logging.getLogger(__name__)

_TREE_PAGE_COUNTS = frozenset({"cached_pages", "evictable_pages", "locked_pages", "free_pages",
                               "host_cached_pages", "host_only_pages", "host_free_pages"})
REUSE_WINDOW = 16  # reuse history length, in multiples of the cache's pages, both tiers (measured best)
DEFAULT_CPU_KV_GB = 0.5
DEFAULT_GPU_KV_FRACTION = 0.8


class Engine:
    """Continuous-batching LLM engine over a radix prefix cache.

    Args:
        model: "demo" (the built-in random model) or a local Hugging Face checkpoint directory.
        page_size: tokens per KV page (a power of two).
        num_pages / kv_memory_gb: size of the KV pool, by pages or by bytes; default: 0.5 GB on
            CPU, 80% of free memory on CUDA.
        schedule_policy: "lpm" (longest cached prefix first), "dfs-weight" or "fcfs".
        eviction_policy: "reuse-boost" (the default: "priority", plus pages whose prefix was
            seen recently — remembered beyond eviction — are retained at priority 60; the best
            policy measured, see docs/benchmark.md), "priority" (retention priority, then
            LRU) or "lru".
        max_running: sequences decoding at once. max_queue: waiting requests before QueueFull.
        max_batch_tokens: tokens per forward step; longer prompts are prefilled in chunks.
        max_wait_s: aging bound; a request waiting longer is admitted in arrival order.
        session_ttl_s: how long an idle session's pages stay ahead of ordinary cache.
        max_session_tokens: tokens all open sessions together may keep ahead of ordinary
            cache; past it the least recently active sessions end early (default: half the
            device pool).
        enable_prefix_cache: False computes every prompt in full (a baseline).
        cache_partial_pages: also cache a finished request's last, partly filled page, so a
            conversation's next turn recomputes only its new tokens (False: full pages only).
        debug_checks: run the structural invariant checker after every step.
        host_num_pages / host_kv_memory_gb: size of the host tier, a second KV pool in host
            memory (pinned on CUDA) that pages evicted from the device go to and are loaded
            back from; default (and 0): no host tier.
        host_write_policy: "write-back" (copy a page to host when the device evicts it) or
            "write-through-selective" (also as soon as it has been hit twice).
        host_offload_min_priority: device-only pages below this retention priority are
            dropped on eviction instead of copied to host (default 35: the default priority
            is offloaded).
    """

    def __init__(self, model: str = "demo", page_size: int = 16, num_pages: int | None = None,
                 kv_memory_gb: float | None = None, device: str | None = None,
                 schedule_policy: str = "lpm", eviction_policy: str = "reuse-boost", *,
                 dtype: str | torch.dtype | None = None, max_running: int = 256,
                 max_queue: int | None = None, max_batch_tokens: int = 2048,
                 max_wait_s: float = 30.0, session_ttl_s: float = 600.0,
                 max_session_tokens: int | None = None,
                 enable_prefix_cache: bool = True, debug_checks: bool = False,
                 backend: str | None = None, seed: int = 0, host_num_pages: int | None = None,
                 host_kv_memory_gb: float | None = None, host_write_policy: str = WRITE_BACK,
                 host_offload_min_priority: int = DEFAULT_OFFLOAD_MIN_PRIORITY,
                 cache_partial_pages: bool = True) -> None:
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size: must be a power of two >= 1, got {page_size}")
        for name, value in (("max_running", max_running), ("max_batch_tokens", max_batch_tokens)):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.loaded = load_model(model, dtype=dtype, device=device)
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self.max_context_len = self.loaded.max_context_len
        self.device = self.loaded.device
        self.page_size = page_size
        self.pool = self._make_pool(num_pages, kv_memory_gb)
        self.host_tier = self._make_host_tier(host_num_pages, host_kv_memory_gb, host_write_policy,
                                              host_offload_min_priority) if enable_prefix_cache else None
        reuse_boost = eviction_policy == "reuse-boost"
        self.cache_events = CacheEventHub(page_size)
        self.tree = RadixTree(self.pool, eviction_policy="priority" if reuse_boost else eviction_policy,
                              events=self.cache_events, host=self.host_tier)
        cache_pages = self.pool.num_pages + (self.host_tier.pool.num_pages if self.host_tier else 0)
        self.reuse_history = (ReuseHistory(page_size, REUSE_WINDOW * cache_pages)
                              if reuse_boost and enable_prefix_cache else None)
        self.scheduler = Scheduler(self.pool, self.tree, make_policy(schedule_policy, max_wait_s=max_wait_s),
                                   max_running=max_running, max_batch_tokens=max_batch_tokens,
                                   clock=time.monotonic, prefix_cache=enable_prefix_cache,
                                   window=self.loaded.model.kv_window, cache_partial_pages=cache_partial_pages)
        attention = create_backend(backend, self.device, self.loaded.dtype)
        self.runner = ModelRunner(self.loaded, self.pool, attention, verify_tables=debug_checks)
        self.max_queue = max_queue
        if max_session_tokens is None:
            max_session_tokens = self.pool.num_pages * page_size // 2
        self.sessions = SessionTable(session_ttl_s, max_session_tokens, self._demote)
        self.debug_checks = debug_checks
        self.eos_token_ids = self._eos_token_ids()
        self._rng = torch.Generator().manual_seed(seed)
        self._requests: dict[str, Request] = {}
        self._pending: dict[str, list[StreamDelta]] = {}
        self._counters = {"prompt_tokens": 0, "cached_tokens": 0, "host_cached_tokens": 0,
                          "generated_tokens": 0, "requests_finished": 0, "requests_aborted": 0,
                          "steps": 0, "prefill_tokens": 0}
        self._prefill_step_s = 0.0
        self._step_time_s = 0.0
        self._last_step_s = 0.0
        self._timings = StepTimings()  # seconds per section of step(), for stats and bench
        self._released: list[int] = []  # pages let go in this step, for the debug checker

    # ------------------------------------------------------------------ set-up
    def _make_pool(self, num_pages: int | None, kv_memory_gb: float | None) -> PagePool:
        cfg = self.loaded.model
        shape = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     dtype=self.loaded.dtype, device=self.device)
        if num_pages is not None and kv_memory_gb is not None:
            raise ValueError("give num_pages or kv_memory_gb, not both")
        if num_pages is not None:
            if num_pages < 1:
                raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
            return PagePool(num_pages, self.page_size, **shape)
        if kv_memory_gb is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * DEFAULT_GPU_KV_FRACTION)
            else:
                budget = int(DEFAULT_CPU_KV_GB * 2**30)
        else:
            budget = int(kv_memory_gb * 2**30)
        return PagePool.from_memory_budget(budget, self.page_size, **shape)

    def _make_host_tier(self, num_pages: int | None, memory_gb: float | None, write_policy: str,
                        offload_min_priority: int) -> HostTier | None:
        """The host tier's pool (same page shape, in host memory, pinned on CUDA); None when
        neither size is given or it is zero."""
        if num_pages is not None and memory_gb is not None:
            raise ValueError("give host_num_pages or host_kv_memory_gb, not both")
        for name, value in (("host_num_pages", num_pages), ("host_kv_memory_gb", memory_gb)):
            if value is not None and value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        if not num_pages and not memory_gb:
            return None
        cfg = self.loaded.model
        shape = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     dtype=self.loaded.dtype, device="cpu", pin_memory=self.device.type == "cuda")
        if num_pages:
            host_pool = PagePool(num_pages, self.page_size, **shape)
        else:
            host_pool = PagePool.from_memory_budget(int(memory_gb * 2**30), self.page_size, **shape)
        return HostTier.over(self.pool, host_pool, write_policy=write_policy,
                             offload_min_priority=offload_min_priority)

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.loaded.config, getattr(self.loaded.model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    retention: Retention | None = None,
                    prefix_retention: tuple[int, Retention] | None = None,
                    session_id: str | None = None) -> str:
        """Queues a request; returns its id. Raises ValueError, PromptTooLong or QueueFull."""
        params = params or SamplingParams()
        params.validate()
        if params.beam_width == 1:  # one beam is greedy decoding, as num_beams=1 in transformers
            params = replace(params, beam_width=None, temperature=0.0)
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(prompt_ids, params)
        queued = sum(1 for s in self.scheduler.waiting if s.request.cached_tokens is None)
        if self.max_queue is not None and queued >= self.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.max_queue} requests)")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        namespace = (self.model_name, cache_salt or None)  # "" is no salt: one namespace, one id
        req = Request(request_id, prompt_ids, params, time.monotonic(), priority, namespace,
                      retention, prefix_retention, session_id)
        if self.reuse_history is not None:
            seen_pages = self.reuse_history.observe(np.asarray(prompt_ids, dtype=np.int64), namespace)
            req.reused_tokens = seen_pages * self.page_size
        self._requests[request_id] = req
        self._pending[request_id] = []
        if params.beam_search:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            req.beam = BeamGroup.for_request(req, stops)
            req.beam.running.append(self._new_sequence(req, 0, list(prompt_ids), output=False))
            self.scheduler.waiting.append(req.beam.running[0])
        else:
            self.scheduler.waiting.append(self._new_sequence(req, 0, list(prompt_ids)))
        return request_id

    @property
    def max_sequence_len(self) -> int:
        """The longest prompt + output one sample can have: the context, or the pool if smaller."""
        return min(self.max_context_len, (self.pool.num_pages - 1) * self.page_size)

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.loaded.model.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_context_len:
            raise PromptTooLong(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                f"exceeds the model's context of {self.max_context_len} tokens",
                                param=_cause(len(prompt_ids), self.max_context_len))
        # Every sample must fit the pool on its own, or preemption could never make room; the
        # beams of a group run together, so all of them must (counted without sharing: a
        # group resumed after its cached pages were evicted recomputes each beam in full).
        beams = params.beam_width if params.beam_search else 1
        if beams * (math.ceil(total / self.page_size) + 1) > self.pool.num_pages:
            what = f"{beams} beams of " if beams > 1 else ""
            raise PromptTooLong(f"{what}prompt + max_tokens ({total} tokens) needs more KV pages than the "
                                f"pool holds ({self.pool.num_pages} pages of {self.page_size} tokens)",
                                param=_cause(len(prompt_ids), self.max_sequence_len))
        if beams > self.scheduler.max_running:
            raise ValueError(f"beam_width: {beams} beams run at once, more than max_running "
                             f"({self.scheduler.max_running})")

    def _new_sequence(self, req: Request, index: int, token_ids: list[int], *, output: bool = True) -> Sequence:
        """A sequence of `req`; `output`: one of the request's samples (not a beam)."""
        seed = None if req.params.beam_search else sampling_seed(req.params, index, self._rng)
        seq = Sequence(req, index, token_ids, IncrementalDetokenizer(self.tokenizer, req.prompt_ids),
                       StopStringMatcher(list(req.params.stop)), seed)
        if output:
            req.sequences.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stops a request wherever it is and frees its pages (computed full pages stay cached)."""
        req = self._requests.get(request_id)
        if req is None:
            return
        req.aborted = True
        for seq in req.sequences:
            if not seq.finished:
                self._finish(seq, "abort")
        if req.beam is not None:
            self._release_beams(req.beam, "abort")
        for index in range(len(req.sequences), req.params.n):  # samples not forked yet
            self._pending[request_id].append(StreamDelta(index, [], "", None, "abort", len(req.prompt_ids),
                                                         req.cached_tokens or 0))
        self._retire(req)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ------------------------------------------------------------------ the step
    def step(self) -> dict[str, list[StreamDelta]]:
        """Runs one forward pass; returns what is new, per request id.

        A failure that one request causes (its forward chunk, sampling, detokenizing, stop
        checks) ends that request alone with finish_reason "error"; the others carry on.
        """
        start = time.perf_counter()
        self.sessions.sweep()
        scheduling = time.perf_counter()
        chunks = self.scheduler.schedule()
        self._timings.add("schedule", time.perf_counter() - scheduling)
        if chunks:
            self._timings.steps += 1
            self._run(chunks)
        self._counters["steps"] += 1
        self._last_step_s = time.perf_counter() - start
        prefilled = sum(c.num_new for c in chunks if c.num_new > 1)
        if prefilled:  # for prefill time per token (vs. a host-tier copy's)
            self._counters["prefill_tokens"] += prefilled
            self._prefill_step_s += self._last_step_s
        self._step_time_s += self._last_step_s
        if self.debug_checks:
            self.check_invariants()
        self._released = []
        return self.take_deltas()

    def _run(self, chunks: list[ScheduledChunk]) -> None:
        """Runs `chunks` in one forward pass; if it fails, runs each half on its own, so a
        chunk that cannot run fails only its own request and the rest are retried.

        Retrying is safe: a failed pass advanced no sequence and cached nothing, and the
        slots it may have half-written are rewritten by the retry (they lie in pages the
        sequence holds alone: the copy-on-write rule).
        """
        chunks = [c for c in chunks if not c.seq.finished]  # a sibling half may have failed it
        if not chunks:
            return
        clock = time.perf_counter
        try:
            t0 = clock()
            prepared = self.runner.prepare(chunks)
            t1 = clock()
            logits = self.runner.forward(*prepared)
            self._timings.add("metadata", t1 - t0)
            self._timings.add("model", clock() - t1)
        except Exception:
            if len(chunks) == 1:
                logger.exception("forward pass failed for request %s; it ends with finish_reason "
                                 "'error'", chunks[0].seq.request.request_id)
                self._fail({chunks[0].seq.request})
                return
            middle = len(chunks) // 2
            self._run(chunks[:middle])
            self._run(chunks[middle:])
            return
        self._process(chunks, logits)

    def take_deltas(self) -> dict[str, list[StreamDelta]]:
        """What is new per request id since the last call (step() returns it too)."""
        out, self._pending = self._pending, {rid: [] for rid in self._pending if rid in self._requests}
        return {rid: deltas for rid, deltas in out.items() if deltas}

    def _process(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> None:
        clock, timings = time.perf_counter, self._timings
        ready: list[tuple[Sequence, int]] = []  # (sequence, logits row)
        beams: list[tuple[Sequence, int]] = []  # beam-search beams: their rows go to their group
        row = 0
        t0 = clock()
        for chunk in chunks:
            seq = chunk.seq
            needs_logits = chunk.needs_logits
            seq.num_computed += chunk.num_new
            req = seq.request
            if chunk.num_new > 1:  # a prefill chunk: share its pages now (decodes cache at the end)
                self.scheduler.cache_computed(seq, req.retention, req.range_retention())
            self._released.extend(self.scheduler.trim_window(seq))
            if not needs_logits:
                continue
            if req.beam is not None:
                beams.append((seq, row))
                row += 1
                continue
            ready.append((seq, row))
            if len(req.sequences) < req.params.n and seq.index == 0:
                ready.extend((child, row) for child in self._fork(seq))
            row += 1
        t1 = clock()
        timings.add("tree", t1 - t0)
        if beams:  # scored with the sampling
            self._deliver_beams(beams, logits)
        if not ready:
            return
        seqs = [s for s, _ in ready]
        rows = [r for _, r in ready]
        # A decode step samples every row in order: no copy of the logits then.
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        tokens, logprobs = self._sample(picked, seqs)
        t2 = clock()
        timings.add("sampling", t2 - t1)
        tree_before = timings.seconds["tree"]
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            if seq.finished:  # its request failed while sampling
                continue
            try:
                self._append_token(seq, token, logprob)
            except Exception:
                logger.exception("post-processing a token of request %s failed; it ends with "
                                 "finish_reason 'error'", seq.request.request_id)
                self._fail({seq.request})
        finishing = timings.seconds["tree"] - tree_before  # _finish's share, counted there
        timings.add("detokenize", clock() - t2 - finishing)

    def _sample(self, rows: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token (and logprobs if asked) per row; the batch at once, or row by row if the
        batch fails, so a request whose sampling fails ends alone (with a dummy token here)."""
        params = [s.request.params for s in seqs]
        seeds = [s.sampling_seed for s in seqs]
        steps = [len(s.output_ids) for s in seqs]  # token t of a sample is drawn from (seed, t)
        try:
            tokens = sample(rows, params, seeds, steps)
            return tokens, compute_logprobs(rows, tokens, [p.logprobs for p in params])
        except Exception:
            logger.exception("batched sampling failed; sampling row by row")
        tokens, logprobs = [0] * len(seqs), [None] * len(seqs)
        for i, seq in enumerate(seqs):
            try:
                (tokens[i],) = sample(rows[i:i + 1], params[i:i + 1], seeds[i:i + 1], steps[i:i + 1])
                (logprobs[i],) = compute_logprobs(rows[i:i + 1], tokens[i:i + 1], [params[i].logprobs])
            except Exception:
                logger.exception("sampling failed for request %s; it ends with finish_reason 'error'",
                                 seq.request.request_id)
                self._fail({seq.request})
        return tokens, logprobs

    def _fail(self, requests: set[Request]) -> None:
        """Ends the requests of a step that raised; their pages may hold half-written K/V,
        so they are freed, never cached. The engine and every other request carry on."""
        for req in requests:
            for seq in req.sequences:
                if not seq.finished:
                    seq.finish_reason = "error"
                    self.scheduler.finish(seq, cache=False)
                    self._emit(seq)
            if req.beam is not None:
                self._release_beams(req.beam, "error")
            for index in range(len(req.sequences), req.params.n):
                self._pending[req.request_id].append(StreamDelta(index, [], "", None, "error",
                                                                 len(req.prompt_ids), req.cached_tokens or 0))
            req.aborted = True
            self._retire(req)

    # ------------------------------------------------------------------ beam search
    def _deliver_beams(self, beams: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
        """Hands each beam its logits row; a group whose beams have all delivered steps."""
        groups: dict[int, BeamGroup] = {}
        for seq, row in beams:
            group = seq.request.beam
            if group is not None and not group.done:
                group.deliver(seq, logits[row])
                groups[id(group)] = group
        for group in groups.values():
            if not group.ready:
                continue
            try:
                self._beam_step(group)
            except Exception:
                logger.exception("a beam search step of request %s failed; it ends with finish_reason "
                                 "'error'", group.request.request_id)
                self._fail({group.request})

    def _beam_step(self, group: BeamGroup) -> None:
        """One beam-search step over the paged cache.

        New hypotheses hold their parent's full pages; a beam no candidate continues releases
        its pages; a parent's first surviving child is the parent itself (it keeps its pages,
        last page included), every further child shares the parent's full pages and copies
        its partly filled last page. Beams that die free exactly as many partial pages as the
        extra children copy, so only the first step (one prompt, W children) needs free
        pages: if they cannot be had, the group is preempted and recomputes from the cache.
        """
        req = group.request
        parents = list(group.running)
        result = group.step()
        fresh = []
        for entry in result.finished:
            if isinstance(entry, Candidate):
                parent = parents[entry.parent]
                seq = self._new_sequence(req, 0, parent.token_ids + [entry.token], output=False)
                seq.output_ids = parent.output_ids + [entry.token]
                if not parent.dropped_pages:  # else it could never be cached: it holds nothing
                    self.scheduler.share_full_pages(parent, seq)
                entry = Hypothesis(entry.score, seq)
            fresh.append(entry)
        for dropped in group.keep(fresh):
            self._released.extend(self.scheduler.finish(dropped.seq, cache=False))
        if result.done:
            self._finish_beams(group)
            return
        children: dict[int, list[int]] = {}  # parent position -> ranks of its children
        for rank, cand in enumerate(result.running):
            children.setdefault(cand.parent, []).append(rank)
        for i, parent in enumerate(parents):
            if i not in children:
                parent.finish_reason = "pruned"
                self._released.extend(self.scheduler.finish(parent, cache=False))
        extra = len(result.running) - len(children)
        copies = extra if parents[0].num_computed % self.page_size else 0
        fits = (len(self.scheduler.running) + extra <= self.scheduler.max_running
                and self.scheduler.ensure_free(copies))
        running: list[Sequence] = [parents[0]] * len(result.running)
        for i, ranks in children.items():
            parent = parents[i]
            for rank in ranks[1:]:
                child = self._new_sequence(req, 0, list(parent.token_ids), output=False)
                child.output_ids = list(parent.output_ids)
                if not (fits and self.scheduler.fork(parent, child)):
                    self.scheduler.waiting.append(child)
                running[rank] = child
            running[ranks[0]] = parent
        for rank, cand in enumerate(result.running):
            running[rank].token_ids.append(cand.token)
            running[rank].output_ids.append(cand.token)
            self._counters["generated_tokens"] += 1
        group.running = running
        if not fits:  # all of the group waits, and is admitted again as a whole
            self.scheduler.preempt_unit(running)

    def _finish_beams(self, group: BeamGroup) -> None:
        """Ends a search: the n best hypotheses become the request's outputs (their pages are
        cached like any finished sample's); everything else the group holds is released."""
        req = group.request
        stops = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else self.eos_token_ids)
        if len(group.hypotheses) < req.params.n:  # the scorer always keeps W: a bug, not input
            raise RuntimeError(f"beam search ended with {len(group.hypotheses)} hypotheses, n={req.params.n}")
        best, rest = group.hypotheses[: req.params.n], group.hypotheses[req.params.n:]
        group.hypotheses = rest
        self._release_beams(group, None)
        for rank, hyp in enumerate(best):
            seq = hyp.seq
            seq.index, seq.beam_score = rank, hyp.score
            seq.text = "".join(seq.detokenizer.push(t) for t in seq.output_ids) + seq.detokenizer.flush()
            req.sequences.append(seq)
            self._finish(seq, "stop" if seq.output_ids[-1] in stops else "length")
        self._retire(req)

    def _release_beams(self, group: BeamGroup, reason: str | None) -> None:
        """Releases every running beam and kept hypothesis of `group` (no caching) and ends
        the search; `reason` marks the beams (so chunks of this step skip them)."""
        for seq in group.running + [h.seq for h in group.hypotheses]:
            seq.finish_reason = reason or "pruned"
            self._released.extend(self.scheduler.finish(seq, cache=False))
        group.running, group.hypotheses = [], []
        group.logits.clear()
        group.done = True

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of a request start from sample 0's computed prompt pages."""
        req = parent.request
        children = []
        for index in range(len(req.sequences), req.params.n):
            child = self._new_sequence(req, index, list(parent.token_ids))
            # A child past max_running waits and is admitted like any request (a cache hit).
            if len(self.scheduler.running) < self.scheduler.max_running and self.scheduler.fork(parent, child):
                children.append(child)
            else:
                self.scheduler.waiting.append(child)
        return children

    def _append_token(self, seq: Sequence, token: int, logprob) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        seq.output_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        self._counters["generated_tokens"] += 1
        text, hit_stop = seq.stop_matcher.feed(seq.detokenizer.push(token))
        seq.text += text
        if hit_stop or token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_context_len:
            reason = "length"
        else:
            reason = None
        if reason is not None and not hit_stop:
            # The end releases held-back text (an unfinished character): it may hold a stop.
            tail, hit_stop = seq.stop_matcher.feed(seq.detokenizer.flush())
            seq.text += tail if hit_stop else tail + seq.stop_matcher.flush()
            if hit_stop:
                reason = "stop"
        if reason is not None:
            self._finish(seq, reason)
        else:
            self._emit(seq)
        if seq.request.finished:
            self._retire(seq.request)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sample: its computed full pages stay cached with the request's retention."""
        req = seq.request
        seq.finish_reason = reason
        ranges = req.range_retention()
        in_session = req.session_id is not None and reason != "abort" and seq.index == 0
        if in_session:
            # The latest turn is kept ahead of ordinary cache for the TTL, on top of whatever
            # retention its pages have for good; the turn before it no longer is. Sessions end
            # first: what the new turn shares with them is raised again by the insert below.
            self.sessions.reserve(req.session_id, seq.num_computed)
            ranges.append((0, seq.num_computed, Retention(SESSION_PRIORITY, self.sessions.ttl_s)))
        computed = seq.token_ids[: seq.num_computed]
        start = time.perf_counter()
        self._released.extend(self.scheduler.finish(seq, req.retention, ranges))
        self._timings.add("tree", time.perf_counter() - start)
        if in_session:
            self.sessions.add(req.session_id, computed, req.namespace)
        self._emit(seq)

    def _demote(self, session: Session) -> None:
        self.tree.end_retention(session.tokens, session.namespace, SESSION_PRIORITY)

    def close_session(self, session_id: str) -> bool:
        """Ends a session: its pages become ordinary cache. False if it was not open (or
        expired: idle past the TTL)."""
        return self.sessions.close(session_id)

    def _emit(self, seq: Sequence) -> None:
        req = seq.request
        if req.request_id not in self._pending:
            return
        new_logprobs = seq.logprobs[seq.emitted_logprobs:] if req.params.logprobs is not None else None
        delta = StreamDelta(seq.index, seq.output_ids[seq.emitted_tokens:], seq.text[seq.emitted_text:],
                            new_logprobs, seq.finish_reason, len(req.prompt_ids), req.cached_tokens or 0)
        seq.emitted_tokens, seq.emitted_text = len(seq.output_ids), len(seq.text)
        seq.emitted_logprobs = len(seq.logprobs)
        self._pending[req.request_id].append(delta)

    def _retire(self, req: Request) -> None:
        if req.request_id not in self._requests:
            return
        del self._requests[req.request_id]
        self._counters["requests_aborted" if req.aborted else "requests_finished"] += 1
        self._counters["prompt_tokens"] += len(req.prompt_ids)
        self._counters["cached_tokens"] += req.cached_tokens or 0
        self._counters["host_cached_tokens"] += req.host_cached_tokens

    # ------------------------------------------------------------------ offline API
    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs prompts to completion; returns one output per sample, in prompt order."""
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError("params: give one SamplingParams, or one per prompt")
            per_prompt = params
        else:
            per_prompt = [params or SamplingParams()] * len(prompts)
        requests = []
        for prompt, p in zip(prompts, per_prompt):
            rid = self.add_request(prompt, p)
            requests.append(self._requests[rid])
        while self.has_work():
            self.step()
        return [RequestOutput(req.request_id, seq.index, len(req.prompt_ids), req.cached_tokens or 0,
                              list(seq.output_ids), seq.text, seq.finish_reason,
                              list(seq.logprobs) if req.params.logprobs is not None else None,
                              seq.beam_score)
                for req in requests for seq in sorted(req.sequences, key=lambda s: s.index)]

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        """Counters and gauges: the keys below are stable (the server's /metrics maps them).

        prompt_tokens, cached_tokens, hit_rate (finished requests), generated_tokens,
        requests_finished, requests_aborted, waiting, running, preemptions, admissions,
        shrunk_chunks (prefill chunks cut to the pages available rather than preempting),
        deferred_for_sharing (admissions put off so a shared prefix is computed once), steps,
        step_time_s_total, last_step_s, pages_total, pages_free, pages_used, pages_cached,
        pages_evictable, pages_locked, page_size, kv_tokens_capacity, kv_bytes, sessions_open,
        the tree's counters prefixed "cache_" (cache_evicted_pages, cache_lookups, ...), and
        the host tier's (zero without one): host_cached_tokens / device_cached_tokens (the
        part of cached_tokens loaded back from the host / found on the device),
        host_pages_total, host_pages_free, host_pages_used, host_pages_cached (host copies the
        tree holds), host_only_pages (cached pages on the host only), host_kv_bytes,
        cache_offloaded_pages / cache_written_through_pages (copied to host on eviction / by
        write-through), cache_dropped_pages (left the device without a host copy),
        cache_loaded_pages, cache_host_evicted_pages, cache_device_hit_tokens /
        cache_host_hit_tokens (lookups), kv_offloaded_bytes, kv_loaded_bytes,
        kv_offload_seconds_total / kv_load_seconds_total (time spent issuing the copies),
        prefill_tokens and prefill_step_s_total (steps that prefilled: prefill time per
        token, to compare with a copy's), and
        "histograms": {"hit_age_seconds" | "evict_age_seconds" | "evict_reuse":
        {"buckets": [(le, cumulative count), ...], "sum", "count"}} — the age of cached KV
        when it is hit and when it is evicted, and how often each evicted page had been hit.
        "step_breakdown_s": cumulative seconds per section of step() (schedule, metadata,
        model, sampling, detokenize, tree; see engine/timing.py) and "steps" that ran a batch.
        """
        c = self._counters
        out: dict[str, Any] = dict(c)
        out["hit_rate"] = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
        out.update(
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
            preemptions=self.scheduler.counters.preemptions, admissions=self.scheduler.counters.admitted,
            shrunk_chunks=self.scheduler.counters.shrunk_chunks,
            deferred_for_sharing=self.scheduler.counters.deferred_for_sharing,
            step_time_s_total=self._step_time_s, last_step_s=self._last_step_s,
            step_breakdown_s=self._timings.snapshot(),
            pages_total=self.pool.num_pages, pages_free=self.pool.num_free, pages_used=self.pool.num_used,
            pages_cached=self.tree.cached_pages, pages_evictable=self.tree.evictable_pages,
            pages_locked=self.tree.locked_pages, page_size=self.page_size,
            kv_tokens_capacity=self.pool.num_pages * self.page_size,
            kv_bytes=self.pool.num_pages * self._bytes_per_page(), sessions_open=len(self.sessions),
        )
        out["device_cached_tokens"] = c["cached_tokens"] - c["host_cached_tokens"]
        out["prefill_step_s_total"] = self._prefill_step_s
        out.update(self._host_stats())
        # The tree's page counts are reported as pages_* / host_*; its counters come prefixed.
        out.update({f"cache_{k}": v for k, v in self.tree.stats().items() if k not in _TREE_PAGE_COUNTS})
        # Prometheus-style cumulative buckets: [(upper bound, count <= bound), ...] ending at +inf.
        out["histograms"] = {name: {"buckets": h.cumulative(), "sum": h.sum, "count": h.count}
                             for name, h in self.tree.histograms().items()}
        return out

    def _host_stats(self) -> dict[str, float]:
        host = self.host_tier
        if host is None:
            return dict.fromkeys(("host_pages_total", "host_pages_free", "host_pages_used", "host_pages_cached",
                                  "host_only_pages", "host_kv_bytes", "kv_offloaded_bytes", "kv_loaded_bytes",
                                  "kv_offload_seconds_total", "kv_load_seconds_total"), 0)
        tree = self.tree.stats()
        per_page = host.bytes_per_page
        return {
            "host_pages_total": host.pool.num_pages, "host_pages_free": host.pool.num_free,
            "host_pages_used": host.pool.num_used, "host_pages_cached": self.tree.host_cached_pages,
            "host_only_pages": self.tree.host_only_pages, "host_kv_bytes": host.pool.num_pages * per_page,
            "kv_offloaded_bytes": (tree["offloaded_pages"] + tree["written_through_pages"]) * per_page,
            "kv_loaded_bytes": tree["loaded_pages"] * per_page,
            "kv_offload_seconds_total": host.copier.offload_seconds,
            "kv_load_seconds_total": host.copier.load_seconds,
        }

    def _bytes_per_page(self) -> int:
        m = self.loaded.model
        return PagePool.bytes_per_page(self.page_size, m.num_layers, m.num_kv_heads, m.head_dim,
                                       self.loaded.dtype)

    def check_invariants(self) -> None:
        """The structural checker over the pool, the tree and every live block table.

        Pages that finished sequences let go in the last step must be free unless the tree
        or another live sequence still holds them.
        """
        holders = list(self.scheduler.running)
        for req in self._requests.values():
            if req.beam is not None:  # finished hypotheses keep their full pages until the end
                holders.extend(h.seq for h in req.beam.hypotheses)
                self._check_beam_group(req.beam)
        window = self.scheduler.window
        views = [SequenceView(s.block_table, s.num_computed, window) for s in holders]
        held = {p for s in holders for p in s.block_table[s.dropped_pages:]}
        held.update(p for _, pages in self.tree.nodes() for p in pages)
        released = [p for p in self._released if p not in held]
        check_invariants(self.pool, self.tree, views, released_pages=released)

    def _check_beam_group(self, group: BeamGroup) -> None:
        """A beam group is scheduled as a whole: its beams all run or all wait."""
        running = [s in self.scheduler.running for s in group.running]
        waiting = [s in self.scheduler.waiting for s in group.running]
        if not (all(running) or all(waiting)):
            raise InvariantError(f"[beam-group-split] request {group.request.request_id}: beams running "
                                 f"{running}, waiting {waiting}")

    def flush_cache(self) -> PagesFreed:
        """Drops every unlocked cached page; returns how many device pages were freed (an
        int), with the host-tier pages freed as its `host`."""
        return self.tree.reset()

    def subscribe_events(self, callback: Callable[[CacheEvent], None], *,
                         include_token_ids: bool = False) -> Callable[[], None]:
        """Calls `callback` with every later cache event (radixserve.cache.events), in order,
        on the thread that runs the engine's steps; returns a function that unsubscribes.

        Token ids ride along only with `include_token_ids`. With no subscriber the cache
        computes no page hashes, so events cost nothing unless someone listens.
        """
        return self.cache_events.subscribe(callback, include_token_ids=include_token_ids)

    def cache_page_hashes(self, tier: str | None = "device") -> set[tuple[str, int]]:
        """(namespace id, page hash) of every cached page on `tier` ("device", the default;
        "host"; None: either): what an indexer of that tier's events holds."""
        return self.tree.cached_page_hashes(tier)


def _cause(prompt_len: int, limit: int) -> str:
    """What PromptTooLong blames: the prompt if it leaves no room for one token, else max_tokens."""
    return "prompt" if prompt_len + 1 > limit else "max_tokens"
