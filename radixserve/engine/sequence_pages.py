"""The pages a sequence holds: the scheduler's page bookkeeping, below its choice of what runs.

`SequencePages` takes a sequence's cached prefix (shared full pages, a copied partial page,
a host continuation loaded back), reserves the pages of its next chunk (evicting cache when
the pool runs short), caches its computed pages in the tree, releases them when it ends or
is preempted, shares a parent's pages with a fork or a beam hypothesis, and releases the
pages that left the sliding window. It decides nothing about which sequence runs: that is
the scheduler's (engine/scheduler.py), which calls these at admission, at each step and at
the end of a sequence.

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

from radixserve.cache.pool import OUT_OF_WINDOW_PAGE, PagePool
from radixserve.cache.radix import MatchResult, RadixTree, Retention
from radixserve.engine.request import SequenceState
from radixserve.engine.scheduled import SchedulerCounters


class SequencePages:
    """Every page a live sequence holds, over one pool and its radix tree."""

    def __init__(self, pool: PagePool, tree: RadixTree, counters: SchedulerCounters, *,
                 prefix_cache: bool = True, window: int | None = None, cache_partial_pages: bool = False) -> None:
        self.pool = pool
        self.tree = tree
        self.page_size = pool.page_size
        self.counters = counters  # the scheduler's: loads back are counted here
        self.prefix_cache = prefix_cache  # False: nothing is matched or cached (a baseline)
        self.window = window  # sliding window of every layer, or None (some layer sees all)
        # True: a released sequence's last, partly filled page is cached too (a partial leaf),
        # so the next turn of a conversation recomputes only its new tokens at any page size.
        self.cache_partial_pages = cache_partial_pages

    # ------------------------------------------------------------------ admission
    def may_fit(self, num_tokens: list[int], cached: list[MatchResult | None], budget: int,
                reserve: int) -> bool:
        """Whether the pages an admission of sequences of `num_tokens` tokens needs for their
        first chunks could be had at all (free + evictable); a prefix found on the host needs
        device pages too, loaded or recomputed. The matched prefixes' own pages are not
        supply: taking them locks them (else a claimant whose cached prefix was all that was
        evictable looked admissible, failed, and its claim starved the running step after
        step)."""
        needed = 0
        taken = 0
        for tokens, match in zip(num_tokens, cached):
            hit = match.cached_tokens if match else 0
            num_new = min(tokens - hit, budget)
            budget -= num_new
            needed += math.ceil((hit + num_new) / self.page_size) - (len(match.pages) if match else 0)
            taken = max(taken, self.tree.unlocked_pages(match.node) if match else 0)
        return needed + reserve <= self.pool.num_free + self.tree.evictable_pages - taken

    def take_cached_prefix(self, seq: SequenceState) -> None:
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
        # Eviction may just have freed the partial page itself; then it is no hit.
        if (match.partial_page is not None and self.ensure_free(1)
                and self.pool.refcount(match.partial_page) > 0):
            (page,) = self.pool.allocate(1)
            # The page may still be loading from the host for another request (a CUDA side
            # stream): the copy, on the compute stream, is ordered after that load.
            self.tree.fence_load(match.partial_load)
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

    def tokens_that_fit(self, seq: SequenceState, others: list[SequenceState]) -> int:
        """How many tokens past `seq.num_computed` its pages plus the free and evictable pages
        could hold, keeping a page for each of `others` whose next token needs a new page."""
        needed_by_others = sum(1 for s in others if s.num_computed % self.page_size == 0)
        available = len(seq.block_table) + self.pool.num_free + self.tree.evictable_pages - needed_by_others
        return available * self.page_size - seq.num_computed

    def reserve(self, seq: SequenceState, num_tokens: int, extra_free: int = 0) -> bool:
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
                # The tree's pages may still be loading from the host (another request's load
                # back): the sequence sits out until they land, as after its own load.
                seq.pending_loads += [load for load in match.loads if not load.done()]
            self.tree.lock(node)
            if seq.lock_node is not None:
                self.tree.unlock(seq.lock_node)
            seq.lock_node = node
            seq.locked_tokens = full * self.page_size
        elif retention is not None or range_retention:
            self.tree.insert(tokens, seq.block_table[:full], seq.namespace, retention, range_retention)

    def release(self, seq: SequenceState, cache: bool,
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

    # ------------------------------------------------------------------ sharing
    def fork(self, parent: SequenceState, child: SequenceState) -> bool:
        """Gives `child` the parent's computed tokens: full pages shared, the last, partly
        filled page copied (copy-on-write: the two would both write it next). False when no
        page is free for the copy; the child then holds nothing."""
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
        return True

    def share_full_pages(self, parent: SequenceState, holder: SequenceState) -> None:
        """Makes `holder` hold the parent's computed full pages (increfs, the parent's tree
        lock, and its loads from the host still in flight: a fork waits for them as the parent
        does): a beam hypothesis frozen at the parent's state, or the start of a fork."""
        full = parent.num_computed // self.page_size
        holder.block_table = list(parent.block_table[:full])
        holder.pages_out_of_window = min(parent.pages_out_of_window, full)
        self.pool.incref(holder.block_table[holder.pages_out_of_window:])
        holder.num_computed = full * self.page_size
        holder.lock_node, holder.locked_tokens = parent.lock_node, parent.locked_tokens
        if holder.lock_node is not None:
            self.tree.lock(holder.lock_node)
        holder.pending_loads = [load for load in parent.pending_loads if not load.done()]
