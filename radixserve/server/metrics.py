"""Prometheus metrics: the engine's stats() as a custom Collector, plus latencies the server sees.

Every app gets its own CollectorRegistry, so several apps (tests) never collide.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from radixserve import StreamDelta
from radixserve.server.connection_limits import ConnectionLimits
from radixserve.server.refusal_pacing import RefusalPacer
from radixserve.server.start_shares import StartShares

PREFIX = "radixserve"

# engine.stats() key → (metric name without prefix, kind, help). Counters get "_total" appended by the
# exposition format, and only they may end so (a gauge named *_total reads as a counter sample). A number
# under a key not listed here is still exported, as a gauge radixserve_engine_<key>, so nothing is lost:
# list every count that only grows here as a counter, so that rate() and restarts are handled.
ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    "prompt_tokens": ("prompt_tokens", "counter",
                      "Prompt tokens of admitted requests (finished, or aborted after they started; not "
                      "those given up for another prompt of their batch)."),
    "cached_tokens": ("cached_tokens", "counter",
                      "Prompt tokens of admitted requests served from the prefix cache."),
    "hit_rate": ("cache_hit_rate", "gauge", "cached_tokens / prompt_tokens over admitted requests."),
    "generated_tokens": ("generated_tokens", "counter", "Tokens generated."),
    "requests_finished": ("requests_finished", "counter", "Requests that finished (aborted ones are counted apart)."),
    "requests_aborted": ("requests_aborted", "counter", "Requests aborted (client gone, shutdown, failed step)."),
    "requests_refused": ("requests_refused", "counter",
                         "Requests given up because another prompt of their batch was refused."),
    "waiting": ("sequences_waiting", "gauge", "Sequences waiting to be scheduled."),
    "running": ("sequences_running", "gauge", "Sequences running."),
    "preemptions": ("preemptions", "counter", "Sequences preempted for memory."),
    "admissions": ("admissions", "counter", "Sequences admitted to run (a preempted one again when it resumes)."),
    "computed_tokens": ("computed_tokens", "counter", "Tokens run through the model."),
    "recomputed_tokens": ("recomputed_tokens", "counter",
                          "Of the computed tokens, those a preempted sequence computed again (its pages had "
                          "left both tiers)."),
    "shrunk_chunks": ("shrunk_chunks", "counter", "Prefill chunks cut to the pages available rather than preempting."),
    "fair_preemptions": ("fair_preemptions", "counter", "Sequences preempted for another tenant's share of the pool."),
    "requests_paused": ("requests_paused", "counter", "Pauses of sequences whose client stopped reading."),
    "paused": ("sequences_paused", "gauge", "Sequences paused because their client stopped reading."),
    "streams_paused": ("streams_paused", "gauge", "Output streams paused because their client stopped reading."),
    "stream_read_timeouts": ("stream_read_timeouts", "counter",
                             "Streams ended because their client read nothing for the read timeout."),
    "view_pieces": ("cache_view_pieces", "counter",
                    "Pieces of cache-view work (tree copies, snapshots) the engine thread ran between steps."),
    "held_rows": ("held_rows", "counter",
                  "Decoding rows that sat a step out for other tenants' shares of the step (--tenant-step-rows)."),
    "paced_rows": ("grammar_paced_rows", "counter",
                   "Rows of slow output constraints that sat a step out for the other rows."),
    "paced_preemptions": ("grammar_paced_preemptions", "counter",
                          "Of the preemptions, rows of slow output constraints past their own slots or in a "
                          "newcomer's way."),
    "deferred_for_sharing": ("deferred_for_sharing", "counter",
                             "Admissions deferred so that a request reuses another's prefix."),
    "short_lane_admitted": ("short_lane_admitted", "counter",
                            "Short prompts admitted ahead of a running long prefill's next chunk "
                            "(--short-prompt-tokens)."),
    "steps": ("engine_steps", "counter", "Engine steps run."),
    "step_time_s_total": ("engine_step_seconds", "counter", "Time spent in engine steps."),
    "last_step_s": ("engine_last_step_seconds", "gauge", "Duration of the latest engine step."),
    "seconds_since_last_step": ("engine_seconds_since_last_step", "gauge",
                                "Seconds since the engine loop last completed a step (grows while idle)."),
    "stalled": ("engine_stalled", "gauge",
                "1 while work has waited longer than the stall bound for a step (/health is 503)."),
    "pages_total": ("kv_pool_pages", "gauge", "KV pages in the pool."),
    "pages_free": ("kv_pages_free", "gauge", "KV pages free."),
    "pages_used": ("kv_pages_used", "gauge", "KV pages allocated (running sequences and cache)."),
    "pages_cached": ("kv_pages_cached", "gauge", "KV pages held by the prefix cache."),
    "pages_evictable": ("kv_pages_evictable", "gauge", "Cached KV pages no running request locks."),
    "pages_locked": ("kv_pages_locked", "gauge", "Cached KV pages locked by running requests."),
    "page_size": ("kv_page_size_tokens", "gauge", "Tokens per KV page."),
    "kv_tokens_capacity": ("kv_capacity_tokens", "gauge", "Tokens the KV pool can hold."),
    "kv_bytes": ("kv_pool_bytes", "gauge", "Bytes of the KV pool."),
    "sessions_open": ("sessions_open", "gauge", "Open sessions."),
    "cache_lookups": ("cache_lookups", "counter", "Prefix-cache lookups."),
    "cache_lookup_tokens": ("cache_lookup_tokens", "counter", "Tokens looked up in the prefix cache."),
    "cache_hit_tokens": ("cache_hit_tokens", "counter", "Tokens found in the prefix cache."),
    "cache_hit_rate": ("cache_lookup_hit_rate", "gauge",
                       "cache_hit_tokens / cache_lookup_tokens over all lookups (incl. preempted)."),
    "cache_evicted_pages": ("cache_evicted_pages", "counter", "Cached pages evicted."),
    "cache_nodes": ("cache_nodes", "gauge", "Nodes of the radix tree."),
    # The host tier (all zero without one).
    "host_cached_tokens": ("host_cached_tokens", "counter",
                           "Prompt tokens of admitted requests loaded back from the host tier."),
    "device_cached_tokens": ("device_cached_tokens", "counter",
                             "Prompt tokens of admitted requests found in device memory."),
    "host_pages_total": ("host_kv_pool_pages", "gauge", "KV pages in the host tier."),
    "host_pages_free": ("host_kv_pages_free", "gauge", "Host-tier KV pages free."),
    "host_pages_used": ("host_kv_pages_used", "gauge", "Host-tier KV pages allocated."),
    "host_pages_cached": ("host_kv_pages_cached", "gauge",
                          "Host-tier KV pages the prefix cache holds (host-only pages and host copies)."),
    "host_only_pages": ("kv_pages_host_only", "gauge", "Cached KV pages that live on the host tier only."),
    "host_kv_bytes": ("host_kv_pool_bytes", "gauge", "Bytes of the host tier's KV pool."),
    "cache_device_hit_tokens": ("cache_device_hit_tokens", "counter", "Tokens found in device memory by lookups."),
    "cache_host_hit_tokens": ("cache_host_hit_tokens", "counter",
                              "Tokens found on the host tier only by lookups."),
    "cache_offloaded_pages": ("kv_pages_offloaded", "counter", "Pages copied to the host tier on device eviction."),
    "cache_written_through_pages": ("kv_pages_written_through", "counter",
                                    "Pages copied to the host tier once hit often enough (write-through)."),
    "cache_dropped_pages": ("kv_pages_dropped", "counter",
                            "Pages evicted from the device without a copy on the host tier."),
    "cache_loaded_pages": ("kv_pages_loaded", "counter", "Pages copied back from the host tier to the device."),
    "cache_host_evicted_pages": ("host_kv_pages_evicted", "counter", "Pages evicted from the host tier."),
    "cache_host_copies_freed_pages": ("host_kv_copies_freed", "counter",
                                      "Host-tier copies of pages the device holds too, freed for room (nothing lost)."),
    "kv_offloaded_bytes": ("kv_offloaded_bytes", "counter", "Bytes copied from the device to the host tier."),
    "kv_loaded_bytes": ("kv_loaded_bytes", "counter", "Bytes copied from the host tier to the device."),
    "kv_offload_seconds_total": ("kv_offload_seconds", "counter", "Time spent issuing copies to the host tier."),
    "kv_load_seconds_total": ("kv_load_seconds", "counter", "Time spent issuing copies from the host tier."),
    "prefill_tokens": ("prefill_tokens", "counter", "Prompt tokens computed in prefill chunks."),
    "prefill_step_s_total": ("prefill_step_seconds", "counter", "Time of the engine steps that prefilled."),
}

# engine.stats()["histograms"] name → (metric name without prefix, help). Their flattened
# "cache_<name>_sum" / "_count" twins in the same snapshot are not exported a second time.
ENGINE_HISTOGRAMS: dict[str, tuple[str, str]] = {
    "hit_age_seconds": ("kv_age_at_hit_seconds", "Age of cached KV pages when a request hits them."),
    "evict_age_seconds": ("kv_age_at_eviction_seconds", "Age of cached KV pages when they are evicted."),
    "evict_reuse": ("evicted_page_reuse", "How many times each evicted page had been hit."),
}

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class EngineStatsCollector(Collector):
    """Turns one engine.stats() snapshot into metric families at every scrape.

    Numbers become counters or gauges. `stats["histograms"]` entries ({"buckets":
    [(upper bound, cumulative count), ...], "sum", "count"}) become Prometheus histograms.
    Any other `<key>_sum` / `<key>_count` pair becomes a summary (exactly a sum and a count).
    """

    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = dict(self.stats())
        histograms: Mapping[str, Mapping[str, Any]] = stats.pop("histograms", {})
        for name, histogram in sorted(histograms.items()):
            yield _histogram(name, histogram)
        exported_as_histogram = {f"cache_{name}" for name in histograms}
        pairs = {key.removesuffix("_sum") for key in stats
                 if key.endswith("_sum") and f"{key.removesuffix('_sum')}_count" in stats}
        for key, value in sorted(stats.items()):
            base = key.removesuffix("_sum").removesuffix("_count")
            if key != base and base in pairs:
                if key.endswith("_sum") and base not in exported_as_histogram:
                    yield SummaryMetricFamily(f"{PREFIX}_engine_{base}", f"engine.stats()[{base!r}_*]",
                                              count_value=stats[f"{base}_count"], sum_value=value)
                continue
            name, kind, help_text = ENGINE_METRICS.get(
                key, (f"engine_{key}", "gauge", f"engine.stats()[{key!r}]"))
            if isinstance(value, int | float) and not isinstance(value, bool):
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(f"{PREFIX}_{name}", help_text, value=value)


def _histogram(name: str, histogram: Mapping[str, Any]) -> Metric:
    metric_name, help_text = ENGINE_HISTOGRAMS.get(name, (f"engine_{name}", f"engine histogram {name!r}"))
    buckets = [("+Inf" if bound == float("inf") else repr(float(bound)), count)
               for bound, count in histogram["buckets"]]
    return HistogramMetricFamily(f"{PREFIX}_{metric_name}", help_text, buckets=buckets,
                                 sum_value=histogram["sum"])


TTFT_METRIC = f"{PREFIX}_time_to_first_token_seconds"


class ConnectionsCollector(Collector):
    """The open connections and the refused ones, read from the caps' counts at each scrape."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(f"{PREFIX}_http_connections_open", "Open HTTP connections (those under the caps).",
                                value=self.limits.open_total)
        refused = CounterMetricFamily(f"{PREFIX}_http_connections_refused",
                                      "Connections refused over the caps: 429 one address's, 503 the server's.",
                                      labels=["status"])
        for status in (429, 503):
            refused.add_metric([str(status)], self.limits.refused[status])
        yield refused


class RefusalPacingCollector(Collector):
    """Requests held for their addresses' refusals, and holds ended in a 429, read at each scrape."""

    def __init__(self, pacer: RefusalPacer) -> None:
        self.pacer = pacer

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(f"{PREFIX}_http_refusal_holds",
                                  "Requests held because their address had too many requests refused (4xx) "
                                  "lately.", value=self.pacer.held)
        yield CounterMetricFamily(f"{PREFIX}_http_refusal_holds_refused",
                                  "Holds that lasted their longest and ended in a 429 too_many_refusals.",
                                  value=self.pacer.refused_holds)


class StartSharesCollector(Collector):
    """Requests in flight, and those that waited for their tenant's share of starts, read at
    each scrape."""

    def __init__(self, starts: StartShares) -> None:
        self.starts = starts

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(f"{PREFIX}_http_generation_requests_in_flight",
                                "Generation requests in flight (from their body's arrival to their response's end).",
                                value=self.starts.in_flight.total())
        yield GaugeMetricFamily(f"{PREFIX}_http_requests_waiting_to_start",
                                "Generation requests waiting for their tenant's share of starts (--tenant-starts).",
                                value=self.starts.waiting)
        yield CounterMetricFamily(f"{PREFIX}_http_start_waits",
                                  "Generation requests that waited for their tenant's share of starts.",
                                  value=self.starts.waited)


class ServerMetrics:
    """The app's registry: engine stats plus the latencies and outcomes the server observes."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(stats))
        self.ttft = Histogram(TTFT_METRIC,
                              "Time from request arrival to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Gap between consecutive deltas of one choice.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.latency = Histogram(f"{PREFIX}_request_latency_seconds",
                                 "Time from request arrival to its last token.",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter(f"{PREFIX}_http_requests",
                                "Generation requests answered, by endpoint and status (one per access-log line).",
                                ["endpoint", "status"], registry=self.registry)
        Gauge(f"{PREFIX}_gc_frozen_objects",
              "Objects frozen out of the garbage collector's passes at start-up (server/startup_gc.py).",
              registry=self.registry).set_function(gc.get_freeze_count)
        self.disconnects = Counter(f"{PREFIX}_http_disconnects",
                                   "Generation requests whose client left before any answer (not in the access log).",
                                   ["endpoint"], registry=self.registry)

    def watch_connections(self, limits: ConnectionLimits) -> None:
        """Exports the open connections and those refused over the caps (connection_limits.py)."""
        self.registry.register(ConnectionsCollector(limits))

    def watch_refusal_pacing(self, pacer: RefusalPacer) -> None:
        """Exports how often a refused address's connection was held (refusal_pacing.py)."""
        self.registry.register(RefusalPacingCollector(pacer))

    def watch_start_shares(self, starts: StartShares) -> None:
        """Exports the generation requests in flight and their waits for starts (start_shares.py)."""
        self.registry.register(StartSharesCollector(starts))

    def ttft_count_sum(self) -> tuple[float, float]:
        """The TTFT histogram's count and sum, read from that histogram alone: the registry's
        get_sample_value collects every metric (the engine's stats among them) for each value,
        and eight clients looping on /v1/cache/stats saturated the event loop with it."""
        values = {sample.name: sample.value for metric in self.ttft.collect() for sample in metric.samples}
        return values.get(f"{TTFT_METRIC}_count", 0.0), values.get(f"{TTFT_METRIC}_sum", 0.0)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self) -> "RequestTimer":
        """A timer for one request, started now."""
        return RequestTimer(self)


class RequestTimer:
    """Observes TTFT, inter-token gaps and latency of one request from its deltas."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token_seen = False
        self.last_token_at: dict[int, float] = {}  # choice index → time of its latest delta

    def observe(self, delta: StreamDelta) -> None:
        """Records one delta's arrival."""
        if not delta.token_ids:
            return
        now = time.perf_counter()
        if not self.first_token_seen:
            self.first_token_seen = True
            self.metrics.ttft.observe(now - self.start)
        previous = self.last_token_at.get(delta.index)
        if previous is not None:
            self.metrics.itl.observe(now - previous)
        self.last_token_at[delta.index] = now

    def finish(self) -> None:
        """Records the request's end-to-end latency."""
        self.metrics.latency.observe(time.perf_counter() - self.start)
