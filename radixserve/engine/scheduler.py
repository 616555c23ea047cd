"""Which sequences run in the next step, and the pages they run in.

The scheduler owns the waiting and running queues and every page a sequence holds. Each step
it (1) gives every running sequence its next chunk (one token when decoding), preempting the
lowest-priority, latest-arrived sequences when pages run out, then (2) admits waiting
sequences in the policy's order within the token budget, reusing their cached prefixes.
With several tenants, both orders are fair_share.py's first: tenants are interleaved by
the service they have had (so the tenant with the most is preempted first), and the order
above holds within each tenant; with one tenant they are exactly the orders above.
It knows nothing of the model: the runner turns its Batch into a forward pass.

With a host tier under the tree, a prefix found on the host is loaded back into device pages
at admission (`_take_cached_prefix`) before the rest is prefilled; a load that does not fit
in device memory falls back to recomputing what did not fit. Where the copy runs
asynchronously (CUDA), the sequence joins the running set but runs no chunk until its copy
is done, so the copy never holds up the running batch.

The beams of a beam-search request (engine/beam.py) form one unit: they are scheduled,
preempted and admitted together, never some of them, since a beam step needs every beam's
next-token logits. Beams share pages by reference count; only the last, partly filled page
is copied when two beams would both write it (copy-on-write, `fork`).

Sliding window (`window`: every layer of the model attends to at most that many tokens): a
running sequence releases each page that lies wholly before the window of its next token
(`trim_window`); its block table marks the page OUT_OF_WINDOW_PAGE. The tree stays prefix-closed:
pages under the sequence's tree lock are released only once all of them have left the window
(the lock is then dropped too, and the tree keeps them as ordinary, evictable cache), and a
sequence with dropped pages caches nothing more when it ends (what it still holds has no
path from the root). So a sequence decoding far past its cached prefix holds at most
ceil(window / page_size) + 1 pages, and any prefix the tree matches is whole: the window
before the match point is always there.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from radixserve.cache.pool import OUT_OF_WINDOW_PAGE, PagePool
from radixserve.cache.radix import MatchResult, RadixTree, Retention
from radixserve.engine.fair_share import FairShare
from radixserve.engine.policy import SchedulePolicy, common_prefix_len
from radixserve.engine.request import SequenceState
from radixserve.engine.scheduled import ScheduledChunk, SchedulerCounters

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerCounters"]


class Scheduler:
    """Continuous batching over a paged KV pool with a radix prefix cache."""

    def __init__(self, pool: PagePool, tree: RadixTree, policy: SchedulePolicy, *,
                 max_running: int, max_batch_tokens: int, clock: Callable[[], float],
                 prefix_cache: bool = True, window: int | None = None, cache_partial_pages: bool = False,
                 fair_share: FairShare | None = None) -> None:
        self.pool = pool
        self.tree = tree
        self.policy = policy
        self.page_size = pool.page_size
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock
        self.prefix_cache = prefix_cache  # False: nothing is matched or cached (a baseline)
        self.window = window  # sliding window of every layer, or None (some layer sees all)
        # True: a released sequence's last, partly filled page is cached too (a partial leaf),
        # so the next turn of a conversation recomputes only its new tokens at any page size.
        self.cache_partial_pages = cache_partial_pages
        self.waiting: list[SequenceState] = []
        self.running: list[SequenceState] = []
        self.counters = SchedulerCounters()
        self.fair = fair_share or FairShare()  # the order across tenants (engine/fair_share.py)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> list[ScheduledChunk]:
        """Picks the next step's chunks and makes sure their pages exist."""
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        self._make_room_fairly()
        ordered = self.fair.order_running(self._running_units(), lambda s: (-s.priority, s.arrival_time, s.seq_id))
        while ordered and budget > 0:
            unit = ordered.pop(0)
            if not all(self._loaded(seq) for seq in unit):
                continue  # a prefix is still being copied from the host
            work = self._next_chunks(unit, budget)
            if not work:  # beams that delivered their logits and wait for their siblings
                continue
            while not all(self._reserve(c.seq, c.seq.num_computed + c.num_new) for c in work):
                # A prefill chunk shrinks to the pages it can have before anyone is preempted,
                # leaving each sequence still to run this step the page its next token needs.
                if len(work) == 1:
                    fits = self._tokens_that_fit(work[0].seq, [s for u in ordered for s in u])
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
        if budget > 0:
            chunks.extend(self._admit(budget))
        return chunks

    def _make_room_fairly(self) -> None:
        """Preempts the least important running units of a tenant served well ahead of a
        waiting one (FairShare.claimant) until the waiting tenant's next sequence fits: else
        a flood's long generations would run to their end first. Runs before chunks are picked."""
        claim = self.fair.claimant(self.waiting, self.running)
        if claim is None:
            return
        waiting_tenant, victim_tenant = claim
        now = self.clock()
        head = self.policy.order([s for s in self.waiting if s.request.tenant == waiting_tenant], self.tree, now)[0]
        unit = list(head.request.beam.running) if head.request.beam is not None else [head]
        victims = [u for u in self._running_units() if u[0].request.tenant == victim_tenant]
        victims.sort(key=lambda u: (-u[0].priority, u[0].arrival_time, u[0].seq_id))
        while victims and not self._room_for(unit):
            self.preempt_unit(victims.pop())
            self.counters.fair_preemptions += 1

    def _room_for(self, unit: list[SequenceState]) -> bool:
        """Whether `unit` could be admitted now (a slot each, and its first chunks' pages)."""
        if len(self.running) + len(unit) > self.max_running:
            return False
        reserve = sum(1 for s in self.running if s.num_computed % self.page_size == 0)
        peeks = [self.tree.match(s.prompt_ids[: s.num_tokens - 1], s.namespace, update=False)
                 if self.prefix_cache else None for s in unit]
        return self._may_fit([s.num_tokens for s in unit], peeks, self.max_batch_tokens, reserve)

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

    @staticmethod
    def _next_chunks(unit: list[SequenceState], budget: int) -> list[ScheduledChunk]:
        """Each member's next chunk within `budget`; members with nothing to run get none."""
        work = []
        for seq in unit:
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            if num_new > 0:
                work.append(ScheduledChunk(seq, num_new))
                budget -= num_new
        return work

    def _admit(self, budget: int) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        if not self.waiting:
            return chunks
        now = self.clock()
        admitted: set[int] = set()  # beams admitted with an earlier member of their group
        for seq in self.fair.order_waiting(self.waiting, lambda group: self.policy.order(group, self.tree, now)):
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if seq.seq_id in admitted:
                continue
            unit = list(seq.request.beam.running) if seq.request.beam is not None else [seq]
            aged = now - seq.arrival_time > self.policy.max_wait_s
            peeks = []  # one look at the cache per member serves both checks below
            if self.prefix_cache:
                peeks = [self.tree.match(s.prompt_ids[: s.num_tokens - 1], s.namespace, update=False)
                         for s in unit]
                if not aged and any(self._shares_prefill_in_flight(s.prompt_ids, s, peek.cached_tokens)
                                    for s, peek in zip(unit, peeks)):
                    self.counters.deferred_for_sharing += 1
                    continue
            # Keep a page per decoding sequence in hand, so admitting does not force a preemption
            # in the very next step; an empty engine admits whatever fits.
            reserve = sum(1 for s in self.running if s.num_computed % self.page_size == 0)
            if len(self.running) + len(unit) > self.max_running or not self._may_fit(
                    [s.num_tokens for s in unit], peeks or [None] * len(unit), budget, reserve):
                break  # before touching the tree: a hopeless attempt neither evicts nor counts
            work = self._take_unit(unit, budget, reserve)
            if work is None:
                break
            if seq.request.cached_tokens is None:  # first admission: what the caller is told
                seq.request.cached_tokens = seq.num_computed
                seq.request.host_cached_tokens = seq.loaded_tokens
            for member in unit:
                self.waiting.remove(member)
                self.running.append(member)
                admitted.add(member.seq_id)
            self.counters.admitted += 1
            chunks.extend(work)  # members loading from the host run once their copy is done
            budget -= sum(c.num_new for c in work)
        return chunks

    def _take_unit(self, unit: list[SequenceState], budget: int, reserve: int) -> list[ScheduledChunk] | None:
        """Takes each member's cached prefix and the pages of its first chunk, all or none
        (None: the pages could not be had; nothing is held then). A member whose prefix is
        still being copied from the host gets its pages when the copy is done."""
        for seq in unit:
            self._take_cached_prefix(seq)
        work = self._next_chunks([seq for seq in unit if self._loaded(seq)], budget)
        if all(self._reserve(c.seq, c.seq.num_computed + c.num_new, extra_free=reserve) for c in work):
            return work
        for seq in unit:
            self._release_pages(seq, cache=False)
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

    def _may_fit(self, num_tokens: list[int], cached: list[MatchResult | None], budget: int,
                 reserve: int) -> bool:
        """Whether the pages an admission of sequences of `num_tokens` tokens needs for their
        first chunks could be had at all (free + evictable); a prefix found on the host needs
        device pages too, loaded or recomputed."""
        needed = 0
        for tokens, match in zip(num_tokens, cached):
            hit = match.cached_tokens if match else 0
            num_new = min(tokens - hit, budget)
            budget -= num_new
            needed += math.ceil((hit + num_new) / self.page_size) - (len(match.pages) if match else 0)
        return needed + reserve <= self.pool.num_free + self.tree.evictable_pages

    def _take_cached_prefix(self, seq: SequenceState) -> None:
        """Locks the sequence's longest cached prefix and takes its pages.

        Full pages are shared; a match that ends inside a cached page is copied into a private
        page (copy-on-partial-reuse), so the hit does not depend on the page size. A prefix
        that continues on the host is copied into device pages first, as far as device
        memory allows (eviction included); the rest is recomputed.
        """
        seq.loaded_tokens = 0
        if not self.prefix_cache:
            return
        tokens = seq.prompt_ids
        match = self.tree.match(tokens[: len(tokens) - 1], seq.namespace)
        if match.host_pages:
            found_on_device = match.num_tokens
            match = self._load_back(match)
            seq.loaded_tokens = match.num_tokens - found_on_device
        self.tree.lock(match.node)
        self.pool.incref(match.pages)
        seq.pending_loads = list(match.loads)
        seq.lock_node = match.node
        seq.block_table = list(match.pages)
        seq.num_computed = seq.locked_tokens = len(match.pages) * self.page_size
        if match.partial_page is not None and self.ensure_free(1):
            # Eviction may just have freed the partial page itself; then it is no hit.
            if self.pool.refcount(match.partial_page) > 0:
                (page,) = self.pool.allocate(1)
                self.pool.copy_page(match.partial_page, page, match.partial_tokens)
                seq.block_table.append(page)
                seq.num_computed += match.partial_tokens

    def _load_back(self, match: MatchResult) -> MatchResult:
        """Copies the host continuation of `match` into device pages, evicting to make room;
        what cannot get a device page stays on the host (and is recomputed)."""
        handle = match.host_node
        self.tree.lock(handle)  # making room must not evict the pages being loaded
        self.ensure_free(len(match.host_pages))
        loaded = self.tree.load_back(match)
        self.tree.unlock(handle)
        self.counters.loaded_tokens += loaded.num_tokens - match.num_tokens
        return loaded

    # ------------------------------------------------------------------ pages
    def ensure_free(self, num_pages: int) -> bool:
        short = num_pages - self.pool.num_free
        if short > 0:
            self.tree.evict(short)
        return self.pool.num_free >= num_pages

    def _tokens_that_fit(self, seq: SequenceState, others: list[SequenceState]) -> int:
        """How many tokens past `seq.num_computed` its pages plus the free and evictable pages
        could hold, keeping a page for each of `others` whose next token needs a new page."""
        needed_by_others = sum(1 for s in others if s.num_computed % self.page_size == 0)
        available = len(seq.block_table) + self.pool.num_free + self.tree.evictable_pages - needed_by_others
        return available * self.page_size - seq.num_computed

    def _reserve(self, seq: SequenceState, num_tokens: int, extra_free: int = 0) -> bool:
        """Gives `seq` pages for its first `num_tokens` tokens, evicting cache if needed."""
        needed = math.ceil(num_tokens / self.page_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if not self.ensure_free(needed + extra_free):
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        return True

    def cache_computed(self, seq: SequenceState, retention: Retention | None,
                       range_retention: list[tuple[int, int, Retention]]) -> None:
        """Puts the sequence's computed full pages into the tree and moves its lock there.

        Where the tree already held the same tokens in other pages, the sequence switches to
        the tree's pages and frees its own, so equal prefixes are stored once.
        """
        full = seq.num_computed // self.page_size
        if full == 0 or not self.prefix_cache or seq.pages_out_of_window:
            return
        tokens = seq.token_ids[: full * self.page_size]
        if full * self.page_size > seq.locked_tokens:
            self.tree.insert(tokens, seq.block_table[:full], seq.namespace, retention, range_retention)
            # insert leaves a node boundary exactly at the end of `tokens`, so a peek (which
            # neither counts as a lookup nor refreshes recency) returns the covering node.
            match = self.tree.match(tokens, seq.namespace, update=False)
            node = match.node
            if seq.block_table[: len(match.pages)] != match.pages:
                # A new list, not a change in place: the runner mirrors tables by appends.
                table = list(seq.block_table)
                for i, page in enumerate(match.pages):
                    if table[i] != page:
                        self.pool.incref([page])
                        self.pool.decref([table[i]])
                        table[i] = page
                seq.block_table = table
            self.tree.lock(node)
            if seq.lock_node is not None:
                self.tree.unlock(seq.lock_node)
            seq.lock_node = node
            seq.locked_tokens = full * self.page_size
        elif retention is not None or range_retention:
            self.tree.insert(tokens, seq.block_table[:full], seq.namespace, retention, range_retention)

    def _release_pages(self, seq: SequenceState, cache: bool,
                       retention: Retention | None = None,
                       range_retention: list[tuple[int, int, Retention]] = ()) -> list[int]:
        """Drops everything `seq` holds; with `cache`, its computed full pages stay in the tree,
        and with `cache_partial_pages` its last, partly filled page too (none once it has
        dropped pages: they would have no path from the root). Only a released sequence's
        partial page is cached: a running one still writes into it."""
        if cache and self.prefix_cache and not seq.pages_out_of_window:
            computed = seq.num_computed if self.cache_partial_pages else seq.num_computed // self.page_size * self.page_size
            self.tree.insert(seq.token_ids[:computed], seq.block_table[: -(-computed // self.page_size)],
                             seq.namespace, retention, list(range_retention), partial=self.cache_partial_pages)
        released = seq.block_table[seq.pages_out_of_window:]
        self.pool.decref(released)
        if seq.lock_node is not None:
            self.tree.unlock(seq.lock_node)
        seq.block_table = []
        seq.lock_node = None
        seq.num_computed = seq.locked_tokens = seq.pages_out_of_window = 0
        return released

    def trim_window(self, seq: SequenceState) -> list[int]:
        """Releases the pages of `seq` that lie wholly before the sliding window of its next
        token (position num_computed, which attends to the `window` positions ending there);
        returns them. Pages under its tree lock go only all at once, with the lock."""
        if self.window is None:
            return []
        out_of_window = max(0, seq.num_computed - self.window + 1) // self.page_size
        if out_of_window <= seq.pages_out_of_window or seq.locked_tokens > out_of_window * self.page_size:
            return []
        if seq.lock_node is not None:
            self.tree.unlock(seq.lock_node)
            seq.lock_node, seq.locked_tokens = None, 0
        released = seq.block_table[seq.pages_out_of_window:out_of_window]
        self.pool.decref(released)
        # A new list, not a change in place: block tables are only ever appended to in place.
        seq.block_table = [OUT_OF_WINDOW_PAGE] * out_of_window + seq.block_table[out_of_window:]
        seq.pages_out_of_window = out_of_window
        return released

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
            self.fair.charge_chunk(seq, chunk.num_new)
            self._count_computed(seq, chunk.num_new)
            seq.num_computed += chunk.num_new
            if chunk.num_new > 1:
                req = seq.request
                self.cache_computed(seq, req.retention, req.range_retention())
            released.extend(self.trim_window(seq))
            if last:
                on_last_token(seq)
        return released

    def _count_computed(self, seq: SequenceState, num_new: int) -> None:
        """Counts a chunk of `num_new` tokens from `seq.num_computed` on; the part below the
        most the sequence ever had computed was thrown away by a preemption and is recomputed."""
        end = seq.num_computed + num_new
        self.counters.computed_tokens += num_new
        self.counters.recomputed_tokens += max(0, min(end, seq.computed_high) - seq.num_computed)
        seq.computed_high = max(seq.computed_high, end)

    # ------------------------------------------------------------------ lifecycle
    def preempt(self, seq: SequenceState) -> None:
        """Stops a running sequence; its computed pages go to the tree, it recomputes later."""
        req = seq.request
        self._release_pages(seq, cache=True, retention=req.retention,
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

        With `cache`, its computed pages stay in the tree (see `_release_pages`)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        return self._release_pages(seq, cache=cache, retention=retention, range_retention=range_retention)

    def fork(self, parent: SequenceState, child: SequenceState) -> bool:
        """Starts `child` running on the parent's computed tokens: full pages shared, the last,
        partly filled page copied (copy-on-write: the two would both write it next).

        Returns False when no page is free for the copy; the child then waits and is
        admitted like any request (its prompt is a cache hit by then).
        """
        full = parent.num_computed // self.page_size
        partial = parent.num_computed - full * self.page_size
        if partial and not self.ensure_free(1):
            return False
        self.share_full_pages(parent, child)
        if partial:
            (page,) = self.pool.allocate(1)
            self.pool.copy_page(parent.block_table[full], page, partial)
            child.block_table.append(page)
            child.num_computed = parent.num_computed
        self.running.append(child)
        return True

    def share_full_pages(self, parent: SequenceState, holder: SequenceState) -> None:
        """Makes `holder` hold the parent's computed full pages (increfs, and the parent's tree
        lock): a beam hypothesis frozen at the parent's state, or the start of a fork."""
        full = parent.num_computed // self.page_size
        holder.block_table = list(parent.block_table[:full])
        holder.pages_out_of_window = min(parent.pages_out_of_window, full)
        self.pool.incref(holder.block_table[holder.pages_out_of_window:])
        holder.num_computed = full * self.page_size
        holder.lock_node, holder.locked_tokens = parent.lock_node, parent.locked_tokens
        if holder.lock_node is not None:
            self.tree.lock(holder.lock_node)
