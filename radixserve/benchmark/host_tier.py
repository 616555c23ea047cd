"""`radixserve bench tiers`: a multi-turn workload on a device pool too small for it, served
with and without the host tier.

The device pool holds `device_fraction` (a quarter by default) of the workload's working set
— every distinct token its prompts and replies contain — so conversations are evicted
between their turns; the host tier holds `host_factor` times the working set. The same
requests are replayed against `radixserve serve` with and without the host tier, over HTTP,
`repeat` times in alternation (medians reported: a shared machine is noisy), and compared:
TTFT, throughput, whether every completion is the same text in every run (greedy), and, from
the server's own counters of the host-tier run, the time a load from the host takes per token
against the time a prefill step takes per prefilled token (whole steps, so an upper bound).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from radixserve.benchmark.compare import failed_requests, launch_server, median_summary, ratio
from radixserve.benchmark.optimum import WorkloadBounds
from radixserve.benchmark.serve import run_serve_benchmark
from radixserve.benchmark.workloads import Workload

DEVICE_ONLY = "device only"
WITH_HOST = "device + host tier"
COUNTERS = ("radixserve_kv_load_seconds", "radixserve_kv_pages_loaded", "radixserve_kv_pages_offloaded",
            "radixserve_kv_pages_written_through",
            "radixserve_prefill_step_seconds", "radixserve_prefill_tokens", "radixserve_host_cached_tokens",
            "radixserve_cached_tokens", "radixserve_preemptions")


def working_set_tokens(workload: Workload) -> int:
    """Distinct tokens of the workload's prompts and known replies (its trie's size)."""
    return int(WorkloadBounds(workload).trie.size.sum())


def pool_sizes(workload: Workload, page_size: int, device_fraction: float, host_factor: float) -> tuple[int, int]:
    """(device pages, host pages): a fraction of the working set on the device, but at least
    what the longest request needs on its own; `host_factor` times the working set on host."""
    working = working_set_tokens(workload)
    longest = max(r.prompt_len + max(r.output_len, 1) for r in workload.requests)
    device = max(math.ceil(working * device_fraction / page_size), math.ceil(longest / page_size) + 2)
    return device, math.ceil(working * host_factor / page_size)


def scrape_counters(url: str) -> dict[str, float]:
    """The host-tier and prefill counters from the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in COUNTERS:
            out[family.name.removeprefix("radixserve_")] = sum(s.value for s in family.samples)
    return out


def run_host_tier_comparison(workload: Workload, model_dir: str | Path, *, page_size: int = 16,
                             device_fraction: float = 0.25, host_factor: float = 2.0, concurrency: int = 4,
                             repeat: int = 1, server_args: list[str] | None = None,
                             log_dir: Path | None = None, progress: bool = False,
                             port: int | None = None) -> dict[str, object]:
    """Serves `workload` on `model_dir` with a small device pool, without and with a host
    tier, `repeat` times in alternation; returns the median summaries, the ratios of the
    medians, whether every run's outputs agree, and copy vs prefill time per token. A server
    that fails to start is reported, not fatal."""
    device_pages, host_pages = pool_sizes(workload, page_size, device_fraction, host_factor)
    base = [*(server_args or []), "--page-size", str(page_size), "--num-pages", str(device_pages)]
    runs = ((DEVICE_ONLY, base), (WITH_HOST, [*base, "--host-num-pages", str(host_pages)]))
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    each: dict[str, list[dict]] = {label: [] for label, _ in runs}
    texts: list[list[str | None]] = []
    ttfts: dict[str, list[float]] = {label: [] for label, _ in runs}
    failures: dict[str, str] = {}
    request_failures: dict[str, str] = {}  # label -> how many requests failed and the commonest error
    for _ in range(repeat):
        for label, flags in runs:
            log_path = log_dir / f"server-{label.replace(' ', '-').replace('+', 'plus')}.log" if log_dir else None
            try:
                with launch_server(model_dir, flags, log_path=log_path, port=port) as url:
                    result = asyncio.run(run_serve_benchmark(url, workload, concurrency=concurrency,
                                                             progress=progress))
                    counters = scrape_counters(url)
            except (RuntimeError, TimeoutError) as exc:
                failures[label] = str(exc)
                continue
            each[label].append({**result.summary(), **{f"server_{k}": v for k, v in counters.items()}})
            if (why := failed_requests(result)) is not None:
                request_failures[label] = why
            texts.append([r.text if r.error is None else None for r in result.records])
            ttfts[label] += [r.ttft_s for r in result.records if r.error is None]
    summaries = {label: median_summary(runs_of) for label, runs_of in each.items() if runs_of}
    out: dict[str, object] = {
        "workload": workload.name, "workload_params": workload.params, "requests": len(workload.requests),
        "prompt_tokens": workload.prompt_tokens, "working_set_tokens": working_set_tokens(workload),
        "page_size": page_size, "device_pages": device_pages, "host_pages": host_pages,
        "concurrency": concurrency, "repeat": repeat, "servers": summaries, "runs": each,
        "server_failures": failures, "request_failures": request_failures, "ttft_s": ttfts,
    }
    if len(summaries) == 2:
        plain, tiered = summaries[DEVICE_ONLY], summaries[WITH_HOST]
        mismatched = sum(len({run[i] for run in texts}) > 1 for i in range(len(workload.requests)))
        loaded_tokens = (tiered.get("server_kv_pages_loaded") or 0.0) * page_size
        prefill_tokens = tiered.get("server_prefill_tokens") or 0.0
        copy = (tiered.get("server_kv_load_seconds") or 0.0) / loaded_tokens if loaded_tokens else None
        prefill = (tiered.get("server_prefill_step_seconds") or 0.0) / prefill_tokens if prefill_tokens else None
        out.update(
            identical_outputs=mismatched == 0, mismatched_requests=mismatched,
            copy_s_per_token=copy, prefill_s_per_token=prefill,
            ratios=tier_ratios(plain, tiered, copy, prefill))
    return out


def tier_ratios(plain: dict, tiered: dict, copy: float | None, prefill: float | None) -> dict[str, float | None]:
    """The host tier's ratios to the device-only run (median summaries); None where a side
    completed nothing (no TTFT, 0 tok/s) or a time per token is unknown."""
    return {
        "ttft mean: device only / host tier": ratio(plain["ttft_mean_s"], tiered["ttft_mean_s"]),
        "ttft p99: device only / host tier": ratio(plain["ttft_p99_s"], tiered["ttft_p99_s"]),
        "throughput: host tier / device only": ratio(tiered["total_token_throughput"],
                                                     plain["total_token_throughput"]),
        "prefill time per token / copy time per token": ratio(prefill, copy) if copy and prefill else None,
    }
