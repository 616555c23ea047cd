"""Each tenant's share of a step's decode rows (engine/step_share.py): counted in engine steps
and rows, never in seconds."""

from __future__ import annotations

from pathlib import Path

from radixserve import Engine, SamplingParams
from radixserve.engine.params import SamplingParams as Params
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.step_share import units_held
from tests.engine_util import hf_greedy


def decoding(tenant: str | None, count: int, last_step: int = -1, priority: int = 0) -> list[list[SequenceState]]:
    """`count` one-sequence units of `tenant`, each with one token left to run (decoding)."""
    units = []
    for i in range(count):
        request = Request(f"{tenant}-{i}-{priority}", [1, 2], Params(), float(i), priority, tenant=tenant)
        seq = SequenceState(request, 0, [1, 2, 3], None, None, None)  # type: ignore[arg-type]
        seq.num_computed, seq.last_step = 2, last_step
        units.append([seq])
    return units


def held_per_tenant(units: list[list[SequenceState]], limit: int) -> dict[str | None, int]:
    held = units_held(units, limit)
    counts: dict[str | None, int] = {}
    for unit in units:
        counts[unit[0].request.tenant] = counts.get(unit[0].request.tenant, 0) + (unit[0].seq_id in held)
    return counts


def test_the_limit_is_shared_max_min_fairly() -> None:
    # 8 rows between a tenant of 2 and one of 20: the small one runs whole, the other 6.
    assert held_per_tenant(decoding("a", 2) + decoding("b", 20), 8) == {"a": 0, "b": 14}
    # Three tenants over 9 rows: 1 needs 1; the other 8 split 4 and 4.
    assert held_per_tenant(decoding("a", 1) + decoding("b", 10) + decoding("c", 6), 9) == {"a": 0, "b": 6, "c": 2}
    # Within the limit, or one tenant however many rows: nothing held.
    assert held_per_tenant(decoding("a", 3) + decoding("b", 5), 8) == {"a": 0, "b": 0}
    assert held_per_tenant(decoding(None, 50), 8) == {None: 0}
    # More tenants than rows: each still runs one.
    assert held_per_tenant(decoding("a", 3) + decoding("b", 3) + decoding("c", 3), 2) == {"a": 2, "b": 2, "c": 2}


def test_the_least_recently_run_go_first_and_prefills_are_never_held() -> None:
    fresh, stale = decoding("b", 3, last_step=7), decoding("b", 3, last_step=5)
    held = units_held(decoding("a", 2) + fresh + stale, 5)
    assert {u[0].seq_id for u in fresh} <= held and not {u[0].seq_id for u in stale} & held
    prefilling = decoding("b", 10)
    for (seq,) in prefilling:
        seq.num_computed = 0  # a prompt still to run: the prefill cap governs it
    assert not units_held(decoding("a", 2) + prefilling, 4)


def test_a_tenants_higher_priority_streams_run_first() -> None:
    # Tenant b's priority-10 stream ran last step, its ten priority-0 streams before: with 3
    # rows for b, the priority-10 stream runs again (priority orders a tenant's own work).
    vip = decoding("b", 1, last_step=7, priority=10)
    rest = decoding("b", 10, last_step=5)
    held = units_held(decoding("a", 1) + rest + vip, 4)
    assert vip[0][0].seq_id not in held and len(held) == 8


def test_one_tenants_many_streams_do_not_set_the_pace_of_anothers(tiny_llama_dir: Path) -> None:
    """A flood of 24 streams from one key beside one stream of another, 8 rows a step: every
    step runs at most 8 decode rows; the other tenant's stream decodes in every step; each
    flood stream waits at most 4 steps between its tokens; every token is what it is alone."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=512, debug_checks=True, tenant_step_rows=8)
    flood = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=4)
    prompts = {f"f{i}": list(range(30 + 9 * i, 40 + 9 * i)) for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, flood, request_id=rid, tenant="flood")
    innocent = list(range(200, 212))
    innocent_steps, gaps, last = [], [], {}
    tokens: dict[tuple[str, int], list[int]] = {}
    step = 0
    while engine.has_work():
        step += 1
        if step == 4:  # the flood is decoding when the other tenant arrives
            engine.add_request(innocent, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                               request_id="ok", tenant="innocent")
        chunks_before = engine.stats()["computed_tokens"]
        outputs = engine.step()
        rows = engine.stats()["computed_tokens"] - chunks_before
        for rid, deltas in outputs.items():
            for delta in deltas:
                tokens.setdefault((rid, delta.index), []).extend(delta.token_ids)
                if rid == "ok":
                    innocent_steps.append(step)
                elif delta.token_ids:
                    key = (rid, delta.index)
                    if key in last:
                        gaps.append(step - last[key])
                    last[key] = step
        if "ok" in outputs and len(innocent_steps) > 1 and engine.scheduler.running:
            assert rows <= 8  # 1 row of the innocent tenant, 7 of the flood
    first = innocent_steps[0]
    assert innocent_steps == list(range(first, first + 12))  # a token every step
    assert max(gaps) <= 4 and engine.stats()["held_rows"] > 0
    assert tokens[("ok", 0)] == hf_greedy(tiny_llama_dir, innocent, 12)
    for rid, prompt in prompts.items():
        expected = hf_greedy(tiny_llama_dir, prompt, 24)
        assert all(tokens[(rid, i)] == expected for i in range(4))


def test_a_held_stream_is_preempted_in_its_turn(tiny_llama_dir: Path) -> None:
    """Out of pages, the scheduler preempts the latest arrived of a tenant's streams first:
    one sitting the step out (held) included. Sparing the held ones preempted earlier streams,
    or the stream about to run, in their place."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=96, debug_checks=True, tenant_step_rows=4)
    scheduler = engine.scheduler
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    prompts = {f"f{i:02d}": list(range(30 + 9 * i, 38 + 9 * i)) for i in range(12)}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, greedy, request_id=rid, tenant="flood")
    out_of_turn = []
    real_preempt = scheduler.preempt_unit

    def preempt_unit(unit: list[SequenceState]) -> None:
        victim = unit[0]
        later = [s.request.request_id for s in scheduler.running
                 if s.request.tenant == victim.request.tenant and s.arrival_time > victim.arrival_time]
        if later:
            out_of_turn.append((victim.request.request_id, later))
        real_preempt(unit)

    scheduler.preempt_unit = preempt_unit  # type: ignore[method-assign]  # observes, then the real one
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_work():
        step += 1
        if step == 3:  # a long stream of another tenant: rows are held until the pool runs out
            engine.add_request(list(range(200, 208)), long, request_id="ok", tenant="innocent")
        for rid, deltas in engine.step().items():
            for delta in deltas:
                tokens.setdefault(rid, []).extend(delta.token_ids)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["held_rows"] > 0  # both happened
    assert not out_of_turn
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(tiny_llama_dir, prompt, 40)
    assert tokens["ok"] == hf_greedy(tiny_llama_dir, list(range(200, 208)), 100)
