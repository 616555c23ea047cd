"""The scheduler over a two-tier cache: load-back at admission, waiting for a copy in flight
without holding up the running batch (a forked sample too), and a load that does not fit.

Real scheduler, tree and pools (no tensors); the copy engine is the benchmark's simulated
one, whose loads complete when the clock reaches their finish time (as a CUDA copy on a side
stream completes while the compute stream goes on).
"""

from __future__ import annotations

from radixserve.benchmark.sim_server import SimulatedCopier
from radixserve.cache.invariants import SequenceView, check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cache.tiers import HostTier
from radixserve.engine.params import SamplingParams
from radixserve.engine.policy import make_schedule_policy
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.scheduler import Scheduler

P = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_pages: int, load_s_per_page: float = 0.0, max_batch_tokens: int = 256, write_policy: str = "write-back"):
    clock = Clock()
    pool = PagePool(num_pages, P)
    tier = HostTier(PagePool(64, P), SimulatedCopier(clock, load_s_per_page), write_policy=write_policy)
    tree = RadixTree(pool, clock=clock, host=tier)
    scheduler = Scheduler(pool, tree, make_schedule_policy("fcfs"), max_running=8, max_batch_tokens=max_batch_tokens,
                          clock=clock)
    return clock, pool, tree, scheduler


def submit(scheduler: Scheduler, tokens: list[int], arrival: float = 0.0) -> SequenceState:
    req = Request(str(len(scheduler.waiting) + len(scheduler.running)), tokens, SamplingParams(), arrival)
    seq = SequenceState(req, 0, list(tokens), None, None, None)
    req.sequences.append(seq)
    scheduler.waiting.append(seq)
    return seq


def on_host(pool: PagePool, tree: RadixTree, tokens: list[int]) -> None:
    """Caches `tokens` and pushes every page of them to the host tier."""
    pages = pool.allocate(len(tokens) // P)
    tree.insert(tokens, pages)
    pool.decref(pages)
    assert tree.evict(len(pages)) == len(pages)
    assert tree.host_only_pages == len(pages)


def run(scheduler: Scheduler, chunks) -> None:
    """What the engine does after a forward pass, minus the tokens: progress and caching."""
    for chunk in chunks:
        needs_logits = chunk.needs_logits  # before the progress below, as the engine reads it
        chunk.seq.num_computed += chunk.num_new
        if chunk.num_new > 1:
            scheduler.cache_computed(chunk.seq, None, [])
        if needs_logits:
            chunk.seq.token_ids.append(7)


def check(pool: PagePool, tree: RadixTree, scheduler: Scheduler, *others: SequenceView) -> None:
    check_invariants(pool, tree, [SequenceView(s.block_table, s.num_computed) for s in scheduler.running] + list(others))


def test_a_request_waits_for_its_copy_from_the_host_while_the_batch_decodes() -> None:
    clock, pool, tree, scheduler = make(32, load_s_per_page=0.01)
    conversation = list(range(100, 140))  # 10 pages
    on_host(pool, tree, conversation)
    other = submit(scheduler, list(range(300, 310)))
    run(scheduler, scheduler.schedule())  # `other` prefills and decodes from now on
    returning = submit(scheduler, conversation + [1], arrival=clock.now)
    chunks = scheduler.schedule()
    assert [c.seq for c in chunks] == [other]  # the copy of 10 pages is in flight: 0.1 s
    assert returning in scheduler.running and returning.pending_loads
    assert returning.request.cached_tokens == 40 and returning.request.host_cached_tokens == 40
    run(scheduler, chunks)
    check(pool, tree, scheduler)
    clock.now += 0.05
    assert [c.seq for c in scheduler.schedule()] == [other]
    clock.now += 0.06
    chunks = scheduler.schedule()
    assert {c.seq for c in chunks} == {other, returning}
    first = next(c for c in chunks if c.seq is returning)
    assert returning.num_computed == 40 and first.num_new == 1  # only the last token is computed
    run(scheduler, chunks)
    check(pool, tree, scheduler)
    assert tree.stats()["loaded_pages"] == 10


def test_a_load_that_finds_no_device_room_loads_what_fits_and_the_request_waits() -> None:
    clock, pool, tree, scheduler = make(16)
    conversation = list(range(100, 140))  # 10 pages, pushed to the host
    on_host(pool, tree, conversation)
    # Another holder keeps 12 cached pages alive: the tree may evict them (they count as
    # evictable) but that frees nothing, so only 4 device pages can be had.
    held = pool.allocate(12)
    tree.insert(list(range(500, 548)), held)
    returning = submit(scheduler, conversation + [1])
    assert scheduler.schedule() == []  # it loaded what fitted; the rest of its pages do not
    assert returning in scheduler.waiting and returning.request.cached_tokens is None
    assert scheduler.counters.loaded_tokens == 16 and tree.host_only_pages == 6 + 12
    check(pool, tree, scheduler, SequenceView(held, len(held) * P))
    pool.decref(held)  # the other holder lets go: now everything fits
    chunks = scheduler.schedule()
    assert [c.seq for c in chunks] == [returning] and chunks[0].num_new == 1
    # 4 pages came back in the first attempt (found on the device now), 6 in this one.
    assert returning.request.cached_tokens == 40 and returning.request.host_cached_tokens == 24
    run(scheduler, chunks)
    check(pool, tree, scheduler)


def test_a_sample_forked_while_its_parent_waits_for_a_load_waits_too() -> None:
    """n > 1: the parent's last prompt chunk finds the tree holding its tokens in pages another
    request is still loading back, so it switches to them and waits for the load; its forked
    sample shares those pages and must wait as well (it ran at once and read them unloaded)."""
    clock, pool, tree, scheduler = make(32, load_s_per_page=0.01, max_batch_tokens=12)
    prefix = list(range(100, 116))  # 4 pages
    parent = submit(scheduler, prefix + [1])
    chunks = scheduler.schedule()
    assert [c.num_new for c in chunks] == [12]  # 3 pages now, the last prefix page next step
    run(scheduler, chunks)
    # Meanwhile another request cached the whole prefix, and memory pressure sent its last
    # page (the only one the parent does not lock) to the host.
    pages = pool.allocate(4)
    tree.insert(prefix, pages)
    pool.decref(pages)
    assert tree.evict(1) == 1 and tree.host_only_pages == 1
    loader = submit(scheduler, prefix + [2], arrival=clock.now)  # loads that page back
    chunks = scheduler.schedule()
    assert [c.seq for c in chunks] == [parent] and loader.pending_loads
    run(scheduler, chunks)  # the parent switches to the loading page...
    assert parent.block_table[3] == loader.block_table[3] and parent.pending_loads
    child = SequenceState(parent.request, 1, list(parent.token_ids), None, None, None)
    parent.request.sequences.append(child)
    assert scheduler.fork(parent, child)  # ...and forks its second sample at once
    assert child.block_table[:4] == parent.block_table[:4]
    assert [c.seq.index for c in scheduler.schedule()] == []  # nobody reads the page before it lands
    check(pool, tree, scheduler)
    clock.now += 0.02
    assert {c.seq for c in scheduler.schedule()} == {parent, child, loader}


def test_under_exclusive_a_loaded_node_split_before_its_load_is_done_keeps_no_page_on_both_tiers() -> None:
    """Under `exclusive`, a node loaded back keeps its host copy until the load is done. Split
    by a shorter hit meanwhile, its lower part then leaving the device (back to its host copy),
    the upper part's host copy goes at the next settling too (it stayed for good: both tiers)."""
    clock, pool, tree, scheduler = make(32, load_s_per_page=0.01, write_policy="exclusive")
    conversation = list(range(100, 132))  # 8 pages
    on_host(pool, tree, conversation)
    match = tree.match(conversation + [1])
    tree.lock(match.host_node)
    assert tree.load_back(match).loads  # in flight: the 8 pages keep their host copies meanwhile
    tree.unlock(match.host_node)
    tree.match(conversation[:16] + [1])  # splits the loaded node: upper 4 pages, lower 4
    assert tree.evict(4) == 4  # the lower part leaves the device; its host copy stays
    assert tree.host_cached_pages == 8 and tree.host_only_pages == 4
    clock.now += 1.0  # the load is done
    upper = tree.match(conversation[:16]).node
    tree.lock(upper)  # in use: the next eviction takes other pages
    pages = pool.allocate(2)
    tree.insert(list(range(500, 508)), pages)
    pool.decref(pages)
    assert tree.evict(2) == 2  # an offload, which first settles the loads done
    tree.unlock(upper)
    assert tree.host_only_pages == 4 + 2 and tree.host_cached_pages == 4 + 2
    assert tree.cached_pages == 4
    check(pool, tree, scheduler)
