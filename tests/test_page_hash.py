"""Page hashes: the documented spec, re-implemented from scratch, gives the same numbers."""

from __future__ import annotations

import hashlib

import numpy as np

from radixserve import Engine, SamplingParams
from radixserve.cache.events import BlockStored
from radixserve.cache.page_hash import namespace_id, namespace_seed, page_hashes

M = (1 << 64) - 1


def mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)


def spec_hashes(tokens: list[int], page_size: int, salt: str | None, model: str) -> list[int]:
    """What an outside indexer would write from the spec in page_hash.py's docstring."""
    ns = hashlib.blake2b(f"{model}\x00{salt or ''}".encode(), digest_size=8).hexdigest()
    seed = int.from_bytes(hashlib.blake2b(ns.encode(), digest_size=8).digest(), "little")
    out, state = [], 0
    for k in range(1, len(tokens) // page_size + 1):
        page = tokens[(k - 1) * page_size: k * page_size]
        digest = mix(sum(mix(t + 1) * mix(j) for j, t in enumerate(page, start=1)) & M)
        state = (state + digest * mix((k * 0x9E3779B97F4A7C15) & M)) & M
        out.append(mix((state + seed) & M))
    return out


def test_the_spec_gives_the_same_hashes() -> None:
    tokens = [5, 900, 31, 7, 7, 7, 120000, 2, 0, 44]
    ns = namespace_id(("m", "tenant"))
    got, _ = page_hashes(np.asarray(tokens), 3, namespace_seed(ns))
    assert got.tolist() == spec_hashes(tokens, 3, "tenant", "m")
    assert ns == hashlib.blake2b(b"m\x00tenant", digest_size=8).hexdigest()


def test_a_chain_continues_where_it_stopped() -> None:
    tokens = np.arange(100, 164)
    whole, end = page_hashes(tokens, 8, seed=3)
    head, state = page_hashes(tokens[:24], 8, seed=3)
    tail, end2 = page_hashes(tokens[24:], 8, seed=3, state=state, first_page=3)
    assert np.array_equal(np.concatenate([head, tail]), whole) and end == end2


def test_hashes_depend_on_the_whole_prefix_and_the_namespace() -> None:
    a = np.arange(32)
    b = a.copy()
    b[0] = 99
    ha, hb = page_hashes(a, 8)[0], page_hashes(b, 8)[0]
    assert len(ha) == 4 and not np.any(ha == hb)
    hc = page_hashes(a, 8, seed=namespace_seed(namespace_id(("m", "x"))))[0]
    assert not np.any(ha == hc)


def test_engine_events_name_pages_as_the_spec_does(tiny_llama_dir) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=64, debug_checks=True)
    stored: list[BlockStored] = []
    unsubscribe = engine.subscribe_events(lambda e: stored.append(e) if isinstance(e, BlockStored) else None)
    prompt = list(range(3, 14))  # 11 tokens: 2 full pages are cached after the prefill
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), cache_salt="t")
    while engine.has_work():
        engine.step()
    expected = spec_hashes(prompt, 4, "t", engine.model_name)
    assert [h for e in stored for h in e.hashes] == expected
    assert stored[0].parent_hash is None and stored[0].namespace == namespace_id((engine.model_name, "t"))
    assert engine.cache_page_hashes() == {(stored[0].namespace, h) for h in expected}
    unsubscribe()
    engine.flush_cache()
    assert len(stored) == 1  # nothing delivered after unsubscribing
