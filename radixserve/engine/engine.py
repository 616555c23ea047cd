"""The serving engine: requests in, tokens out, over a paged KV pool with a prefix cache.

`Engine` is the API: request intake (`add_request`), a request's end (`abort`, pause,
sessions), `step`, the offline `generate` and introspection. What a step does is step_loop.py's;
its other jobs are the modules ARCHITECTURE.md §6 lists.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from radixserve.attention.base import create_backend
from radixserve.cache.events import CacheEvent
from radixserve.cache.page_hash import PageHashing
from radixserve.cache.radix import PagesFreed, Retention
from radixserve.cache.tiers import DEFAULT_OFFLOAD_MIN_PRIORITY, WRITE_BACK
from radixserve.engine.beam_driver import BeamDriver
from radixserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from radixserve.engine.engine_setup import (
    build_cache,
    bytes_per_page,
    eos_token_ids,
    runtime_summary,
    sampling_defaults,
)
from radixserve.engine.engine_stats import (
    StepClock,
    check_engine,
    count_retired,
    engine_stats,
    new_counters,
)
from radixserve.engine.fair_share import FairShare
from radixserve.engine.grammar_pace import PACED_SHARE, GrammarPace
from radixserve.engine.params import (
    QueueFull,
    RequestOutput,
    SamplingParams,
    StreamDelta,
)
from radixserve.engine.paused import PausedRequests
from radixserve.engine.policy import make_schedule_policy
from radixserve.engine.prompt_check import check_prompt, max_sequence_len
from radixserve.engine.request import Request, SequenceState, namespace_of
from radixserve.engine.runner import ModelRunner
from radixserve.engine.sampler import sampling_seed
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.step_cost import ChunkCost
from radixserve.engine.sessions import PendingHold, SessionTable, hold_raised
from radixserve.engine.spelling import hidden_token_ids
from radixserve.engine.step_loop import StepLoop
from radixserve.engine.timing import StepTimings
from radixserve.engine.token_output import DeltaQueue
from radixserve.grammar import GrammarFault, Grammars, MaskBuffer
from radixserve.grammar.compile_workers import DEFAULT_COMPILE_TIMEOUT_S
from radixserve.models.loader import load_model
from radixserve.parallel.launch import TensorParallel

# Tokens per forward step. On a CPU a step of 2,048 prompt tokens takes seconds, and every
# running stream waits for it; 512 (llama.cpp's micro-batch) costs no throughput (the linear
# kernel streams the weights once per 64 rows either way) and, side by side with 2,048, cut
# TTFT p50 2.6x and ITL p99 4x where eight distinct prompts arrive together (docs/benchmark.md).
DEFAULT_MAX_BATCH_TOKENS = 512
# Prompt tokens a CPU step may prefill while other streams decode in it: each such step is a
# pause in every stream, about 1 ms per prompt token here, so this bounds their inter-token
# gaps. The price: a prompt beside decoding streams takes more steps, each carrying their
# decodes too, so its own first token comes later (agent workload: ITL p99 0.43x for 0.94x
# the throughput; docs/benchmark.md). A GPU runs the whole budget in a few milliseconds: no
# cap there unless asked.
DEFAULT_CPU_MIXED_PREFILL_TOKENS = 128
# A waiting prompt with at most this many tokens left to compute (after its cached prefix) is
# admitted ahead of a running prompt's next chunk (Scheduler._short_lane): else a one-word
# question, or an agent's next turn on a cached history, waits for every chunk of a long prompt
# (26 s behind 5,400 tokens with SmolLM2 on a CPU). A quarter of the default step budget: the
# long prompt keeps three quarters of each step while short ones arrive.
DEFAULT_SHORT_PROMPT_TOKENS = 128
# While several tenants decode, a step runs at most this many rows shared fairly between them
# (engine/step_share.py). On a CPU a decode step's time grows with its rows (SmolLM2, 2 cores:
# 12.6 ms for 1, 35 ms for 32, 124 ms for 128): one tenant's 128 streams made every other
# tenant's token wait 124 ms; at 32 they wait about 35 ms, for 3% of the tokens (medians of
# bench/tenant_step_share.py). A GPU step barely grows with its rows: no limit there.
DEFAULT_CPU_TENANT_STEP_ROWS = 32


class Engine:
    """Continuous-batching LLM engine over a radix prefix cache.

    Args:
        model: "demo" (the built-in random model) or a local Hugging Face checkpoint directory.
        page_size: tokens per KV page (a power of two).
        num_pages / kv_memory_gb: size of the KV pool, by pages or by bytes; default: 0.5 GB on
            CPU, 80% of free memory on CUDA.
        schedule_policy: "lpm" (longest cached prefix first), "dfs-weight" or "fcfs".
        eviction_policy: "adaptive" (the default: retention priority, then recency, where
            pages whose prefix was seen recently — remembered beyond eviction — count as used
            later by a lead learned from the cache's own misses; cache/adaptive.py),
            "reuse-boost" ("priority", plus those pages retained at priority 60 for good),
            "priority" (retention priority, then LRU) or "lru".
        max_running: sequences decoding at once. max_queue: waiting requests before QueueFull.
        max_batch_tokens: tokens per forward step; longer prompts are prefilled in chunks.
        mixed_prefill_tokens: prompt tokens a step may prefill while other sequences decode in
            it (they wait for the whole step). None: 128 on a CPU, else max_batch_tokens.
        short_prompt_tokens: a waiting prompt with at most this many tokens left to compute
            (after its cached prefix) is admitted ahead of a running prompt's next chunk, within
            that many tokens of the step, instead of waiting for all of its chunks. 0: off.
        tenant_step_rows: while several tenants decode, the rows a step runs, shared fairly
            between the tenants; a tenant's rows beyond its share sit the step out in turns
            (engine/step_share.py). None: 32 on a CPU, else no limit; 0: no limit.
        grammar_paced_share: the share of the engine's time that rows of slow output
            constraints (over 1 ms of grammar work a step, on average) may take together while other
            rows run; their rows sit steps out beyond it (engine/grammar_pace.py). 1: no pacing.
        max_wait_s: aging bound; a request waiting longer is admitted in arrival order.
        session_ttl_s: how long an idle session's pages stay ahead of ordinary cache (and a
            tenant's raised retention at most, after the last request that raised it).
        max_session_tokens: tokens all open sessions and tenants' raised retention together
            may keep ahead of ordinary cache, shared fairly between tenants (a session's turn or
            a held span is cut to its tenant's share: its leading tokens); past it the least
            recently active entries of the tenant holding the most end early (default: half
            the device pool; engine/sessions.py).
        enable_prefix_cache: False computes every prompt in full (a baseline).
        cache_partial_pages: also cache a finished request's last, partly filled page, so a
            conversation's next turn recomputes only its new tokens (False: full pages only).
        debug_checks: run the structural invariant checker after every step.
        host_num_pages / host_kv_memory_gb: size of the host tier, a second KV pool in host
            memory (pinned on CUDA) that pages evicted from the device go to and are loaded
            back from; default (and 0): no host tier.
        host_write_policy: "write-back" (copy a page to host when the device evicts it),
            "write-through-selective" (also as soon as it has been hit twice) or "exclusive"
            (as write-back, and a page loaded back to the device leaves the host).
        host_offload_min_priority: device-only pages below this retention priority are
            dropped on eviction instead of copied to host (default 35: the default priority
            is offloaded).
        fair_share: share the engine fairly between tenants (engine/fair_share.py; False: one
            queue for all, a baseline). With one tenant the two are the same.
        cache_hash_secret: keys the page hashes and namespace ids that cache events and views
            publish (page_hash.py's PageHashing), so that none can be tested offline; None
            publishes the public spec's (an indexer outside the server can compute them).
        generation_config: "auto" applies the checkpoint's recommended temperature, top_p and
            top_k (generation_config.json, or GGUF metadata) to requests without params;
            "none" ignores them. Its stop tokens always end generation.
        tensor_parallel_size: split the model over this many ranks (radixserve/parallel:
            this process is rank 0, the others are spawned worker processes); 1: no split.
        adaptive_threads: on the CPU in float32, run decode steps with all of torch's threads
            or with one, whichever the runner measures faster (engine/thread_governor.py: one
            thread wins on a machine whose cores are busy); False keeps torch's count.
        grammar_compile_timeout_s: a grammar (structured output, strict tools) that takes
            longer to compile is refused, its compile process killed
            (grammar/compile_workers.py); None compiles in the calling thread, unbounded.
    """

    def __init__(self, model: str = "demo", page_size: int = 16, num_pages: int | None = None,
                 kv_memory_gb: float | None = None, device: str | None = None,
                 schedule_policy: str = "lpm", eviction_policy: str = "adaptive", *,
                 dtype: str | torch.dtype | None = None, max_running: int = 256,
                 max_queue: int | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 mixed_prefill_tokens: int | None = None, tenant_step_rows: int | None = None,
                 short_prompt_tokens: int = DEFAULT_SHORT_PROMPT_TOKENS,
                 grammar_paced_share: float = PACED_SHARE,
                 max_wait_s: float = 30.0, session_ttl_s: float = 600.0,
                 max_session_tokens: int | None = None,
                 enable_prefix_cache: bool = True, debug_checks: bool = False,
                 backend: str | None = None, seed: int = 0, host_num_pages: int | None = None,
                 host_kv_memory_gb: float | None = None, host_write_policy: str = WRITE_BACK,
                 host_offload_min_priority: int = DEFAULT_OFFLOAD_MIN_PRIORITY,
                 generation_config: str = "auto", cache_partial_pages: bool = True,
                 fair_share: bool = True, cache_hash_secret: str | bytes | None = None,
                 tensor_parallel_size: int = 1, adaptive_threads: bool = True,
                 grammar_compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size: must be a power of two >= 1, got {page_size}")
        for name, value in (("max_running", max_running), ("max_batch_tokens", max_batch_tokens),
                            ("mixed_prefill_tokens", mixed_prefill_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if short_prompt_tokens < 0:
            raise ValueError(f"short_prompt_tokens: must be >= 0 (0: off), got {short_prompt_tokens}")
        if tenant_step_rows is not None and tenant_step_rows < 0:
            raise ValueError(f"tenant_step_rows: must be >= 0 (0: no limit), got {tenant_step_rows}")
        if not 0 < grammar_paced_share <= 1:
            raise ValueError(f"grammar_paced_share: must be in (0, 1] (1: no pacing), got {grammar_paced_share}")
        if grammar_compile_timeout_s is not None and grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s: must be > 0 (or None), got {grammar_compile_timeout_s}")
        self._grammar_compile_timeout_s = grammar_compile_timeout_s
        self.tensor_parallel: TensorParallel | None = None
        if tensor_parallel_size > 1:
            self.tensor_parallel = TensorParallel.start(model, tensor_parallel_size, dtype=dtype, device=device,
                                                        backend=backend)
            self.loaded = self.tensor_parallel.loaded
        else:
            self.loaded = load_model(model, dtype=dtype, device=device)
        try:  # a refusal below (a policy name, a pool too small) must end a started group's workers
            self.tokenizer = self.loaded.tokenizer
            self.model_name = self.loaded.name
            self.max_context_len = self.loaded.max_context_len
            self.device = self.loaded.device
            self.page_size = page_size
            cache = build_cache(self.loaded, page_size, num_pages=num_pages, kv_memory_gb=kv_memory_gb,
                                eviction_policy=eviction_policy, prefix_cache=enable_prefix_cache,
                                host_num_pages=host_num_pages, host_kv_memory_gb=host_kv_memory_gb,
                                host_write_policy=host_write_policy,
                                host_offload_min_priority=host_offload_min_priority,
                                hashing=PageHashing(cache_hash_secret))
            self.pool, self.host_tier, self.tree = cache.pool, cache.host_tier, cache.tree
            self.cache_events, self.reuse_history = cache.events, cache.reuse_history
            self.hashing = self.tree.hashing
            if mixed_prefill_tokens is None and self.device.type == "cpu":
                mixed_prefill_tokens = DEFAULT_CPU_MIXED_PREFILL_TOKENS
            if tenant_step_rows is None:
                tenant_step_rows = DEFAULT_CPU_TENANT_STEP_ROWS if self.device.type == "cpu" else 0
            # The cap counts a chunk's attention too: late chunks of a long prompt would pause the
            # streams beside them several times longer than early ones (engine/step_cost.py).
            # At least an eighth of the cap a step, however deep the context: a step costs too.
            chunk_cost = (ChunkCost.of_model(self.loaded.config, self.loaded.model.kv_window,
                                             max(1, mixed_prefill_tokens // 8))
                          if mixed_prefill_tokens is not None else None)
            self.scheduler = Scheduler(self.pool, self.tree, make_schedule_policy(schedule_policy, max_wait_s=max_wait_s),
                                       max_running=max_running, max_batch_tokens=max_batch_tokens,
                                       mixed_prefill_tokens=mixed_prefill_tokens, chunk_cost=chunk_cost,
                                       tenant_step_rows=tenant_step_rows or None,
                                       short_prompt_tokens=short_prompt_tokens or None,
                                       grammar_pace=GrammarPace(time.monotonic, share=grammar_paced_share),
                                       clock=time.monotonic, prefix_cache=enable_prefix_cache,
                                       window=self.loaded.model.kv_window, cache_partial_pages=cache_partial_pages,
                                       fair_share=FairShare(enabled=fair_share, preempt_margin=max_batch_tokens))
            attention = create_backend(backend, self.device, self.loaded.dtype)
            self.runner = (ModelRunner(self.loaded, self.pool, attention, verify_tables=debug_checks,
                                       adaptive_threads=adaptive_threads)
                           if self.tensor_parallel is None else
                           self.tensor_parallel.runner(self.pool, self.host_tier, attention, verify_tables=debug_checks))
        except BaseException:
            if self.tensor_parallel is not None:
                self.tensor_parallel.abandon()
            raise
        self.max_queue = max_queue
        if max_session_tokens is None:
            max_session_tokens = self.pool.num_pages * page_size // 2
        self.sessions = SessionTable.over(self.tree, session_ttl_s, max_session_tokens)
        self.debug_checks = debug_checks
        self.eos_token_ids = eos_token_ids(self.loaded)
        self.sampling_defaults = sampling_defaults(self.loaded, generation_config)
        self._rng = torch.Generator().manual_seed(seed)
        self._requests: dict[str, Request] = {}
        self._session_closed: set[str] = set()  # running turns whose session was closed meanwhile
        self._refused: set[str] = set()  # requests given up as refused (abort(refused=True))
        self._deltas = DeltaQueue()
        self._counters = new_counters()
        self._step_clock = StepClock()
        self._timings = StepTimings()  # seconds per section of step(), for stats and bench
        self._released: list[int] = []  # pages let go in this step, for the debug checker
        self.paused = PausedRequests(self.scheduler)  # requests whose client stopped reading
        self._grammar_masks = MaskBuffer()  # the step's grammar mask rows, reused step after step
        self.beams = BeamDriver(self.scheduler, new_beam=lambda req, ids: self._new_sequence(req, 0, ids, output=False),
                                finish=self._finish, fail=self._fail_request, retire=self._retire,
                                eos_token_ids=self.eos_token_ids, released=self._released, counters=self._counters)
        self._loop = StepLoop(self.scheduler, self.runner, self.beams, self.sessions, self._deltas,
                              new_sequence=self._new_sequence, finish=self._finish, fail=self._fail_request,
                              retire=self._retire, eos_token_ids=self.eos_token_ids,
                              max_context_len=self.max_context_len, counters=self._counters, timings=self._timings,
                              step_clock=self._step_clock, grammar_masks=self._grammar_masks, released=self._released)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    retention: Retention | None = None,
                    prefix_retention: tuple[int, Retention] | None = None,
                    session_id: str | None = None, tenant: str | None = None,
                    admin: bool = False, client: Hashable = None) -> str:
        """Queues a request; returns its id. Raises ValueError, PromptTooLong or QueueFull.
        `priority` orders it within its `tenant` (None: the single tenant), and across tenants
        too for an `admin`'s request (engine/fair_share.py). A tenant's retention above the
        default is held within the tenant's share of the raised tokens (engine/sessions.py);
        the single tenant's and an admin's are the tree's as given. `client` tells the single
        tenant's senders apart for fair share (the server passes the client's address): they
        share the engine as tenants do (Request.fair_key); a tenant's request ignores it."""
        params = params or self.default_sampling_params()
        params.validate()
        if params.beam_width == 1:  # one beam is greedy decoding, as num_beams=1 in transformers
            params = replace(params, beam_width=None, temperature=0.0)
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # GrammarError (a ValueError) for one that cannot compile. The server compiled it off
        # this thread and holds it until here, so it is found, not compiled (compiled.py).
        compiled_grammar = self.grammars.compile(params.grammar, "grammar") if params.grammar is not None else None
        check_prompt(prompt_ids, params, vocab_size=self.loaded.model.vocab_size,
                     max_context_len=self.max_context_len, num_pages=self.pool.num_pages,
                     page_size=self.page_size, max_running=self.scheduler.max_running)
        fair_key = tenant if tenant is not None else client  # (Request.fair_key)
        if self.max_queue is not None:
            self._check_queue(fair_key)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        namespace = namespace_of(self.model_name, cache_salt, tenant)
        held: tuple[tuple[int | None, Retention], ...] = ()
        if tenant is not None and not admin:
            retention, prefix_retention, held = hold_raised(retention, prefix_retention)
        req = Request(request_id, prompt_ids, params, time.monotonic(), priority, namespace,
                      retention, prefix_retention, session_id, tenant, admin=admin, held_retention=held,
                      client=client, compiled_grammar=compiled_grammar)
        if self.reuse_history is not None:
            seen_pages = self.reuse_history.observe(np.asarray(prompt_ids, dtype=np.int64), namespace)
            req.reused_tokens = seen_pages * self.page_size
            req.reused_retention = self.reuse_history.retention
        self._requests[request_id] = req
        self.scheduler.fair.arrive(req.fair_key)
        self._deltas.open(request_id)
        if params.beam_search:
            self.scheduler.waiting.append(self.beams.start(req))
        else:
            self.scheduler.waiting.append(self._new_sequence(req, 0, list(prompt_ids)))
        return request_id

    def _check_queue(self, tenant: Hashable) -> None:
        """QueueFull when the waiting queue holds `max_queue` requests and `tenant` (a fair
        key: a tenant, or a client of the single tenant) already has its share of them
        (`max_queue` over the tenants waiting, itself counted): a tenant that keeps the queue
        full gets the 503s, not a tenant that comes after it. The queue may so pass
        `max_queue` by the shares of tenants that came later (each at most its share)."""
        queued = Counter(s.request.fair_key for s in self.scheduler.waiting if s.request.cached_tokens is None)
        if sum(queued.values()) < self.max_queue:
            return
        if queued[tenant] * len(queued.keys() | {tenant}) >= self.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.max_queue} requests)")

    def describe(self) -> str:
        """Device, dtype, attention backend and CPU kernels in one line (builds the kernels),
        and the tensor-parallel ranks, if any (the KV pool's figures are then per rank)."""
        summary = runtime_summary(self.loaded, self.runner.backend)
        if self.tensor_parallel is not None:
            summary += f"; tensor parallel: {self.tensor_parallel.group.world_size} ranks, KV pool per rank"
        return summary

    def default_sampling_params(self, **fields: object) -> SamplingParams:
        """SamplingParams with `fields`, and the checkpoint's sampling defaults where unset."""
        return SamplingParams(**{**self.sampling_defaults, **fields})

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The grammar engine of this model's tokenizer and logits (built on first use)."""
        return Grammars(self.tokenizer, self.loaded.model.vocab_size, self.eos_token_ids,
                        compile_timeout_s=self._grammar_compile_timeout_s,
                        textless_token_ids=hidden_token_ids(self.tokenizer))

    @property
    def max_sequence_len(self) -> int:
        """The longest prompt + output one sample can have: the context, or the pool if smaller."""
        return max_sequence_len(self.max_context_len, self.pool.num_pages, self.page_size)

    def _new_sequence(self, req: Request, index: int, token_ids: list[int], *, output: bool = True) -> SequenceState:
        """A sequence of `req`; `output`: one of the request's samples (not a beam)."""
        seed = None if req.params.beam_search else sampling_seed(req.params, index, self._rng)
        seq = SequenceState(req, index, token_ids, IncrementalDetokenizer(self.tokenizer, req.prompt_ids),
                            StopStringMatcher(list(req.params.stop)), seed)
        if req.compiled_grammar is not None:
            seq.grammar = self.grammars.matcher_of(req.compiled_grammar)
        if output:
            req.sequences.append(seq)
        return seq

    def abort(self, request_id: str, *, refused: bool = False) -> None:
        """Stops a request wherever it is and frees its pages (computed full pages stay cached).
        `refused`: the caller gives it up because a request it belongs with was refused (another
        prompt of its batch): it is counted as refused, not aborted, and adds no prompt tokens."""
        req = self._requests.get(request_id)
        if req is None:
            return
        if refused:
            self._refused.add(request_id)
        self._end_request(req, "abort")

    def abort_all(self) -> int:
        """Aborts every request (the server is stopping); returns how many there were."""
        requests = list(self._requests.values())
        for req in requests:
            self._end_request(req, "abort")
        return len(requests)

    def pause_request(self, request_id: str) -> bool:
        """Stops scheduling a request (its client is not reading): it is preempted and held
        until `resume_request` (engine/paused.py). False if unknown, paused or a beam search."""
        req = self._requests.get(request_id)
        return req is not None and self.paused.pause(req)

    def resume_request(self, request_id: str) -> None:
        """Lets a paused request be scheduled again (a no-op if it is not paused)."""
        self.paused.resume(request_id)

    def _end_request(self, req: Request, reason: str) -> None:
        """Ends `req` and its unfinished samples: "abort" keeps their computed full pages cached;
        "error" (a step that raised) frees them uncached: they may hold half-written K/V."""
        req.aborted = True
        for seq in req.sequences:
            if seq.finished:
                continue
            if reason == "abort":
                self._finish(seq, reason)
            else:
                seq.finish_reason = reason
                self.scheduler.finish(seq, cache=False)
                self._deltas.emit(seq)
        if req.beam is not None:
            self.beams.release(req.beam, reason)
        self._deltas.end_unforked(req, reason)
        self._retire(req)

    def _fail_request(self, req: Request, cause: BaseException | None = None) -> None:
        """Ends `req` with finish_reason "error"; the engine and the other requests carry on.
        A `cause` of the request's own making (its grammar) is kept for its client."""
        if isinstance(cause, GrammarFault):
            req.fault = str(cause)
        self._end_request(req, "error")

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def load_counts(self) -> tuple[int, int, int]:
        """(sequences waiting, sequences running, free pages): a few reads, for a caller
        deciding whether the stats changed since it last built them."""
        return len(self.scheduler.waiting), len(self.scheduler.running), self.pool.num_free

    def fault(self) -> str | None:
        """Why the engine cannot run steps any more (a tensor-parallel worker died or hangs),
        or None: what the server's /health reports."""
        return getattr(self.runner, "fault", None)

    def close(self) -> None:
        """Ends the tensor-parallel workers, if any (a no-op otherwise)."""
        if self.tensor_parallel is not None:
            self.runner.close()

    # ------------------------------------------------------------------ the step
    def step(self) -> dict[str, list[StreamDelta]]:
        """Runs one forward pass; returns what is new, per request id.

        A failure that one request causes (its forward chunk, sampling, detokenizing, stop
        checks) ends that request alone with finish_reason "error"; the others carry on.
        """
        self._loop.step(self.check_invariants if self.debug_checks else None)
        return self.take_deltas()

    def take_deltas(self) -> dict[str, list[StreamDelta]]:
        """What is new per request id since the last call (step() returns it too)."""
        return self._deltas.take(self._requests)

    def _finish(self, seq: SequenceState, reason: str) -> None:
        """Ends a sample: its computed full pages stay cached with the request's retention."""
        req = seq.request
        seq.finish_reason = reason
        ranges = req.range_retention()
        kept = reason != "abort" and seq.index == 0  # what the request raises outlives it
        # the latest turn is kept ahead of ordinary cache for the TTL, unless the session was
        # closed while it ran (a close wins over the turns then in flight)
        in_session = req.session_id is not None and kept and req.request_id not in self._session_closed
        if in_session:  # cut to the tenant's share, as a held span is
            turn = self.sessions.begin_turn(req.session_id, seq.num_computed, req.tenant)
            if turn[1]:
                ranges.append(turn)
        computed = seq.token_ids[: seq.num_computed]
        holds = self._begin_holds(req, computed) if kept else []
        ranges.extend(hold.span for hold in holds)
        start = time.perf_counter()
        self._released.extend(self.scheduler.finish(seq, req.retention, ranges))
        self._timings.add("tree", time.perf_counter() - start)
        if in_session:
            self.sessions.add(req.session_id, computed[: turn[1]], req.namespace, req.tenant)
        self.sessions.add_holds(holds, req.namespace)
        self._deltas.emit(seq)

    def _begin_holds(self, req: Request, computed: list[int]) -> list[PendingHold]:
        """Room for what a tenant's finished request asked to raise, within its share
        (engine/sessions.py); nothing for a request that asked for no raise."""
        if not req.held_retention:
            return []
        spans = [(computed if num_tokens is None else computed[:num_tokens], retention)
                 for num_tokens, retention in req.held_retention]
        return self.sessions.begin_holds(spans, req.namespace, req.tenant)

    def close_session(self, session_id: str, tenant: str | None = None) -> bool:
        """Ends `tenant`'s session: its pages become ordinary cache, and the turns of it still
        running when it is closed do not open it again as they finish (a later turn does).
        False if it was neither open (or it expired: idle past the TTL) nor had a turn
        running, as for another tenant's session of that id."""
        running = [rid for rid, req in self._requests.items()
                   if req.session_id == session_id and req.tenant == tenant and not req.aborted]
        self._session_closed.update(running)
        return self.sessions.close(session_id, tenant) or bool(running)

    def _retire(self, req: Request) -> None:
        if req.request_id not in self._requests:
            return
        del self._requests[req.request_id]
        self.scheduler.fair.leave(req.fair_key)
        self.paused.forget(req.request_id)
        self._session_closed.discard(req.request_id)
        refused = req.request_id in self._refused
        self._refused.discard(req.request_id)
        count_retired(self._counters, req, refused=refused)

    # ------------------------------------------------------------------ offline API
    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs prompts to completion; returns one output per sample, in prompt order."""
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError("params: give one SamplingParams, or one per prompt")
        per_prompt = params if isinstance(params, list) else [params or self.default_sampling_params()] * len(prompts)
        requests = [self._requests[self.add_request(prompt, p)] for prompt, p in zip(prompts, per_prompt)]
        while self.has_work():
            self.step()
        return [RequestOutput.of(seq) for req in requests for seq in sorted(req.sequences, key=lambda s: s.index)]

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        """Counters and gauges under stable keys (the server's /metrics maps them); the keys
        and their meaning: `engine_stats.engine_stats`, plus `paused` (sequences held because
        their client stopped reading), `requests_paused` (pauses so far) and `fair_preemptions`
        (sequences preempted for a tenant served less, engine/fair_share.py).

        Call it on the thread that runs the steps (as AsyncEngine does, idle too): it ends
        the sessions that expired first, so `sessions_open` need not wait for a step."""
        self.sessions.sweep()
        stats = engine_stats(self._counters, self.scheduler, self.tree, self.pool, self.host_tier,
                             clock=self._step_clock, timings=self._timings,
                             bytes_per_page=bytes_per_page(self.loaded, self.page_size),
                             sessions_open=len(self.sessions))
        stats.update(paused=self.paused.num_sequences, requests_paused=self.paused.pauses,
                     fair_preemptions=self.scheduler.counters.fair_preemptions)
        return stats

    def check_invariants(self) -> None:
        """The structural checker over the pool, the tree and every live block table.

        Pages that finished sequences let go in the last step must be free unless the tree
        or another live sequence still holds them.
        """
        check_engine(self.scheduler, self.tree, self.beams, list(self._requests.values()), self._released)

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

