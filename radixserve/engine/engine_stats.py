"""The engine's introspection. stats(): its counters, the scheduler's, the pool's, the tree's and
the host tier's gauges and counters, in one flat dict whose keys the server's /metrics maps
(Engine.stats documents them); check_invariants(): the structural checker over the cache and
every live sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.cache.invariants import SequenceView, check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cache.tiers import HostTier
from radixserve.engine.beam_driver import BeamDriver
from radixserve.engine.request import Request
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.timing import StepTimings

# The tree's page counts are reported as pages_* / host_*; its other counters come prefixed.
_TREE_PAGE_COUNTS = frozenset({"cached_pages", "evictable_pages", "locked_pages", "free_pages",
                               "host_cached_pages", "host_only_pages", "host_free_pages"})
_HOST_KEYS = ("host_pages_total", "host_pages_free", "host_pages_used", "host_pages_cached",
              "host_only_pages", "host_kv_bytes", "kv_offloaded_bytes", "kv_loaded_bytes",
              "kv_offload_seconds_total", "kv_load_seconds_total")


def new_counters() -> dict[str, int]:
    """The engine's cumulative counters, all zero; stats() reports each under its own name."""
    return dict.fromkeys(("prompt_tokens", "cached_tokens", "host_cached_tokens", "generated_tokens",
                          "requests_finished", "requests_aborted", "requests_refused", "steps",
                          "prefill_tokens"), 0)


def count_retired(counters: dict[str, int], req: Request, *, refused: bool = False) -> None:
    """Counts a request that left the engine: finished, aborted / failed, or `refused` (given
    up by its caller because a request it came with was refused: Engine.abort's `refused`).
    Its prompt (and what of it was cached) counts only if it was admitted (looked up in the
    cache and started) and not refused: a request given up while it waited ran nothing."""
    counters["requests_refused" if refused else "requests_aborted" if req.aborted else "requests_finished"] += 1
    if refused or req.cached_tokens is None:
        return
    counters["prompt_tokens"] += len(req.prompt_ids)
    counters["cached_tokens"] += req.cached_tokens
    counters["host_cached_tokens"] += req.host_cached_tokens


@dataclass
class StepClock:
    """The engine's step times, in seconds: all steps, the last one, steps that prefilled."""

    step_time_s: float = 0.0
    last_step_s: float = 0.0
    prefill_step_s: float = 0.0

    def record(self, seconds: float, prefilled: bool) -> None:
        """Counts one step; a step that prefilled also counts toward prefill time per token."""
        self.last_step_s = seconds
        if prefilled:
            self.prefill_step_s += seconds
        self.step_time_s += seconds


def engine_stats(counters: dict[str, int], scheduler: Scheduler, tree: RadixTree, pool: PagePool,
                 host: HostTier | None, *, clock: StepClock, timings: StepTimings,
                 bytes_per_page: int, sessions_open: int) -> dict[str, Any]:
    """The dict Engine.stats() returns, from the parts of the engine it reads: counters and
    gauges under stable keys (the server's /metrics maps them):

    prompt_tokens, cached_tokens, hit_rate (requests that were admitted and finished or were
    aborted, not refused), generated_tokens, requests_finished, requests_aborted (client gone,
    shutdown, failed), requests_refused (given up because another prompt of their batch was
    refused: Engine.abort's `refused`), waiting, running, preemptions, admissions,
    computed_tokens (tokens run through the model), recomputed_tokens (of those, tokens a
    preempted sequence computed again: its pages had left both tiers),
    shrunk_chunks (prefill chunks cut to the pages available rather than preempting),
    held_rows (decoding rows that sat a step out for other tenants' shares of the step),
    paced_rows (rows of slow grammars that sat a step out for the other rows),
    paced_preemptions (of the preemptions, paced rows past their own slots or in a newcomer's way),
    deferred_for_sharing (admissions put off so a shared prefix is computed once),
    short_lane_admitted (short prompts admitted ahead of a running prefill's chunk), steps,
    step_time_s_total, last_step_s, pages_total, pages_free, pages_used, pages_cached,
    pages_evictable, pages_locked, page_size, kv_tokens_capacity, kv_bytes, sessions_open,
    the tree's counters prefixed "cache_" (cache_evicted_pages, cache_lookups, ...), and
    the host tier's (zero without one): host_cached_tokens / device_cached_tokens (the
    part of cached_tokens loaded back from the host / found on the device),
    host_pages_total, host_pages_free, host_pages_used, host_pages_cached (host copies the
    tree holds), host_only_pages (cached pages on the host only), host_kv_bytes,
    cache_offloaded_pages / cache_written_through_pages (copied to host on eviction / by
    write-through), cache_dropped_pages (left the device without a host copy),
    cache_loaded_pages, cache_host_evicted_pages, cache_host_copies_freed_pages (host
    copies of pages the device holds too, freed for room), cache_device_hit_tokens /
    cache_host_hit_tokens (lookups), kv_offloaded_bytes, kv_loaded_bytes,
    kv_offload_seconds_total / kv_load_seconds_total (time spent issuing the copies),
    prefill_tokens and prefill_step_s_total (steps that prefilled: prefill time per
    token, to compare with a copy's), and
    "histograms": {"hit_age_seconds" | "evict_age_seconds" | "evict_reuse":
    {"buckets": [(le, cumulative count), ...], "sum", "count"}} — the age of cached KV
    when it is hit and when it is evicted, and how often each evicted page had been hit.
    "step_breakdown_s": cumulative seconds per section of step() (schedule, metadata,
    model, sampling, detokenize, tree; see engine/timing.py) and "steps" that ran a batch.
    """
    c = counters
    out: dict[str, Any] = dict(c)
    out["hit_rate"] = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
    out.update(
        waiting=len(scheduler.waiting), running=len(scheduler.running),
        preemptions=scheduler.counters.preemptions, admissions=scheduler.counters.admitted,
        shrunk_chunks=scheduler.counters.shrunk_chunks, held_rows=scheduler.counters.held_rows,
        paced_rows=scheduler.counters.paced_rows, paced_preemptions=scheduler.counters.paced_preemptions,
        computed_tokens=scheduler.counters.computed_tokens,
        recomputed_tokens=scheduler.counters.recomputed_tokens,
        deferred_for_sharing=scheduler.counters.deferred_for_sharing,
        short_lane_admitted=scheduler.counters.short_lane_admitted,
        step_time_s_total=clock.step_time_s, last_step_s=clock.last_step_s,
        step_breakdown_s=timings.snapshot(),
        pages_total=pool.num_pages, pages_free=pool.num_free, pages_used=pool.num_used,
        pages_cached=tree.cached_pages, pages_evictable=tree.evictable_pages,
        pages_locked=tree.locked_pages, page_size=pool.page_size,
        kv_tokens_capacity=pool.num_pages * pool.page_size,
        kv_bytes=pool.num_pages * bytes_per_page, sessions_open=sessions_open,
    )
    out["device_cached_tokens"] = c["cached_tokens"] - c["host_cached_tokens"]
    out["prefill_step_s_total"] = clock.prefill_step_s
    out.update(host_stats(tree, host))
    out.update({f"cache_{k}": v for k, v in tree.stats().items() if k not in _TREE_PAGE_COUNTS})
    # Prometheus-style cumulative buckets: [(upper bound, count <= bound), ...] ending at +inf.
    out["histograms"] = {name: {"buckets": h.cumulative(), "sum": h.sum, "count": h.count}
                         for name, h in tree.histograms().items()}
    return out


def host_stats(tree: RadixTree, host: HostTier | None) -> dict[str, float]:
    """The host tier's gauges and copy counters; zero without a host tier."""
    if host is None:
        return dict.fromkeys(_HOST_KEYS, 0)
    counts = tree.stats()
    per_page = host.bytes_per_page
    return {
        "host_pages_total": host.pool.num_pages, "host_pages_free": host.pool.num_free,
        "host_pages_used": host.pool.num_used, "host_pages_cached": tree.host_cached_pages,
        "host_only_pages": tree.host_only_pages, "host_kv_bytes": host.pool.num_pages * per_page,
        "kv_offloaded_bytes": (counts["offloaded_pages"] + counts["written_through_pages"]) * per_page,
        "kv_loaded_bytes": counts["loaded_pages"] * per_page,
        "kv_offload_seconds_total": host.copier.offload_seconds,
        "kv_load_seconds_total": host.copier.load_seconds,
    }


def check_engine(scheduler: Scheduler, tree: RadixTree, beams: BeamDriver, requests: list[Request],
                 released: list[int]) -> None:
    """Engine.check_invariants over the live `requests`; `released`: pages let go in the last
    step, which must be free unless the tree or a live sequence still holds them."""
    holders = list(scheduler.running)
    for req in requests:
        if req.beam is not None:  # finished hypotheses keep their full pages until the end
            holders.extend(h.seq for h in req.beam.hypotheses)
            beams.check(req.beam)
    views = [SequenceView(s.block_table, s.num_computed, scheduler.window) for s in holders]
    held = {p for s in holders for p in s.block_table[s.pages_out_of_window:]}
    held.update(p for _, pages in tree.nodes() for p in pages)
    check_invariants(scheduler.pool, tree, views, released_pages=[p for p in released if p not in held])
