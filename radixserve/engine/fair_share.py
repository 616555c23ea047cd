"""Fair share between tenants: the Virtual Token Counter (VTC) in front of the cache-aware order.

VTC is the scheduler of "Fairness in Serving Large Language Models" (Sheng et al., OSDI 2024):
each client has a counter of the service it has had, tokens weighted (input `input_weight`,
output `output_weight`: an output token costs a decode step of its own); the next request
admitted is the next one of the backlogged client with the least counter; and a client that
becomes backlogged has its counter lifted to the least counter of the backlogged ones (to
the greatest counter any client has had, when none is backlogged), so idling earns no credit
to flood with later, and work done while nobody else asked for any is not held against the
client that did it. It bounds the service gap between backlogged
clients, whatever one of them sends.

Here a client is a tenant (`Request.tenant`), or on a server without tenants' keys a
client address (`Request.fair_key`); "tenant" below means either. Within a tenant the
schedule policy's order (longest cached prefix first, with aging) is kept; across tenants the counters pick whose
request comes next. Service is counted as computed: tokens the cache already held cost
nothing. Running sequences are ordered the same way, so that when pages run out the tenant
that has had the most service is preempted first. `priority` orders across tenants only
where `Request.admin` (an admin's request); otherwise within its tenant.

With one tenant none of this changes anything: every order is the policy's (and the
running order is the scheduler's plain priority-then-arrival order).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from radixserve.engine.request import SequenceState

INPUT_WEIGHT = 1.0  # the paper's weights: an output token costs twice an input token
OUTPUT_WEIGHT = 2.0
# How far ahead (in weighted tokens) a running tenant must be of a waiting one before its
# sequences are preempted for it: about a step's prefill, so two backlogged tenants do not
# take turns preempting each other every step.
PREEMPT_MARGIN = 2048.0
# Counters kept of clients with nothing live: past this many (a server without keys counts
# client addresses, which an attacker can vary) they are forgotten. One back later is lifted
# to the backlog's least counter on arrival, as a newcomer is.
MAX_IDLE_COUNTERS = 4096

T = TypeVar("T")


@dataclass(frozen=True)
class Claim:
    """A waiting tenant's claim on the next step (`FairShare.claimant`): its first chunk is
    kept in the step, and with `preempts` the running tenant's sequences make room for it."""

    waiting_tenant: Hashable
    running_tenant: Hashable
    preempts: bool


class FairShare:
    """Per-tenant virtual token counters and the orders they give (see the module docstring).

    The engine calls `arrive` when a request is queued and `leave` when it ends; the
    scheduler calls `charge` for every computed chunk and uses `order_waiting` and
    `order_running`. `enabled=False` keeps the counters but orders as if there were one
    tenant (a baseline for benchmarks).
    """

    def __init__(self, *, enabled: bool = True, input_weight: float = INPUT_WEIGHT,
                 output_weight: float = OUTPUT_WEIGHT, preempt_margin: float = PREEMPT_MARGIN) -> None:
        self.enabled = enabled
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.preempt_margin = preempt_margin
        self.counters: dict[Hashable, float] = {}
        self._backlog: dict[Hashable, int] = {}  # live requests per tenant (backlogged: > 0)
        self._high = 0.0  # the greatest counter any tenant has had

    # ------------------------------------------------------------------ accounting
    def arrive(self, tenant: Hashable) -> None:
        """A request of `tenant` is queued. A tenant that was not backlogged has its counter
        lifted to the least counter of the backlogged tenants, or, with none backlogged, to
        the greatest counter any tenant has had (VTC's counter lift; the paper lifts to the
        counter of the client that left last). With none backlogged nobody is behind anyone:
        every lead was earned while nobody else asked for any. Lifted to the one that left
        last, a newcomer found a tenant that had worked alone that many tokens behind it and
        had it preempted until they were spent; and forty newcomers lifted to a light
        client's counter, the last to leave, kept a heavy client that came back waiting until
        each of them had caught up with it (87 s to a first token; now 26 s, as one of them).
        A tenant that leaves and comes back while others are backlogged keeps its lead: it
        was earned beside them."""
        if not self._backlog.get(tenant):
            others = [self.counters.get(t, 0.0) for t, live in self._backlog.items() if live and t != tenant]
            floor = min(others) if others else self._high
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self._backlog[tenant] = self._backlog.get(tenant, 0) + 1

    def leave(self, tenant: Hashable) -> None:
        """A request of `tenant` ended (finished, aborted or failed)."""
        live = self._backlog.get(tenant, 0) - 1
        if live > 0:
            self._backlog[tenant] = live
        else:
            self._backlog.pop(tenant, None)
            if len(self.counters) - len(self._backlog) > MAX_IDLE_COUNTERS:
                self.counters = {t: c for t, c in self.counters.items() if t in self._backlog or t == tenant}

    def charge(self, tenant: Hashable, input_tokens: int = 0, output_tokens: int = 0) -> None:
        """Counts service `tenant` has had: tokens computed for it."""
        counter = self.counters.get(tenant, 0.0) + self.input_weight * input_tokens + self.output_weight * output_tokens
        self.counters[tenant] = counter
        self._high = max(self._high, counter)

    def charge_chunk(self, seq: SequenceState, num_new: int) -> None:
        """Charges a computed chunk of `seq` (its `num_new` new tokens, before num_computed
        moved; the scheduler leaves out what a preemption threw away): a decode step is one
        output token; anything else (a prompt) is input."""
        decoding = num_new == 1 and seq.num_computed >= len(seq.request.prompt_ids)
        if decoding:
            self.charge(seq.request.fair_key, output_tokens=1)
        else:
            self.charge(seq.request.fair_key, input_tokens=num_new)

    def claimant(self, waiting: Sequence[SequenceState], running: Sequence[SequenceState]) -> Claim | None:
        """A claim of a waiting tenant on the most-served tenant with running sequences: the
        scheduler keeps the waiting tenant's first chunk in the next step (else a running
        tenant's long prefill, which takes every step's whole budget, holds it until its
        last chunk). The least-served waiting tenant claims where the running one is more
        than `preempt_margin` ahead of it, and the claim preempts (admission alone would wait
        for a flood's generations to end; the margin keeps two backlogged tenants from
        preempting each other in turns). Else the least-served tenant that waits with nothing
        running claims if it is not ahead, without preempting: a newcomer, lifted to the
        running tenant's counter on arrival, is not held for the steps the margin takes.
        None otherwise, and always with fewer than two backlogged tenants."""
        if not self.enabled or len(self._backlog) < 2 or not waiting or not running:
            return None
        counter = self.counters.get
        key = lambda t: (counter(t, 0.0), _name(t))  # noqa: E731
        serving = {s.request.fair_key for s in running}
        most = max(serving, key=key)
        since = _longest_waits(waiting)  # who claims first on a tie
        key = lambda t: (counter(t, 0.0), since.get(t, 0.0), _name(t))  # noqa: E731
        others = since.keys() - {most}  # (a claim on itself would change nothing)
        if not others:
            return None
        least = min(others, key=key)
        if counter(most, 0.0) - counter(least, 0.0) > self.preempt_margin:
            return Claim(least, most, preempts=True)
        idle = others - serving
        if not idle:
            return None
        least = min(idle, key=key)
        return Claim(least, most, preempts=False) if counter(least, 0.0) <= counter(most, 0.0) else None

    def not_ahead(self, tenant: Hashable, of: set[Hashable]) -> bool:
        """Whether `tenant` has had no more service than any of the tenants `of` (always,
        disabled): whether a request of its may go ahead of theirs without breaking the
        order the counters give."""
        if not self.enabled:
            return True
        counter = self.counters.get(tenant, 0.0)
        return all(counter <= self.counters.get(other, 0.0) for other in of)

    # ------------------------------------------------------------------ orders
    def order_waiting(self, waiting: Sequence[SequenceState],
                      policy_order: Callable[[list[SequenceState]], list[SequenceState]]) -> list[SequenceState]:
        """The admission order, whole (`iter_waiting`'s)."""
        return list(self.iter_waiting(waiting, policy_order))

    def iter_waiting(self, waiting: Sequence[SequenceState],
                     policy_order: Callable[[list[SequenceState]], list[SequenceState]]) -> Iterator[SequenceState]:
        """The admission order: each tenant's waiting sequences in `policy_order`, merged by
        taking next the head with the highest cross-tenant priority, then of the tenant with
        the least counter (which grows, within this order, by each taken prompt's tokens).

        Lazy: a step admits a few sequences of thousands waiting (one request of 64 prompts
        x n=16 queues 1,024), and merging all of them every step took most of the engine
        thread's time under such requests. Every tenant's `policy_order` and the counters
        are taken now, as before, so the order is the same however far it is read (a
        policy may keep state across orderings: LongestPrefixMatch's stale lengths)."""
        queues = [(tenant, policy_order(group)) for tenant, group in self.groups(waiting).items()]
        if len(queues) == 1:
            return iter(queues[0][1])
        return self._merge([(tenant, queue) for tenant, queue in queues if queue])

    def groups(self, waiting: Sequence[SequenceState]) -> dict[Hashable, list[SequenceState]]:
        """What `iter_waiting` has the policy order, in this order: each tenant's waiting
        sequences, or with fewer than two tenants (or disabled) all of them, as one."""
        groups = _by_tenant(waiting)
        if len(groups) < 2 or not self.enabled:
            return {None: list(waiting)}
        return groups

    def _merge(self, queues: list[tuple[Hashable, list[SequenceState]]]) -> Iterator[SequenceState]:
        """Merges the tenants' `queues` (first-seen order) by a heap of their heads; the
        queue's rank breaks exact ties as the first of equals did in a linear search."""
        virtual = [self.counters.get(tenant, 0.0) for tenant, _ in queues]
        heap = [(_head_key(queue[0], virtual[rank], tenant), rank) for rank, (tenant, queue) in enumerate(queues)]
        heapq.heapify(heap)
        return self._take_heads(queues, virtual, heap)

    def _take_heads(self, queues: list[tuple[Hashable, list[SequenceState]]], virtual: list[float],
                    heap: list[tuple[tuple, int]]) -> Iterator[SequenceState]:
        """Yields the least head, moving its tenant's counter and head on before it does."""
        heads = [0] * len(queues)
        while heap:
            rank = heap[0][1]
            tenant, queue = queues[rank]
            seq = queue[heads[rank]]
            virtual[rank] += self.input_weight * seq.num_tokens
            heads[rank] += 1
            if heads[rank] == len(queue):
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (_head_key(queue[heads[rank]], virtual[rank], tenant), rank))
            yield seq

    def order_running(self, units: list[list[SequenceState]],
                      plain_key: Callable[[SequenceState], tuple]) -> list[list[SequenceState]]:
        """Running units (a beam group, or one sequence) most deserving first: the least
        preempted last. By cross-tenant priority, then the tenant's counter, then `plain_key`
        (the scheduler's order within a tenant); with one tenant, by `plain_key` alone."""
        if not self.enabled or len({unit[0].request.fair_key for unit in units}) < 2:
            return sorted(units, key=lambda u: plain_key(u[0]))
        return sorted(units, key=lambda u: (-_cross_priority(u[0]), self.counters.get(u[0].request.fair_key, 0.0),
                                            plain_key(u[0])))


def _longest_waits(waiting: Sequence[SequenceState]) -> dict[Hashable, float]:
    """Each waiting tenant's earliest arrival. One pass, on the request's fields: it runs
    every step over every waiting sequence (thousands under requests of many samples)."""
    since: dict[Hashable, float] = {}
    for seq in waiting:
        request = seq.request
        tenant, arrival = request.fair_key, request.arrival_time
        if arrival < since.get(tenant, math.inf):
            since[tenant] = arrival
    return since


def _by_tenant(seqs: Sequence[SequenceState]) -> dict[Hashable, list[SequenceState]]:
    groups: dict[Hashable, list[SequenceState]] = {}
    for seq in seqs:
        groups.setdefault(seq.request.fair_key, []).append(seq)
    return groups


def _head_key(seq: SequenceState, virtual: float, tenant: Hashable) -> tuple[int, float, float, str]:
    """Which tenant's head is admitted next: the highest cross-tenant priority, then the
    least counter; on equal counters (newcomers lifted to the same one) the head that came
    first."""
    return -_cross_priority(seq), virtual, seq.arrival_time, _name(tenant)


def _cross_priority(seq: SequenceState) -> int:
    """The priority that orders `seq` across tenants: its own where an admin set it, else 0."""
    request = seq.request
    return request.priority if request.admin else 0


def _name(tenant: Hashable) -> str:
    """A stable tie-break between tenants of equal counters (None: the single tenant)."""
    return "" if tenant is None else str(tenant)
