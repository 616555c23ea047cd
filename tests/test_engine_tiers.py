"""The host tier in the engine: offload on eviction, load back on a hit, accounting, flush.

Every engine here runs with debug_checks on: the structural checker (host pool included)
runs after every step. The factual check reads pages on either tier.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine, Retention, SamplingParams
from radixserve.models.kv_check import verify_cached_kv
from tests.engine_util import cached_paths
from tests.test_engine import make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


def assert_every_cached_page_is_factual(engine: Engine) -> int:
    """Every cached page, on the device and on the host, holds the K/V of its tokens (a fresh
    computation of the whole path); returns how many host pages were checked."""
    host = engine.tree.host.pool
    offset = engine.pool.num_pages  # host page h is row offset + h of the joined caches
    k_all = [torch.cat([d, h]) for d, h in zip(engine.pool.k_cache, host.k_cache)]
    v_all = [torch.cat([d, h]) for d, h in zip(engine.pool.v_cache, host.v_cache)]
    checked_host = 0
    for tokens, device_first, host_first in cached_paths(engine):
        checked_host += sum(p >= offset for p in host_first)
        for pages in (device_first, host_first):
            bad = verify_cached_kv(engine.loaded.model, k_all, v_all, tokens, pages, engine.page_size)
            assert bad is None, f"page {pages[bad]} (host if >= {offset}) holds K/V of other tokens"
    return checked_host


@pytest.mark.parametrize("write_policy", ["write-back", "write-through-selective", "exclusive"])
def test_tiny_device_pool_with_a_host_tier_gives_the_same_tokens(ckpt: Path, write_policy: str) -> None:
    prompts = random_prompts(160, seed=11)
    params = [SamplingParams(max_tokens=random.Random(i).randrange(2, 10), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    ample = make_engine(ckpt, num_pages=1024).generate(prompts, params)
    tight = make_engine(ckpt, num_pages=24, max_batch_tokens=64, host_num_pages=48, host_write_policy=write_policy)
    ids = [tight.add_request(p, q) for p, q in zip(prompts, params)]
    aborted = set()
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while tight.has_work():
        for rid, deltas in tight.step().items():
            outputs[rid] += [t for d in deltas for t in d.token_ids]
        steps += 1
        if steps % 7 == 0:  # abort a request now and then, wherever it is
            victim = ids[(steps // 7 * 13) % len(ids)]
            if victim in tight._requests:
                tight.abort(victim)
                aborted.add(victim)
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["requests_aborted"] == len(aborted) > 0
    assert stats["cache_offloaded_pages"] > 0 and stats["cache_loaded_pages"] > 0
    assert stats["host_cached_tokens"] > 0 and stats["cache_host_evicted_pages"] > 0
    if write_policy == "write-through-selective":
        assert stats["cache_written_through_pages"] > 0
    for rid, out in zip(ids, ample):
        if rid not in aborted:
            assert outputs[rid] == out.token_ids
    assert assert_every_cached_page_is_factual(tight) > 0
    tight.flush_cache()
    assert tight.pool.num_free == tight.pool.num_pages
    assert tight.host_tier.pool.num_free == tight.host_tier.pool.num_pages
    assert tight.stats()["host_only_pages"] == 0


def _push_off_the_device(engine: Engine, count: int = 6) -> None:
    rng = random.Random(4)
    filler = [[rng.randrange(3, 190) for _ in range(60)] for _ in range(count)]
    engine.generate(filler, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


def test_a_request_after_offload_reports_the_host_hit(ckpt: Path) -> None:
    conversation = list(range(200, 240))  # 10 pages of 4
    hits = {}
    for host_pages in (0, 400):
        engine = make_engine(ckpt, page_size=4, num_pages=40, max_running=1, host_num_pages=host_pages)
        first = engine.generate([conversation], GREEDY)[0]
        _push_off_the_device(engine)
        if host_pages:
            assert engine.tree.match(conversation, (engine.model_name, None), update=False).pages == []
            assert engine.stats()["host_only_pages"] > 0
        again = engine.generate([conversation + first.token_ids[:3]], GREEDY)[0]
        hits[host_pages] = again.cached_tokens, engine.stats()
    (cached, stats), (no_host_cached, _) = hits[400], hits[0]
    # The new prompt matches 42 tokens: 10 full pages came back from the host (a partial
    # page is only taken from the device, so the 2 tokens after them are recomputed).
    assert cached == 40 and no_host_cached == 0
    assert stats["host_cached_tokens"] == 40 and stats["cache_loaded_pages"] == 10
    assert stats["device_cached_tokens"] == stats["cached_tokens"] - 40
    assert stats["kv_loaded_bytes"] == 10 * engine.host_tier.bytes_per_page > 0
    assert stats["host_pages_total"] == 400 and stats["host_pages_used"] == stats["host_pages_cached"]


def test_pages_below_the_offload_floor_are_dropped_not_offloaded(ckpt: Path) -> None:
    conversation = list(range(200, 240))
    cached = {}
    for floor in (0, 35):
        engine = make_engine(ckpt, page_size=4, num_pages=40, max_running=1, host_num_pages=400,
                             eviction_policy="priority", host_offload_min_priority=floor)
        engine.add_request(conversation, GREEDY, retention=Retention(10))
        while engine.has_work():
            engine.step()
        _push_off_the_device(engine)
        cached[floor] = engine.generate([conversation + [1]], GREEDY)[0].cached_tokens
        assert engine.stats()["cache_dropped_pages"] > 0 if floor else True
    assert cached == {0: 40, 35: 0}


def test_no_host_tier_is_the_single_tier_engine(ckpt: Path) -> None:
    for size in ({}, {"host_num_pages": 0}, {"host_kv_memory_gb": 0.0}):
        engine = make_engine(ckpt, **size)
        assert engine.host_tier is None and engine.tree.host is None
        stats = engine.stats()
        assert stats["host_pages_total"] == stats["cache_offloaded_pages"] == stats["host_cached_tokens"] == 0
    sized = make_engine(ckpt, host_kv_memory_gb=0.001)
    assert sized.host_tier.pool.num_pages == int(0.001 * 2**30) // sized.host_tier.bytes_per_page


def test_host_tier_settings_are_validated(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        make_engine(ckpt, host_num_pages=8, host_kv_memory_gb=0.1)
    with pytest.raises(ValueError, match="host_num_pages"):
        make_engine(ckpt, host_num_pages=-1)
    with pytest.raises(ValueError, match="host_write_policy"):
        make_engine(ckpt, host_num_pages=8, host_write_policy="write-around")
    with pytest.raises(ValueError, match="host_offload_min_priority"):
        make_engine(ckpt, host_num_pages=8, host_offload_min_priority=200)
    for size in ({"host_kv_memory_gb": 1e-12}, {"kv_memory_gb": 1e-9}):  # under one page: named, with the minimum
        (name,) = size
        with pytest.raises(ValueError, match=rf"^{name}: .* GiB holds no page of \d+ tokens of this model "
                                             r"\(\d+ bytes; at least .* GiB\)$"):
            make_engine(ckpt, **size, **({"num_pages": None} if "kv_memory_gb" in size else {}))
