"""Scheduler.advance on its own: the bookkeeping after a forward pass, with no model (a pool
of no layers and a tree), checked value by value."""

from __future__ import annotations

from radixserve.cache.pool import OUT_OF_WINDOW_PAGE, PagePool
from radixserve.cache.radix import RadixTree
from radixserve.engine.params import SamplingParams
from radixserve.engine.policy import make_schedule_policy
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.scheduler import Scheduler

PAGE = 4


def make_scheduler(max_batch_tokens: int = 64, window: int | None = None) -> Scheduler:
    pool = PagePool(16, PAGE)
    return Scheduler(pool, RadixTree(pool), make_schedule_policy("fcfs"), max_running=8,
                     max_batch_tokens=max_batch_tokens, clock=lambda: 0.0, window=window)


def queue(scheduler: Scheduler, request_id: str, tokens: list[int]) -> SequenceState:
    request = Request(request_id, list(tokens), SamplingParams(max_tokens=8), 0.0)
    seq = SequenceState(request, 0, list(tokens), None, None, None)  # type: ignore[arg-type]
    request.sequences.append(seq)
    scheduler.waiting.append(seq)
    return seq


def test_prefill_chunks_advance_cache_their_full_pages_and_ask_for_tokens_in_chunk_order() -> None:
    scheduler = make_scheduler()
    a = queue(scheduler, "a", list(range(1, 11)))  # 10 tokens: two full pages and a partial one
    b = queue(scheduler, "b", [20, 21, 22])  # less than a page: nothing to cache
    chunks = scheduler.schedule()
    assert [(c.seq, c.num_new) for c in chunks] == [(a, 10), (b, 3)]
    calls: list[tuple[SequenceState, int, int]] = []

    def on_last_token(seq: SequenceState) -> None:  # sees each chunk's bookkeeping before the next's
        calls.append((seq, a.num_computed, b.num_computed))

    released = scheduler.advance(chunks, on_last_token)
    assert calls == [(a, 10, 0), (b, 10, 3)]
    assert released == []
    assert (a.num_computed, a.locked_tokens, b.num_computed, b.locked_tokens) == (10, 8, 3, 0)
    assert scheduler.tree.cached_pages == 2
    assert scheduler.tree.match(list(range(1, 11)), a.namespace, update=False).pages == a.block_table[:2]


def test_a_chunk_short_of_the_last_token_asks_for_none_and_a_decode_chunk_caches_nothing() -> None:
    scheduler = make_scheduler(max_batch_tokens=6)
    a = queue(scheduler, "a", list(range(1, 11)))
    calls: list[SequenceState] = []
    chunks = scheduler.schedule()
    assert [(c.seq, c.num_new) for c in chunks] == [(a, 6)]
    scheduler.advance(chunks, calls.append)
    assert (calls, a.num_computed, scheduler.tree.cached_pages) == ([], 6, 1)
    scheduler.advance(scheduler.schedule(), calls.append)  # the last 4 prompt tokens
    assert (calls, a.num_computed, scheduler.tree.cached_pages) == ([a], 10, 2)
    for token in (11, 12):  # decodes: cached when the sequence ends, not per step
        a.token_ids.append(token)
        chunks = scheduler.schedule()
        assert [(c.seq, c.num_new) for c in chunks] == [(a, 1)]
        scheduler.advance(chunks, calls.append)
    assert (calls, a.num_computed, scheduler.tree.cached_pages) == ([a, a, a], 12, 2)


def test_pages_that_leave_the_window_are_released_and_returned() -> None:
    scheduler = make_scheduler(window=PAGE)
    a = queue(scheduler, "a", [1, 2, 3])  # no full page: nothing locked in the tree
    calls: list[SequenceState] = []
    scheduler.advance(scheduler.schedule(), calls.append)
    released: list[int] = []
    for token in range(4, 9):  # positions 3..7: at 8 computed, page 0 is wholly out of the window
        a.token_ids.append(token)
        released += scheduler.advance(scheduler.schedule(), calls.append)
    first_page = released[0] if released else None
    assert (a.num_computed, a.pages_out_of_window, len(released)) == (8, 1, 1)
    assert a.block_table[0] == OUT_OF_WINDOW_PAGE and first_page not in a.block_table
    assert scheduler.pool.refcount(first_page) == 0
    assert calls == [a] * 6


def test_advance_of_no_chunks_does_nothing() -> None:
    scheduler = make_scheduler()
    assert scheduler.advance([], lambda seq: None) == []


def test_a_cached_prefix_is_not_room_for_the_request_that_extends_it() -> None:
    """16 pages: a finished 32-token prompt leaves 8 cached pages, a running one holds the
    other 8. Extending the cached prompt by 8 tokens needs 2 more pages; the 8 evictable ones
    are its own prefix, which admitting it locks: no room (counted as room, a claim on them
    failed step after step)."""
    scheduler = make_scheduler()
    done = queue(scheduler, "done", list(range(1, 33)))
    scheduler.advance(scheduler.schedule(), lambda seq: None)
    scheduler.finish(done)
    busy = queue(scheduler, "busy", list(range(100, 132)))
    scheduler.advance(scheduler.schedule(), lambda seq: None)
    assert busy in scheduler.running and scheduler.pool.num_free == 0 and scheduler.tree.evictable_pages == 8
    longer = list(range(1, 33)) + list(range(40, 48))
    match = scheduler.tree.match(longer[:-1], None, update=False)
    assert len(match.pages) == 8
    assert not scheduler.pages.may_fit([len(longer)], [match], 64, reserve=0)
    other = scheduler.tree.match([7, 7, 7], None, update=False)  # unrelated: the 8 pages are room for it
    assert scheduler.pages.may_fit([12], [other], 64, reserve=0)
