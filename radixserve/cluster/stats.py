"""Cluster-wide stats: the sum of the replicas' engine.stats() snapshots."""

from __future__ import annotations

from typing import Any


def merge_stats(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums engine.stats() snapshots: counters and gauges add up, rates are recomputed,
    page_size is shared, last_step_s is the slowest, histogram buckets add up."""
    out: dict[str, Any] = {}
    for snapshot in snapshots:
        for key, value in snapshot.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key in ("page_size",):
                out[key] = value
            elif key == "last_step_s":
                out[key] = max(out.get(key, 0.0), value)
            else:
                out[key] = out.get(key, 0) + value
    out["hit_rate"] = out["cached_tokens"] / out["prompt_tokens"] if out.get("prompt_tokens") else 0.0
    lookups = out.get("cache_lookup_tokens", 0)
    out["cache_hit_rate"] = out.get("cache_hit_tokens", 0) / lookups if lookups else 0.0
    out["histograms"] = _merge_histograms([s.get("histograms", {}) for s in snapshots])
    return out


def _merge_histograms(all_histograms: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for histograms in all_histograms:
        for name, h in histograms.items():
            if name not in merged:
                merged[name] = {"buckets": [list(b) for b in h["buckets"]], "sum": h["sum"], "count": h["count"]}
                continue
            into = merged[name]
            for bucket, (_, count) in zip(into["buckets"], h["buckets"]):
                bucket[1] += count
            into["sum"] += h["sum"]
            into["count"] += h["count"]
    for h in merged.values():
        h["buckets"] = [tuple(b) for b in h["buckets"]]
    return merged
