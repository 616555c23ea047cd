"""Steps that carry decoding streams prefill only up to the next multiple of `mixed_prefill_tokens`.

Every stream decoding in a step waits for the whole step, and a step's time grows with its
prompt tokens: the cap bounds those gaps, and counting the decodes in it keeps the step's rows
in whole tiles of the linear kernels. Steps with nobody decoding keep the whole budget.
Checked chunk by chunk on the scheduler alone, then end to end on an engine against
transformers' tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.engine.policy import make_schedule_policy
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.step_cost import ChunkCost
from tests.engine_util import hf_greedy
from tests.test_engine import random_prompts
from tests.test_scheduler_advance import PAGE, queue


def make_scheduler(mixed_prefill_tokens: int | None, max_batch_tokens: int = 64) -> Scheduler:
    pool = PagePool(64, PAGE)
    return Scheduler(pool, RadixTree(pool), make_schedule_policy("fcfs"), max_running=8,
                     max_batch_tokens=max_batch_tokens, clock=lambda: 0.0,
                     mixed_prefill_tokens=mixed_prefill_tokens)


def run(scheduler: Scheduler) -> list[tuple[str, int]]:
    """One step: its chunks as (request id, tokens); a sequence whose chunk reached its last
    token gets a next token, as the engine's sampler would give it."""
    chunks = scheduler.schedule()
    ended = [c.seq for c in chunks if c.needs_logits]
    scheduler.advance(chunks, lambda seq: None)
    for seq in ended:
        seq.token_ids.append(7)
    return [(c.seq.request.request_id, c.num_new) for c in chunks]


def test_a_prompt_beside_a_decoding_stream_fills_steps_of_the_cap() -> None:
    scheduler = make_scheduler(mixed_prefill_tokens=8)
    queue(scheduler, "a", [1, 2, 3])
    assert run(scheduler) == [("a", 3)]
    queue(scheduler, "b", list(range(10, 40)))  # 30 prompt tokens, 7 a step beside a's decode
    steps = [run(scheduler) for _ in range(5)]
    assert steps == [[("a", 1), ("b", 7)]] * 4 + [[("a", 1), ("b", 2)]]


def test_prompts_share_the_capped_step_in_the_policys_order() -> None:
    """Beside one decode and a cap of 8: b's 4 prompt tokens, then 3 of c's; d waits (the
    step's prefill is spent). The next step: 6 more of c's beside two decodes."""
    scheduler = make_scheduler(mixed_prefill_tokens=8)
    queue(scheduler, "a", [1, 2, 3])
    run(scheduler)
    queue(scheduler, "b", [40, 41, 42, 43])
    queue(scheduler, "c", list(range(50, 80)))
    queue(scheduler, "d", list(range(90, 100)))
    assert run(scheduler) == [("a", 1), ("b", 4), ("c", 3)]
    assert [seq.request.request_id for seq in scheduler.waiting] == ["d"]
    assert run(scheduler) == [("a", 1), ("b", 1), ("c", 6)]  # two decodes now: 6 to reach 8


def test_counted_with_their_attention_chunks_shrink_as_the_context_grows() -> None:
    """A key at 1/16 of a token and a cap of 16 beside one decode (15 to spend): the prompt's
    chunks are 10, 7, 6 and 5 tokens, each costing at most 15 with the keys before it."""
    scheduler = make_scheduler(mixed_prefill_tokens=16)
    scheduler.chunk_cost = ChunkCost(key_cost=1 / 16)
    queue(scheduler, "a", [1, 2, 3])
    run(scheduler)
    queue(scheduler, "b", list(range(10, 70)))
    assert [run(scheduler) for _ in range(4)] == [[("a", 1), ("b", n)] for n in (10, 7, 6, 5)]


def test_without_a_cap_the_prompt_takes_the_rest_of_the_budget() -> None:
    scheduler = make_scheduler(mixed_prefill_tokens=None, max_batch_tokens=16)
    queue(scheduler, "a", [1, 2, 3])
    run(scheduler)
    queue(scheduler, "b", list(range(10, 40)))
    assert [run(scheduler) for _ in range(2)] == [[("a", 1), ("b", 15)], [("a", 1), ("b", 15)]]


def test_steps_with_nobody_decoding_keep_the_whole_budget() -> None:
    """Prefills with nobody decoding beside them (nobody waits for those steps but the prompts
    themselves): the cap does not apply. A prompt's last token is not prefill either."""
    scheduler = make_scheduler(mixed_prefill_tokens=8, max_batch_tokens=40)
    queue(scheduler, "a", list(range(1, 51)))
    queue(scheduler, "b", list(range(100, 131)))
    assert run(scheduler) == [("a", 40)]
    assert run(scheduler) == [("a", 10), ("b", 30)]
    assert run(scheduler) == [("a", 1), ("b", 1)]


@pytest.mark.parametrize(("cap", "streams", "prompt_tokens"), [
    (4, 5, 3),  # 5 decodes, a cap of 4: the step is rounded up to 8, 3 prompt tokens
    (8, 7, 9),  # 7 decodes, a cap of 8: 1 prompt token would fill it; at least half the cap: 16 in all
])
def test_decoding_streams_all_run_and_cannot_starve_a_prompt(cap: int, streams: int, prompt_tokens: int) -> None:
    """Every decoding stream runs, however many; the prompt beside them gets enough to bring
    the step to a multiple of the cap, and at least half the cap (else a client holding
    cap - 1 streams would hold every other prompt to a token a step)."""
    scheduler = make_scheduler(mixed_prefill_tokens=cap, max_batch_tokens=64)
    for i in range(streams):
        queue(scheduler, f"s{i}", [1, 2, 3 + i])
    run(scheduler)
    queue(scheduler, "long", list(range(10, 40)))
    assert run(scheduler) == [(f"s{i}", 1) for i in range(streams)] + [("long", prompt_tokens)]


def test_an_engine_with_a_cap_gives_transformers_tokens_and_starts_the_long_prompt_later(
        tiny_llama_dir: Path) -> None:
    """A 6-token prompt and a 200-token one, 64 tokens per step: the short one decodes while the
    long one is prefilled. Uncapped, the long prompt's first token comes in step 4 (58, 63, 63,
    16 prompt tokens); capped at 8 while the short one decodes (steps 2-12: 7 each, 77), in
    step 14 (then 64 and 1). Both outputs are transformers' either way."""
    short, long = list(range(3, 9)), list(range(10, 210))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = {"short": hf_greedy(tiny_llama_dir, short, 12), "long": hf_greedy(tiny_llama_dir, long, 12)}
    for cap, first_long_step in ((64, 4), (8, 14)):
        engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=256, schedule_policy="fcfs",
                        max_batch_tokens=64, mixed_prefill_tokens=cap, debug_checks=True)
        ids = {"short": engine.add_request(short, params), "long": engine.add_request(long, params)}
        tokens: dict[str, list[int]] = {"short": [], "long": []}
        first: dict[str, int] = {}
        step = 0
        while engine.has_work():
            step += 1
            deltas = engine.step()
            for name, request_id in ids.items():
                for delta in deltas.get(request_id, []):
                    tokens[name] += delta.token_ids
                    if tokens[name]:
                        first.setdefault(name, step)
        assert first == {"short": 1, "long": first_long_step}, cap
        assert tokens == expected, cap


def test_capped_steps_under_preemption_and_eviction_give_the_same_tokens(tiny_llama_dir: Path) -> None:
    """200 prompts through 24 pages with the cap at 8 (it binds: 64 tokens a step): sequences
    are preempted and pages evicted, and every output equals an ample engine's, whose first
    outputs equal transformers'."""
    prompts = random_prompts(200, seed=11)
    params = [SamplingParams(max_tokens=random.Random(i).randrange(2, 10), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    ample = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=1024, mixed_prefill_tokens=8).generate(
        prompts, params)
    tight = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=24, max_batch_tokens=64,
                   mixed_prefill_tokens=8, debug_checks=True)
    squeezed = tight.generate(prompts, params)
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["cache_evicted_pages"] > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in ample]
    for i in (0, 99):
        assert ample[i].token_ids == hf_greedy(tiny_llama_dir, prompts[i], len(ample[i].token_ids))


def test_a_fair_share_claim_beside_decoding_streams_keeps_them_in_the_step() -> None:
    """Tenant A decodes 20 streams; tenant B's three prompts wait and fall behind, so B claims
    the next steps' tokens. The claim is no larger than the step's prefill (4 tokens' worth
    beside 20 decodes at a cap of 8; 3 prompt tokens, whose attention costs a little more):
    every step still runs all 20 of A's decodes. Before, the claim held 64 tokens out of the
    running units and B could use 4 of them: steps ran 1 or 2."""
    engine = Engine(model="demo", page_size=16, num_pages=1024, max_batch_tokens=64,
                    mixed_prefill_tokens=8, max_running=64)
    scheduler, steps = engine.scheduler, []
    schedule = scheduler.schedule

    def recorded() -> list:  # observes each step's chunks; the scheduler's own schedule runs
        decoding = sum(1 for s in scheduler.running if s.request.tenant == "A" and s.num_tokens - s.num_computed == 1)
        chunks = schedule()
        steps.append((decoding, sum(c.seq.request.tenant == "A" for c in chunks),
                      [c.num_new for c in chunks if c.seq.request.tenant == "B"]))
        return chunks

    scheduler.schedule = recorded  # type: ignore[method-assign]
    streams = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(20):
        engine.add_request([5 + i, 7, 9], streams, tenant="A")
    for _ in range(5):
        engine.step()
    steps.clear()
    for j in range(3):
        engine.add_request(list(range(100 + j, 200 + j)), SamplingParams(max_tokens=2, temperature=0.0,
                                                                         ignore_eos=True), tenant="B")
    for _ in range(12):
        engine.step()
    assert steps == [(20, 20, [3])] * 12
    assert engine.scheduler.counters.fair_preemptions == 0


def long_prompt_then_newcomer(scheduler: Scheduler, new: list[int]) -> None:
    """Tenant "long" sends a 100-token prompt, which takes the first step whole; then tenant
    "new" sends `new`, lifted to its counter on arrival."""
    for request_id, tokens in (("long", list(range(10, 110))), ("new", new)):
        queue(scheduler, request_id, tokens).request.tenant = request_id
        scheduler.fair.arrive(request_id)
        if request_id == "long":
            assert run(scheduler) == [("long", 64)]


def test_a_step_that_keeps_a_newcomers_first_chunk_is_capped_too() -> None:
    """A tenant's long prompt takes whole steps; another tenant's request arrives, level with
    it: the next step keeps the newcomer's 5 tokens (its claim) and, since the newcomer waits
    for that step's output as a decoding stream would, caps the step's prefill at 8."""
    scheduler = make_scheduler(mixed_prefill_tokens=8)
    long_prompt_then_newcomer(scheduler, [1, 2, 3, 4, 5])
    assert run(scheduler) == [("long", 3), ("new", 5)]
    assert run(scheduler) == [("long", 7), ("new", 1)]  # then the cap beside a decode


def test_a_claim_keeps_its_chunks_cost_when_attention_is_counted() -> None:
    """With a key at 1/4 of a token, the newcomer's 6 tokens cost 6 + 21/4, more than the cap
    of 8: its chunk is what 8 affords, 4 tokens (6.5), taken first; the long prompt's chunk
    gets the rest (1.5: its least chunk, a token, which costs 17 that deep in its context).
    Counted in tokens, the claim took 6 of the 8 and the newcomer's chunk came short."""
    scheduler = make_scheduler(mixed_prefill_tokens=8)
    scheduler.chunk_cost = ChunkCost(key_cost=1 / 4)
    long_prompt_then_newcomer(scheduler, [1, 2, 3, 4, 5, 6])
    assert run(scheduler) == [("long", 1), ("new", 4)]


def test_a_chunk_that_overspends_the_cap_leaves_the_claim_whole() -> None:
    """A key at 1/16: the long prompt's least chunk (a token, 5 + 1/16 deep in its context)
    costs more than the 2 the claim left of the cap; the claim's 5 + 15/16 stay whole for the
    newcomer, whose whole first chunk runs in the step."""
    scheduler = make_scheduler(mixed_prefill_tokens=8)
    scheduler.chunk_cost = ChunkCost(key_cost=1 / 16)
    long_prompt_then_newcomer(scheduler, [1, 2, 3, 4, 5])
    assert run(scheduler) == [("long", 1), ("new", 5)]
