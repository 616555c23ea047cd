"""The adaptive retention rule: how long re-seen prefixes are kept, learned from the cache's
own traffic.

Reuse-boost (reuse.py) raises every page whose prefix was seen recently to a higher
priority for good: small caches gain (one-off prompts go first), large ones lose (re-seen
conversations that are over pin the cache while the live ones' new turns go first). The
adaptive rule keeps the recognition but changes what it buys: a re-seen page is *boosted*
(`Retention.boost`), and the `adaptive` eviction policy (eviction.py) orders a boosted page
as if it had been used `lead` ticks later than it was. A finite lead lets boosted pages age
out; `lead = 0` is plain LRU, an unbounded one reuse-boost. Explicit priorities are
untouched: the boost only reorders pages of equal priority.

The lead is learned from ghost caches, the way ARC (Megiddo and Modha) sizes its segments
from ghost lists and set dueling picks a cache's insertion policy: `LeadDuel` keeps, for each
lead of a geometric ladder (`LEADS`: 0, 8^k ticks, unbounded), a ghost cache — page-prefix
hashes only, no KV — of a spatially hashed sample of the pages (SHARDS, Waldspurger et al.:
pages whose hash falls in 1/R of the space, in a cache of 1/R the size). Every prompt's
sampled pages go through every ghost cache (a sampled page hits only while every sampled
page before it in the prompt hit too: a prefix cache hits prefixes), and so does every page
the tree caches (`RadixTree.insert_observer`: a reply takes room in the tree when its turn
ends, long before a prompt resends it), without a hit; a prompt's pages are ordered tail
first, as the tree evicts them. The ghost caches are
compared in pairs, prompt by prompt (`LeadDuel`): the evidence is how many sampled pages of
each prompt one lead hit and another missed, tested against its own spread, so a prompt
counts once however many pages it moves, and the hits both share count not at all. The
record decays over the reuse history's window (what a lead buys is keeping pages re-seen
within it).

The rule starts at LRU and is cheap to be wrong about: it takes the best lead only when that
lead beats LRU and the lead in use by two standard deviations, corrected for having picked
the best of several different records (Bonferroni: a switch on a fluke costs more than the
lead can gain while the tree's contents change over), keeps it only while it still
beats LRU at all (the evidence must last, not only appear) and while the recent traffic does
not turn against it (below), and a guard watches the tree itself: from the moment it leaves LRU, its own hits on the sampled pages (peeked at arrival)
are compared with LRU's ghost cache in the same paired test, and when LRU's would have hit
more by two standard deviations it returns to LRU and voids the ghost caches' records (their
model of the tree is wrong here; a new try needs fresh evidence). It keeps the tree's record
of the refuted lead, which the same ghosts would otherwise outvote within a round of the
same traffic: no lead is taken while it still shows the tree behind by the guard's margin
(at LRU it fades, z / sqrt 2 a window), and the next lead is judged from it on. The record that takes a
lead spans the reuse window, since that is where a lead's gains build up; but traffic
changes, and a lead that loses on today's traffic keeps the support of yesterday's for half a
window or more (on the Mooncake trace at 1M the unbounded lead, taken at request 2,474 of
3,993, lost 1.6 points in the last tenth before the record turned at 3,956). So a second,
*recent* record of the same paired differences decays every cache's worth of sampled
accesses (what the cache holds was decided within about that much traffic): a lead it shows
behind LRU by one standard deviation is left, and not taken. Leaving is cheap to be wrong
about (LRU is the baseline the rule must not fall under), hence the low bar. The recent
record also *takes* a lead, by the corrected two-sigma margin, where the long record holds
it back without showing it behind LRU: traffic in phases (on the chat-crowd workload at 2M a
lead lost in the third to fifth tenths and gained 9-19 points in the next four, while the
long record still counted the early losses; taking it on the recent record: 55.4% against
52.3%, LRU 53.0%). No constant
here is a property of a workload: the ladder spans every lead, the margins are statistical,
the decays are the reuse window and the cache itself.

Replicas of one model behind a router can pool their evidence: `LeadDuel.record()` is a
duel's record as it travels (`DuelRecord`: records add), and a duel whose `peers` holds the
sum of the other replicas' records decides on all of it, its guard included (a tree's
record counts only what it did under a lead), and on its own record alone when it gets no
other. Each replica
still keeps its own ghost caches (its traffic, its capacity) and its own lead.
`share_evidence` pools duels in one process (the cluster simulation does, before every
routing).

What counts as *re-seen* is pooled too: behind a router, one document's requests are spread
over the replicas, so a replica's own history often takes a prefix the cluster has seen
before for a new one (it was seen on another replica), and no lead can help a page that is
never boosted. Whatever sees every request (the cluster's ingress, the cluster simulation's
router) keeps a `ReuseHistory` of the cluster, over a window of the sum of the replicas'
windows, and hands each request the leading pages it has seen (`cluster_seen`): the replica
boosts those instead of its own count (its own history still observes, for a replica that
gets no count).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import threading
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.retention import PageRange, Retention
from radixserve.cache.reuse import ReuseHistory

if TYPE_CHECKING:  # radix.py imports this module (through eviction.py)
    from radixserve.cache.radix import RadixTree

REUSE_BOOST = Retention(boost=True)  # what a re-seen prefix gets under the adaptive rule
# A lead no tick count reaches (reuse-boost's order: the tree's clock moves a few ticks per
# request, so 2**40 is decades of traffic), small enough that a float64 near it still tells
# a prompt's pages apart: the ghost caches key them `tick + lead` a fraction of a tick apart
# (`prompt_ticks`), and the spacing at 2**40 is 2**-12, exact for prompts of up to 4,095
# pages (at 1e15 it was 0.125: a 40-page prompt fell into 9 keys and its pages left the
# unbounded lead's ghost in hash order, not tail first, leaving holes the tree never has).
UNBOUNDED = 2.0 ** 40
LEADS = (0.0, *(float(8 ** k) for k in range(1, 6)), UNBOUNDED)  # 0, 8 .. 32,768 ticks, unbounded
MIN_GHOST_PAGES = 1024    # sample fewer pages only while each ghost cache keeps at least this many
MAX_SAMPLE_RATE = 32       # at most 1 page in 32 sampled
MAX_PENDING = 1024         # cluster messages kept for the engine thread (a refused prompt's count is never taken)
SWITCH_SIGMAS = 2.0     # the margin of every test: two standard deviations
RECENT_SIGMAS = 1.0     # ... but one against a lead on the recent record: leaving for LRU is cheap
# The lead taken is the best of the other leads' records, so its margin is corrected for the
# number of distinct records among them (Bonferroni: two sigmas' one-sided chance, split
# among them; leads whose ghosts hit alike are one test): PICK_SIGMAS[k] for k records, 2.0
# for one, about 2.67 for six.
PICK_SIGMAS = tuple(NormalDist().inv_cdf(1.0 - NormalDist().cdf(-SWITCH_SIGMAS) / max(k, 1))
                    for k in range(len(LEADS)))


class GhostCache:
    """A page-hash cache of `capacity` entries ordered as the adaptive policy would with
    `lead`: key = last use tick, plus the lead for a boosted page. Counts its hits."""

    def __init__(self, capacity: int, lead: float) -> None:
        self.capacity = capacity
        self.lead = lead
        self.hits = 0.0
        self._keys: dict[int, float] = {}
        self._boosted: set[int] = set()
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._keys)

    def access(self, page: int, tick: float, boost: bool, countable: bool) -> bool:
        """A prompt uses `page` at `tick` (boosted from now on with `boost`); returns whether
        it was cached, and counts a hit if so and `countable` (the pages before it hit too).
        Pages of one prompt pass ticks a fraction apart, deeper ones earlier (`prompt_ticks`),
        so that they leave tail first, as the tree evicts a leaf's tail."""
        keys = self._keys
        present = page in keys
        if present and countable:
            self.hits += 1
        if boost:
            self._boosted.add(page)
        key = tick + self.lead if boost or page in self._boosted else float(tick)
        keys[page] = key
        heap = self._heap
        heapq.heappush(heap, (key, page))
        while len(keys) > self.capacity:
            old_key, old = heapq.heappop(heap)
            if keys.get(old) == old_key:
                del keys[old]
                self._boosted.discard(old)
        if len(heap) > 4 * self.capacity + 64:  # drop superseded entries: bounded state
            self._heap = [(k, p) for p, k in keys.items()]
            heapq.heapify(self._heap)
        return present


class LeadDuel:
    """Ghost caches for every lead of `LEADS` over a hashed sample of the pages of a cache of
    `cache_pages`; `lead` is the winner's (see the module docstring).

    Every comparison is paired, prompt by prompt: the ghost caches see the same prompts, so
    what tells two of them apart is only how many sampled pages of each prompt one hit and
    the other missed. The unit of evidence is the prompt, not the page: a prefix cache hits a
    prompt's pages together (one prompt that one lead hits and another misses moves many
    pages, and is one piece of evidence). `_diff[a, b]` sums, over prompts, `a`'s sampled
    hits minus `b`'s, `_var[a, b]` the squares of those differences (each decayed like the
    hits: a weight that halves, so the squares' weight quarters); `a` is ahead of `b` by `s`
    standard deviations when `_diff[a, b] > s * sqrt(_var[a, b])` (a self-normalized paired
    test: it needs several prompts that agree, however many pages each moves)."""

    def __init__(self, cache_pages: int, horizon_pages: int | None = None) -> None:
        self.sample_rate = int(max(1, min(MAX_SAMPLE_RATE, cache_pages // MIN_GHOST_PAGES)))
        capacity = max(1, cache_pages // self.sample_rate)
        self.ghosts = [GhostCache(capacity, lead) for lead in LEADS]
        self.current = 0  # index into LEADS: start as LRU
        self._accesses = 0
        # The evidence halves once per `horizon_pages` page accesses (sampled: divided by the
        # rate), the reuse history's window: what a lead buys is keeping pages re-seen within
        # that window, so the record that judges it spans the same traffic.
        horizon = horizon_pages if horizon_pages is not None else cache_pages
        self._decay_every = max(capacity, horizon // self.sample_rate)
        self.switches = 0
        self._diff = np.zeros((len(LEADS), len(LEADS)))
        self._var = np.zeros((len(LEADS), len(LEADS)))
        # The recent record: the same differences, halved every cache's worth of sampled accesses.
        self._recent_diff = np.zeros((len(LEADS), len(LEADS)))
        self._recent_var = np.zeros((len(LEADS), len(LEADS)))
        self._recent_accesses = 0
        # The tree's own record against LRU's ghost cache on the sampled pages (peeked at
        # arrival), as one more row of the same test: its hits minus the ghost's, squared;
        # built only under a lead, reset when the duel leaves LRU (unless `_refuted`).
        self.tree_record = np.zeros(2)
        # The guard sent the rule back to LRU: the tree's record of that lead is the only
        # measurement of what a lead does on this tree, and the ghost caches that made the
        # case for it will make it again from the same traffic (their model is what was
        # wrong). So it is kept: no lead is taken while it shows the tree behind by the
        # guard's margin, and a lead taken after it is judged from it on.
        self._refuted = False
        # The other replicas' evidence (the sum of their records), when the replicas of one
        # model pool theirs (`share_evidence`, or a cluster's ingress): every decision reads
        # this duel's record plus this.
        self.peers: DuelRecord | None = None

    @property
    def lead(self) -> float:
        """The lead the tree should use now."""
        return LEADS[self.current]

    def observe(self, hashes: list[int], boosted: int, tick: int, cached: int) -> bool:
        """A prompt with these page hashes, its first `boosted` pages boosted, of which the
        tree holds the first `cached`, arrives at `tick`; returns whether the lead changed."""
        return self._replay(hashes, boosted, tick, cached)

    def observe_elsewhere(self, hashes: list[int], tick: int) -> bool:
        """A prompt this replica served before was sent to another one because this replica
        had lost it (`AdaptiveReuse.elsewhere`): the ghost caches replay it as if it had
        come here, since a lead that had kept the prefix would also have drawn the request
        back (a cache-aware router follows what each replica holds); the tree's record is
        left alone (the tree never saw it). Its pages are replayed unboosted: the prompt is
        served and cached where it was sent, so no request will use its copies here, and a
        lead's ghost would keep boosted copies longest (on the Mooncake trace's replicas a
        replay's home held 1.1 of the prompt's 45 sampled pages; the other 44, boosted, stayed
        in the unbounded lead's ghost for good and its evidence faded). Unboosted, the copies
        weigh on every ghost as the cluster's traffic does and leave first under a lead.
        Returns whether the lead changed."""
        return self._replay(hashes, 0, tick, None)

    def _replay(self, hashes: list[int], boosted: int, tick: int, cached: int | None) -> bool:
        """Runs a prompt through every ghost cache and adds its paired differences to the
        record, and, when the tree holds its first `cached` pages (None: the tree did not
        see it), the tree's difference from LRU's ghost."""
        rate = self.sample_rate
        sampled = [(i, h) for i, h in enumerate(hashes) if h % rate == 0]
        if not sampled:
            return False
        hit = np.zeros((len(self.ghosts), len(sampled)), dtype=bool)
        ticks = prompt_ticks(tick, len(hashes))
        for g, ghost in enumerate(self.ghosts):
            leading = True  # a prefix cache hits a page only if every page before it hits
            for k, (i, h) in enumerate(sampled):
                leading = ghost.access(h, ticks[i], i < boosted, leading) and leading
                hit[g, k] = leading
        hits = hit.sum(axis=1).astype(np.float64)
        diff = hits[:, None] - hits[None, :]
        self._diff += diff
        self._var += diff * diff
        self._recent_diff += diff
        self._recent_var += diff * diff
        if cached is not None and self.current != 0:
            # Only under a lead: at LRU the tree may trail its flat ghost for reasons no lead
            # causes (pages pinned in flight, leaf-only eviction; `_move`). The record travels
            # to the other replicas, whose guards judge their own leads by it: a trail built
            # at LRU would trip theirs the moment they take one, or drown a real loss in its
            # spread. What it held under a lead it keeps at LRU (decaying), so that the
            # others' guards still count a tree that refuted the lead.
            tree = float(sum(1 for i, _ in sampled if i < cached)) - hits[0]
            self.tree_record += (tree, tree * tree)
        self._accesses += len(sampled)
        self._recent_accesses += len(sampled)
        if self._recent_accesses >= self.ghosts[0].capacity:
            self._recent_accesses = 0
            self._recent_diff /= 2
            self._recent_var /= 4
        if self._accesses >= self._decay_every:
            self._accesses = 0
            for ghost in self.ghosts:
                ghost.hits /= 2
            self._diff /= 2
            self._var /= 4
            # Under a lead the tree's record decays as the others do (its z unchanged). At LRU
            # it only keeps what a past lead showed, and nothing new is measured: there its
            # variance halves too, so that a refutation weighs less (z / sqrt 2) with every
            # window of traffic since (see `_refuted`), and the rule can try a lead again.
            self.tree_record /= (2, 4) if self.current != 0 else (2, 2)
        return self._decide()

    def cached(self, hashes: list[int], boosted: np.ndarray, tick: int) -> None:
        """The tree cached (or touched) pages with these hashes at `tick`, those where `boosted`
        is set boosted: every ghost cache takes them too, as the tree does, without counting
        hits (no prompt looked them up). Without this the ghosts would see a reply only when
        the next turn's prompt resends it, and model a tree with more room than it has."""
        rate = self.sample_rate
        ticks = prompt_ticks(tick, len(hashes))
        sampled = [(h, ticks[i], bool(boosted[i])) for i, h in enumerate(hashes) if h % rate == 0]
        for ghost in self.ghosts:
            for h, at, boost in sampled:
                ghost.access(h, at, boost, False)

    def record(self) -> DuelRecord:
        """A copy of this duel's own evidence, to pool with other replicas' (`peers`); its
        tree record holds only what the tree did under a lead (`_replay`)."""
        return DuelRecord(self._diff.copy(), self._var.copy(), np.array([g.hits for g in self.ghosts]),
                          self.tree_record.copy(), self._recent_diff.copy(), self._recent_var.copy())

    def _decide(self) -> bool:
        """Moves to the lead the record supports (pooled with `peers`); returns whether it
        moved."""
        diff, var, tree = self._diff, self._var, self.tree_record
        recent_diff, recent_var = self._recent_diff, self._recent_var
        hits = np.array([g.hits for g in self.ghosts])
        # Read once: a replica's event loop replaces `peers` while this runs on the engine
        # thread, and one record's differences tested against another's variances support
        # moves that neither record does.
        peers = self.peers
        if peers is not None:
            diff, var, tree = diff + peers.diff, var + peers.var, tree + peers.tree
            recent_diff, recent_var = recent_diff + peers.recent_diff, recent_var + peers.recent_var
            hits = hits + peers.hits
        if self.current != 0 and _ahead(-tree[0], tree[1], SWITCH_SIGMAS):
            # Since it took this lead, the tree itself hits less than LRU's ghost cache: the
            # ghost caches' model of the tree is wrong here. Back to LRU, and the case they
            # made is void, the recent record's too: another try needs fresh evidence, not
            # the refuted record. The tree's record stays (`_refuted`).
            self._diff[:] = 0.0
            self._var[:] = 0.0
            self._recent_diff[:] = 0.0
            self._recent_var[:] = 0.0
            self._refuted = True
            return self._move(0)
        if self.current == 0 and self._refuted and _ahead(-tree[0], tree[1], SWITCH_SIGMAS):
            # The tree trailed LRU's ghost under the last lead it tried: fresh ghost evidence
            # for a lead does not outweigh that until it has faded below the guard's margin
            # (without this, the ghost caches retook the refuted lead within a round of
            # steady traffic, and the guard had to find it out again from nothing: the rule
            # cycled, under a lead most of the time).
            return False
        if self.current != 0 and not _ahead(diff[self.current, 0], var[self.current, 0], 0.0):
            # The lead in use no longer beats LRU at all: back to LRU. Staying away from LRU
            # needs the evidence to last, not only to have appeared.
            return self._move(0)
        if self.current != 0 and _ahead(recent_diff[0, self.current], recent_var[0, self.current], RECENT_SIGMAS):
            # The recent traffic has turned against the lead in use, while the long record still
            # remembers what it gained before: back to LRU (the long record stays; the lead comes
            # back when the recent traffic no longer shows it behind).
            return self._move(0)
        # Most hits; the longer lead on ties: leads longer than the history so far tie, and the
        # longest is the one that stays right as the history grows. Not a lead the recent
        # record shows behind LRU, nor one it shows behind the lead in use by the margin on
        # which its own move (below) would take the rule back: where the records disagree
        # that much the recent one decides, or the two would send the rule to and fro on
        # every prompt.
        best = max(range(len(hits)), key=lambda i: (hits[i], i))
        if best != self.current:
            sigmas = PICK_SIGMAS[_distinct_records(diff, var)]
            recent_sigmas = PICK_SIGMAS[_distinct_records(recent_diff, recent_var)]
            if _ahead(diff[best, self.current], var[best, self.current], sigmas) and \
                    _ahead(diff[best, 0], var[best, 0], sigmas) and \
                    not _ahead(recent_diff[0, best], recent_var[0, best], RECENT_SIGMAS) and \
                    not _ahead(recent_diff[self.current, best], recent_var[self.current, best], recent_sigmas):
                return self._move(best)
        # Traffic in phases: a lead that lost early and wins now is held back by the long
        # record's early losses for half a window. The recent record takes it, by the same
        # corrected margin over LRU and the lead in use, once the long record no longer shows
        # it behind LRU at all (the condition it is kept on: taken, it stays, and the long
        # record's move above cannot take the rule back while the recent one shows it ahead).
        best = max(range(len(hits)), key=lambda i: (recent_diff[i, 0], i))
        if best in (0, self.current):
            return False
        sigmas = PICK_SIGMAS[_distinct_records(recent_diff, recent_var)]
        if _ahead(recent_diff[best, 0], recent_var[best, 0], sigmas) and \
                _ahead(recent_diff[best, self.current], recent_var[best, self.current], sigmas) and \
                _ahead(diff[best, 0], var[best, 0], 0.0):
            return self._move(best)
        return False

    def _move(self, index: int) -> bool:
        if self.current == 0:
            # The tree's record judges the lead it takes from the moment it leaves LRU: what
            # it held at LRU is an earlier lead's (kept for the other replicas' guards), not
            # this one's; except after a trip, when it is the refutation the new lead must
            # live down (a tree that still trails sends it back within a prompt or two).
            if not self._refuted:
                self.tree_record[:] = 0.0
            self._refuted = False
        self.current = index
        self.switches += 1
        return True


@dataclass(frozen=True)
class DuelRecord:
    """A duel's evidence as it travels between the replicas of one model (the seam between
    a replica's cache and whatever connects the replicas: the cluster simulation, a
    cluster's ingress): the paired differences between leads and their squares, each
    lead's ghost hits, the tree's record against LRU's ghost, and the recent record's
    differences and squares, all decayed as the duel decays them. Records add: the sum of several replicas' is the evidence of all their
    prompts (different prompts are independent pieces of evidence, and the variance of a
    sum of independent differences is the sum of theirs).

    Why pool: behind a router each replica sees only its share of the traffic, so a case
    that is clear over the cluster can stay under the margin on every replica; replicas of
    one model serve the same kind of traffic, the router spreading it over them."""

    diff: np.ndarray
    var: np.ndarray
    hits: np.ndarray
    tree: np.ndarray
    recent_diff: np.ndarray
    recent_var: np.ndarray

    def _parts(self) -> tuple[np.ndarray, ...]:
        return (self.diff, self.var, self.hits, self.tree, self.recent_diff, self.recent_var)

    def __add__(self, other: DuelRecord) -> DuelRecord:
        return DuelRecord(*(mine + theirs for mine, theirs in zip(self._parts(), other._parts())))

    def __sub__(self, other: DuelRecord) -> DuelRecord:
        return DuelRecord(*(mine - theirs for mine, theirs in zip(self._parts(), other._parts())))

    def to_list(self) -> list[float]:
        """Flat floats, for a message (`from_list` reads them back)."""
        return [float(x) for part in self._parts() for x in part.ravel()]

    @classmethod
    def from_list(cls, values: list[float]) -> DuelRecord:
        """The record `to_list` wrote (a record of a duel with `LEADS`)."""
        n = len(LEADS)
        sizes = (n * n, n * n, n, 2, n * n, n * n)
        flat = np.asarray(values, dtype=np.float64)
        if flat.shape != (sum(sizes),):
            raise ValueError(f"DuelRecord: {sum(sizes)} values expected, got {flat.shape}")
        parts = np.split(flat, np.cumsum(sizes)[:-1])
        return cls(*(part.reshape(n, n) if part.size == n * n else part for part in parts))


def share_evidence(duels: list[LeadDuel]) -> None:
    """Pools the evidence of the duels of one model's replicas: each one's `peers` becomes
    the sum of the others' records as they are now. A lone duel's `peers` is cleared: a
    record decays only with its own replica's traffic, so one kept from a replica that has
    left would count, undecayed, for good."""
    records = [duel.record() for duel in duels]
    if len(records) < 2:
        for duel in duels:
            duel.peers = None
        return
    total = sum(records[1:], records[0])
    for duel, own in zip(duels, records):
        duel.peers = total - own


def _distinct_records(diff: np.ndarray, var: np.ndarray) -> int:
    """How many different records against LRU the leads other than LRU have (the tests the
    best of them was picked from); a lead whose ghost never hit differently from LRU's has no
    record, only a tie."""
    return len({(diff[i, 0], var[i, 0]) for i in range(1, len(LEADS)) if var[i, 0] > 0})


def prompt_ticks(tick: int, num_pages: int) -> list[float]:
    """The ghost caches' recency of each page of a prompt used at `tick`: the first page
    `tick`, each deeper one a fraction of a tick earlier (all above `tick - 1`), so that among
    pages used together the deepest is evicted first: the tree evicts leaves, tail first, and
    a prefix cache that lost a page in the middle of a prompt could hit nothing after it."""
    return [tick - i / (num_pages + 1) for i in range(num_pages)]


def _prompt_key(tokens: np.ndarray | list[int]) -> bytes:
    """A prompt's tokens as the key of its expected cluster count: a 16-byte digest (the
    tokens themselves would keep whole prompts alive)."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def _ahead(diff: float, var: float, sigmas: float) -> bool:
    """A summed difference `diff` whose terms' squares sum to `var` is above zero by `sigmas`
    standard deviations (with no sigmas: above zero at all)."""
    return diff > sigmas * math.sqrt(var)


class LeadLearner:
    """The lead the `adaptive` eviction policy reads (0 until a duel is attached), and an
    epoch that changes with it: eviction queues re-key their entries when it does."""

    def __init__(self) -> None:
        self.lead = 0.0
        self.epoch = 0
        self.latest_tick = 0  # the largest tick the policy keyed: the tree's clock, roughly

    def saw_tick(self, tick: int) -> None:
        """The policy keyed a leaf with this tick."""
        if tick > self.latest_tick:
            self.latest_tick = tick

    def set_lead(self, lead: float) -> None:
        """Switches to `lead` (a new epoch if it changed)."""
        if lead != self.lead:
            self.lead = lead
            self.epoch += 1


class AdaptiveReuse:
    """The adaptive rule's arrival hook, as the engine and the simulator call it: looks a
    prompt up in the reuse history (its leading pages seen recently will be boosted:
    `retention`), runs it through the lead duel, and hands the winning lead to the learner
    of the tree's `adaptive` policy. Same interface as ReuseHistory."""

    retention = REUSE_BOOST

    def __init__(self, tree: RadixTree, window_pages: int) -> None:
        self.tree = tree
        self.page_size: int = tree.page_size
        cache_pages = tree.pool.num_pages + (tree.host.pool.num_pages if tree.host is not None else 0)
        self.history = ReuseHistory(self.page_size, window_pages)
        self.duel = LeadDuel(cache_pages, window_pages)
        self.learner: LeadLearner = getattr(tree.policy, "learner", None) or LeadLearner()
        tree.insert_observer = self.inserted
        # The cluster's counts for prompts on their way in (`expect`), by the prompt's tokens,
        # and prompts served elsewhere that this replica had lost (`elsewhere`); a replica's
        # event loop adds them while the engine thread takes them: under a lock.
        self._expected: dict[bytes, int] = {}
        self._elsewhere: deque[tuple[np.ndarray, Hashable]] = deque(maxlen=MAX_PENDING)
        self._pending_lock = threading.Lock()

    def inserted(self, tokens: np.ndarray, namespace: Hashable, retention: Retention,
                 ranges: list[PageRange], tick: int) -> None:
        """The tree's insert hook: its full pages `tokens` were cached at `tick` with
        `retention` and the page `ranges`' retentions; the ghost caches follow."""
        hashes = self.history.hashes(tokens, namespace)
        boosted = np.full(len(hashes), retention.boost, dtype=bool)
        for first, end, each in ranges:
            if each.boost:
                boosted[first:end] = True
        self.duel.cached(hashes, boosted, tick)

    def expect(self, tokens: np.ndarray | list[int], cluster_seen: int) -> None:
        """The cluster's count for a prompt that `observe` will see next (a replica hands it
        on before the engine takes the request: the engine calls `observe` without it).
        Keyed by the tokens alone: two namespaces sending the same prompt at once may swap
        counts, which moves a boost, never what is computed."""
        key = _prompt_key(tokens)
        with self._pending_lock:
            if len(self._expected) >= MAX_PENDING:  # counts of prompts the engine refused: drop the oldest
                del self._expected[next(iter(self._expected))]
            self._expected[key] = cluster_seen

    def elsewhere(self, tokens: np.ndarray | list[int], namespace: Hashable) -> None:
        """The router sent a prompt this replica served last to another replica, because this
        one no longer held the leading pages of it the cluster saw (whoever routes tells it:
        the cluster simulation, a cluster's ingress). Its ghost caches replay it at the next
        `observe` (`LeadDuel.observe_elsewhere`), on the engine thread; at most MAX_PENDING
        wait (the oldest are dropped)."""
        with self._pending_lock:
            self._elsewhere.append((np.asarray(tokens, dtype=np.int64), namespace))

    def _replay_elsewhere(self) -> None:
        with self._pending_lock:
            pending = list(self._elsewhere)
            self._elsewhere.clear()
        for tokens, namespace in pending:
            hashes = self.history.hashes(tokens, namespace)
            if self.duel.observe_elsewhere(hashes, self.learner.latest_tick):
                self.learner.set_lead(self.duel.lead)

    def observe(self, tokens: np.ndarray, namespace: Hashable = None, *, boost_all: bool = False,
                cluster_seen: int | None = None) -> int:
        """Leading pages of `tokens` seen recently (all of them boosted with `boost_all`: a
        session's turn, declared reuse): the cluster's count when given (`cluster_seen`, or
        one `expect` left for these tokens), else this cache's own; teaches the tree's policy
        the lead."""
        if self._elsewhere:
            self._replay_elsewhere()
        hashes = self.history.hashes(tokens, namespace)
        seen = self.history.observe_hashes(hashes)
        if cluster_seen is None and self._expected:
            key = _prompt_key(tokens)
            with self._pending_lock:
                cluster_seen = self._expected.pop(key, None)
        if cluster_seen is not None:
            seen = min(cluster_seen, len(hashes))
        cached = self.tree.match(tokens, namespace, update=False).cached_tokens // self.page_size
        if self.duel.observe(hashes, len(hashes) if boost_all else seen, self.learner.latest_tick, cached):
            self.learner.set_lead(self.duel.lead)
        return seen
