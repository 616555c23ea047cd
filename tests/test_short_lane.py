"""A short prompt does not wait for every chunk of a long one (`Scheduler._short_lane`).

A waiting prompt with at most `short_prompt_tokens` tokens left to compute (after its cached
prefix) is admitted, whole, ahead of a running prefill's next chunk, within at most three
quarters of the step's prefill; the long prompt runs on the rest of every step. Checked chunk
by chunk on the scheduler alone, then end to end on an engine against transformers' tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.engine.policy import make_schedule_policy
from radixserve.engine.scheduler import Scheduler
from tests.engine_util import hf_greedy
from tests.test_mixed_steps import run
from tests.test_scheduler_advance import PAGE, queue

LONG = list(range(10, 210))  # 200 prompt tokens: four steps of 64


def make_scheduler(short_prompt_tokens: int | None, *, mixed_prefill_tokens: int | None = None,
                   num_pages: int = 64, max_running: int = 8) -> Scheduler:
    pool = PagePool(num_pages, PAGE)
    return Scheduler(pool, RadixTree(pool), make_schedule_policy("fcfs"), max_running=max_running,
                     max_batch_tokens=64, clock=lambda: 0.0, mixed_prefill_tokens=mixed_prefill_tokens,
                     short_prompt_tokens=short_prompt_tokens)


@pytest.mark.parametrize("lane", [None, 8])
def test_a_short_prompt_runs_beside_the_long_prefill_instead_of_after_it(lane: int | None) -> None:
    """Without the lane the 5-token prompt waits for the long one's last chunk (step 4); with it,
    it runs in the step after it came, and the long prompt's chunk gives up those 5 tokens."""
    scheduler = make_scheduler(lane)
    queue(scheduler, "long", LONG)
    steps = [run(scheduler)]
    queue(scheduler, "short", [3, 4, 5, 6, 7])
    steps += [run(scheduler) for _ in range(3)]
    if lane is None:
        assert steps == [[("long", 64)], [("long", 64)], [("long", 64)], [("long", 8), ("short", 5)]]
    else:  # step 3: no cap, the long prompt is first in the order and takes the whole budget
        assert steps == [[("long", 64)], [("long", 59), ("short", 5)], [("long", 64)], [("long", 13), ("short", 1)]]
    assert scheduler.counters.short_lane_admitted == (0 if lane is None else 1)


def test_a_prompt_longer_than_the_lane_waits_and_so_does_everyone_when_nothing_prefills() -> None:
    """9 tokens left is more than a lane of 8: it waits for the long prompt, as before. Once
    the long prompt decodes, there is no running prefill to go ahead of: ordinary admission."""
    scheduler = make_scheduler(8)
    queue(scheduler, "long", LONG)
    run(scheduler)
    queue(scheduler, "nine", list(range(300, 309)))
    assert [run(scheduler) for _ in range(3)] == [[("long", 64)], [("long", 64)], [("long", 8), ("nine", 9)]]
    queue(scheduler, "short", [3, 4, 5])
    assert run(scheduler) == [("long", 1), ("nine", 1), ("short", 3)]
    assert scheduler.counters.short_lane_admitted == 0


def test_a_flood_of_short_prompts_slows_the_long_prefill_but_never_stops_it() -> None:
    """Two 4-token prompts arrive every step beside a long prefill, under a mixed-step cap of 16:
    the short ones decode after their first step, and their decodes bring the step's prefill
    down (14, 12, 10, 9, 8 tokens with 2, 4, 6, 7, 8 of them). The lane takes at most three
    quarters of it (8, 8, 7, 6, 6): a prompt that does not fit whole waits a step, and the
    long prompt keeps the rest. Given all of it, the lane would have left it nothing."""
    scheduler = make_scheduler(8, mixed_prefill_tokens=16, num_pages=256, max_running=64)
    queue(scheduler, "long", LONG)
    steps = [run(scheduler)]
    for i in range(5):
        queue(scheduler, f"s{i}a", [400 + i, 300, 301, 302])
        queue(scheduler, f"s{i}b", [400 + i, 303, 304, 305])
        steps.append(run(scheduler))
    prefills = [[(name, n) for name, n in step if n > 1] for step in steps]
    assert prefills == [[("long", 64)],
                        [("long", 56), ("s0a", 4), ("s0b", 4)],  # nobody decodes: no cap
                        [("long", 6), ("s1a", 4), ("s1b", 4)],
                        [("long", 4), ("s2a", 4), ("s2b", 4)],
                        [("long", 6), ("s3a", 4)],  # a lane of 7: s3b waits
                        [("long", 6), ("s3b", 3)]]  # its first token copied from s3a's page
    assert scheduler.counters.short_lane_admitted == 8


def test_the_lane_does_not_take_the_pages_of_the_long_prefills_next_chunk() -> None:
    """24 pages (96 tokens), a 200-token prompt: after its first chunk 8 pages are free, room
    for 32 of its tokens. A 5-token prompt would take 2 of them and cut the chunk to 24: it
    waits, and the long prompt's chunk is what the pages allow (shrunk, nobody preempted)."""
    scheduler = make_scheduler(8, num_pages=24)
    queue(scheduler, "long", LONG)
    first = run(scheduler)
    queue(scheduler, "short", [3, 4, 5, 6, 7])
    assert (first, run(scheduler)) == ([("long", 64)], [("long", 32)])
    assert scheduler.counters.preemptions == 0 and scheduler.counters.short_lane_admitted == 0


def test_with_no_slot_free_the_lane_leaves_the_policy_alone() -> None:
    """The lane's admission had LPM order the queue even with every slot taken, and LPM
    refreshes stale cached lengths at each ordering: the lane changed the order of later
    admissions through the policy's state (half of its first simulated gain). With no slot
    free the lane stops first: the policy is asked exactly what it is asked without it."""
    lookups = []
    for lane in (None, 8):
        pool = PagePool(64, PAGE)
        scheduler = Scheduler(pool, RadixTree(pool), make_schedule_policy("lpm"), max_running=1,
                              max_batch_tokens=64, clock=lambda: 0.0, short_prompt_tokens=lane)
        queue(scheduler, "long", LONG)
        run(scheduler)
        for i in range(3):
            queue(scheduler, f"short{i}", [400 + i, 5, 6])
        steps = [run(scheduler) for _ in range(3)]
        assert steps == [[("long", 64)], [("long", 64)], [("long", 8)]]  # (the slot: the long prompt's)
        lookups.append(scheduler.policy.cached_lengths.lookups)
    assert lookups[0] == lookups[1]


@pytest.mark.parametrize("urgent_priority", [0, 5])
def test_the_lane_never_passes_a_longer_prompt_of_a_higher_priority(urgent_priority: int) -> None:
    """A 100-token prompt of priority 5 waits before a 5-token one of priority 0: the short one
    does not go ahead (it would take the last slot and the step's room first). Of equal
    priority, it does: short before long within a class."""
    scheduler = make_scheduler(8)
    queue(scheduler, "long", LONG)
    run(scheduler)
    urgent = queue(scheduler, "urgent", list(range(300, 400)))
    urgent.request.priority = urgent_priority
    queue(scheduler, "short", [3, 4, 5, 6, 7])
    step = run(scheduler)
    assert step == ([("long", 64)] if urgent_priority else [("long", 59), ("short", 5)])


@pytest.mark.parametrize("served_before", [0, 1000])
def test_another_tenant_goes_ahead_only_if_served_no_more(served_before: int) -> None:
    """Client b's 5-token prompt beside client a's long prefill: b was lifted to a's counter
    on arrival (VTC), so it runs in the next step (its tenant's claim on the step); served
    1,000 tokens more than a, b neither claims nor goes ahead in the lane: it waits, and a's
    prefill keeps the whole step."""
    scheduler = make_scheduler(8)
    long = queue(scheduler, "long", LONG)
    long.request.client = "a"
    scheduler.fair.arrive("a")
    steps = [run(scheduler)]
    short = queue(scheduler, "short", [3, 4, 5, 6, 7])
    short.request.client = "b"
    scheduler.fair.arrive("b")
    scheduler.fair.charge("b", input_tokens=served_before)
    steps.append(run(scheduler))
    assert steps == [[("long", 64)], [("long", 59), ("short", 5)] if not served_before else [("long", 64)]]
    assert scheduler.counters.short_lane_admitted == 0


def test_an_engine_with_the_lane_gives_transformers_tokens_and_answers_the_short_prompt_first(
        tiny_llama_dir: Path) -> None:
    """A 200-token prompt, then (after its first step) a 6-token one and a follow-up turn whose
    history (a finished request's prompt and reply) is cached, 64 tokens a step. With the lane
    (16 tokens) both have their first token in step 2; without, after the long prompt's last
    chunk. Every output is transformers' either way, and the invariants hold after each step."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    history = list(range(220, 260))
    short = list(range(3, 9))
    for lane, first_short_step in ((16, 2), (0, 4)):
        engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=256, schedule_policy="fcfs",
                        max_batch_tokens=64, mixed_prefill_tokens=64, short_prompt_tokens=lane, debug_checks=True)
        [earlier] = engine.generate([history], params)
        follow_up = history + earlier.token_ids + [5, 6, 7]
        ids = {"long": engine.add_request(LONG, params)}
        engine.step()
        ids |= {"short": engine.add_request(short, params), "follow_up": engine.add_request(follow_up, params)}
        tokens: dict[str, list[int]] = {name: [] for name in ids}
        first: dict[str, int] = {}
        step = 1
        while engine.has_work():
            step += 1
            deltas = engine.step()
            engine.check_invariants()
            for name, request_id in ids.items():
                for delta in deltas.get(request_id, []):
                    tokens[name] += delta.token_ids
                    if tokens[name]:
                        first.setdefault(name, step)
        assert first["short"] == first["follow_up"] == first_short_step, lane
        assert first["long"] == 4, lane
        assert engine.stats()["short_lane_admitted"] == (2 if lane else 0)
        for name, prompt in (("long", LONG), ("short", short), ("follow_up", follow_up)):
            assert tokens[name] == hf_greedy(tiny_llama_dir, prompt, 6), (lane, name)
