"""Host-tier loads that land late, as a CUDA side stream's do: no sequence may read a page
before the copy into it has landed.

On the CPU every load is synchronous, so the engine's own tests cannot see this. Here a copier
(LateCopier: the KVCopier seam, as the CUDA one) lands each load `delay` clock units after it
was issued, or at once when fenced (what waiting on its CUDA event orders); a stand-in forward
pass checks every K slot a scheduled chunk reads (K of token t at position p is t * 1000 + p)
and writes its new ones. Found by a review: a partial page copied from a page still loading,
and a sequence switched onto another request's loading pages.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from radixserve.cache.invariants import SequenceView, check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cache.tiers import HostTier
from radixserve.cache.transfer import PageCopier
from radixserve.engine.params import SamplingParams
from radixserve.engine.policy import make_schedule_policy
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.scheduler import ScheduledChunk, Scheduler

PAGE = 4
POOL = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1}


class Clock:
    """The scheduler's and the copier's time, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class LateLoad:
    """One load in flight: its pages are copied when it lands."""

    def __init__(self, copier: LateCopier, host_pages: Sequence[int], device_pages: Sequence[int],
                 ready_at: float) -> None:
        self.copier, self.host_pages, self.device_pages, self.ready_at = copier, list(host_pages), list(device_pages), ready_at
        self.landed = False

    def land(self) -> None:
        if not self.landed:
            PageCopier.load(self.copier, self.host_pages, self.device_pages)
            self.landed = True
            self.copier.in_flight.remove(self)

    def done(self) -> bool:
        return self.landed


class LateCopier(PageCopier):
    """Loads land `delay` clock units after they are issued, or when fenced."""

    def __init__(self, device: PagePool, host: PagePool, clock: Clock, delay: float) -> None:
        super().__init__(device, host)
        self.clock, self.delay = clock, delay
        self.in_flight: list[LateLoad] = []

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LateLoad:
        load = LateLoad(self, host_pages, device_pages, self.clock.now + self.delay)
        self.in_flight.append(load)
        return load

    def fence(self, handle: object) -> None:
        assert isinstance(handle, LateLoad)
        handle.land()

    def tick(self) -> None:
        for load in list(self.in_flight):
            if self.clock.now >= load.ready_at:
                load.land()


def k_of(token: int, position: int) -> float:
    return float(token * 1000 + position)


class Rig:
    """A scheduler over a device pool and a host tier whose loads land late."""

    def __init__(self, device_pages: int, host_pages: int, delay: float, max_batch_tokens: int = 256,
                 write_policy: str = "write-back", cache_partial_pages: bool = False) -> None:
        self.clock = Clock()
        self.device = PagePool(device_pages, PAGE, **POOL)
        self.host = PagePool(host_pages, PAGE, **POOL)
        self.copier = LateCopier(self.device, self.host, self.clock, delay)
        self.tree = RadixTree(self.device, clock=self.clock,
                              host=HostTier(self.host, self.copier, write_policy=write_policy, write_through_hits=1))
        self.scheduler = Scheduler(self.device, self.tree, make_schedule_policy("fcfs"), max_running=6,
                                   max_batch_tokens=max_batch_tokens, clock=self.clock,
                                   cache_partial_pages=cache_partial_pages)
        self.k = self.device.k_cache[0]
        self._ids = 0

    def cache(self, tokens: list[int]) -> None:
        """Caches `tokens` with their true K, on the device."""
        pages = self.device.allocate(len(tokens) // PAGE)
        for position, token in enumerate(tokens):
            self.k[pages[position // PAGE], position % PAGE, 0, 0] = k_of(token, position)
        self.tree.insert(tokens, pages)
        self.device.decref(pages)

    def submit(self, tokens: list[int], max_tokens: int = 1) -> SequenceState:
        request = Request(str(self._ids), tokens, SamplingParams(max_tokens=max_tokens), self.clock.now)
        self._ids += 1
        seq = SequenceState(request, 0, list(tokens), None, None, None)
        request.sequences.append(seq)
        self.scheduler.waiting.append(seq)
        return seq

    def step(self) -> list[ScheduledChunk]:
        """One step: time moves, due loads land, the chunks scheduled read (checked) and write."""
        self.clock.now += 1.0
        self.copier.tick()
        chunks = self.scheduler.schedule()
        for chunk in chunks:
            seq = chunk.seq
            assert all(load.done() for load in seq.pending_loads), "scheduled while its pages load"
            for position in range(seq.num_computed):
                page = seq.block_table[position // PAGE]
                read = self.k[page, position % PAGE, 0, 0].item()
                assert read == k_of(seq.token_ids[position], position), (
                    f"sequence {seq.request.request_id} reads position {position} from page {page}: {read}")
            for position in range(seq.num_computed, seq.num_computed + chunk.num_new):
                self.k[seq.block_table[position // PAGE], position % PAGE, 0, 0] = k_of(seq.token_ids[position],
                                                                                        position)
        self.scheduler.advance(chunks, lambda seq: seq.token_ids.append(7))
        return chunks


def test_a_partial_page_is_copied_after_its_load_lands() -> None:
    """A request ending inside a page that another request is loading back copies that page
    into its own at once: the copy waits for the load (it copied the stale page before)."""
    rig = Rig(16, 16, delay=1.0)
    a, b = list(range(100, 108)), list(range(200, 208))
    rig.cache(a + b)
    rig.tree.lock(rig.tree.match(a).node)  # a stays on the device
    rig.tree.evict(2)  # b goes to the host
    assert rig.tree.host_only_pages == 2
    for page in range(16):
        if rig.device.refcount(page) == 0:
            rig.k[page] = -1.0  # what a free device page held before
    loading = rig.submit(a + b + [1])
    partial = rig.submit(a + b[:2] + [9])  # two tokens into b's first page, which `loading` loads
    rig.scheduler.schedule()
    assert loading.pending_loads and not partial.pending_loads
    copy = partial.block_table[-1]
    assert rig.k[copy, :2, 0, 0].tolist() == [k_of(200, 8), k_of(201, 9)]


def test_a_sequence_switched_onto_loading_pages_waits_for_them() -> None:
    """A sequence that recomputed a tail (its own load back fell short) and then finds the
    tree holding that tail in pages another request is loading switches to those pages: it
    sits out until they land (it read them before)."""
    rig = Rig(16, 16, delay=3.0, max_batch_tokens=6)
    tokens = list(range(10, 50))  # 10 pages
    rig.cache(tokens)
    rig.tree.evict(10)
    others = rig.device.allocate(7)  # another holder's pages, cached: evicting them frees nothing
    rig.tree.insert(list(range(500, 528)), others)
    first = rig.submit(tokens + [1], max_tokens=4)
    for _ in range(3):
        rig.step()
    rig.device.decref(others[:5])  # memory frees up
    rig.submit(tokens + [2], max_tokens=4)
    for _ in range(12):
        rig.step()
    assert first.num_computed > len(tokens)


@pytest.mark.parametrize("write_policy", ["write-back", "write-through-selective", "exclusive"])
def test_random_traffic_never_reads_a_page_before_its_load_lands(write_policy: str) -> None:
    """Admissions over shared prefixes, aborts, errors, preemptions and resets under memory
    pressure, loads landing 1.5 steps late: every read is checked, and the invariants."""
    for seed in range(4):
        rng = random.Random(seed)
        rig = Rig(rng.choice([10, 14, 20]), rng.choice([6, 12, 30]), delay=1.5, max_batch_tokens=24,
                  write_policy=write_policy, cache_partial_pages=bool(seed % 2))
        prefixes = [[rng.randrange(3, 300) for _ in range(20)] for _ in range(3)]
        live: list[SequenceState] = []
        for _ in range(200):
            roll = rng.random()
            if roll < 0.35 and len(live) < 12:
                tokens = rng.choice(prefixes)[: rng.randrange(2, 21)] + [rng.randrange(3, 300)
                                                                          for _ in range(rng.randrange(1, 8))]
                live.append(rig.submit(tokens, max_tokens=rng.randrange(1, 12)))
            elif roll < 0.42 and live:
                seq = live.pop(rng.randrange(len(live)))
                rig.scheduler.finish(seq, cache=rng.random() < 0.6)  # an abort (cached) or an error
            elif roll < 0.47 and rig.scheduler.running:
                rig.scheduler.preempt(rng.choice(rig.scheduler.running))
            elif roll < 0.49:
                rig.tree.reset()
            rig.step()
            for seq in [s for s in live if len(s.token_ids) >= len(s.prompt_ids) + s.request.params.max_tokens]:
                live.remove(seq)
                rig.scheduler.finish(seq)
            views = [SequenceView(s.block_table, s.num_computed)
                     for s in rig.scheduler.running + rig.scheduler.waiting if s.block_table or s.num_computed]
            check_invariants(rig.device, rig.tree, views)
