"""The engine without the server: a workload replayed through `Engine` in this process.

The same closed loop as the HTTP client (`serve.py`): `concurrency` requests in flight, each
sent as token ids with greedy sampling, `ignore_eos` and its workload output length, a chat
turn released only once its parent finished. TTFT, inter-token latency and throughput are
measured at the step loop, so the difference to an HTTP run of the same workload is the
server's share. The engine's own step-time breakdown (`Engine.stats()["step_breakdown_s"]`)
comes with every run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from radixserve.benchmark.serve import RequestRecord, ServeResult
from radixserve.benchmark.workloads import BenchRequest, Workload
from radixserve.engine.engine import Engine
from radixserve.engine.params import SamplingParams
from radixserve.engine.timing import SECTIONS


@dataclass
class EngineRun:
    """One in-process replay: the serve-style result and where the step time went."""

    result: ServeResult
    breakdown_s: dict[str, float] = field(default_factory=dict)  # section -> seconds, "steps"
    step_time_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """`ServeResult.summary()` plus the breakdown (seconds per section and per step)."""
        out = self.result.summary()
        out["step_time_s_total"] = self.step_time_s
        out["step_breakdown_s"] = dict(self.breakdown_s)
        return out


def run_in_process(engine: Engine, workload: Workload, *, concurrency: int = 8,
                   isolate: bool = False) -> EngineRun:
    """Replays `workload` through `engine` (closed loop; `isolate`: a cache_salt per request,
    so nothing can be reused). The engine should be fresh: its stats are reported as is."""
    queue = list(workload.requests)
    slots: list[BenchRequest] = []  # taken by a request in flight or waiting for its parent
    started: dict[str, tuple[BenchRequest, float]] = {}
    records: dict[int, RequestRecord] = {}
    last_token: dict[int, float] = {}
    finished: set[int] = set()
    begin = time.perf_counter()
    while queue or slots:
        while queue and len(slots) < concurrency:
            slots.append(queue.pop(0))
        for request in slots:
            if (request.parent is None or request.parent in finished) and request.index not in records:
                records[request.index] = RequestRecord(request.index)
                rid = engine.add_request(
                    request.prompt_ids.tolist(),
                    SamplingParams(max_tokens=max(request.output_len, 1), temperature=0.0, ignore_eos=True),
                    request_id=f"bench-{request.index}",
                    cache_salt=f"isolated-{request.index}" if isolate else None)
                started[rid] = (request, time.perf_counter())
        if not engine.has_work():
            raise RuntimeError("requests are waiting on parents that never run")
        deltas = engine.step()
        now = time.perf_counter()
        for rid, items in deltas.items():
            request, start = started[rid]
            record = records[request.index]
            for delta in items:
                if delta.token_ids:
                    if request.index in last_token:
                        record.itl_s.append(now - last_token[request.index])
                    else:
                        record.ttft_s = now - start
                    last_token[request.index] = now
                    record.completion_tokens += len(delta.token_ids)
                record.prompt_tokens, record.cached_tokens = delta.prompt_tokens, delta.cached_tokens
                if delta.finish_reason is not None:
                    record.latency_s = now - start
                    record.finished_s = now - begin
                    finished.add(request.index)
                    slots.remove(request)
    duration = time.perf_counter() - begin
    stats = engine.stats()
    result = ServeResult("in-process", workload.name, [records[r.index] for r in workload.requests], duration)
    return EngineRun(result, stats["step_breakdown_s"], stats["step_time_s_total"])


def breakdown_table(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown: per run, milliseconds per batch step in each section and their share."""
    lines = ["| run | steps | " + " | ".join(SECTIONS) + " | outside the model |",
             "|---" * (len(SECTIONS) + 3) + "|"]
    for label, summary in runs.items():
        breakdown = summary.get("step_breakdown_s") or {}
        steps = max(int(breakdown.get("steps", 0)), 1)
        total = sum(breakdown.get(s, 0.0) for s in SECTIONS) or float("nan")
        cells = [f"{1000 * breakdown.get(s, 0.0) / steps:.2f} ms ({breakdown.get(s, 0.0) / total:.0%})"
                 for s in SECTIONS]
        outside = 1 - breakdown.get("model", 0.0) / total
        lines.append(f"| {label} | {steps} | " + " | ".join(cells) + f" | {outside:.1%} |")
    return "\n".join(lines) + "\n"
