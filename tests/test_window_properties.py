"""Sliding window: the scheduler's page release against a brute-force model of what
attention reads, and the prefix cache's rule for windowed models.

The pool here records, for every slot, the token whose K/V it holds (writes at the slots a
step computes, copies with the pages): a stand-in for K/V that is exact about *which* token
each slot holds. Before every chunk runs, each of its new tokens must find every position of
its window (the `window` positions ending at its own) in a page the sequence still holds,
holding the right token. After every rule the structural checker runs with the window (its
rule: exactly the pages wholly before the window are released, so at most
ceil(window / page_size) + 1 are held) and every path of the tree must hold its tokens (the
tree stays prefix-closed, so whatever a later request matches is whole).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixserve.cache.invariants import SequenceView, check_invariants
from radixserve.cache.pool import OUT_OF_WINDOW_PAGE, PagePool
from radixserve.cache.radix import RadixTree
from radixserve.engine.params import SamplingParams
from radixserve.engine.policy import make_schedule_policy
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.scheduler import Scheduler

PREFIXES = [[7] * 30, [7] * 12 + [8] * 18, [9, 10] * 15]


class TokenPool(PagePool):
    """A page pool (no tensors) that records which token each slot holds."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self.slots = np.full((num_pages, page_size), -1, dtype=np.int64)

    def copy_page(self, src: int, dst: int, num_slots: int | None = None) -> None:
        super().copy_page(src, dst, num_slots)
        n = self.page_size if num_slots is None else num_slots
        self.slots[dst, :n] = self.slots[src, :n]


def make_scheduler(num_pages: int, page_size: int, window: int, max_batch_tokens: int = 16) -> Scheduler:
    pool = TokenPool(num_pages, page_size)
    return Scheduler(pool, RadixTree(pool), make_schedule_policy("lpm"), max_running=4,
                     max_batch_tokens=max_batch_tokens, clock=lambda: 0.0, window=window)


_ids = itertools.count()


def new_sequence(tokens: list[int], max_tokens: int) -> SequenceState:
    request = Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens), 0.0)
    seq = SequenceState(request, 0, list(tokens), None, None, None)  # type: ignore[arg-type]
    request.sequences.append(seq)
    return seq


def run_step(scheduler: Scheduler, next_token) -> list[SequenceState]:
    """One step: every chunk reads its windows (checked) and writes its tokens; sequences
    that reach max_tokens finish (cached). Returns the finished ones."""
    pool: TokenPool = scheduler.pool  # type: ignore[assignment]
    size, window = scheduler.page_size, scheduler.window
    finished = []
    for chunk in scheduler.schedule():
        seq, start = chunk.seq, chunk.seq.num_computed
        for pos in range(start, start + chunk.num_new):
            page = seq.block_table[pos // size]
            pool.slots[page, pos % size] = seq.token_ids[pos]
        for query in range(start, start + chunk.num_new):
            for pos in range(max(0, query - window + 1), query + 1):
                page = seq.block_table[pos // size]
                assert page != OUT_OF_WINDOW_PAGE, f"position {pos} in the window of {query} was released"
                assert pool.slots[page, pos % size] == seq.token_ids[pos], f"page {page} holds another token"
        needs_logits = chunk.needs_logits
        seq.num_computed += chunk.num_new
        if chunk.num_new > 1:
            scheduler.cache_computed(seq, None, [])
        scheduler.trim_window(seq)
        if needs_logits:
            seq.token_ids.append(next_token())
            seq.output_ids.append(seq.token_ids[-1])
            if len(seq.output_ids) >= seq.request.params.max_tokens:
                seq.finish_reason = "length"
                scheduler.finish(seq)
                finished.append(seq)
    return finished


def check_all(scheduler: Scheduler) -> None:
    size, window = scheduler.page_size, scheduler.window
    views = [SequenceView(s.block_table, s.num_computed, window) for s in scheduler.running]
    check_invariants(scheduler.pool, scheduler.tree, views)
    pool: TokenPool = scheduler.pool  # type: ignore[assignment]
    for node, pages in scheduler.tree.nodes():
        if node.is_root:
            continue
        assert (pool.slots[pages].reshape(-1) == np.asarray(node.tokens)).all(), "a cached page holds other tokens"
    for seq in scheduler.running:
        if seq.pages_out_of_window:  # far past its cached prefix: the window's pages only
            assert len(seq.block_table) - seq.pages_out_of_window <= math.ceil(window / size) + 1


class WindowMachine(RuleBasedStateMachine):
    """Requests sharing prefixes, decoding past a window of 8, preempted and aborted at random."""

    page_size = 4

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.window = data.draw(st.sampled_from([5, 8]))
        self.scheduler = make_scheduler(num_pages=40, page_size=self.page_size, window=self.window)
        self.tokens = data.draw(st.randoms(use_true_random=False))

    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        if len(self.scheduler.waiting) >= 4:
            return
        prefix = data.draw(st.sampled_from(PREFIXES))
        length = data.draw(st.integers(2, len(prefix)))
        tail = data.draw(st.lists(st.integers(20, 23), max_size=3))
        self.scheduler.waiting.append(new_sequence(prefix[:length] + tail, data.draw(st.integers(1, 30))))

    @rule(steps=st.integers(1, 12))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            run_step(self.scheduler, lambda: self.tokens.randrange(20, 23))
            check_all(self.scheduler)

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        if self.scheduler.running:
            self.scheduler.preempt(data.draw(st.sampled_from(self.scheduler.running)))

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if self.scheduler.running:
            self.scheduler.finish(data.draw(st.sampled_from(self.scheduler.running)), cache=False)

    @rule()
    def evict(self) -> None:
        self.scheduler.tree.evict(3)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "scheduler"):
            check_all(self.scheduler)


class WindowMachinePage1(WindowMachine):
    page_size = 1


SETTINGS = settings(max_examples=60, stateful_step_count=40, derandomize=True, database=None, deadline=None)
TestWindowPage4 = WindowMachine.TestCase
TestWindowPage4.settings = SETTINGS
TestWindowPage1 = WindowMachinePage1.TestCase
TestWindowPage1.settings = SETTINGS


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decoding_far_past_the_window_holds_only_the_window(page_size: int) -> None:
    window = 32
    scheduler = make_scheduler(num_pages=64, page_size=page_size, window=window)
    prompt = PREFIXES[2][:20]
    seq = new_sequence(prompt, max_tokens=200)
    scheduler.waiting.append(seq)
    counter = itertools.count(100)
    held = []
    while not seq.finished:
        run_step(scheduler, lambda: next(counter))
        check_all(scheduler)
        if not seq.finished:
            held.append((seq.num_computed, len(seq.block_table) - seq.pages_out_of_window))
    # Once the window has left the cached prompt, it holds exactly the pages that overlap
    # positions n - window + 1 .. n - 1 (n tokens computed), never more than the bound.
    far = [(n, pages) for n, pages in held if n - window + 1 >= len(prompt)]
    assert len(far) > 100
    for n, pages in far:
        assert pages == math.ceil(n / page_size) - (n - window + 1) // page_size
    assert max(pages for _, pages in far) <= math.ceil(window / page_size) + 1
    # The prompt's pages stay cached (its prefix is whole); nothing past it was cached.
    assert scheduler.tree.cached_pages == len(prompt) // page_size
    assert scheduler.pool.num_used == scheduler.tree.cached_pages


def test_a_later_request_hits_the_cached_prefix_after_pages_were_released() -> None:
    """A request decodes far past the window of 8 (its generated pages are released as they
    leave it); a later one sharing its prompt and first generated tokens hits the prompt's
    cached pages, which hold the right tokens, and its windows read only held pages."""
    scheduler = make_scheduler(num_pages=32, page_size=4, window=8)
    prompt = PREFIXES[1][:18]
    first = new_sequence(prompt, max_tokens=40)
    scheduler.waiting.append(first)
    counter = itertools.count(100)
    while not first.finished:
        run_step(scheduler, lambda: next(counter))
        check_all(scheduler)
    assert scheduler.tree.cached_pages == 4  # the prompt's full pages; the rest was released
    second = new_sequence(first.token_ids[:30], max_tokens=3)
    scheduler.waiting.append(second)
    run_step(scheduler, lambda: next(counter))
    assert second.request.cached_tokens == 16  # the 4 cached pages of the prompt
    while not second.finished:
        run_step(scheduler, lambda: next(counter))
        check_all(scheduler)
