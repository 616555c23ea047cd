"""Slow output constraints take a bounded share of the engine (engine/grammar_pace.py).

The unit tests drive GrammarPace with a clock of their own and real matchers; the engine test
runs an ambiguous regex (each step's grammar work larger than the last) beside an innocent
request and checks, step by step, the one inequality pacing promises: after paced work W in a
step with others running, the paced rows run again beside others only W x (1/share - 1) of
wall time later. Wall time only grows on a loaded machine, so it holds there too; without
the pacing it fails by about that factor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from transformers import AutoTokenizer

from radixserve import Engine, SamplingParams
from radixserve.engine.grammar_pace import SLOW_GRAMMAR_S, GrammarPace
from radixserve.engine.params import SamplingParams as Params
from radixserve.engine.request import Request, SequenceState
from radixserve.grammar import Grammars, GrammarSpec
from radixserve.grammar.matcher import Matcher
from radixserve.models.demo import demo_checkpoint_dir

AMBIGUOUS = "((a|aa|aaa){0,100}){0,100}a{40}b"  # each step's work 1.5-2x the last


TOKENIZER = AutoTokenizer.from_pretrained(str(demo_checkpoint_dir()))
A = TOKENIZER.encode("a")[0]


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOKENIZER, 2048, [TOKENIZER.eos_token_id], compile_timeout_s=None)


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def unit(grammar: Matcher | None, last_step: int = 0, tenant: str | None = None) -> list[SequenceState]:
    """A one-sequence decoding unit of `tenant` with `grammar`."""
    request = Request(f"r{id(grammar)}-{last_step}", [1, 2], Params(), 0.0, 0, tenant=tenant)
    seq = SequenceState(request, 0, [1, 2, 3], None, None, None, grammar=grammar)  # type: ignore[arg-type]
    seq.num_computed, seq.last_step = 2, last_step
    return [seq]


def worked(grammars: Grammars, pattern: str, steps: int) -> Matcher:
    """A matcher of `pattern` that has filled and accepted "a" `steps` times (work to bill)."""
    matcher = grammars.matcher(GrammarSpec.regex(pattern, "guided_regex"))
    for _ in range(steps):
        matcher.prepare()
        assert matcher.accept(A)
    matcher.prepare()
    return matcher


def ids(units: list[list[SequenceState]]) -> set[int]:
    return {seq.seq_id for u in units for seq in u}


def test_a_row_is_paced_once_its_step_work_passes_the_bound_and_real_grammars_never_are(grammars: Grammars) -> None:
    pace = GrammarPace(Clock())
    cheap = [unit(worked(grammars, "a{0,30}b", 1)) for _ in range(3)]
    slow = unit(grammars.matcher(GrammarSpec.regex(AMBIGUOUS, "guided_regex")))
    for _ in range(40):  # the ambiguous one's mean passes 1 ms within some 10 steps (CPU time)
        slow[0].grammar.accept(A)
        slow[0].grammar.prepare()
        pace.bill([seq for u in [*cheap, slow] for seq in u])
        for u in cheap:
            u[0].grammar.accept(A)
            u[0].grammar.prepare()
        if slow[0].grammar.paced:
            break
    assert slow[0].grammar.paced and slow[0].grammar.mean_work_s > SLOW_GRAMMAR_S
    assert not any(u[0].grammar.paced for u in cheap)
    assert all(u[0].grammar.mean_work_s < SLOW_GRAMMAR_S for u in cheap)


def test_paced_rows_sit_out_until_their_work_is_paid_for_by_the_others_time(grammars: Grammars) -> None:
    clock = Clock()
    pace = GrammarPace(clock, slow_s=-1.0, share=0.2)  # every constrained row is paced
    first, second = unit(worked(grammars, AMBIGUOUS, 4), last_step=3), unit(worked(grammars, AMBIGUOUS, 4), last_step=5)
    innocent = unit(None)
    clock.now = 10.0
    pace.bill([first[0], second[0], innocent[0]])
    work = first[0].grammar.last_work_s + second[0].grammar.last_work_s
    assert work > 0 and pace.ready_at == pytest.approx(10.0 + 4 * work)  # work x (1/share - 1)
    units = [innocent, first, second]
    assert pace.held(units, set()) == ids([first, second])
    clock.now = pace.ready_at - 1e-9
    assert pace.held(units, set()) == ids([first, second])
    clock.now = pace.ready_at
    # Their time has come: the least recently run (step 3) goes first, the other while both
    # (their last work doubled) fit in the step's paced budget. The budget is set from the
    # work measured (CPU time: more on a loaded machine) so that both just fit, then just not.
    pace.step_s = 2 * work + 1e-9
    assert pace.held(units, set()) == set()
    pace.step_s = 2 * work - 1e-9
    assert pace.held(units, set()) == ids([second])
    pace.step_s = 0.0
    assert pace.held(units, set()) == ids([second])
    first[0].last_step = 9
    assert pace.held(units, set()) == ids([first])
    # A tenant's share holding the only other row leaves the paced rows alone: they run.
    clock.now = 0.0
    pace.ready_at = 5.0
    assert pace.held(units, ids([innocent])) == ids([first])  # (the step's paced budget still applies)


def test_tenants_take_turns_at_the_paced_part(grammars: Grammars) -> None:
    """One tenant's five slow rows and another's one, a step's paced budget for one row: the
    lone row runs every other paced turn, not every sixth."""
    clock = Clock()
    pace = GrammarPace(clock, slow_s=-1.0, step_s=0.0)
    many = [unit(worked(grammars, AMBIGUOUS, 2), last_step=i, tenant="many") for i in range(5)]
    one = unit(worked(grammars, AMBIGUOUS, 2), last_step=0, tenant="one")
    pace.bill([u[0] for u in [*many, one]])
    units = [unit(None), *many, one]
    turns = []
    for step in range(10, 20):
        clock.now = pace.ready_at = 0.0  # their time has come, each turn
        (ran,) = [u for u in units[1:] if u[0].seq_id not in pace.held(units, set())]
        ran[0].last_step = step
        turns.append(ran[0].request.tenant)
    assert turns == ["one", "many"] * 5
    # Within a tenant, least recently run first: all five of "many" had a turn.
    assert [u[0].last_step for u in many] == [11, 13, 15, 17, 19]


def test_alone_paced_rows_run_and_owe_nothing(grammars: Grammars) -> None:
    clock = Clock()
    pace = GrammarPace(clock, slow_s=-1.0, share=0.1)
    paced = [unit(worked(grammars, AMBIGUOUS, 3), last_step=i) for i in range(3)]
    pace.bill([u[0] for u in paced])
    assert pace.ready_at > 0
    # The step's paced budget still applies alone; it is set from the work measured (CPU
    # time: more on a loaded machine, where three fills doubled passed the default 50 ms).
    work = sum(u[0].grammar.last_work_s for u in paced)
    pace.step_s = 2 * work + 1e-9
    assert pace.held(paced, set()) == set()  # nobody else runs: nothing held...
    assert pace.ready_at == float("-inf")  # ...and the debt forgiven
    pace.step_s = 2 * work - 1e-9
    assert pace.held(paced, set()) == ids([paced[2]])  # (the budget, not the debt, holds the last)
    pace.step_s = 2 * work + 1e-9
    innocent = unit(None)
    assert pace.held([innocent, *paced], set()) == set()  # a newcomer does not find them in debt
    pace.bill([paced[0][0], innocent[0]])  # (nothing new billed: no work since)
    assert pace.ready_at == float("-inf")


def test_a_share_of_one_paces_nothing(grammars: Grammars) -> None:
    clock = Clock()
    pace = GrammarPace(clock, slow_s=-1.0, share=1.0, step_s=0.0)
    paced = [unit(worked(grammars, AMBIGUOUS, 3), last_step=i) for i in range(3)]
    pace.bill([u[0] for u in paced])
    assert pace.held([unit(None), *paced], set()) == set()
    # Nor are they paced: with pacing off they run every step, so they take shared slots.
    assert not any(u[0].grammar.paced for u in paced) and not pace.any_paced
    with pytest.raises(ValueError, match="share"):
        GrammarPace(clock, share=0.0)
    with pytest.raises(ValueError, match="grammar_paced_share"):
        Engine("demo", num_pages=8, grammar_paced_share=1.5)


def run(engine: Engine, requests: dict[str, tuple[str, SamplingParams]],
        join: Iterator[tuple[str, str, SamplingParams]] | None = None,
        watch: list | None = None) -> dict[str, tuple[list[int], str | None]]:
    """Runs `requests` to the end (and each of `join` once a row of theirs is paced);
    their tokens and finish reasons. `watch` gets, per step, (time before it, time after it,
    paced work run beside an unpaced row in it)."""
    out: dict[str, tuple[list[int], str | None]] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
        out[rid] = ([], None)
    pending = list(join or [])
    while engine.has_work():
        if pending and any(s.grammar is not None and s.grammar.paced for s in engine.scheduler.running):
            rid, prompt, params = pending.pop(0)
            engine.add_request(prompt, params, request_id=rid)
            out[rid] = ([], None)
        before = time.monotonic()
        deltas = engine.step()
        after = time.monotonic()
        if watch is not None:
            step = engine.scheduler._step
            ran = [s for s in engine.scheduler.running if s.last_step == step]
            paced_work = sum(s.grammar.last_work_s for s in ran if s.grammar is not None and s.grammar.paced)
            beside = any(s.grammar is None for s in ran)
            watch.append((before, after, paced_work if beside else 0.0, beside))
        for rid, items in deltas.items():
            for delta in items:
                out[rid][0].extend(delta.token_ids)
                out[rid] = (out[rid][0], delta.finish_reason or out[rid][1])
    return out


def test_an_ambiguous_grammar_beside_an_innocent_is_paced_and_changes_no_token() -> None:
    # Large enough for several paced runs within the innocent's life, small enough that the
    # paced rows' own steps (without the pacing) come sooner than the promise: 0.08 s vs 0.16.
    share = 0.2
    engine = Engine("demo", num_pages=512, page_size=16, debug_checks=True, grammar_compile_timeout_s=None,
                    grammar_paced_share=share)
    innocent = ("an innocent prompt", SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    attack = SamplingParams(max_tokens=200, temperature=0.0, grammar=GrammarSpec.regex(AMBIGUOUS, "guided_regex"))
    alone = run(engine, {"innocent": innocent})["innocent"]
    watch: list[tuple[float, float, float, bool]] = []
    together = run(engine, {f"attack{i}": (f"a{i}", attack) for i in range(4)},
                   join=iter([("innocent", *innocent)]), watch=watch)
    assert together["innocent"] == alone  # token for token
    for i in range(4):
        assert together[f"attack{i}"][1] == "error"  # its grammar grew too slow: it ended alone
    assert engine.stats()["paced_rows"] > 0
    engine.check_invariants()
    # The promise: paced work W run beside an unpaced row in step i, the paced rows ran beside
    # one again no sooner than W x (1/share - 1) after step i began.
    paced_steps = [(before, after, work) for before, after, work, beside in watch if beside and work > 0]
    assert len(paced_steps) >= 2, paced_steps
    for (before, _, work), (_, next_after, _) in zip(paced_steps, paced_steps[1:]):
        assert next_after - before >= work * (1 / share - 1)


def test_a_beam_search_whose_grammar_grows_too_slow_ends_alone_and_the_engine_empties() -> None:
    """A beam's mask is built as its logits arrive (engine/beam.py): a grammar found too slow
    there escaped the beam driver and failed the whole step (an attack round: the client got
    no answer and the engine spun). Now the beam request ends with the grammar's fault, the
    innocent beside it gets its tokens, and the engine runs dry."""
    engine = Engine("demo", num_pages=512, page_size=16, debug_checks=True, grammar_compile_timeout_s=None)
    innocent = ("an innocent prompt", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    alone = run(engine, {"innocent": innocent})["innocent"]
    beams = SamplingParams(max_tokens=50, temperature=0.0, beam_width=4, n=4,
                           grammar=GrammarSpec.regex(AMBIGUOUS, "guided_regex"))
    together = run(engine, {"beams": ("a", beams), "innocent": innocent})
    assert together["innocent"] == alone
    assert together["beams"][1] == "error"
    assert not engine.has_work() and engine.stats()["pages_locked"] == 0
    engine.check_invariants()


def _paced_engine(**kwargs: object) -> Engine:
    """A demo engine in which every constrained row is paced after its first step."""
    engine = Engine("demo", page_size=16, debug_checks=True, grammar_compile_timeout_s=None, **kwargs)
    engine.scheduler.grammar_pace.slow_s = -1.0
    return engine


LONG = SamplingParams(max_tokens=100, temperature=0.0, grammar=GrammarSpec.regex("[a-z]{1000}", "guided_regex"))
INNOCENT = ("an innocent prompt", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))


def _drain(engine: Engine, on_step: Callable[[set[int]], None] = lambda paced_before: None) -> dict[str, list[int]]:
    """Steps `engine` to the end; each request's tokens. `on_step` gets, after each step,
    the seq_ids of the rows that were paced before it (running or waiting)."""
    out: dict[str, list[int]] = {}
    while engine.has_work():
        paced_before = {s.seq_id for s in engine.scheduler.running + engine.scheduler.waiting
                        if s.grammar is not None and s.grammar.paced}
        for rid, items in engine.step().items():
            out.setdefault(rid, []).extend(t for delta in items for t in delta.token_ids)
        on_step(paced_before)
        engine.check_invariants()
    return out


def test_paced_rows_take_slots_of_their_own_and_never_keep_a_shared_one() -> None:
    """Paced rows sit most steps out, so they take no slot of `max_running`'s but as many of
    their own: a request arriving behind them is admitted at once, not when one of them ends
    (an attack round: 20 loops of a paced regex beside `--max-running 16` kept other clients
    waiting minutes for a slot). A row found slow while it held a shared slot gives it back
    and waits for a paced one (another round: 40 loops took every slot again)."""
    engine = _paced_engine(num_pages=512, max_running=2)
    alone = run(engine, {"innocent": INNOCENT})["innocent"]

    def paced_running() -> int:
        return sum(1 for s in engine.scheduler.running if s.grammar is not None and s.grammar.paced)

    for i in range(3):
        engine.add_request(f"a{i}", LONG, request_id=f"attack{i}")
    while not engine.stats()["paced_preemptions"] and engine.has_work():
        engine.step()  # the third is admitted to a shared slot, found slow, and preempted
    assert paced_running() == 2 and [s.request.request_id for s in engine.scheduler.waiting] == ["attack2"]
    engine.add_request(INNOCENT[0], INNOCENT[1], request_id="innocent")
    engine.add_request("a3", LONG, request_id="attack3")
    admitted_beside: list[int] = []  # paced rows running when the innocent was admitted
    over: list[int] = []  # steps that ran more rows paced before them than their own slots

    def check(paced_before: set[int]) -> None:
        running = engine.scheduler.running
        paced_ran = sum(1 for s in running if s.seq_id in paced_before)
        if not admitted_beside and any(s.request.request_id == "innocent" for s in running):
            admitted_beside.append(paced_ran)
        if paced_ran > 2:
            over.append(engine.scheduler._step)

    out = _drain(engine, check)
    assert admitted_beside == [2]  # at once, both paced rows still running
    assert over == []
    assert out["innocent"] == alone[0]


def test_an_arrival_out_of_pages_preempts_paced_rows_and_they_are_preempted_first() -> None:
    """Out of pages, paced rows make way: a new request that does not fit preempts them (else
    it waited for one to end: an attack round, 49.7 s for a first token), and its growth
    preempts them first. Its tokens are unchanged."""
    engine = _paced_engine(num_pages=8, max_running=4)
    alone = run(engine, {"innocent": INNOCENT})["innocent"]
    for i in range(2):
        engine.add_request(f"a{i}", LONG, request_id=f"attack{i}")
    # Four pages each (60 tokens in): the pool is full.
    while sum(1 for s in engine.scheduler.running if s.grammar is not None and s.grammar.paced
              and len(s.output_ids) >= 60) < 2 and engine.has_work():
        engine.step()
    engine.add_request(INNOCENT[0], INNOCENT[1], request_id="innocent")
    innocent = next(s for s in engine.scheduler.waiting if s.request.request_id == "innocent")
    steps_to_admit: list[int] = []
    preempted: list[int] = []

    def check(paced_before: set[int]) -> None:
        if not steps_to_admit and innocent in engine.scheduler.running:
            steps_to_admit.append(engine.scheduler._step)
        if steps_to_admit and innocent in engine.scheduler.waiting:
            preempted.append(engine.scheduler._step)

    first_step = engine.scheduler._step + 1
    out = _drain(engine, check)
    assert engine.stats()["paced_preemptions"] > 0  # paced rows made room...
    assert steps_to_admit and steps_to_admit[0] - first_step <= 3  # ...at once, for the arrival...
    assert preempted == []  # ...and for its growth
    assert out["innocent"] == alone[0]


def test_paced_rows_are_not_preempted_for_a_unit_whose_shared_slots_are_taken() -> None:
    """A newcomer that waits for shared slots (a beam search needs one per beam) gains
    nothing from paced rows' pages: they stay."""
    engine = _paced_engine(num_pages=512, max_running=2)
    for i in range(2):
        engine.add_request(f"a{i}", LONG, request_id=f"attack{i}")
    while sum(1 for s in engine.scheduler.running if s.grammar is not None and s.grammar.paced) < 2:
        engine.step()
    engine.add_request(INNOCENT[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), request_id="one")
    engine.step()  # it takes one shared slot; the beams need two
    engine.add_request("beams", SamplingParams(max_tokens=8, temperature=0.0, beam_width=2, n=2), request_id="beams")
    for _ in range(5):
        engine.step()
        engine.check_invariants()
    assert engine.stats()["paced_preemptions"] == 0
    assert sum(1 for s in engine.scheduler.running if s.grammar is not None and s.grammar.paced) == 2
    while engine.has_work():  # and everything ends
        engine.step()
    engine.check_invariants()


def test_a_claim_for_a_shared_slot_takes_it_from_an_unpaced_row_not_the_paced_ones() -> None:
    """One client's two paced rows (slots of their own) and two plain streams (both shared
    slots); another client arrives with nothing running and borrows a shared slot. Paced rows
    hold none: a claim preempted them first (three for one claim in an attack round), each for
    nothing. Now one plain stream lends its slot and the paced rows run on."""
    engine = _paced_engine(num_pages=512, max_running=2)
    alone = run(engine, {"innocent": INNOCENT})["innocent"]
    plain = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"a{i}", LONG, request_id=f"paced{i}", client="one")
    while sum(1 for s in engine.scheduler.running if s.grammar is not None and s.grammar.paced) < 2:
        engine.step()
    for i in range(2):
        engine.add_request(f"plain {i}", plain, request_id=f"plain{i}", client="one")
    while sum(1 for s in engine.scheduler.running if s.grammar is None and s.num_tokens - s.num_computed == 1) < 2:
        engine.step()
    engine.add_request(INNOCENT[0], INNOCENT[1], request_id="innocent", client="other")
    out = {rid: [t for delta in items for t in delta.token_ids] for rid, items in engine.step().items()}
    assert engine.stats()["fair_preemptions"] == 1
    assert [s.request.request_id for s in engine.scheduler.waiting] in (["plain0"], ["plain1"])
    assert {s.request.request_id for s in engine.scheduler.running} >= {"paced0", "paced1", "innocent"}
    for rid, tokens in _drain(engine).items():
        out.setdefault(rid, []).extend(tokens)
    assert out["innocent"] == alone[0]
