"""The adaptive eviction rule (cache/adaptive.py): never far below LRU on random traffic, its
state bounded, explicit priorities kept, boosted pages aging out, queues re-keyed when the
lead changes."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.cache.adaptive import LEADS, AdaptiveReuse, GhostCache, LeadDuel, prompt_ticks
from radixserve.cache.invariants import check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree, Retention

PAGE = 4
# The documented margin: on random traffic the adaptive rule may hit fewer prompt tokens than
# LRU of the same capacity by at most this share of all prompt tokens (it starts as LRU and
# leaves it only on evidence, but a lead chosen on past traffic can be wrong for what follows).
MARGIN = 0.01


def serve(tree: RadixTree, prompt: np.ndarray, reuse: AdaptiveReuse | None) -> int:
    """One request as the engine runs it, prompt only: observe, match, make room, insert."""
    seen = reuse.observe(prompt) if reuse is not None else 0
    return cache_tokens(tree, prompt, [(0, seen * PAGE, reuse.retention)] if seen else [])


def cache_tokens(tree: RadixTree, tokens: np.ndarray, ranges: list[tuple[int, int, Retention]]) -> int:
    """Matches `tokens`, makes room, inserts their full pages with `ranges` (as a finished
    request does); returns the tokens the match hit."""
    match = tree.match(tokens)
    tree.lock(match.node)
    full = len(tokens) // PAGE
    need = full - len(match.pages)
    if tree.pool.num_free < need:
        tree.evict(need - tree.pool.num_free)
    new = tree.pool.allocate(need)
    tree.insert(tokens[: full * PAGE], list(match.pages) + new, range_retention=ranges)
    tree.unlock(match.node)
    tree.pool.decref(new)
    return match.num_tokens


def run(prompts: list[np.ndarray], num_pages: int, policy: str) -> tuple[int, RadixTree, AdaptiveReuse | None]:
    tree = RadixTree(PagePool(num_pages, PAGE), eviction_policy=policy)
    reuse = AdaptiveReuse(tree, 16 * num_pages) if policy == "adaptive" else None
    hits = sum(serve(tree, p, reuse) for p in prompts)
    return hits, tree, reuse


@st.composite
def traffic(draw: st.DrawFn) -> tuple[list[np.ndarray], int]:
    """Prompts drawn from a few documents (a prefix of one, then a fresh tail) and one-off
    prompts, in a random order; a cache of 8 to 64 pages."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_docs = draw(st.integers(1, 8))
    docs = [rng.integers(1, 1000, size=PAGE * int(rng.integers(1, 16))) + 1000 * (d + 1) for d in range(num_docs)]
    skew = draw(st.floats(0.0, 2.0))
    weights = 1.0 / np.arange(1, num_docs + 1) ** skew
    prompts = []
    for _ in range(draw(st.integers(10, 150))):
        if rng.random() < draw(st.floats(0.0, 0.5)) if not prompts else rng.random() < 0.2:
            prompts.append(rng.integers(10**6, 10**7, size=PAGE * int(rng.integers(1, 12))))  # one-off
            continue
        doc = docs[rng.choice(num_docs, p=weights / weights.sum())]
        cut = PAGE * int(rng.integers(1, len(doc) // PAGE + 1))
        prompts.append(np.concatenate([doc[:cut], rng.integers(10**7, 10**8, size=int(rng.integers(0, 3 * PAGE)))]))
    return prompts, draw(st.integers(20, 64))  # the longest prompt is 18 pages


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traffic())
def test_adaptive_never_far_below_lru(case: tuple[list[np.ndarray], int]) -> None:
    prompts, num_pages = case
    lru, _, _ = run(prompts, num_pages, "lru")
    adaptive, tree, reuse = run(prompts, num_pages, "adaptive")
    total = sum(len(p) for p in prompts)
    assert adaptive >= lru - MARGIN * total, (adaptive, lru, total, reuse.duel.switches)
    check_invariants(tree.pool, tree, [])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traffic())
def test_adaptive_state_stays_bounded(case: tuple[list[np.ndarray], int]) -> None:
    prompts, num_pages = case
    _, tree, reuse = run(prompts * 3, num_pages, "adaptive")
    window = 16 * num_pages
    assert len(reuse.history) <= 4 * window + 1024 + max(len(p) for p in prompts) // PAGE
    for ghost in reuse.duel.ghosts:
        assert len(ghost) <= ghost.capacity
        assert len(ghost._heap) <= 4 * ghost.capacity + 64 + 1
    assert tree.policy.learner.lead in LEADS
    assert len(tree.queued_nodes()) <= 2 * sum(1 for _ in tree.nodes()) + 64


def test_the_ghost_cache_orders_boosted_pages_by_their_lead() -> None:
    lru, boosted = GhostCache(2, 0.0), GhostCache(2, LEADS[-1])
    for ghost in (lru, boosted):
        ghost.access(1, 0, True, True)    # page 1, boosted
        ghost.access(2, 1, False, True)
        ghost.access(3, 2, False, True)   # evicts the smallest key
        ghost.access(1, 3, False, True)
    assert lru.hits == 0 and boosted.hits == 1  # LRU evicted page 1, the boosted one kept it


def test_every_lead_s_ghost_evicts_a_prompt_tail_first() -> None:
    # A prompt's pages are keyed a fraction of a tick apart, deepest earliest, so that a ghost
    # too small for all of them drops the deepest, as the tree evicts a leaf's tail. Under
    # every lead, the unbounded one included (its keys sit near UNBOUNDED, where a float64's
    # spacing must stay finer than the fractions), on a clock that has run a long while.
    pages = [int(h) for h in np.random.default_rng(1).permutation(10**6)[:40]]  # hash order != depth order
    for tick in (123_456, 10**9):
        for lead in LEADS:
            ghost = GhostCache(30, lead)
            for page, at in zip(pages, prompt_ticks(tick, len(pages))):
                ghost.access(page, at, True, False)
            assert [i for i, page in enumerate(pages) if page in ghost._keys] == list(range(30)), (tick, lead)


def test_the_duel_leaves_lru_only_on_clear_evidence() -> None:
    duel = LeadDuel(4)
    hot = [[7, 8]] * 3
    assert duel.lead == 0.0
    for tick in range(3):  # too few hits to be evidence
        duel.observe(hot[tick], 2, tick, 0)
    assert duel.lead == 0.0


def replay_rounds(duel: LeadDuel, rounds: int, tree_hits: bool = True) -> None:
    """Rounds of a re-seen prompt of 20 pages then 10 fresh pages, for a cache of 24: LRU loses
    the re-seen prompt's first pages (so all of it, a prefix) every round; any lead keeps it.
    With `tree_hits` the tree holds what the longest lead would (the prompt), else nothing."""
    doc = list(range(1, 21))
    for r in range(rounds):
        duel.observe(doc, len(doc), 2 * r, len(doc) if tree_hits else 0)
        duel.observe([1000 * (r + 1) + i for i in range(10)], 0, 2 * r + 1, 0)


def test_one_prompt_is_one_piece_of_evidence() -> None:
    # Pages of a prompt hit together: 20 pages that one lead hits and LRU misses, in one
    # prompt, are not 20 independent wins.
    duel = LeadDuel(24, 16 * 24)  # the engine's horizon: 16 caches of page accesses
    replay_rounds(duel, 2)  # the first round fills the cache; the second is one discordant prompt
    assert duel.lead == 0.0
    replay_rounds(duel, 8)  # several prompts that agree: clear evidence
    assert duel.lead == LEADS[-1]  # every lead ties here; the longest wins ties


def test_a_lead_is_kept_only_while_it_still_beats_lru() -> None:
    duel = LeadDuel(24, 16 * 24)  # the engine's horizon: 16 caches of page accesses
    replay_rounds(duel, 8)
    assert duel.lead == LEADS[-1]
    duel._diff[-1, 0], duel._diff[0, -1] = 0.0, 0.0  # the record now even: no longer ahead
    duel.observe([99_999], 0, 100, 0)
    assert duel.lead == 0.0


def test_the_long_record_halves_at_its_decay_boundary_keeping_its_z_scores() -> None:
    # Every `_decay_every` sampled accesses the long record's weight halves: the differences
    # and hits halve, the squares (variances) quarter, the tree's record likewise, so every
    # z-score (difference over spread) is unchanged; older prompts only weigh less against
    # new ones. A variance quartered wrongly would make the record look surer (or less sure)
    # at every decay.
    duel = LeadDuel(24, 16 * 24)
    replay_rounds(duel, 8)  # at the lead, with a long, a recent and a tree record
    assert duel.lead == LEADS[-1] and duel.tree_record[0] > 0
    fresh = iter(range(50_000, 50_100))

    def fresh_prompt(tick: int) -> None:
        """4 pages no ghost and no tree holds: they add nothing to any record."""
        duel.observe([next(fresh) for _ in range(4)], 0, tick, 0)

    duel._accesses, duel._recent_accesses = duel._decay_every - 5, 0
    diff, var, tree = duel._diff.copy(), duel._var.copy(), duel.tree_record.copy()
    hits = np.array([g.hits for g in duel.ghosts])
    recent = duel._recent_diff.copy(), duel._recent_var.copy()
    fresh_prompt(100)  # one access short of the boundary: nothing decays
    assert np.array_equal(duel._diff, diff) and np.array_equal(duel.tree_record, tree)
    fresh_prompt(101)  # crosses it
    assert duel._accesses == 0
    assert np.array_equal(duel._diff, diff / 2) and np.array_equal(duel._var, var / 4)
    assert np.array_equal(duel.tree_record, tree / (2, 4))
    assert np.array_equal([g.hits for g in duel.ghosts], hits / 2)
    z = diff[-1, 0] / np.sqrt(var[-1, 0])
    assert z > 2 and duel._diff[-1, 0] / np.sqrt(duel._var[-1, 0]) == z
    assert duel.tree_record[0] / np.sqrt(duel.tree_record[1]) == tree[0] / np.sqrt(tree[1])
    # The recent record keeps its own clock (a cache's worth of accesses): not decayed here.
    assert np.array_equal(duel._recent_diff, recent[0]) and np.array_equal(duel._recent_var, recent[1])
    assert duel.lead == LEADS[-1]


def test_a_lead_losing_on_recent_traffic_is_left_before_the_long_record_turns() -> None:
    duel = LeadDuel(24, 16 * 24)  # the engine's horizon: 16 caches of page accesses
    replay_rounds(duel, 8)
    assert duel.lead == LEADS[-1]
    # The document is over; two prompts of 10 pages now alternate. LRU lets the old boosted
    # document go and holds both; the unbounded lead keeps the document and misses them. The
    # tree hits them (its guard stays silent): only the recent record can tell.
    first, second = [5000 + i for i in range(10)], [6000 + i for i in range(10)]
    for r in range(3):
        duel.observe(first, 0, 100 + 2 * r, len(first))
        duel.observe(second, 0, 101 + 2 * r, len(second))
        if duel.lead != LEADS[-1]:
            break
    assert duel.lead == 0.0 and duel.switches == 2 and r == 1  # left at the second round of the new pair
    assert duel._diff[-1, 0] > 0  # the long record still remembers the lead's gains: it alone would stay


def test_a_lead_behind_on_recent_traffic_is_not_taken() -> None:
    duel = duel_with_records([2.3] * 6)
    duel._recent_diff[0, -1], duel._recent_var[0, -1] = 1.5, 1.0  # LRU ahead of it lately by 1.5 sigmas
    assert not duel._decide() and duel.lead == 0.0
    duel._recent_diff[0, -1] = 0.5  # within a sigma: taken
    assert duel._decide() and duel.lead == LEADS[-1]


def test_the_recent_record_takes_a_lead_the_long_record_holds_back_without_showing_it_behind() -> None:
    # Traffic in phases: the lead lost early and wins now; the long record, still counting
    # the early losses, shows it barely ahead (half a sigma), far from the margin.
    duel = duel_with_records([0.5] * 6)
    assert not duel._decide() and duel.lead == 0.0
    duel._recent_diff[1:, 0], duel._recent_var[1:, 0] = 2.3, 1.0  # clearly ahead lately (one record)
    assert duel._decide() and duel.lead == LEADS[-1]
    assert not duel._decide() and duel.lead == LEADS[-1]  # and kept: the long record is not behind
    # Not while the long record shows it behind LRU at all: it would be left at once.
    duel = duel_with_records([-0.1] * 6)
    duel._recent_diff[1:, 0], duel._recent_var[1:, 0] = 2.3, 1.0
    assert not duel._decide() and duel.lead == 0.0
    # The margin is corrected for the best of several different recent records.
    duel = duel_with_records([0.5] * 6)
    duel._recent_diff[1:, 0] = [0.5, 1.0, 1.5, 2.3, 2.3, 2.3]
    duel._recent_var[1:, 0] = 1.0
    assert not duel._decide() and duel.lead == 0.0


def set_pair(diff: np.ndarray, var: np.ndarray, a: int, b: int, value: float) -> None:
    """Lead `a` ahead of lead `b` by `value` over a spread of 1 (and `b` behind `a`)."""
    diff[a, b], diff[b, a] = value, -value
    var[a, b] = var[b, a] = 1.0


def test_two_records_that_disagree_do_not_send_the_rule_to_and_fro() -> None:
    # Traffic in phases: over the long record lead 2 is far ahead of LRU and of lead 5; over
    # the recent one lead 5 is far ahead of LRU and of lead 2. Each record alone would take
    # its own best; together the rule must settle, not switch on every prompt.
    duel = LeadDuel(24, 16 * 24)
    set_pair(duel._diff, duel._var, 2, 0, 10.0)
    set_pair(duel._diff, duel._var, 5, 0, 1.0)
    set_pair(duel._diff, duel._var, 2, 5, 10.0)
    duel.ghosts[2].hits, duel.ghosts[5].hits = 10, 1
    set_pair(duel._recent_diff, duel._recent_var, 5, 0, 10.0)
    set_pair(duel._recent_diff, duel._recent_var, 5, 2, 10.0)
    leads = []
    for _ in range(6):
        duel._decide()
        leads.append(duel.current)
    assert leads == [2, 5, 5, 5, 5, 5] and duel.switches == 2  # the recent record decides, once
    # From lead 2 the recent record moves to 5; from 5 the long record may not move back.
    duel.current = 2
    assert duel._decide() and duel.current == 5
    assert not duel._decide() and duel.current == 5
    # Records that disagree by less than that margin leave the long record its move, and the
    # recent record no move back.
    set_pair(duel._recent_diff, duel._recent_var, 5, 2, 1.5)
    assert duel._decide() and duel.current == 2
    assert not duel._decide() and duel.current == 2


def test_the_tree_trailing_lru_sends_it_back_and_voids_the_evidence() -> None:
    duel = LeadDuel(24, 16 * 24)  # the engine's horizon: 16 caches of page accesses
    replay_rounds(duel, 8, tree_hits=False)  # the ghosts' lead would hit; the tree does not
    assert duel.lead == LEADS[-1]
    recent = [8000 + i for i in range(4)]  # the last round's fresh pages: LRU's ghost holds them
    for r in range(8):  # the tree misses what LRU's ghost cache hits: the model is wrong here
        duel.observe(recent, 0, 100 + r, 0)
        if duel.lead == 0.0:
            break
    assert duel.lead == 0.0 and duel.switches == 2
    assert not duel._diff.any()  # the ghosts' case must be made again from fresh traffic


def mismatch_rounds(duel: LeadDuel, rounds: int) -> tuple[str, int]:
    """Steady traffic on which the ghosts' model is wrong: each round 5 re-seen documents
    (boosted; a lead's ghost keeps them, LRU's loses them, the tree never hits them), 10
    fresh pages, then the first 4 of those again, which the tree hits only at LRU. Returns
    the rounds at a lead ('L') or LRU ('.'), and the pages the tree missed that LRU hit."""
    docs = [[100 * d + i for i in range(1, 5)] for d in range(5)]
    tick, lost, timeline, again = 0, 0, "", None
    for r in range(rounds):
        if again is not None:
            lost += len(again) if duel.current else 0
            duel.observe(again, 0, tick, 0 if duel.current else len(again))
            tick += 1
        for doc in docs:
            duel.observe(doc, len(doc), tick, 0)
            tick += 1
        fresh = [10_000 * (r + 1) + i for i in range(10)]
        duel.observe(fresh, 0, tick, 0)
        tick += 1
        again = fresh[:4]
        timeline += "L" if duel.current else "."
    return timeline, lost


def test_a_refuted_lead_is_not_retaken_on_the_same_ghost_evidence() -> None:
    # The guard's trip is the tree's own measurement of the lead; the ghosts that made the
    # case for it make it again from the next round of the same traffic. Without a memory of
    # the trip the rule retook the lead within a round and cycled (29 of 30 rounds at a lead,
    # 112 pages lost to LRU); with it the refutation holds until it fades (z / sqrt 2 with
    # every window at LRU), and a retry, judged from the kept record, trips within two rounds.
    duel = LeadDuel(24, 16 * 24)
    timeline, lost = mismatch_rounds(duel, 30)
    assert timeline.startswith(".LLLLL.")  # the first try, until the guard trips
    assert timeline.count("L") <= 10 and lost <= 40 and duel.switches <= 6
    assert "LLL" not in timeline[6:]  # every retry is short


def test_a_trip_keeps_the_tree_s_record_until_it_fades() -> None:
    duel = LeadDuel(24, 16 * 24)
    mismatch_rounds(duel, 7)
    assert duel.lead == 0.0 and duel.switches == 2  # tripped in the seventh round
    # Both ghost records were voided: they hold only the 5 documents since the trip.
    assert duel._diff[-1, 0] == 20.0 and 0 < duel._recent_diff[-1, 0] <= 12.0  # the recent one decayed since
    refutation = duel.tree_record.copy()
    assert refutation[0] < -2 * np.sqrt(refutation[1])  # kept: it is what blocks a retake...
    assert duel._diff[-1, 0] > 2 * np.sqrt(duel._var[-1, 0])  # ...of the lead the ghosts show ahead again
    duel._accesses = duel._decay_every - 1  # a window of traffic at LRU ends
    duel.observe([60_000], 0, 10_000, 0)
    assert np.array_equal(duel.tree_record, refutation / 2)  # z / sqrt 2: below the margin
    assert duel.lead == LEADS[-1]  # so the lead is tried again, judged from the kept record on


def test_a_tree_trailing_while_at_lru_does_not_block_a_lead() -> None:
    # At LRU the tree may trail its flat ghost for reasons no lead causes (pages pinned in
    # flight): that record does not judge a lead.
    duel = LeadDuel(24, 16 * 24)  # the engine's horizon: 16 caches of page accesses
    duel.tree_record[:] = (-1000.0, 1000.0)
    replay_rounds(duel, 8)
    assert duel.lead == LEADS[-1]


def duel_with_records(z_scores: list[float]) -> LeadDuel:
    """A duel at LRU whose leads (all but LRU) are ahead of LRU by these many standard
    deviations (each record: a difference of z over a spread of 1), ghost hits in that order."""
    duel = LeadDuel(24, 16 * 24)
    for i, z in enumerate(z_scores, start=1):
        duel._diff[i, 0], duel._var[i, 0] = z, 1.0 if z else 0.0  # 0: never told apart from LRU
        duel.ghosts[i].hits = z
    return duel


def test_the_best_of_several_different_leads_needs_a_corrected_margin() -> None:
    # The best of several different records is ahead by chance more often than one record:
    # 2.3 sigmas is not enough when it was picked among four different records...
    duel = duel_with_records([0.5, 1.0, 1.5, 2.3, 2.3, 2.3])
    assert not duel._decide() and duel.lead == 0.0
    # ...and is when every lead's ghost hit alike (one test, not six).
    duel = duel_with_records([2.3] * 6)
    assert duel._decide() and duel.lead == LEADS[-1]
    # A lead whose ghost never hit differently from LRU's (no discordant prompt) is no test.
    duel = duel_with_records([0.0, 0.0, 2.1, 2.1, 2.1, 2.1])
    assert duel._decide() and duel.lead == LEADS[-1]


def tree_with(num_pages: int = 8) -> RadixTree:
    return RadixTree(PagePool(num_pages, PAGE), eviction_policy="adaptive")


def insert(tree: RadixTree, tokens: list[int], retention: Retention | None = None, boost: bool = False) -> None:
    pages = tree.pool.allocate(len(tokens) // PAGE)
    ranges = [(0, len(tokens), Retention(boost=True))] if boost else []
    tree.insert(tokens, pages, retention=retention, range_retention=ranges)
    tree.pool.decref(pages)


def test_a_boosted_page_ages_out_after_its_lead() -> None:
    tree = tree_with()
    tree.policy.learner.set_lead(4.0)
    insert(tree, [1, 1, 1, 1], boost=True)  # tick 1, boosted: ordered as tick 5
    insert(tree, [2, 2, 2, 2])              # tick 2
    tree.evict(1)
    assert tree.match([1, 1, 1, 1], update=False).num_tokens == 4  # the fresh one went first
    for t in range(3, 9):
        insert(tree, [t] * 4)  # fresh pages at ticks 3..8
    tree.evict(3)              # ticks 3, 4, then the boosted page (tick 1 + lead 4)
    assert tree.match([1, 1, 1, 1], update=False).num_tokens == 0  # its lead is spent
    assert tree.match([6, 6, 6, 6], update=False).num_tokens == 4


def test_an_explicit_priority_outranks_any_lead() -> None:
    tree = tree_with()
    tree.policy.learner.set_lead(LEADS[-1])
    insert(tree, [1, 1, 1, 1], retention=Retention(36))
    insert(tree, [2, 2, 2, 2], boost=True)
    tree.evict(1)
    assert tree.match([1, 1, 1, 1], update=False).num_tokens == 4
    assert tree.match([2, 2, 2, 2], update=False).num_tokens == 0


def test_queues_rekey_when_the_lead_changes() -> None:
    tree = tree_with()
    tree.policy.learner.set_lead(LEADS[-1])
    insert(tree, [1, 1, 1, 1], boost=True)  # queued with an unbounded lead
    insert(tree, [2, 2, 2, 2])
    tree.policy.learner.set_lead(0.0)       # plain LRU now: the boosted page is the oldest
    tree.evict(1)
    assert tree.match([1, 1, 1, 1], update=False).num_tokens == 0
    assert tree.match([2, 2, 2, 2], update=False).num_tokens == 4
