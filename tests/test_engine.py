"""Engine: outputs equal transformers', cached or not, evicted or not, preempted or not.

Every engine here runs with debug_checks on: the structural checker runs after every step.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from radixserve import Engine, PromptTooLong, QueueFull, Retention, SamplingParams
from radixserve.models.kv_check import verify_cached_kv
from tests.engine_util import hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


def make_engine(ckpt: Path, **kwargs) -> Engine:
    kwargs.setdefault("page_size", 4)
    kwargs.setdefault("num_pages", 256)
    return Engine(model=str(ckpt), debug_checks=True, **kwargs)


def random_prompts(n: int, seed: int, groups: int = 5, prefix_len: int = 24, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(groups)]
    return [prefixes[rng.randrange(groups)][: rng.randrange(4, prefix_len + 1)]
            + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))] for _ in range(n)]


def assert_cached_kv_is_factual(engine: Engine) -> None:
    """Every cached leaf path's K/V equal a fresh computation of its tokens (the factual check
    of README.md, "How correctness is checked")."""
    leaves = [node for node, _ in engine.tree.nodes() if not node.children and not node.is_root]
    assert leaves
    for leaf in leaves:
        tokens, pages, node = [], [], leaf
        while not node.is_root:
            tokens[:0], pages[:0] = list(node.tokens), list(node.pages)
            node = node.parent
        bad = verify_cached_kv(engine.loaded.model, engine.pool.k_cache, engine.pool.v_cache, tokens, pages,
                               engine.page_size)
        assert bad is None, f"cached page {pages[bad]} holds K/V of other tokens"


def test_greedy_equals_transformers(ckpt: Path) -> None:
    prompts = random_prompts(6, seed=1)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for page_size in (1, 4, 16):
        engine = make_engine(ckpt, page_size=page_size)
        outs = engine.generate(prompts, params)
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(ckpt, prompt, 32), f"page_size {page_size}"
            assert out.finish_reason == "length" and out.prompt_tokens == len(prompt)


def test_cache_hit_path_equals_transformers_and_stored_kv_is_factual(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    system = list(range(10, 50))
    first = engine.generate([system + [7, 8, 9]], GREEDY)[0]
    assert first.cached_tokens == 0
    second_prompt = system + [60, 61]
    second = engine.generate([second_prompt], GREEDY)[0]
    assert second.cached_tokens == len(system)  # token-deep: the partial page is copied too
    assert second.token_ids == hf_greedy(ckpt, second_prompt, 12)
    match = engine.tree.match(system, (engine.model_name, None), update=False)
    assert len(match.pages) == len(system) // 4
    model = engine.loaded.model
    assert verify_cached_kv(model, engine.pool.k_cache, engine.pool.v_cache, system, match.pages, 4) is None


@pytest.mark.parametrize("partial", [True, False])
def test_multi_turn_reports_previous_conversation_cached(ckpt: Path, partial: bool) -> None:
    engine = make_engine(ckpt, page_size=4, cache_partial_pages=partial)
    conversation = list(range(100, 131))
    previous_computed = 0  # what the turn before computed (none before the first)
    for turn in range(4):
        out = engine.generate([conversation], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
        if turn > 0:
            # Everything computed last turn (all but its final token) is a hit: with partial
            # pages cached, its last, partly filled page too; without, whole pages only.
            assert out.cached_tokens == (previous_computed if partial else (previous_computed // 4) * 4)
        previous_computed = len(conversation) + len(out.token_ids) - 1
        conversation = conversation + out.token_ids + [290 + turn, 291 + turn, 292 + turn]


def test_heavy_eviction_and_preemption_are_token_identical(ckpt: Path) -> None:
    prompts = random_prompts(200, seed=7)
    params = [SamplingParams(max_tokens=random.Random(i).randrange(2, 10), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    ample = make_engine(ckpt, num_pages=1024).generate(prompts, params)
    tight = make_engine(ckpt, num_pages=24, max_batch_tokens=64)
    squeezed = tight.generate(prompts, params)
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["cache_evicted_pages"] > 0
    assert stats["pages_used"] == stats["pages_total"] - stats["pages_free"]
    assert not {"cache_cached_pages", "cache_free_pages"} & set(stats)  # reported once, as pages_*
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in ample]
    for i in (0, 57, 199):
        assert ample[i].token_ids == hf_greedy(ckpt, prompts[i], len(ample[i].token_ids))
    assert_cached_kv_is_factual(tight)
    cached = tight.tree.cached_pages
    assert cached > 0 and tight.pool.num_free == tight.pool.num_pages - cached  # nothing else held
    assert tight.flush_cache() == cached and tight.pool.num_free == tight.pool.num_pages


def test_chunked_prefill_gives_the_same_tokens(ckpt: Path) -> None:
    prompt = list(range(3, 203))
    whole = make_engine(ckpt).generate([prompt], GREEDY)[0]
    chunked = make_engine(ckpt, max_batch_tokens=16).generate([prompt], GREEDY)[0]
    assert chunked.token_ids == whole.token_ids == hf_greedy(ckpt, prompt, 12)


def test_in_batch_sharing_computes_a_shared_prefix_once(ckpt: Path) -> None:
    engine = make_engine(ckpt, page_size=4)
    shared = list(range(260, 300))
    outs = engine.generate([shared + [1, 2], shared + [3, 4], shared + [5, 6]], GREEDY)
    assert sorted(o.cached_tokens for o in outs) == [0, 40, 40]
    assert engine.stats()["deferred_for_sharing"] > 0


def test_abort_in_prefill_and_decode_frees_every_page(ckpt: Path) -> None:
    engine = make_engine(ckpt, max_batch_tokens=8)
    long_prompt = list(range(3, 80))
    a = engine.add_request(long_prompt, SamplingParams(max_tokens=50, temperature=0.0))
    b = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()  # a is mid-prefill (8 of 77 tokens), b waits or starts
    engine.abort(a)
    for _ in range(5):
        engine.step()
    assert engine.scheduler.running and engine.scheduler.running[0].output_ids  # b decodes
    engine.abort(b)
    engine.check_invariants()
    assert not engine.has_work() and engine.tree.locked_pages == 0
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_n_samples_share_prompt_pages_and_seeds_reproduce(ckpt: Path) -> None:
    engine = make_engine(ckpt, page_size=4)
    prompt = list(range(20, 38))  # 18 tokens: 4 full pages + a partial page of 2
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1234, n=4, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    engine.step()  # prefill + first token of every sample
    seqs = engine.scheduler.running
    assert len(seqs) == 4
    full_pages = set(seqs[0].block_table[:4])
    assert all(set(s.block_table[:4]) == full_pages for s in seqs)  # shared, not copied
    assert all(engine.pool.refcount(p) == 4 + 1 for p in full_pages)  # 4 samples + the tree
    assert len({s.block_table[4] for s in seqs}) == 4  # the partial page is copied per sample
    while engine.has_work():
        engine.step()
    again = make_engine(ckpt, page_size=4).generate([prompt], params)
    first = make_engine(ckpt, page_size=4).generate([prompt], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert len({tuple(o.token_ids) for o in first}) > 1  # different samples differ
    del rid


def test_top_k_one_is_greedy_and_logprobs_are_consistent(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    prompt = list(range(40, 60))
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                      logprobs=3))[0]
    topk1 = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3,
                                                     ignore_eos=True))[0]
    assert topk1.token_ids == greedy.token_ids
    for lp, token in zip(greedy.logprobs, greedy.token_ids):
        assert lp.token_id == token and lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1])
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_stop_strings_and_stop_tokens(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    prompt = list(range(40, 60))
    free = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    stop_token = free.token_ids[5]
    by_token = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                        stop_token_ids=[stop_token]))[0]
    assert by_token.finish_reason == "stop" and by_token.token_ids[-1] == stop_token
    assert stop_token not in by_token.token_ids[:-1]
    text = free.text
    if len(text.strip()) >= 4:
        stop = text.strip()[1:3]
        by_string = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                             stop=[stop]))[0]
        assert by_string.finish_reason == "stop"
        assert by_string.text == text[: text.index(stop)]


def test_cache_salt_isolates_namespaces(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    prompt = list(range(3, 43))
    engine.add_request(prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_work():
        engine.step()
    rid = engine.add_request(prompt, GREEDY, cache_salt="tenant-b")
    request = engine._requests[rid]
    while engine.has_work():
        engine.step()
    assert request.cached_tokens == 0
    rid = engine.add_request(prompt, GREEDY, cache_salt="tenant-a")
    request = engine._requests[rid]
    while engine.has_work():
        engine.step()
    assert request.cached_tokens == len(prompt) - 1


def test_retention_keeps_the_system_prompt_under_pressure(ckpt: Path) -> None:
    # One request at a time: the filler then needs only part of the pool, and the rest is
    # decided by retention alone.
    engine = make_engine(ckpt, page_size=4, num_pages=40, max_running=1)
    system = list(range(200, 232))  # 8 pages
    engine.add_request(system + [1], GREEDY, prefix_retention=(len(system), Retention(90)))
    while engine.has_work():
        engine.step()
    rng = random.Random(0)
    filler = [[rng.randrange(3, 190) for _ in range(60)] for _ in range(6)]
    engine.generate(filler, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    hit = engine.generate([system + [2, 3]], GREEDY)[0]
    assert hit.cached_tokens == len(system)


def test_session_keeps_latest_turn_until_closed(ckpt: Path) -> None:
    engine = make_engine(ckpt, page_size=4, num_pages=40, max_running=1)
    turn = list(range(250, 282))
    rid = engine.add_request(turn, GREEDY, session_id="s1")
    while engine.has_work():
        engine.step()
    rng = random.Random(1)
    filler = [[rng.randrange(3, 190) for _ in range(60)] for _ in range(6)]
    engine.generate(filler, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.generate([turn + [1]], GREEDY)[0].cached_tokens == len(turn)
    assert engine.close_session("s1") and not engine.close_session("s1")
    engine.generate(filler, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.generate([turn + [1]], GREEDY)[0].cached_tokens < len(turn)
    del rid


def test_bad_requests_are_refused_and_lose_nothing(ckpt: Path) -> None:
    engine = make_engine(ckpt, num_pages=16, max_queue=2)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1, 2], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], GREEDY)
    with pytest.raises(PromptTooLong):
        engine.add_request(list(range(3, 100)), GREEDY)  # needs more than 16 pages of 4
    with pytest.raises(PromptTooLong):
        engine.add_request([5] * 1020, SamplingParams(max_tokens=10))
    engine.add_request([5, 6], GREEDY)
    engine.add_request([5, 7], GREEDY)
    with pytest.raises(QueueFull):
        engine.add_request([5, 8], GREEDY)
    while engine.has_work():
        engine.step()
    assert engine.stats()["requests_finished"] == 2


def test_a_full_queue_refuses_the_tenant_that_filled_it_not_the_next(ckpt: Path) -> None:
    """--max-queue 4: one tenant keeping the queue full is refused; another tenant still gets
    in, up to its share (4 over the two tenants waiting: 2), and then a third up to 4 / 3."""
    engine = make_engine(ckpt, num_pages=64, max_queue=4)
    for i in range(4):
        engine.add_request([5, 6, i], GREEDY, tenant="mallory")
    with pytest.raises(QueueFull):
        engine.add_request([5, 6, 9], GREEDY, tenant="mallory")
    engine.add_request([7, 1], GREEDY, tenant="victim")
    engine.add_request([7, 2], GREEDY, tenant="victim")
    with pytest.raises(QueueFull):  # its share of a full queue: 2 of 4
        engine.add_request([7, 3], GREEDY, tenant="victim")
    engine.add_request([8, 1], GREEDY, tenant="third")
    engine.add_request([8, 2], GREEDY, tenant="third")  # 1 * 3 < 4
    with pytest.raises(QueueFull):  # 2 * 3 >= 4
        engine.add_request([8, 3], GREEDY, tenant="third")
    engine.add_request([9, 1], GREEDY)  # the server's single tenant: one more, none waiting yet
    while engine.has_work():
        engine.step()
    assert engine.stats()["requests_finished"] == 9
    engine.check_invariants()


def test_cache_aware_policies_beat_fcfs_on_shuffled_groups(ckpt: Path) -> None:
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 300) for _ in range(48)] for _ in range(6)]
    prompts = [p + [rng.randrange(3, 300) for _ in range(4)] for p in prefixes for _ in range(6)]
    rng.shuffle(prompts)
    rates = {}
    for policy in ("fcfs", "lpm", "dfs-weight"):
        engine = make_engine(ckpt, page_size=4, num_pages=40, max_running=2, schedule_policy=policy)
        engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        rates[policy] = engine.stats()["hit_rate"]
    assert rates["lpm"] > rates["fcfs"] and rates["dfs-weight"] > rates["fcfs"], rates


def test_incremental_detokenizer_never_splits_characters(ckpt: Path) -> None:
    from radixserve.engine.detokenizer import IncrementalDetokenizer

    engine = make_engine(ckpt)
    text = "héllo wörld 🙂🚀 ça va? 日本語"
    ids = engine.tokenizer.encode(text)
    detok = IncrementalDetokenizer(engine.tokenizer)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)



def test_prefix_cache_off_shares_nothing_and_gives_the_same_tokens(ckpt: Path) -> None:
    prompts = [list(range(10, 50)) + [i] for i in range(3)]
    cached = make_engine(ckpt).generate(prompts, GREEDY)
    engine = make_engine(ckpt, enable_prefix_cache=False)
    plain = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in plain] == [o.token_ids for o in cached]
    assert [o.cached_tokens for o in plain] == [0, 0, 0] and max(o.cached_tokens for o in cached) > 0
    assert engine.tree.cached_pages == 0 and engine.pool.num_free == engine.pool.num_pages


def test_reuse_boost_retains_a_prefix_seen_before(ckpt: Path) -> None:
    """A document seen twice outranks one-off prompts; under plain LRU it would go first."""
    rng = random.Random(5)
    document = [rng.randrange(3, 300) for _ in range(32)]
    one_offs = [[rng.randrange(3, 300) for _ in range(60)] for _ in range(6)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    hits = {}
    for policy in ("reuse-boost", "lru"):
        engine = make_engine(ckpt, page_size=4, num_pages=40, max_running=1, eviction_policy=policy)
        engine.generate([document + [1], document + [2]], params)  # seen twice: reused
        engine.generate(one_offs, params)
        hits[policy] = engine.generate([document + [3]], params)[0].cached_tokens
    assert hits["reuse-boost"] == len(document) and hits["lru"] < len(document), hits


def test_an_idle_session_expires_into_ordinary_cache(ckpt: Path) -> None:
    engine = make_engine(ckpt, page_size=4, num_pages=40, max_running=1, session_ttl_s=0.2,
                         eviction_policy="priority")
    turn = list(range(250, 282))
    engine.add_request(turn, GREEDY, session_id="s1")
    while engine.has_work():
        engine.step()
    time.sleep(0.3)  # idle past the TTL: the session's retention has decayed
    rng = random.Random(1)
    filler = [[rng.randrange(3, 190) for _ in range(60)] for _ in range(6)]
    engine.generate(filler, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.generate([turn + [1]], GREEDY)[0].cached_tokens < len(turn)


def test_edge_values_are_handled(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    prompt = list(range(40, 60))
    greedy = engine.generate([prompt], GREEDY)[0]
    tiny_temperature = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1e-40,
                                                                ignore_eos=True))[0]
    assert tiny_temperature.token_ids == greedy.token_ids
    huge_seed = SamplingParams(max_tokens=4, seed=2**70, ignore_eos=True)
    assert engine.generate([prompt], huge_seed)[0].token_ids == engine.generate([prompt], huge_seed)[0].token_ids
    for bad in ({"max_running": 0}, {"max_batch_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_engine(ckpt, **bad)


def test_closing_a_session_keeps_another_requests_higher_retention(ckpt: Path) -> None:
    engine = make_engine(ckpt, page_size=4, num_pages=40, max_running=1, eviction_policy="priority")
    system = list(range(200, 232))
    engine.add_request(system + [1], GREEDY, prefix_retention=(len(system), Retention(100)))
    engine.add_request(system + [2, 3], GREEDY, session_id="s")
    while engine.has_work():
        engine.step()
    assert engine.close_session("s")
    rng = random.Random(0)
    filler = [[rng.randrange(3, 190) for _ in range(60)] for _ in range(6)]
    engine.generate(filler, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.generate([system + [4, 5]], GREEDY)[0].cached_tokens == len(system)


def test_stop_string_in_the_text_released_at_the_end_is_a_stop(ckpt: Path) -> None:
    """The last token can leave text held back (an unfinished UTF-8 character, released as
    U+FFFD when the sample ends); a stop string found in it makes the reason "stop"."""
    engine = make_engine(ckpt)
    lead_byte = engine.tokenizer.convert_tokens_to_ids("Ã")  # byte 0xC3: begins a 2-byte character
    assert engine.tokenizer.decode([lead_byte]) == "\ufffd"

    def force_lead_byte(module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., lead_byte] = 1e4
        return logits

    handle = engine.loaded.model.register_forward_hook(force_lead_byte)  # the logits
    try:
        plain = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
        stopped = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                                             stop=["\ufffd"]))[0]
    finally:
        handle.remove()
    assert (plain.token_ids, plain.text, plain.finish_reason) == ([lead_byte], "\ufffd", "length")
    assert (stopped.token_ids, stopped.text, stopped.finish_reason) == ([lead_byte], "", "stop")


@pytest.mark.parametrize("max_session_tokens", [10**6, 90])
def test_sessions_together_raise_at_most_their_token_bound(ckpt: Path, max_session_tokens: int) -> None:
    """Past max_session_tokens the least recently active sessions end early: their turns
    become ordinary cache (evicted under pressure) while the newer sessions' stay."""
    engine = make_engine(ckpt, page_size=4, num_pages=48, max_running=1, eviction_policy="priority",
                         max_session_tokens=max_session_tokens)
    turns = {"oldest": list(range(250, 282)), "middle": list(range(200, 232)), "newest": list(range(150, 182))}
    for session_id, turn in turns.items():
        engine.add_request(turn, GREEDY, session_id=session_id)
        while engine.has_work():
            engine.step()
    raised = len(turns["newest"]) + GREEDY.max_tokens - 1  # computed tokens of one turn: 43
    bounded = max_session_tokens < 3 * raised  # 90: room for two turns
    assert engine.stats()["sessions_open"] == (2 if bounded else 3)
    assert engine.sessions.tokens == (2 if bounded else 3) * raised
    rng = random.Random(0)
    filler = [[rng.randrange(3, 140) for _ in range(40)] for _ in range(6)]
    engine.generate(filler, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    cached = {sid: engine.generate([turn + [1]], GREEDY)[0].cached_tokens for sid, turn in turns.items()}
    assert cached == {"oldest": 0 if bounded else 32, "middle": 32, "newest": 32}
    assert [engine.close_session(sid) for sid in turns] == [not bounded, True, True]
