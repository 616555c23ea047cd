"""One simulated server: the engine's own scheduler and cache, a model-free runner, its own clock.

`SimServer` holds exactly what an `Engine` schedules with — `Scheduler`, `RadixTree`,
`PagePool(num_layers=0)` and, when configured, a `HostTier` — and replaces the model by a
cost model: a step lasts `decode_step_s` plus its prefill tokens / `prefill_tokens_per_s`,
and a load from the host tier finishes `load_s_per_page` per page after it was issued (one
copy channel, overlapping the steps, as on CUDA; the sequence waits for it). Generated tokens
are the workload's known reply followed by an end token, or unique filler tokens where the
reply is unknown, so what the tree caches is what the engine would cache. With `window` (a
model whose every layer has that sliding window) running sequences release the pages that
leave it, as the engine does: both run `Scheduler.advance` after a step.

The driver (simulate.py) owns arrivals and time between requests; a server only advances
its own clock (`now`), so several servers can run side by side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import numpy as np

from radixserve.benchmark.retention import RetentionRule
from radixserve.benchmark.workloads import BenchRequest
from radixserve.cache.events import CacheEventHub
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree, Retention
from radixserve.cache.tiers import HostTier
from radixserve.cache.transfer import KVCopier, LoadHandle
from radixserve.engine.params import SamplingParams
from radixserve.engine.policy import make_schedule_policy
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.scheduler import Scheduler

FILLER_TOKEN = 1 << 30  # generated tokens of unknown replies: FILLER_TOKEN + request index, unique


@dataclass(frozen=True)
class ServerSpec:
    """What one simulated server is: its cache, scheduler limits and costs."""

    num_pages: int
    page_size: int
    schedule_policy: str = "lpm"
    eviction_policy: str = "lru"
    use_cache: bool = True
    max_running: int = 64
    max_batch_tokens: int = 8192
    max_wait_s: float = 30.0
    decode_step_s: float = 0.02
    prefill_tokens_per_s: float = 100_000.0
    host_num_pages: int = 0
    host_write_policy: str = "write-back"
    host_offload_min_priority: int = 35
    load_s_per_page: float = 0.0  # 0: a load from the host is instant
    window: int | None = None  # sliding window of every layer (None: full attention)
    cache_partial_pages: bool = False  # also cache a finished request's last, partly filled page
    mixed_prefill_tokens: int | None = None  # the Scheduler's caps (None: none)
    short_prompt_tokens: int | None = None


class _SimLoad:
    """A simulated load: done once the server's clock reaches `ready_at`."""

    def __init__(self, clock: Callable[[], float], ready_at: float) -> None:
        self._clock = clock
        self.ready_at = ready_at

    def done(self) -> bool:
        return self._clock() >= self.ready_at


class SimulatedCopier(KVCopier):
    """Moves no data (the pools hold no tensors); times loads on one copy channel."""

    def __init__(self, clock: Callable[[], float], seconds_per_page: float) -> None:
        super().__init__()
        self._clock = clock
        self._per_page = seconds_per_page
        self._busy_until = 0.0

    def offload(self, device_pages: Seq[int], host_pages: Seq[int]) -> None:
        """Device-to-host copies are not timed: they overlap compute on the device."""

    def load(self, host_pages: Seq[int], device_pages: Seq[int]) -> LoadHandle | None:
        if self._per_page <= 0:
            return None
        start = max(self._clock(), self._busy_until)
        self._busy_until = start + len(host_pages) * self._per_page
        return _SimLoad(self._clock, self._busy_until)


class TokenBuffer:
    """A growable int32 token array: the sequence's tokens without a Python list (a trace
    prompt holds tens of thousands of tokens)."""

    __slots__ = ("_data", "_len")

    def __init__(self, prompt: np.ndarray, room: int) -> None:
        self._data = np.empty(len(prompt) + max(room, 1), dtype=np.int32)
        self._data[: len(prompt)] = prompt
        self._len = len(prompt)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: slice) -> np.ndarray:
        return self._data[: self._len][key]

    def append(self, token: int) -> None:
        if self._len == len(self._data):
            self._data = np.concatenate([self._data, np.empty(len(self._data), dtype=np.int32)])
        self._data[self._len] = token
        self._len += 1

    def view(self) -> np.ndarray:
        return self._data[: self._len]


class SimRequest(Request):
    """A workload request as the scheduler sees it; its retention comes from the rule."""

    def __init__(self, bench: BenchRequest, released_at: float, rule: RetentionRule, reply: np.ndarray) -> None:
        super().__init__(str(bench.index), bench.prompt_ids, SamplingParams(max_tokens=len(reply)), released_at)
        self.bench = bench
        self.rule = rule
        self.reply = reply  # the tokens it will generate, in order
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def range_retention(self) -> list[tuple[int, int, Retention]]:
        return self.rule.ranges(self.bench, self.cached_tokens or 0)


class SimSequence(SequenceState):
    """A sequence whose tokens live in a `TokenBuffer`."""

    @property
    def prompt_ids(self) -> np.ndarray:
        return self.token_ids.view()


class SimServer:
    """The engine's scheduler and cache over simulated time; see the module docstring."""

    def __init__(self, spec: ServerSpec, rule: RetentionRule, events: CacheEventHub | None = None) -> None:
        self.spec = spec
        self.rule = rule
        self.now = 0.0
        self.pool = PagePool(spec.num_pages, spec.page_size)
        host = None
        if spec.host_num_pages and spec.use_cache:
            host = HostTier(PagePool(spec.host_num_pages, spec.page_size),
                            SimulatedCopier(self.clock, spec.load_s_per_page),
                            write_policy=spec.host_write_policy,
                            offload_min_priority=spec.host_offload_min_priority)
        self.tree = RadixTree(self.pool, eviction_policy=spec.eviction_policy, clock=self.clock, host=host,
                              events=events)
        rule.bind(self.tree)
        self.scheduler = Scheduler(self.pool, self.tree, make_schedule_policy(spec.schedule_policy, max_wait_s=spec.max_wait_s),
                                   max_running=spec.max_running, max_batch_tokens=spec.max_batch_tokens,
                                   clock=self.clock, prefix_cache=spec.use_cache, window=spec.window,
                                   cache_partial_pages=spec.cache_partial_pages,
                                   mixed_prefill_tokens=spec.mixed_prefill_tokens,
                                   short_prompt_tokens=spec.short_prompt_tokens)
        self.held_pages_sum = 0   # pages running sequences keep from being freed, summed over steps
        self.held_pages_peak = 0
        self.steps = 0

    def clock(self) -> float:
        """This server's simulated time."""
        return self.now

    # ------------------------------------------------------------------ requests
    def fits(self, request: BenchRequest, max_tokens: int) -> bool:
        """The engine's admission rule: prompt and output fit the pool with a page to spare."""
        return math.ceil((request.prompt_len + max_tokens) / self.spec.page_size) + 1 <= self.spec.num_pages

    def submit(self, request: BenchRequest, reply: np.ndarray) -> SimRequest | None:
        """Queues `request`, which will generate `reply`; None when the engine would refuse
        it (too long for the pool)."""
        if not self.fits(request, len(reply)):
            return None
        self.rule.observe(request)
        req = SimRequest(request, self.now, self.rule, reply)
        seq = SimSequence(req, 0, TokenBuffer(request.prompt_ids, len(reply)), None, None, None)
        req.sequences.append(seq)
        self.scheduler.waiting.append(seq)
        return req

    def has_work(self) -> bool:
        """Whether anything waits or runs."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def advance_to(self, when: float) -> None:
        """Lets the clock reach `when` (idle time)."""
        self.now = max(self.now, when)

    def next_load_done(self) -> float | None:
        """When the earliest unfinished load of a running sequence completes."""
        times = [load.ready_at for seq in self.scheduler.running for load in seq.pending_loads
                 if isinstance(load, _SimLoad)]
        return min(times) if times else None

    # ------------------------------------------------------------------ the step
    def step(self) -> tuple[bool, list[SimRequest]]:
        """Runs one scheduling step: (whether anything ran, requests finished by it)."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return False, []
        prefilled = sum(c.num_new for c in chunks if c.num_new > 1)
        self.now += self.spec.decode_step_s + prefilled / self.spec.prefill_tokens_per_s
        finished: list[SimRequest] = []

        def take_token(seq: SequenceState) -> None:
            """The model's next token is the reply's; the last one ends the request."""
            req: SimRequest = seq.request
            if req.first_token_at is None:
                req.first_token_at = self.now
            token = int(req.reply[len(seq.output_ids)])
            seq.token_ids.append(token)
            seq.output_ids.append(token)
            if len(seq.output_ids) == len(req.reply):
                seq.finish_reason = "length"
                self.scheduler.finish(seq, None, req.range_retention())
                req.finished_at = self.now
                finished.append(req)

        self.scheduler.advance(chunks, take_token)  # the engine's bookkeeping, minus the model
        self._count_held_pages()
        return True, finished

    def _count_held_pages(self) -> None:
        """Pages that running sequences keep from being freed (used and not evictable)."""
        held = self.pool.num_used - self.tree.evictable_pages
        self.held_pages_sum += held
        self.held_pages_peak = max(self.held_pages_peak, held)
        self.steps += 1


def reply_tokens(request: BenchRequest, *, prompt_only: bool) -> np.ndarray:
    """What a simulated request generates. A known reply, then an end token (never computed,
    like a model's EOS), so the next turn finds the whole reply cached; otherwise filler
    tokens starting with one unique to the request, `output_len` of them (one with
    `prompt_only`: the trace README's setting, prompts alone)."""
    if request.output_ids is not None:
        return np.append(request.output_ids.astype(np.int32), np.int32(FILLER_TOKEN + request.index))
    count = 1 if prompt_only else max(request.output_len, 1)
    return np.full(count, FILLER_TOKEN + request.index, dtype=np.int32)
