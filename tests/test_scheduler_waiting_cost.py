"""What a scheduling step costs with a long waiting queue, and that making it cheap changed no
decision. A request of 64 prompts x n=16 queues 1,024 sequences; four such from four clients
made every step order 4,096 sequences in Python and an innocent stream 20x slower. The step
now reads the fair order lazily, no further than it can admit, and orders nothing it does not
need when no slot is free (Scheduler._admit, FairShare.iter_waiting).

Work is counted, never timed (the suite runs on a loaded machine). The decisions are pinned by
digests of every step's chunks, recorded with the scheduler before this change: the same
workloads must give the same chunks, step by step. (Seed 1's four run the short-prompt lane;
they were recorded again when the lane's own decisions changed after its review: never past
an aged or higher-priority request, and no more new streams than keep every decode in a step.)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Hashable, Iterator

import pytest

from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.engine.fair_share import FairShare, _cross_priority, _name
from radixserve.engine.params import SamplingParams
from radixserve.engine.policy import LongestPrefixMatch, make_schedule_policy
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.scheduler import Scheduler


def _policy(name: str, max_wait_s: float):
    """"lpm8": LPM with a lookup budget of 8, so that its stale lengths (state kept from one
    ordering to the next) decide orders here too."""
    if name == "lpm8":
        return LongestPrefixMatch(max_wait_s, match_budget=8)
    return make_schedule_policy(name, max_wait_s=max_wait_s)


def run_workload(seed: int, policy: str, steps: int = 250) -> tuple[str, int]:
    """A random workload (tenants, prompts sharing prefixes, n > 1, priorities, admins, aging,
    fair preemptions and their loans, the short lane, pages running out) driven through the
    scheduler; returns a digest of every step's chunks and how many chunks ran."""
    rng = random.Random(seed)
    pool = PagePool(rng.choice([96, 256, 1024]), 4)
    clock = [0.0]
    wait = rng.choice([0.3, 30.0])
    sched = Scheduler(pool, RadixTree(pool), _policy(policy, wait),
                      max_running=rng.choice([4, 16, 64]), max_batch_tokens=rng.choice([64, 256]),
                      clock=lambda: clock[0], fair_share=FairShare(preempt_margin=rng.choice([32.0, 2048.0])),
                      mixed_prefill_tokens=rng.choice([None, 32]), short_prompt_tokens=rng.choice([None, 16]))
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    trace = []
    ids = 0

    def arrive() -> None:
        nonlocal ids
        ids += 1
        tenant = f"t{rng.randrange(4)}"
        prompt = rng.choice(prefixes)[: rng.randrange(0, 24)] + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
        n = rng.choice([1, 1, 2, 4, 8])
        req = Request(f"r{ids}", prompt, SamplingParams(max_tokens=rng.randrange(1, 12), n=n), clock[0],
                      priority=rng.choice([0, 0, 0, 1, -1]), tenant=tenant, admin=rng.random() < 0.05)
        sched.fair.arrive(req.fair_key)
        for k in range(n):
            seq = SequenceState(req, k, list(prompt), None, None, None)  # type: ignore[arg-type]
            req.sequences.append(seq)
            sched.waiting.append(seq)

    def on_last(seq: SequenceState) -> None:
        seq.token_ids.append(rng.randrange(1, 500))
        seq.output_ids.append(seq.token_ids[-1])
        if len(seq.output_ids) >= seq.request.params.max_tokens:
            seq.finish_reason = "length"
            sched.finish(seq, cache=True)
            if all(s.finished for s in seq.request.sequences):
                sched.fair.leave(seq.request.fair_key)

    for _ in range(rng.randrange(20, 200)):
        arrive()
    for _ in range(steps):
        clock[0] += 0.01
        for _ in range(rng.choice([0, 0, 0, 1, 5])):
            arrive()
        chunks = sched.schedule()
        trace.append([(c.seq.request.request_id, c.seq.index, c.num_new) for c in chunks])
        sched.advance(chunks, on_last)
    return hashlib.sha256(repr(trace).encode()).hexdigest()[:16], sum(len(t) for t in trace)


# Recorded with the scheduler of commit 40f935e (every waiting sequence ordered each step).
RECORDED = {
    (0, "lpm"): ("f102e14a76079861", 999),
    (0, "lpm8"): ("6d0df7fb1eabe1c4", 999),
    (1, "lpm"): ("c0338d59917e0cce", 3171),
    (1, "lpm8"): ("dcc00abff06edd9d", 3171),
    (1, "fcfs"): ("62c4b373eb239811", 3156),
    (1, "dfs-weight"): ("933b82a1e6bb3962", 3270),
    (3, "lpm8"): ("6c695165b8660a43", 3624),
    (5, "lpm"): ("b6ac91118755e997", 6794),
    (5, "dfs-weight"): ("d5852ecd73f6a3be", 6911),
    (6, "lpm8"): ("4b40a1a1861208ee", 3998),
    (11, "lpm"): ("badea691b58b7b80", 3759),
    (14, "fcfs"): ("eeb3cb7ea909354c", 3646),
}


@pytest.mark.parametrize(("seed", "policy"), sorted(RECORDED))
def test_every_steps_chunks_are_what_the_full_ordering_chose(seed: int, policy: str) -> None:
    assert run_workload(seed, policy) == RECORDED[seed, policy]


def _linear_merge(fair: FairShare, waiting: list[SequenceState],
                  policy_order: Callable[[list[SequenceState]], list[SequenceState]]) -> list[SequenceState]:
    """The merge as it was: a linear search of the tenants' heads for every sequence."""
    groups: dict[Hashable, list[SequenceState]] = {}
    for seq in waiting:
        groups.setdefault(seq.request.fair_key, []).append(seq)
    if len(groups) < 2:
        return policy_order(list(waiting))
    queues = {tenant: policy_order(group) for tenant, group in groups.items()}
    virtual = {tenant: fair.counters.get(tenant, 0.0) for tenant in queues}
    heads = dict.fromkeys(queues, 0)
    merged = []
    while queues:
        tenant = min(queues, key=lambda t: (-_cross_priority(queues[t][heads[t]]), virtual[t],
                                            queues[t][heads[t]].arrival_time, _name(t)))
        seq = queues[tenant][heads[tenant]]
        merged.append(seq)
        virtual[tenant] += fair.input_weight * seq.num_tokens
        heads[tenant] += 1
        if heads[tenant] == len(queues[tenant]):
            del queues[tenant]
    return merged


@pytest.mark.parametrize("seed", range(30))
def test_the_lazy_merge_is_the_linear_one_ties_included(seed: int) -> None:
    rng = random.Random(seed)
    tenants = [1, "1", "a", "b", None][: rng.randrange(1, 6)]  # 1 and "1": the same name, told apart by rank
    fair = FairShare()
    for tenant in tenants:
        fair.counters[tenant] = float(rng.choice([0, 0, 5, 40]))  # equal counters: ties to break
    waiting = []
    for i in range(rng.randrange(1, 60)):
        req = Request(f"r{i}", [1] * rng.randrange(1, 9), SamplingParams(), float(rng.randrange(4)),
                      priority=rng.choice([0, 0, 3]), tenant=rng.choice(tenants), admin=rng.random() < 0.2)
        waiting.append(SequenceState(req, 0, list(req.prompt_ids), None, None, None))  # type: ignore[arg-type]
    policy = lambda group: sorted(group, key=lambda s: (s.num_tokens, s.arrival_time))  # noqa: E731
    assert list(fair.iter_waiting(waiting, policy)) == _linear_merge(fair, waiting, policy)


# ---------------------------------------------------------------------------- work, counted
def flooded(max_running: int, per_tenant: int = 1024, tenants: int = 4) -> Scheduler:
    """`max_running` sequences decoding, then `per_tenant` sequences waiting from each tenant,
    in requests of 16 samples (the attack's shape), under the server's default policy."""
    pool = PagePool(4096, 16)
    rng = random.Random(0)
    sched = Scheduler(pool, RadixTree(pool), make_schedule_policy("lpm"), max_running=max_running,
                      max_batch_tokens=512, clock=lambda: 1.0, fair_share=FairShare(preempt_margin=512),
                      short_prompt_tokens=128, mixed_prefill_tokens=128)

    def queue(tenant: int, name: str, n: int) -> None:
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(4, 12))]
        req = Request(name, prompt, SamplingParams(max_tokens=16, n=n), 0.0, tenant=f"t{tenant}")
        sched.fair.arrive(req.fair_key)
        for k in range(n):
            seq = SequenceState(req, k, list(prompt), None, None, None)  # type: ignore[arg-type]
            req.sequences.append(seq)
            sched.waiting.append(seq)

    for i in range(max_running):
        queue(i % tenants, f"running-{i}", 1)
    while sched.waiting:
        sched.advance(sched.schedule(), lambda seq: seq.token_ids.append(7))
    for tenant in range(tenants):
        for i in range(per_tenant // 16):
            queue(tenant, f"flood-{tenant}-{i}", 16)
    return sched


class Counts:
    """Per step: sequences read from the fair order, and sequences given `_waiting_order`'s key."""

    def __init__(self, sched: Scheduler) -> None:
        self.read = self.keyed = 0
        iter_waiting, waiting_key = sched.fair.iter_waiting, sched._waiting_key

        def counted_order(*args, **kwargs) -> Iterator[SequenceState]:
            for seq in iter_waiting(*args, **kwargs):
                self.read += 1
                yield seq

        def counted_key(now: float) -> Callable[[SequenceState], tuple]:
            key = waiting_key(now)

            def counting(seq: SequenceState) -> tuple:
                self.keyed += 1
                return key(seq)
            return counting

        sched.fair.iter_waiting = counted_order  # type: ignore[method-assign]
        sched._waiting_key = counted_key  # type: ignore[method-assign]


def step_counts(sched: Scheduler, steps: int = 5) -> list[tuple[int, int, int]]:
    """(read, keyed, chunks) of each of `steps` steps."""
    counts = Counts(sched)
    out = []
    for _ in range(steps):
        counts.read = counts.keyed = 0
        chunks = sched.schedule()
        out.append((counts.read, counts.keyed, len(chunks)))
        sched.advance(chunks, lambda seq: seq.token_ids.append(7))
    return out


def test_with_every_slot_taken_a_step_reads_none_of_4096_waiting() -> None:
    sched = flooded(max_running=32)
    assert len(sched.waiting) == 4096 and len(sched.running) == 32
    assert step_counts(sched) == [(0, 0, 32)] * 5  # the 32 decodes; nothing waiting read or keyed


def test_with_free_slots_a_step_reads_the_order_only_as_far_as_it_admits() -> None:
    sched = flooded(max_running=40)
    for seq in list(sched.running)[:8]:  # 8 slots free
        seq.finish_reason = "length"
        sched.finish(seq)
    lookups = sched.policy.cached_lengths.lookups
    first, *rest = step_counts(sched)
    assert first[2] == 32 + 8 and first[0] <= 8 + 1  # 8 admitted: the order read no further than one past them
    assert all(read == 0 for read, _, _ in rest)  # full again
    # The policy still orders every tenant's queue each step (it keeps state across
    # orderings), with a bounded number of tree lookups however long the queue.
    assert sched.policy.cached_lengths.lookups - lookups <= 5 * 4 * sched.policy.match_budget
