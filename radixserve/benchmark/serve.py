"""Serve mode: drive a running OpenAI-compatible server with a workload over HTTP.

Each request goes to /v1/completions with its token ids as the prompt (so the server sees
exactly the workload's tokens), `max_tokens` = the request's output length, `ignore_eos`,
greedy sampling, streaming with `stream_options.include_usage`. Measured per request: TTFT
(time to the first streamed chunk carrying a choice), ITL (gaps between later such chunks),
end-to-end latency (from the request's send; `latency_from_start_mean_s`: from the run's
start, the time queued in the client included), and from the final usage chunk prompt,
completion and cached tokens.

Arrivals: a closed loop of `concurrency` workers taking requests in order, or an open loop
at each request's `arrival_time` (trace timestamps, or `with_poisson_arrivals`). Either way
a request whose workload `parent` has not finished waits for it (a chat's next turn).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import numpy as np

from radixserve.benchmark.sse import StreamFailed, stream_chunks
from radixserve.benchmark.workloads import BenchRequest, Workload

SERVER_CONNECTIONS_PER_ADDRESS = 1024  # as server/connection_limits.py's (not imported: it loads torch)


@dataclass
class RequestRecord:
    """What one request measured. Times in seconds; `error` set when it failed."""

    index: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""  # the completion, to compare runs
    # When it finished, from the run's start: its latency plus the time it queued behind the
    # closed loop's concurrency (and behind its parent), as a static batch's latency counts.
    finished_s: float = float("nan")


@dataclass
class ServeResult:
    """All records of one serve-mode run plus its wall-clock duration."""

    url: str
    workload: str
    records: list[RequestRecord]
    duration_s: float
    replica_requests: dict[str, int] | None = None  # a cluster's requests per replica in this run
    interrupted: bool = False  # cancelled (Ctrl-C) before every request finished: see run_serve_benchmark

    def summary(self) -> dict[str, object]:
        """Latency, throughput and hit-rate figures (JSON-ready)."""
        ok = [r for r in self.records if r.error is None]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        output = sum(r.completion_tokens for r in ok)
        ttft = np.array([r.ttft_s for r in ok]) if ok else np.zeros(0)
        latency = np.array([r.latency_s for r in ok]) if ok else np.zeros(0)
        itl = np.array([g for r in ok for g in r.itl_s])
        duration = self.duration_s or float("nan")
        return {
            "url": self.url, "workload": self.workload,
            "requests": len(self.records), "completed": len(ok), "errors": len(self.records) - len(ok),
            "duration_s": self.duration_s,
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": output,
            "hit_rate": cached / prompt if prompt else 0.0,
            "request_throughput": len(ok) / duration,
            "output_token_throughput": output / duration,
            "total_token_throughput": (prompt + output) / duration,
            **_stats("ttft", ttft), **_stats("itl", itl), **_stats("latency", latency),
            "latency_from_start_mean_s": float(np.mean([r.finished_s for r in ok])) if ok else None,
            **_replica_figures(self.replica_requests),
            **({"interrupted": True} if self.interrupted else {}),
        }

    def errors(self) -> list[tuple[str, int]]:
        """The distinct errors of failed requests with how many requests each, most common first."""
        return Counter(r.error for r in self.records if r.error is not None).most_common()


def _replica_figures(per_replica: dict[str, int] | None) -> dict[str, object]:
    if per_replica is None:
        return {}
    from radixserve.cluster.routing import replica_imbalance

    counts = list(per_replica.values())
    return {"replicas": len(counts), "replica_requests": per_replica,
            "replica_imbalance": replica_imbalance(counts)}


async def cluster_routed(client: httpx.AsyncClient, url: str) -> dict[str, int] | None:
    """Requests routed to each replica so far, if `url` serves a cluster (else None)."""
    try:
        response = await client.get(f"{url}/cluster/replicas")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    body = response.json()
    return {r["id"]: body["routed"].get(r["id"], 0) for r in body["replicas"]}  # live ones, 0 included


def _stats(name: str, values: np.ndarray) -> dict[str, float | None]:
    if not len(values):
        return {f"{name}_mean_s": None, f"{name}_p50_s": None, f"{name}_p90_s": None, f"{name}_p99_s": None}
    return {f"{name}_mean_s": float(values.mean()), f"{name}_p50_s": float(np.percentile(values, 50)),
            f"{name}_p90_s": float(np.percentile(values, 90)), f"{name}_p99_s": float(np.percentile(values, 99))}


def completion_payload(request: BenchRequest, model: str | None, *, isolate: bool = False
                       ) -> dict[str, object]:
    """The /v1/completions body for one workload request; `isolate` gives it a cache_salt of
    its own, so it can reuse nothing (prefix caching at 0% hits)."""
    payload: dict[str, object] = {
        "prompt": request.prompt_ids.tolist(), "max_tokens": max(request.output_len, 1),
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        payload["model"] = model
    if isolate:
        payload["cache_salt"] = f"isolated-{request.index}"
    return payload


async def send_request(client: httpx.AsyncClient, url: str, request: BenchRequest,
                       model: str | None, *, isolate: bool = False) -> RequestRecord:
    """Streams one completion and measures it; failures are recorded, not raised."""
    record = RequestRecord(request.index)
    start = time.perf_counter()
    last_chunk: float | None = None
    try:
        async for chunk in stream_chunks(client, f"{url}/v1/completions",
                                         completion_payload(request, model, isolate=isolate)):
            now = time.perf_counter()
            if chunk.get("choices"):
                record.text += chunk["choices"][0].get("text") or ""
                if last_chunk is None:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last_chunk)
                last_chunk = now
            usage = chunk.get("usage")
            if usage:
                record.prompt_tokens = usage["prompt_tokens"]
                record.completion_tokens = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = details.get("cached_tokens", 0) or 0
    except StreamFailed as exc:
        record.error = str(exc)
        return record
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.latency_s = time.perf_counter() - start
    if last_chunk is None:
        record.error = "no content chunk received"
    return record


async def run_serve_benchmark(url: str, workload: Workload, *, concurrency: int | None = 16,
                              open_loop: bool = False, model: str | None = None, isolate: bool = False,
                              timeout_s: float = 600.0, progress: bool = False,
                              api_key: str | None = None, keep_on_cancel: bool = False) -> ServeResult:
    """Replays `workload` against the server at `url` (e.g. http://127.0.0.1:8000).

    `open_loop` sends each request at its `arrival_time`; otherwise `concurrency` workers
    keep that many requests in flight. `isolate` gives every request its own cache_salt.
    `api_key` is sent as `Authorization: Bearer` (a keyed server answers 401 without it).
    With `keep_on_cancel`, a cancellation (asyncio.run's answer to Ctrl-C) ends the run and
    returns what finished, `interrupted`, every other request recorded with the error
    "interrupted"; without it the cancellation propagates.
    """
    url = url.rstrip("/")
    requests = workload.requests
    finished = {r.index: asyncio.Event() for r in requests}
    records: dict[int, RequestRecord] = {}
    bar = _progress_bar(len(requests), progress)
    # Open loop: as many connections as the server lets one address hold (past them its 429s
    # would count as failures); requests beyond wait here for a connection.
    limits = httpx.Limits(max_connections=SERVER_CONNECTIONS_PER_ADDRESS if open_loop else max(concurrency or 1, 1))

    async def one(client: httpx.AsyncClient, request: BenchRequest) -> None:
        if request.parent is not None:
            await finished[request.parent].wait()
        record = records[request.index] = await send_request(client, url, request, model, isolate=isolate)
        record.finished_s = time.perf_counter() - start
        finished[request.index].set()
        if bar is not None:
            bar.update(1)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits,
                                 headers=auth_headers(api_key)) as client:
        routed_before = await cluster_routed(client, url)
        start = time.perf_counter()
        interrupted = False
        try:
            if open_loop:
                async def at_arrival(request: BenchRequest) -> None:
                    await asyncio.sleep(max(0.0, request.arrival_time - (time.perf_counter() - start)))
                    await one(client, request)
                await asyncio.gather(*(at_arrival(r) for r in requests))
            else:
                queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
                for r in requests:
                    queue.put_nowait(r)

                async def worker() -> None:
                    while not queue.empty():
                        await one(client, queue.get_nowait())
                await asyncio.gather(*(worker() for _ in range(max(concurrency or 1, 1))))
        except asyncio.CancelledError:
            if not keep_on_cancel:
                raise
            interrupted = True  # gather cancelled the requests still running
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        duration = time.perf_counter() - start
        routed_after = await cluster_routed(client, url) if routed_before is not None and not interrupted else None
    if bar is not None:
        bar.close()
    per_replica = None
    if routed_before is not None and routed_after is not None:
        per_replica = {r: n - routed_before.get(r, 0) for r, n in routed_after.items()}
    return ServeResult(url, workload.name, [records.get(r.index) or RequestRecord(r.index, error="interrupted")
                                            for r in requests], duration, per_replica, interrupted)


PROBE_TOKEN_ID = 2**31 - 1  # past any vocabulary; a trace's raw ids run to tens of millions
_VOCAB_RANGE = re.compile(r"token ids must be in \[0, (\d+)\)")


def probe_vocab_size(url: str, *, model: str | None = None, api_key: str | None = None,
                     timeout_s: float = 30.0) -> int | None:
    """The vocabulary size of the server at `url`, if it says: a one-token prompt of an id
    past any vocabulary gets radixserve's 400 "token ids must be in [0, N)". None for any other
    answer (another server, unreachable: the run itself reports that). /v1/models carries no
    vocabulary size, and the synthetic default (32,000) is out of range for the demo model's
    2,048, which turned every request of `bench serve` against a default server into a 400."""
    payload: dict[str, object] = {"prompt": [PROBE_TOKEN_ID], "max_tokens": 1, "temperature": 0.0}
    if model is not None:
        payload["model"] = model
    try:
        response = httpx.post(f"{url.rstrip('/')}/v1/completions", json=payload, headers=auth_headers(api_key),
                              timeout=timeout_s)
    except (httpx.HTTPError, httpx.InvalidURL):  # the run itself reports a bad or unreachable URL
        return None
    match = _VOCAB_RANGE.search(response.text) if response.status_code == 400 else None
    return int(match.group(1)) if match else None


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that carries `api_key` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _progress_bar(total: int, enabled: bool):  # -> tqdm | None
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
