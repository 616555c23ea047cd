"""Which sequences run in the next step, and the pages they run in.

The scheduler owns the waiting and running queues, and through `SequencePages` every page a
sequence holds. Each step it (1) gives every running sequence its next chunk (one token when
decoding), preempting the lowest-priority, latest-arrived sequences when pages run out, then
(2) admits waiting sequences in the policy's order within the token budget, reusing their
cached prefixes. A step admits a few of what may be thousands waiting (requests of many
prompts and samples): it reads that order lazily, no further than it admits, and merges none
of it once no slot is left (`_admit`). Within a priority, a request's further samples (n > 1)
come after every request's first unfinished one, in both orders: one request whose samples
together need more than the pool preempts and delays its own samples, not another request
(`_extra_sample`).
A step in which sequences decode prefills only enough prompt tokens to bring it to a
multiple of `mixed_prefill_tokens` (at least half of that many): every decoding stream waits
for the whole step, and a step's time grows with the prompt tokens in it.
With several tenants, both orders are fair_share.py's first: tenants are interleaved by
the service they have had (so the tenant with the most is preempted first), and the order
above holds within each tenant; with one tenant they are exactly the orders above. With a
`tenant_step_rows` limit, a tenant's decoding rows beyond its share of the limit sit the step
out (step_share.py), so that one tenant's many streams do not set the others' pace; rows of
slow grammars sit steps out alike, so that they take a bounded part of the engine's time
(grammar_pace.py).
It knows nothing of the model: the runner turns its Batch into a forward pass.

With a host tier under the tree, a prefix found on the host is loaded back into device pages
at admission (`SequencePages.take_cached_prefix`) before the rest is prefilled; a load that
does not fit in device memory falls back to recomputing what did not fit. Where the copy runs
asynchronously (CUDA), the sequence joins the running set but runs no chunk until its copy
is done, so the copy never holds up the running batch.

The beams of a beam-search request (engine/beam.py) form one unit: they are scheduled,
preempted and admitted together, never some of them, since a beam step needs every beam's
next-token logits. Beams share pages by reference count; only the last, partly filled page
is copied when two beams would both write it (copy-on-write, `fork`).

Every page a sequence holds is `SequencePages`' (engine/sequence_pages.py): taking a cached
prefix, reserving a chunk's pages, caching, releasing, forks and the sliding window. The
scheduler decides which sequences run and calls it; the scheduler's `ensure_free`,
`cache_computed`, `trim_window` and `share_full_pages` pass through to it, for the engine
and the beam driver.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator

import numpy as np

from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree, Retention
from radixserve.engine.fair_share import FairShare
from radixserve.engine.grammar_pace import GrammarPace
from radixserve.engine.policy import SchedulePolicy, common_prefix_len
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.scheduled import ScheduledChunk, SchedulerCounters
from radixserve.engine.sequence_pages import SequencePages
from radixserve.engine.step_cost import ChunkCost
from radixserve.engine.step_share import units_held

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerCounters"]

SHORT_LANE_LOOKS = 16  # waiting units the short lane looks at per step, in admission order
# The most of a step's prefill budget short prompts take ahead of a running prefill: it keeps
# a quarter of every step, so a flood of short prompts slows a long one but never stops it.
# In bench/short_lane.py (8 workloads, 2 loads) a half gave up most of the short prompts'
# gain where streams decode (the mixed step's cap of 128 left them 64 tokens: zipf-docs'
# mean TTFT above the lane off); all of it let short prompts take whole steps from the long one.
SHORT_LANE_SHARE = 0.75


class Scheduler:
    """Continuous batching over a paged KV pool with a radix prefix cache."""

    def __init__(self, pool: PagePool, tree: RadixTree, policy: SchedulePolicy, *,
                 max_running: int, max_batch_tokens: int, clock: Callable[[], float],
                 prefix_cache: bool = True, window: int | None = None, cache_partial_pages: bool = False,
                 fair_share: FairShare | None = None, mixed_prefill_tokens: int | None = None,
                 chunk_cost: ChunkCost | None = None, tenant_step_rows: int | None = None,
                 grammar_pace: GrammarPace | None = None, short_prompt_tokens: int | None = None) -> None:
        self.pool = pool
        self.tree = tree
        self.policy = policy
        self.page_size = pool.page_size
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.mixed_prefill_tokens = mixed_prefill_tokens  # None: a mixed step's prefill is not capped
        # What a capped step's prefill counts (tokens and their attention); None: tokens alone.
        self.chunk_cost = chunk_cost
        self._step_cost: ChunkCost | None = None  # this step's: chunk_cost while the cap applies
        # None: every decoding row runs every step; else tenants share this many (step_share.py).
        self.tenant_step_rows = tenant_step_rows
        # None: a waiting prompt, however short, waits for the running prefills' chunks
        # (`_short_lane`); else prompts of at most this many tokens left to compute do not.
        self.short_prompt_tokens = short_prompt_tokens
        self._step = 0
        self.clock = clock
        self.waiting: list[SequenceState] = []
        self.running: list[SequenceState] = []
        self.counters = SchedulerCounters()
        self.fair = fair_share or FairShare()  # the order across tenants (engine/fair_share.py)
        # Slow grammars' rows sit steps out (engine/grammar_pace.py).
        self.grammar_pace = grammar_pace or GrammarPace(clock)
        self.pages = SequencePages(pool, tree, self.counters, prefix_cache=prefix_cache, window=window,
                                   cache_partial_pages=cache_partial_pages)

    @property
    def prefix_cache(self) -> bool:
        """False: nothing is matched or cached (a baseline)."""
        return self.pages.prefix_cache

    @property
    def window(self) -> int | None:
        """The sliding window of every layer, or None (some layer sees all)."""
        return self.pages.window

    @property
    def cache_partial_pages(self) -> bool:
        """Whether a released sequence's last, partly filled page is cached too."""
        return self.pages.cache_partial_pages

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> list[ScheduledChunk]:
        """Picks the next step's chunks and makes sure their pages exist."""
        chunks: list[ScheduledChunk] = []
        # Tokens of this step kept for a waiting tenant's claim (`_make_room_fairly`): the
        # claimant is admitted first with its first chunk, the running units take what is left
        # and admission (fair order) the rest. The claim comes out of both budgets, and is no
        # larger than the step's prefill cap: the claimant's first chunk cannot use more, and
        # the rest would only keep the running units' decodes out of the step.
        self._step += 1
        self._cap_paced()
        self._room_from_paced()
        claim, claimant = self._make_room_fairly()  # first: it may preempt, and the cap counts decodes
        units = self._running_units()
        held = self._units_held(units)
        cap = self._prefill_cap(claiming=claim > 0, held=held)
        self._step_cost = self.chunk_cost if cap < self.max_batch_tokens else None
        # Held units run no chunk this step but stay in the order preemption takes its victims
        # from (the last): sitting a step out must not spare a tenant's pages.
        ordered = self.fair.order_running(units, _running_key)
        claimed_work = self._admit_claimant(claimant, min(claim, cap), cap) if claim else []
        claimed = sum(c.num_new for c in claimed_work)
        claimed_cost = self._prefill_spent(claimed_work)
        budget = self.max_batch_tokens - claimed
        prefill = cap - claimed_cost
        short_work = self._short_lane(ordered, held, budget, prefill)
        budget -= sum(c.num_new for c in short_work)
        prefill -= self._prefill_spent(short_work)
        while ordered and budget > 0:
            unit = ordered.pop(0)
            if unit[0].seq_id in held:
                continue
            if not all(self._loaded(seq) for seq in unit):
                continue  # a prefix is still being copied from the host
            work = self._next_chunks(unit, budget, prefill)
            if not work:  # beams that delivered their logits and wait for their siblings
                continue
            while not all(self.pages.reserve(c.seq, c.seq.num_computed + c.num_new) for c in work):
                # A prefill chunk shrinks to the pages it can have before anyone is preempted,
                # leaving each sequence still to run this step the page its next token needs.
                if len(work) == 1:
                    fits = self.pages.tokens_that_fit(work[0].seq, [s for u in ordered if u[0].seq_id not in held
                                                                    for s in u])
                    if 0 < fits < work[0].num_new:
                        work[0].num_new = fits
                        self.counters.shrunk_chunks += 1
                        continue
                # Out of pages even after eviction: preempt the least important unit, which
                # is the last one in `ordered`, or this one if it is the last.
                victim = ordered.pop() if ordered else unit
                self.preempt_unit(victim)
                if victim is unit:
                    break
            else:
                chunks.extend(work)
                budget -= sum(c.num_new for c in work)
                prefill -= self._prefill_spent(work)
        chunks.extend(claimed_work)
        chunks.extend(short_work)
        if budget > 0 and prefill > 0:
            chunks.extend(self._admit(budget, prefill))
        for chunk in chunks:
            chunk.seq.last_step = self._step
        return chunks

    def _short_lane(self, ordered: list[list[SequenceState]], held: set[int], budget: int,
                    prefill: float) -> list[ScheduledChunk]:
        """Admits waiting prompts with at most `short_prompt_tokens` tokens left to compute
        (after their cached prefix) ahead of the running prefills' next chunks, whole, within
        that many tokens of the step: else a short prompt, or a follow-up turn whose history
        is cached, waits for every chunk of a long prompt admitted before it (a one-word
        question waited 26 s behind a 5,400-token prompt on a CPU). The long prefill still
        runs every step, on the rest of the budget; once the short ones decode, the mixed
        step's cap paces it as beside any decoding stream. Only while a running prefill would
        take the step's prefill budget: else admission gets what is left anyway. Across
        tenants, only a tenant served no more than every tenant prefilling goes ahead (the
        fair share's order): another tenant's flood of short prompts does not take three
        quarters of each step from a long prompt of a tenant served less."""
        if not self.short_prompt_tokens or not self.waiting:
            return []
        if self._no_slot_left(self.slots_taken(), self._paced_running() if self.grammar_pace.any_paced else 0):
            return []  # (before `_admit`: with no slot it orders the whole queue, for nothing here)
        rows = [s for unit in ordered if unit[0].seq_id not in held for s in unit]
        long_rows = [s for s in rows if s.num_tokens - s.num_computed > 1]
        prefilling = sum(s.num_tokens - s.num_computed for s in long_rows)
        if prefilling < prefill:
            return []
        decoding = sum(1 for s in rows if s.num_tokens - s.num_computed == 1)
        # At most a share of the prefill and of the budget the decodes leave; and no more new
        # streams than keep every decode in a step's budget (each short prompt decodes next).
        lane = min(self.short_prompt_tokens, int((budget - decoding) * SHORT_LANE_SHARE),
                   int(prefill * SHORT_LANE_SHARE), budget // 2 - decoding)
        if lane <= 0:
            return []
        # The running prefills' next chunk keeps its pages, as large as it may be whatever
        # the lane takes (the rest of the cap, in tokens): a short prompt admitted ahead of it
        # must not make it shrink, or preempt.
        chunk_pages = math.ceil(min(prefilling, prefill) / self.page_size) + 1
        work = self._admit(lane, min(float(lane), prefill), short=lane, reserve_extra=chunk_pages,
                           ahead_of={s.request.fair_key for s in long_rows})
        self.counters.short_lane_admitted += len(work)
        return work

    def _units_held(self, units: list[list[SequenceState]]) -> set[int]:
        """The sequences (seq_ids) of the running units that sit this step out: tenants'
        decoding rows beyond their shares of `tenant_step_rows` (step_share.py), and rows of
        slow grammars while their part of the engine's time is spent (grammar_pace.py)."""
        held: set[int] = set()
        if self.tenant_step_rows is not None and self.fair.enabled:
            held = units_held(units, self.tenant_step_rows)
            self.counters.held_rows += len(held)
        paced = self.grammar_pace.held(units, held) - held
        self.counters.paced_rows += len(paced)
        return held | paced

    def _admit_claimant(self, head: SequenceState, tokens: int, cap: int) -> list[ScheduledChunk]:
        """Admits a claimant's unit now with its first chunks, within `tokens` and their cost
        (at most the cap); nothing when its pages cannot be had after all. Admitted before the
        running units pick their chunks, so that a claim that cannot be had keeps nothing from
        them (kept for a claimant that then failed, it starved them step after step)."""
        unit = self._unit_of(head)
        cost = tokens if self._step_cost is None else min(self._step_cost.of(head.num_tokens - tokens, tokens), cap)
        reserve = sum(1 for s in self.running if s.num_computed % self.page_size == 0)
        work = self._take_unit(unit, tokens, cost, reserve)
        if work is None:
            return []
        self._start(head, unit)
        return work

    def _prefill_cap(self, claiming: bool = False, held: set[int] = frozenset()) -> int:
        """The prompt tokens this step may run. While sequences decode (one token left to run:
        each waits for the step), enough to bring the step to a multiple of
        `mixed_prefill_tokens`, and at least half of it: the pause a prefill adds to a decode
        step stays bounded, the step's rows fill whole tiles of the linear kernels (8 decodes
        and 128 prompt tokens would pass over the weights a third time for 8 rows), and many
        decoding streams cannot starve a prompt (127 decodes: 129 prompt tokens, not 1).
        A step `claiming` tokens for a waiting tenant's first chunk is capped alike: that
        tenant waits for the step's output as a decoding stream does (beside another tenant's
        long prefill, a whole budget's step took seconds on a CPU). Else the whole budget."""
        cap = self.mixed_prefill_tokens
        decoding = sum(1 for s in self.running if s.num_tokens - s.num_computed == 1 and s.seq_id not in held)
        if cap is None or cap >= self.max_batch_tokens or not (decoding or claiming):
            return self.max_batch_tokens  # (a cap of the whole budget: the decodes count in it already)
        fill = cap - decoding % cap
        return min(fill if 2 * fill >= cap else fill + cap, self.max_batch_tokens)

    def _make_room_fairly(self) -> tuple[int, SequenceState | None]:
        """The tokens of this step to keep for the first chunk of a waiting tenant served no
        more than a running one (FairShare.claimant), and its sequence to admit first: room in
        slots and pages is not enough when the running tenant's long prefill takes every
        step's whole token budget (the waiting tenant would wait for all of its chunks).
        Where the running tenant is served well ahead, first preempts its least important
        units until the waiting tenant's next sequence fits (their computed pages stay
        cached, and they come back first: `_lend_slots`): else a flood's long generations
        would run to their end first. The same where it holds more than its part of the
        slots. Runs before chunks are picked."""
        claim = self.fair.claimant(self.waiting, self.running)
        if claim is None:
            return 0, None
        now = self.clock()
        head = self._waiting_head([s for s in self.waiting if s.request.fair_key == claim.waiting_tenant], now)
        unit = self._unit_of(head)
        if any(s.lent_step is not None for s in self.waiting) and self._room_for(unit):
            return 0, None  # a free slot goes back to a lender first (`_admit`); the claim borrows next step
        # Only units past their prompts (a prefill preempted is thrown away), and no paced ones
        # where the claimant lacks a shared slot: they hold none (three such were preempted for
        # one claim, each for nothing).
        lacks_slot = self.slots_taken() + len(unit) > self.max_running
        victims = [u for u in self._running_units() if u[0].request.fair_key == claim.running_tenant
                   and all(s.num_tokens - s.num_computed <= 1 for s in u)
                   and not (lacks_slot and any(_paced(s) for s in u))]
        victims.sort(key=lambda u: _running_key(u[0]))
        if self._claim_deferred(unit, now - head.arrival_time > self.policy.max_wait_s):
            return 0, head  # admission would defer it: no slot lent, no tokens kept
        self._lend_slots(unit, victims, claim.running_tenant, claim.preempts)
        return self._claimed_tokens(unit, claim.running_tenant), head

    def _lend_slots(self, unit: list[SequenceState], victims: list[list[SequenceState]], tenant: Hashable,
                    served_ahead: bool) -> None:
        """Preempts `tenant`'s units (the last of `victims` first) while `unit` (a claimant's)
        has no room and `tenant` is `served_ahead` by the margin or holds more than its part
        of the slots: each *lends* its slot, and comes back before any other waiting sequence
        when a slot frees (its pages cached: a partial page to recompute), a claim's included
        (`_make_room_fairly`: the claim borrows another). Before, a claimant beside a tenant
        holding too many slots waited for one of its long generations to end (forty loops of
        300-token chats from one address: another address's chats 1.1 s from their first
        tokens); and a unit preempted without a loan waited for its tenant's counter to be
        the least again, which a client with two streams beside thirty looping addresses did
        for 55 s mid-stream."""
        while victims and (served_ahead or self._over_its_slots(tenant)) and not self._room_for(unit):
            lender = victims.pop()
            self.preempt_unit(lender)
            for seq in lender:
                seq.lent_step = self._step
            self.counters.fair_preemptions += 1

    def _over_its_slots(self, tenant: Hashable) -> bool:
        """Whether `tenant` holds more than its part of the shared slots: `max_running` over the
        tenants with work, running or waiting, and at least one: a waiting tenant with nothing
        running may then borrow one (`_lend_slots`). A lending tenant holds two slots or more
        before, so it still runs after, and cannot claim a slot back the same way (at one slot
        each, two tenants took it from each other every step)."""
        tenants = {s.request.fair_key for s in self.running} | {s.request.fair_key for s in self.waiting}
        held = sum(1 for s in self.running if s.request.fair_key == tenant and not _paced(s))
        return held > max(1, self.max_running // len(tenants))

    def _claimed_tokens(self, unit: list[SequenceState], victim_tenant: Hashable) -> int:
        """The tokens of this step to keep for a claimant's unit: its first chunks (its
        uncached prompt), short of one token for every running sequence with work of a tenant
        other than the one served most (a claim holds back that tenant's chunks, not a third
        tenant's next token); none unless admission would take the unit now (room for it; the
        caller checked that it is not deferred behind a prefill of its prefix in flight)."""
        if not self._room_for(unit):
            return 0
        uncached = 0
        for seq in unit:
            hit = 0
            if self.prefix_cache:
                hit = self.tree.match(seq.prompt_ids[: seq.num_tokens - 1], seq.namespace,
                                      update=False).cached_tokens
            uncached += seq.num_tokens - max(hit, seq.num_computed)
        busy = sum(1 for s in self.running if s.num_tokens > s.num_computed and s.request.fair_key != victim_tenant)
        return max(0, min(uncached, self.max_batch_tokens - busy))

    def _claim_deferred(self, unit: list[SequenceState], aged: bool) -> bool:
        """Whether admission would defer the claimant's `unit` behind a prefill of its prefix in
        flight (it needs the step's tokens; `aged` ones are not deferred)."""
        if not self.prefix_cache or aged:
            return False
        for seq in unit:
            hit = self.tree.match(seq.prompt_ids[: seq.num_tokens - 1], seq.namespace, update=False).cached_tokens
            if self._shares_prefill_in_flight(seq.prompt_ids, seq, hit):
                return True
        return False

    def slots_taken(self) -> int:
        """The running sequences that count against `max_running`: all but the rows of paced
        grammars (grammar_pace.py), which have `max_running` slots of their own and never keep
        a shared one (`_cap_paced`). A paced row sits most steps out and runs a bounded part of
        the engine's time, so it does not take the batch's place; counted, twenty loops of a
        paced regex held every slot of `--max-running 16` for minutes while the engine sat
        nearly idle. A row admitted unpaced takes a shared slot until it is found slow."""
        if not self.grammar_pace.any_paced:
            return len(self.running)
        return len(self.running) - min(self._paced_running(), self.max_running)

    def _paced_running(self) -> int:
        return sum(1 for s in self.running if _paced(s))

    def _paced_units(self) -> list[list[SequenceState]]:
        """The running units with a paced row, in the running order (the last preempted first)."""
        units = [u for u in self._running_units() if any(_paced(s) for s in u)]
        units.sort(key=lambda u: _running_key(u[0]))
        return units

    def _cap_paced(self) -> None:
        """Preempts the paced units past the paced rows' own slots (their pages stay cached):
        a row found slow while it held a shared slot gives it back, and waits for a paced slot.
        Else paced loops twice `max_running` deep held every shared slot again."""
        if not self.grammar_pace.any_paced or self._paced_running() <= self.max_running:
            return  # (the common case: no units built or sorted)
        paced = self._paced_units()
        rows = sum(len(u) for u in paced)
        while rows > self.max_running and paced:
            unit = paced.pop()
            self.preempt_unit(unit)
            rows -= len(unit)
            self.counters.paced_preemptions += 1

    def _room_from_paced(self) -> None:
        """Preempts paced units (the last in the running order first) until the first unpaced
        unit in the admission order has its slot and pages: paced rows make way for others,
        and kept, their pages would hold a newcomer back for as long as they live (an attack
        round: 50 s for a first token). Runs before chunks are picked, like `_make_room_fairly`."""
        if not self.grammar_pace.any_paced or not self.waiting or self.slots_taken() >= self.max_running:
            return
        now = self.clock()
        order = self.fair.iter_waiting(self.waiting, lambda group: self._waiting_order(group, now))
        head = next((seq for seq in order if not any(_paced(s) for s in self._unit_of(seq))), None)
        if head is None:
            return
        unit = self._unit_of(head)
        if self.slots_taken() + len(unit) > self.max_running:
            return  # its slots are not paced rows' to give: preempting them would free none
        victims = self._paced_units()
        while victims and not self._room_for(unit):
            self.preempt_unit(victims.pop())
            self.counters.paced_preemptions += 1

    def _room_for(self, unit: list[SequenceState]) -> bool:
        """Whether `unit` could be admitted now (a slot each, and its first chunks' pages)."""
        if self.slots_taken() + len(unit) > self.max_running:
            return False
        reserve = sum(1 for s in self.running if s.num_computed % self.page_size == 0)
        peeks = [self.tree.match(s.prompt_ids[: s.num_tokens - 1], s.namespace, update=False)
                 if self.prefix_cache else None for s in unit]
        return self.pages.may_fit([s.num_tokens for s in unit], peeks, self.max_batch_tokens, reserve)

    def _running_units(self) -> list[list[SequenceState]]:
        """The running sequences, one list per unit: a beam group's beams, else one sequence."""
        units: list[list[SequenceState]] = []
        groups: set[int] = set()
        for seq in self.running:
            group = seq.request.beam
            if group is None:
                units.append([seq])
            elif id(group) not in groups:
                groups.add(id(group))
                units.append(list(group.running))
        return units

    def _next_chunks(self, unit: list[SequenceState], budget: int, prefill: float) -> list[ScheduledChunk]:
        """Each member's next chunk within `budget` tokens, chunks that prefill
        (`ScheduledChunk.prefills`) within `prefill` (tokens, or this step's cost of them);
        members with nothing to run get none."""
        work = []
        for seq in unit:
            left = seq.num_tokens - seq.num_computed
            if left == 1:
                num_new = min(left, budget)
            elif self._step_cost is None:
                num_new = int(min(left, budget, prefill))
            else:
                num_new = self._step_cost.affordable(seq.num_computed, min(left, budget), prefill)
            if num_new > 0:
                chunk = ScheduledChunk(seq, num_new)
                work.append(chunk)
                budget -= num_new
                prefill -= self._prefill_spent([chunk])
        return work

    def _prefill_spent(self, work: list[ScheduledChunk]) -> float:
        """What `work`'s prefilling chunks take of the step's prefill cap: their tokens, or
        while the cap applies with a chunk cost, their cost."""
        cost = self._step_cost
        return sum(c.num_new if cost is None else cost.of(c.seq.num_computed, c.num_new)
                   for c in work if c.prefills)

    def _admit(self, budget: int, prefill: float, *, short: int | None = None,
               reserve_extra: int = 0, ahead_of: set[Hashable] | None = None) -> list[ScheduledChunk]:
        """Admits waiting sequences in the fair order while the step has tokens and room.
        With `short`, only units whose prompts have at most that many tokens left to compute,
        each computed whole in this step, of tenants served no more than any of `ahead_of`,
        none past a longer one that is aged or of a higher priority,
        among the first `SHORT_LANE_LOOKS` in the order (the lane runs beside every chunk of a
        long prompt: a long queue is not looked up each step); `reserve_extra` more pages stay
        free for the running units' chunks."""
        chunks: list[ScheduledChunk] = []
        if not self.waiting:
            return chunks
        now = self.clock()
        admitted: set[int] = set()  # beams admitted with an earlier member of their group
        slots = self.slots_taken()  # shared slots (a unit admitted unpaced counts in full)
        paced_slots = self._paced_running() if self.grammar_pace.any_paced else 0
        if self._no_slot_left(slots, paced_slots):
            self._order_for_its_state(now)
            return chunks
        # Read lazily, and no further than the step can admit: a step admits a few of what
        # may be thousands waiting (`_no_slot_left`).
        order = self._lenders_first(self.fair.iter_waiting(self.waiting, lambda group: self._waiting_order(group, now)))
        looks = 0
        passed_over: tuple[bool, int] | None = None  # the lane's first unit skipped as long: (aged, priority)
        for seq in order:
            if budget <= 0 or prefill <= 0 or self._no_slot_left(slots, paced_slots):
                break
            if seq.seq_id in admitted:
                continue
            looks += 1
            if short is not None and looks > SHORT_LANE_LOOKS:
                break
            if ahead_of and not self.fair.not_ahead(seq.request.fair_key, ahead_of):
                continue
            unit = self._unit_of(seq)
            # A paced unit (preempted, or back from a paced cap) takes a paced slot and never
            # holds up the units behind it; an unpaced one a shared slot, in the fair order.
            paced = any(_paced(s) for s in unit)
            if paced and paced_slots + len(unit) > self.max_running:
                continue
            if not paced and slots + len(unit) > self.max_running:
                if paced_slots >= self.max_running:
                    break
                continue
            aged = now - seq.arrival_time > self.policy.max_wait_s
            peeks = []  # one look at the cache per member serves both checks below
            if self.prefix_cache:
                peeks = [self.tree.match(s.prompt_ids[: s.num_tokens - 1], s.namespace, update=False)
                         for s in unit]
            if short is not None and sum(s.num_tokens - (p.cached_tokens if p else 0)
                                         for s, p in zip(unit, peeks or [None] * len(unit))) > min(short, budget):
                passed_over = passed_over or (aged, seq.priority)
                continue
            # Short before long only within a class: never past an aged request (aging is what
            # keeps anyone from waiting for ever) or one of a higher priority.
            if short is not None and passed_over is not None and (passed_over[0] or passed_over[1] > seq.priority):
                break
            if self.prefix_cache:
                if not aged and any(self._shares_prefill_in_flight(s.prompt_ids, s, peek.cached_tokens)
                                    for s, peek in zip(unit, peeks)):
                    self.counters.deferred_for_sharing += 1
                    continue
            # Keep a page per decoding sequence in hand, so admitting does not force a preemption
            # in the very next step; an empty engine admits whatever fits.
            reserve = sum(1 for s in self.running if s.num_computed % self.page_size == 0) + reserve_extra
            if not self.pages.may_fit([s.num_tokens for s in unit], peeks or [None] * len(unit),
                                      int(min(budget, prefill)), reserve):
                if paced:
                    continue
                break  # before touching the tree: a hopeless attempt neither evicts nor counts
            work = self._take_unit(unit, budget, prefill, reserve)
            if work is None:
                break
            self._start(seq, unit)
            if paced:
                paced_slots += len(unit)
            else:
                slots += len(unit)
            admitted.update(member.seq_id for member in unit)
            chunks.extend(work)  # members loading from the host run once their copy is done
            budget -= sum(c.num_new for c in work)
            prefill -= self._prefill_spent(work)
        return chunks

    def _lenders_first(self, order: Iterator[SequenceState]) -> Iterator[SequenceState]:
        """`order` with the units that lent their slots to a claim first (they were running),
        in the order they lent, ties in `order` (a stable sort): in the fair order, a client's
        oldest stream, lent last, came back first every time, and its other streams stalled
        in turn. Reads `order` only as far as its last lender (usually none: not at all)."""
        lenders = sum(1 for s in self.waiting if s.lent_step is not None)
        if not lenders:
            yield from order
            return
        found: list[SequenceState] = []
        passed: list[SequenceState] = []
        for seq in order:
            (passed if seq.lent_step is None else found).append(seq)
            if len(found) == lenders:
                break
        found.sort(key=lambda s: s.lent_step)
        yield from found
        yield from passed
        yield from order

    def _order_for_its_state(self, now: float) -> None:
        """Has the policy order what admission would have it order, when nothing can be
        admitted: only that, since a policy may keep state from one ordering to the next
        (LongestPrefixMatch refreshes its stale lengths at each), and the orders of later
        steps must be those they always were. The rest of the order (`_waiting_order`'s
        re-sort, the fair merge) is skipped: it changes nothing."""
        for group in self.fair.groups(self.waiting).values():
            self.policy.order(group, self.tree, now, keep=self.waiting)

    def _no_slot_left(self, slots: int, paced_slots: int) -> bool:
        """Whether no waiting unit can have a slot: the shared ones are taken, and the paced
        ones too or no grammar is paced. Admission stops there instead of ordering and passing
        over every waiting sequence, none of which it could take: under four clients' requests
        of 64 prompts x n=16 (4,096 waiting) that took 68% of the engine thread."""
        return slots >= self.max_running and (paced_slots >= self.max_running or not self.grammar_pace.any_paced)

    def _waiting_order(self, waiting: list[SequenceState], now: float) -> list[SequenceState]:
        """One tenant's admission order: the policy's (aged first, then by priority), with a
        request's further samples after every first sample of the same priority. Aging
        protects a request from waiting for ever, and one whose first sample runs is not
        waiting: its further samples never count as aged (preempted, a hog's old samples
        would all be aged, and come first again)."""
        return sorted(self.policy.order(waiting, self.tree, now, keep=self.waiting), key=self._waiting_key(now))

    def _waiting_head(self, waiting: list[SequenceState], now: float) -> SequenceState:
        """The first of `_waiting_order(waiting, now)`, without sorting the rest (min is the
        first of equals, as the stable sort's first is)."""
        return min(self.policy.order(waiting, self.tree, now, keep=self.waiting), key=self._waiting_key(now))

    def _waiting_key(self, now: float) -> Callable[[SequenceState], tuple[bool, int, bool]]:
        """`_waiting_order`'s key over the policy's order (see there)."""
        firsts: dict[int, float] = {}  # id(request) -> its first unfinished sample's index
        max_wait_s = self.policy.max_wait_s

        def key(seq: SequenceState) -> tuple[bool, int, bool]:
            request = seq.request
            first = firsts.get(id(request))
            if first is None:
                first = firsts[id(request)] = _first_unfinished(request)
            extra = first < seq.index  # _extra_sample's, once per request instead of per sample
            aged = not extra and now - request.arrival_time > max_wait_s
            return not aged, 0 if aged else -request.priority, extra
        return key

    @staticmethod
    def _unit_of(seq: SequenceState) -> list[SequenceState]:
        """What is admitted with waiting `seq`: its beam group's live beams, or itself."""
        return list(seq.request.beam.running) if seq.request.beam is not None else [seq]

    def _start(self, seq: SequenceState, unit: list[SequenceState]) -> None:
        """Moves an admitted unit (`seq` and its beam siblings) from waiting to running."""
        if seq.request.cached_tokens is None:  # first admission: what the caller is told
            seq.request.cached_tokens = seq.num_computed
            seq.request.host_cached_tokens = seq.loaded_tokens
        for member in unit:
            self.waiting.remove(member)
            self.running.append(member)
            member.lent_step = None
        self.counters.admitted += 1

    def _take_unit(self, unit: list[SequenceState], budget: int, prefill: float,
                   reserve: int) -> list[ScheduledChunk] | None:
        """Takes each member's cached prefix and the pages of its first chunk, all or none
        (None: the pages could not be had; nothing is held then). A member whose prefix is
        still being copied from the host gets its pages when the copy is done."""
        for seq in unit:
            self.pages.take_cached_prefix(seq)
        work = self._next_chunks([seq for seq in unit if self._loaded(seq)], budget, prefill)
        if all(self.pages.reserve(c.seq, c.seq.num_computed + c.num_new, extra_free=reserve) for c in work):
            return work
        for seq in unit:
            self.pages.release(seq, cache=False)
        return None

    @staticmethod
    def _loaded(seq: SequenceState) -> bool:
        """Whether every copy from the host into the sequence's pages has completed."""
        if seq.pending_loads:
            seq.pending_loads = [load for load in seq.pending_loads if not load.done()]
        return not seq.pending_loads

    def _shares_prefill_in_flight(self, mine: np.ndarray, seq: SequenceState, cached: int) -> bool:
        """In-batch sharing: wait while another sequence computes a prefix this one needs.

        Once that sequence's chunk has run, its pages are in the tree and this one hits them,
        instead of both computing the same tokens in the same step. `mine` are the sequence's
        tokens, `cached` how many of them the tree holds.
        """
        for other in self.running:
            if other.namespace != seq.namespace:
                continue
            prompt_end = len(other.request.prompt_ids)
            if other.num_computed >= prompt_end:
                continue
            shared = common_prefix_len(mine[: len(mine) - 1], other.prompt_ids[:prompt_end])
            if shared >= cached + self.page_size:
                return True
        return False

    # ------------------------------------------------------------------ after a step
    def advance(self, chunks: list[ScheduledChunk], on_last_token: Callable[[SequenceState], None]) -> list[int]:
        """The bookkeeping after a forward pass over `chunks` (the engine's and the simulator's).

        Chunk by chunk, in order: the sequence counts the chunk's tokens as computed; a prefill
        chunk (more than one token) puts its computed full pages into the tree with its
        request's retention (`cache_computed`; decode tokens are cached when the sequence
        ends); pages that left the sliding window are released (`trim_window`). Then, if the
        chunk reached the sequence's last token, `on_last_token(seq)` is called: the k-th call
        is for the k-th logits row. It runs before the next chunk's bookkeeping, so what the
        caller does there (fork a sample, finish a sequence) sees the cache as that chunk left it.
        Returns the pages the window released.
        """
        released: list[int] = []
        for chunk in chunks:
            seq, last = chunk.seq, chunk.needs_logits  # needs_logits reads num_computed: first
            recomputed = self._count_computed(seq, chunk.num_new)
            # What a preemption threw away is not service: charged, two tenants whose prompts
            # could not both fit preempted each other for ever, each recomputing its prompt.
            self.fair.charge_chunk(seq, chunk.num_new - recomputed)
            seq.num_computed += chunk.num_new
            if chunk.num_new > 1:
                req = seq.request
                self.pages.cache_computed(seq, req.retention, req.range_retention())
            released.extend(self.pages.trim_window(seq))
            if last:
                on_last_token(seq)
        return released

    def _count_computed(self, seq: SequenceState, num_new: int) -> int:
        """Counts a chunk of `num_new` tokens from `seq.num_computed` on; the part below the
        most the sequence ever had computed was thrown away by a preemption and is recomputed.
        Returns that part."""
        end = seq.num_computed + num_new
        recomputed = max(0, min(end, seq.computed_high) - seq.num_computed)
        self.counters.computed_tokens += num_new
        self.counters.recomputed_tokens += recomputed
        seq.computed_high = max(seq.computed_high, end)
        return recomputed

    # ------------------------------------------------------------------ lifecycle
    def preempt(self, seq: SequenceState) -> None:
        """Stops a running sequence; its computed pages go to the tree, it recomputes later."""
        req = seq.request
        self.pages.release(seq, cache=True, retention=req.retention,
                            range_retention=req.range_retention())
        self.running.remove(seq)
        self.waiting.append(seq)
        self.counters.preemptions += 1
        if req.beam is not None:
            req.beam.forget(seq)  # it recomputes its tokens and delivers its logits again

    def preempt_unit(self, unit: list[SequenceState]) -> None:
        """Preempts a unit (a beam group's beams, or one sequence) wherever its members are."""
        for seq in unit:
            if seq in self.running:
                self.preempt(seq)

    def finish(self, seq: SequenceState, retention: Retention | None = None,
               range_retention: list[tuple[int, int, Retention]] = (), *, cache: bool = True) -> list[int]:
        """Releases a finished or aborted sequence wherever it is; returns the pages it let go.

        With `cache`, its computed pages stay in the tree (see `SequencePages.release`)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        return self.pages.release(seq, cache=cache, retention=retention, range_retention=range_retention)

    def fork(self, parent: SequenceState, child: SequenceState) -> bool:
        """Starts `child` running on the parent's computed tokens: full pages shared, the last,
        partly filled page copied (copy-on-write: the two would both write it next).

        Returns False when no page is free for the copy; the child then waits and is
        admitted like any request (its prompt is a cache hit by then).
        """
        if not self.pages.fork(parent, child):
            return False
        self.running.append(child)
        return True

    # ------------------------------------------------------------------ pages (SequencePages')
    def ensure_free(self, num_pages: int) -> bool:
        """Whether `num_pages` pages are free, after evicting cache to free them if needed."""
        return self.pages.ensure_free(num_pages)

    def cache_computed(self, seq: SequenceState, retention: Retention | None,
                       range_retention: list[tuple[int, int, Retention]]) -> None:
        """Puts the sequence's computed full pages into the tree (SequencePages.cache_computed)."""
        self.pages.cache_computed(seq, retention, range_retention)

    def trim_window(self, seq: SequenceState) -> list[int]:
        """Releases the pages of `seq` before its sliding window (SequencePages.trim_window)."""
        return self.pages.trim_window(seq)

    def share_full_pages(self, parent: SequenceState, holder: SequenceState) -> None:
        """Makes `holder` hold the parent's computed full pages (SequencePages.share_full_pages)."""
        self.pages.share_full_pages(parent, holder)


def _extra_sample(seq: SequenceState) -> bool:
    """Whether an earlier sample of the same request is unfinished: `seq` is one of its
    further samples. Ordered after every request's first unfinished sample, so that a request
    of many long samples (n = 16 that together outgrow the pool) preempts and delays its own
    samples: by arrival alone its older samples came first in both orders, and another
    client's short request, the newest, was preempted and kept waiting until they all ended.
    It still progresses: its first unfinished sample is preempted only as any request is."""
    return any(other.index < seq.index and not other.finished for other in seq.request.sequences)


def _first_unfinished(request: Request) -> float:
    """The least index of the request's unfinished samples (inf: none): a sample of a
    greater index is a further sample (`_extra_sample`)."""
    return min((s.index for s in request.sequences if not s.finished), default=math.inf)


def _running_key(seq: SequenceState) -> tuple:
    """The order of running units within a tenant, most deserving first: the last preempted.
    Within a priority, rows of paced grammars come last: they hold their pages for many more
    steps than their tokens take, and another row must not be recomputed for them."""
    return -seq.priority, _paced(seq), _extra_sample(seq), seq.arrival_time, seq.seq_id


def _paced(seq: SequenceState) -> bool:
    """Whether the sequence's grammar is paced (grammar_pace.py)."""
    return seq.grammar is not None and seq.grammar.paced
