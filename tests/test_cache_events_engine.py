"""Cache events at the engine: an indexer fed only by `Engine.subscribe_events` holds exactly the
tree's pages after over a thousand random requests with eviction, preemption, flushes and aborts."""

from __future__ import annotations

import random
from pathlib import Path

from cache_indexer import PageIndexer, tree_page_hashes

from radixserve import Engine, SamplingParams

PAGE_SIZE = 4
NUM_PAGES = 48
NUM_REQUESTS = 1300  # with the odds below, the counts asserted at the end hold with a margin
ABORT_ODDS = 0.05  # per step: abort a live request
FLUSH_ODDS = 0.035  # per step, when not aborting: flush the cache


def test_event_indexer_matches_the_tree_through_a_random_workload(tiny_llama_dir: Path) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                    max_batch_tokens=256, debug_checks=True, seed=1)
    indexer, with_tokens = PageIndexer(), PageIndexer()
    unsubscribe = engine.subscribe_events(indexer.apply)
    engine.subscribe_events(with_tokens.apply, include_token_ids=True)
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))] for _ in range(12)]
    live: list[str] = []
    sent = flushes = aborts = checks = 0

    def check() -> None:
        nonlocal checks
        truth = tree_page_hashes(engine.tree)
        assert indexer.pages == truth == with_tokens.pages
        assert truth == engine.cache_page_hashes()
        checks += 1

    while sent < NUM_REQUESTS or engine.has_work():
        for _ in range(rng.randrange(0, 7) if sent < NUM_REQUESTS else 0):
            prompt = rng.choice(prefixes) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(max_tokens=rng.randrange(1, 5), temperature=rng.choice([0.0, 1.0]),
                                    n=rng.choice([1, 1, 1, 2]), ignore_eos=True, seed=rng.randrange(1000))
            live.append(engine.add_request(prompt[:120], params, cache_salt=rng.choice([None, None, "tenant"])))
            sent += 1
        roll = rng.random()
        if roll < ABORT_ODDS and live:
            engine.abort(live.pop(rng.randrange(len(live))))
            aborts += 1
        elif roll < ABORT_ODDS + FLUSH_ODDS:
            engine.flush_cache()
            flushes += 1
            check()
        engine.step()
        if rng.random() < 0.1:
            check()
    check()
    stats = engine.stats()
    # The workload did exercise what it claims to.
    assert stats["preemptions"] > 0 and stats["cache_evicted_pages"] > 1000 and flushes > 10 and aborts > 10
    assert indexer.counts["removed"] > 100 and indexer.counts["cleared"] == flushes
    assert with_tokens.token_ids_seen == indexer.counts["stored"] > 1000
    assert indexer.seq == engine.cache_events.seq and checks > 50
    # Unsubscribed, the indexer hears nothing more.
    unsubscribe()
    seq = indexer.seq
    engine.flush_cache()
    assert indexer.seq == seq and with_tokens.seq == seq + 1
