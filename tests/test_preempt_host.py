"""Preemption into the host tier: a preempted sequence's computed full pages go to the tree,
so device eviction offloads them to the host tier (when there is one) and its resumption
loads them back instead of recomputing them. Output stays token-identical; the share of
computed tokens that are recomputed (`recomputed_tokens` / `computed_tokens`) drops.

Engines run with debug_checks on: the structural checker runs after every step.
"""

from __future__ import annotations

import random
from pathlib import Path

from radixserve import SamplingParams
from radixserve.benchmark.sim_server import reply_tokens
from radixserve.benchmark.simulate import SimConfig, simulate
from radixserve.benchmark.workloads import make_workload
from tests.test_engine import make_engine, random_prompts


def _long_replies(count: int) -> list[SamplingParams]:
    """Replies long enough that a preempted sequence has decoded pages to lose."""
    return [SamplingParams(max_tokens=random.Random(i).randrange(8, 24), temperature=0.0, ignore_eos=True)
            for i in range(count)]


def test_preemption_into_the_host_tier_is_token_identical_and_recomputes_less(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(48, seed=5)
    params = _long_replies(len(prompts))
    ample = make_engine(tiny_llama_dir, num_pages=1024).generate(prompts, params)
    shares = {}
    for host_pages in (0, 512):
        tight = make_engine(tiny_llama_dir, num_pages=20, max_batch_tokens=64, host_num_pages=host_pages)
        squeezed = tight.generate(prompts, params)
        assert [o.token_ids for o in squeezed] == [o.token_ids for o in ample]
        stats = tight.stats()
        assert stats["preemptions"] > 0
        assert 0 <= stats["recomputed_tokens"] < stats["computed_tokens"]
        shares[host_pages] = stats["recomputed_tokens"] / stats["computed_tokens"], stats
    (without, _), (with_host, tiered) = shares[0], shares[512]
    assert without > 0  # the device alone drops a preempted sequence's pages under pressure
    assert tiered["cache_loaded_pages"] > 0
    assert with_host < without / 2


def test_the_recomputed_share_counts_exactly_the_work_preemption_threw_away() -> None:
    # Without a cache nothing survives a preemption: every preempted sequence recomputes all
    # it had computed, so computed = prompt + generated work + recomputed.
    workload = make_workload("multiturn", num_clients=16, num_turns=3)
    result = simulate(workload, SimConfig(capacity_tokens=12_000, use_cache=False, max_running=32))
    assert result.preemptions > 0 and result.recomputed_tokens > 0
    # A request's last generated token (its reply's end) is never run through the model.
    generated = sum(len(reply_tokens(r, prompt_only=False)) - 1 for r in workload.requests)
    assert result.computed_tokens - result.recomputed_tokens == result.prompt_tokens + generated


def test_a_host_tier_keeps_the_recomputed_share_under_pressure_small() -> None:
    workload = make_workload("multiturn")
    plain = simulate(workload, SimConfig(capacity_tokens=20_000, max_running=64))
    tiered = simulate(workload, SimConfig(capacity_tokens=20_000, host_capacity_tokens=200_000, max_running=64))
    assert plain.preemptions > 0 and tiered.preemptions > 0
    plain_share, tiered_share = (r.recomputed_tokens / r.computed_tokens for r in (plain, tiered))
    assert plain_share > 0.05
    assert tiered_share < 0.02
    assert tiered.to_dict()["recomputed_share"] == tiered_share


def test_a_preempted_sequence_leaves_its_decoded_pages_to_the_tiers_and_gets_them_back(tiny_llama_dir: Path) -> None:
    """Preempted mid-decode (paused: Scheduler.preempt), then its device pages pushed to the
    host tier by other work: its resumption loads every full page it had computed, prompt
    and decoded tokens alike, and recomputes less than a page."""
    prompt = list(range(120, 142))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = make_engine(tiny_llama_dir).generate([prompt], params)[0].token_ids
    engine = make_engine(tiny_llama_dir, num_pages=24, max_running=1, host_num_pages=256)
    rid = engine.add_request(prompt, params)
    out: list[int] = []
    while len(out) < 25:
        out += [t for d in engine.step().get(rid, []) for t in d.token_ids]
    (seq,) = engine._requests[rid].sequences
    computed = seq.num_computed
    assert engine.pause_request(rid)
    full = computed // engine.page_size * engine.page_size
    held = engine.tree.match(seq.token_ids[:full], seq.namespace, update=False)
    assert len(held.pages) * engine.page_size == full  # decoded pages too, not only the prompt's
    engine.generate([list(range(200 + 30 * i, 230 + 30 * i)) for i in range(3)],
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.stats()["host_only_pages"] > 0
    engine.resume_request(rid)
    while engine.has_work():
        out += [t for d in engine.step().get(rid, []) for t in d.token_ids]
    assert out == expected
    stats = engine.stats()
    assert stats["cache_loaded_pages"] >= full // engine.page_size - len(prompt) // engine.page_size
    assert stats["recomputed_tokens"] < engine.page_size
