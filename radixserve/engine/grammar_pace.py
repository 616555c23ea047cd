"""Slow output constraints share a bounded part of the engine's time: their rows sit steps out.

A constrained row's grammar work (xgrammar's mask fill and token accept) runs on the engine
thread, inside the step every other request waits for. Real schemas, regexes and tool-call
grammars take 0.01-0.2 ms a step on SmolLM2's 49k vocabulary (at most 0.8 ms over 300-step
walks), but an ambiguous one (`((a|aa|aaa){0,100}){0,100}a{40}b` as a guided_regex) compiles
in milliseconds and then tracks ever more parser states: each step 1.5-2x the last, 0.1 ms
... 100 ms, until the per-fill budget (grammar/matcher.py's FILL_BUDGET_S) ends the request,
about 180 ms of the thread later. Each such request is legal and ends with a 400; eight
clients sending them in a loop cut another client's streams by 6-10x. Ending them sooner
does not help: every new request starts cheap.

So a row whose mean grammar work per step passes `SLOW_GRAMMAR_S` (CPU time, like the fill
budget: a descheduled thread is nobody's grammar's fault) is paced for the rest of its life,
and all paced rows together may take `PACED_SHARE` of the engine's wall time while other
rows run: each step's paced work moves a shared ready time ahead by work x (1 / share - 1);
until then every paced row sits the step out, keeping its pages and its place in the
preemption order (as a row held for another tenant's share does, step_share.py); after it,
paced rows run, as many as `PACED_STEP_S` of work fits (their last steps' work, doubled: it
grows), at least one, so that no step adds up many such fills; tenants take turns, each
with its least recently run rows first. The bound is on all paced rows together, whoever
sends them: thirty-two attacking loops cost the others no more than eight. Work is billed
to the step that did it, including the fills prepared for the next step. Pacing only makes
way for others: while no other row runs, the paced rows run (still at most `PACED_STEP_S` a
step) and owe nothing for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable

from radixserve.engine.request import SequenceState

# A row's mean grammar work per step (each step weighing half of it: a growing grammar is
# caught within a step or two) past which the row is paced: six times the largest mean of a
# real schema, regex or tool grammar (0.17 ms; one step took at most 0.8 ms, see above).
# Not higher: rows just under the bound are never paced, and 32 rows of a regex at 3 ms a
# step (`([b-z]+ ){300,1000}`) made another client's steps twice as slow as 32 plain streams.
SLOW_GRAMMAR_S = 0.001
# The share of the engine's time paced grammars may take while other rows run: the others'
# steps come at least 1 - share as often as without them. A paced row itself runs at most
# share / its work steps a second (5 ms a step: 20 tokens a second beside others).
PACED_SHARE = 0.1
# The paced rows' work one step may take (predicted from their last steps'): everyone waits
# for a step.
PACED_STEP_S = 0.05


class GrammarPace:
    """The ready time of paced grammar rows (see the module docstring). The step loop bills
    each step's rows (`bill`) after it runs; the scheduler asks which rows sit out (`held`).
    A share of 1 paces nothing."""

    def __init__(self, clock: Callable[[], float], *, slow_s: float = SLOW_GRAMMAR_S,
                 share: float = PACED_SHARE, step_s: float = PACED_STEP_S) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share: must be in (0, 1], got {share}")
        self._clock = clock
        self.slow_s = slow_s
        self.share = share
        self.step_s = step_s
        self.ready_at = float("-inf")  # paced rows sit out until then
        # The live paced grammars (gone with their sequences): none, and a step looks no further.
        self._paced: weakref.WeakSet = weakref.WeakSet()

    @property
    def any_paced(self) -> bool:
        """Whether any live grammar is paced (none: no row is, and nothing need be looked at)."""
        return bool(self._paced)

    def bill(self, seqs: Iterable[SequenceState]) -> None:
        """Takes the grammar work the step did for `seqs` (the rows it ran, finished ones
        included); a row whose mean work per step passes `slow_s` becomes paced, and paced
        work moves the ready time."""
        paced_work = 0.0
        for seq in seqs:
            grammar = seq.grammar
            if grammar is None:
                continue
            work = grammar.take_work()
            grammar.mean_work_s = (grammar.mean_work_s + work) / 2
            if grammar.mean_work_s > self.slow_s and self.share < 1:  # (share 1: pacing is off)
                grammar.paced = True
            if grammar.paced:  # (a beam's or sample's fork of a paced grammar is paced too)
                self._paced.add(grammar)
                paced_work += work
        if paced_work:
            self.ready_at = max(self.ready_at, self._clock()) + paced_work * (1 / self.share - 1)

    def held(self, units: list[list[SequenceState]], held: set[int]) -> set[int]:
        """The seq_ids of the paced units' members that sit this step out: all of them until
        the ready time. Then the paced units that ran least recently run (tenants taking
        turns), as many as fit in `step_s` by their last step's work, at least one: their
        fills in one step would add up to one long pause for everyone. When no other unit
        (not paced, not already `held`, with tokens to run) would run, the paced rows run so,
        and their debt is forgiven: pacing makes way for others, it does not hold rows back
        for work done while nobody waited."""
        if self.share >= 1 or not self.any_paced:  # no pacing (a baseline), or nothing paced
            return set()
        paced = [unit for unit in units if any(s.grammar is not None and s.grammar.paced for s in unit)]
        if not paced:
            return set()
        paced_ids = {unit[0].seq_id for unit in paced}
        others = (unit for unit in units if unit[0].seq_id not in paced_ids and unit[0].seq_id not in held)
        if not any(_can_run(unit) for unit in others):
            self.ready_at = float("-inf")
        elif self._clock() < self.ready_at:
            return {seq.seq_id for unit in paced for seq in unit}
        paced.sort(key=_turns(paced))
        left, runs = self.step_s, 0
        for unit in paced:
            work = 2 * sum(s.grammar.last_work_s for s in unit if s.grammar is not None)  # fills grow
            if runs and work > left:
                break
            left -= work
            runs += 1
        return {seq.seq_id for unit in paced[runs:] for seq in unit}


def _can_run(unit: list[SequenceState]) -> bool:
    """Whether the unit has a chunk to run now: tokens to compute, no copy from the host
    pending (beams that delivered their logits wait for their siblings' step instead)."""
    return any(seq.num_computed < seq.num_tokens and not seq.pending_loads for seq in unit)


def _turns(paced: list[list[SequenceState]]) -> Callable[[list[SequenceState]], tuple]:
    """The order paced units take their turns in: tenants in turn (whose paced units ran
    least recently first), each tenant's units least recently run first, so that one
    tenant's many slow rows do not take the paced part from another's one."""
    by_tenant: dict[Hashable, list[list[SequenceState]]] = {}
    for unit in sorted(paced, key=lambda u: (u[0].last_step, u[0].seq_id)):
        by_tenant.setdefault(unit[0].request.fair_key, []).append(unit)
    ran = {tenant: max(u[0].last_step for u in units) for tenant, units in by_tenant.items()}
    rank = {unit[0].seq_id: (i, ran[tenant], unit[0].last_step, unit[0].seq_id)
            for tenant, units in by_tenant.items() for i, unit in enumerate(units)}
    return lambda unit: rank[unit[0].seq_id]
