"""`radixserve bench peers`: the same chat workloads against several OpenAI-compatible servers.

One client (httpx), one request shape for every server: POST /v1/chat/completions, streamed,
greedy, `ignore_eos` with `max_tokens` (so every server writes the same number of tokens),
`stream_options.include_usage`. Each server renders the chat with its own template, and
templates differ (SmolLM2's ignores `tools`: llama-server drops them, radixserve adds a tool
block), so with `render` (a `TokenRenderer`) the client renders every request itself, with
radixserve's renderer, and sends the same token ids to every server's /v1/completions: the
servers then prefill exactly the same tokens. Servers alternate: each repeat runs every workload on every
server, the order of the servers rotating from one repeat to the next, so a noisy machine
hurts them alike. Each repeat's prompts start with a tag of their own (see peer_workloads), so
no repeat finds the previous one's prompts cached.

Measured per request: TTFT (to the first chunk with content), the gaps between later content
chunks (inter-token latency), end-to-end latency, completion tokens, and the prompt tokens the
server says it served from its cache: radixserve's `usage.prompt_tokens_details.cached_tokens`,
llama-server's `timings.cache_n` (whichever the server sends; `timings` wins).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from radixserve.benchmark.peer_workloads import Conversation, PeerWorkload, append_turn
from radixserve.benchmark.serve import RequestRecord, auth_headers
from radixserve.benchmark.sse import StreamFailed, stream_chunks


@dataclass
class RunRecord:
    """One workload run on one server."""

    server: str
    workload: str
    repeat: int
    wall_s: float
    turns: list[RequestRecord]

    def figures(self, only: set[int] | None = None) -> dict[str, float]:
        """wall time, throughput, latency percentiles and cache share of this run (`only`: of
        the requests with these indices, for a ratio over the requests two runs completed)."""
        turns = self.turns if only is None else [t for t in self.turns if t.index in only]
        ok = [t for t in turns if t.error is None]
        ttft = np.array([t.ttft_s for t in ok]) if ok else np.full(1, np.nan)
        itl = np.array([g for t in ok for g in t.itl_s]) if any(t.itl_s for t in ok) else np.full(1, np.nan)
        output = sum(t.completion_tokens for t in ok)
        prompt = sum(t.prompt_tokens for t in ok)
        decode = [(t.latency_s - t.ttft_s) / (t.completion_tokens - 1) for t in ok
                  if t.completion_tokens > 1 and t.itl_s]  # a reply streamed in one piece has no pace
        return {
            "wall_s": self.wall_s,
            "output_tokens": float(output),
            "output_tok_s": output / self.wall_s if self.wall_s > 0 else float("nan"),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "itl_p50_s": float(np.percentile(itl, 50)),
            "itl_p99_s": float(np.percentile(itl, 99)),
            "decode_ms_per_token": 1000 * statistics.median(decode) if decode else float("nan"),
            "prompt_tokens": float(prompt),
            "cached_share": sum(t.cached_tokens for t in ok) / prompt if prompt else 0.0,
            "errors": float(len(turns) - len(ok)),
        }

    def completed(self) -> set[int]:
        """The indices of the requests this run completed."""
        return {t.index for t in self.turns if t.error is None}


def chat_payload(messages: list[dict[str, object]], conversation: Conversation, max_tokens: int,
                 model: str | None) -> dict[str, object]:
    """The /v1/chat/completions body every server gets."""
    payload: dict[str, object] = {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if conversation.tools:
        payload["tools"] = conversation.tools
    if model is not None:
        payload["model"] = model
    return payload


Renderer = Callable[[list[dict[str, object]], list[dict[str, object]] | None], list[int]]


class TokenRenderer:
    """Chat messages (and tools) -> the prompt's token ids as radixserve renders them for
    `model`'s tokenizer and chat template (`ChatRenderer`, the server's own code)."""

    def __init__(self, model: str) -> None:
        from radixserve.models.gguf_checkpoint import is_gguf_file, load_gguf_tokenizer
        from radixserve.models.loader import load_tokenizer
        from radixserve.models.registry import resolve_model
        from radixserve.server.prompts import ChatRenderer

        path = resolve_model(model)
        tokenizer = load_gguf_tokenizer(path) if is_gguf_file(path) else load_tokenizer(path)
        self._renderer = ChatRenderer(tokenizer)

    def __call__(self, messages: list[dict[str, object]], tools: list[dict[str, object]] | None) -> list[int]:
        import msgspec

        from radixserve.server.protocol import ChatMessage

        ids, _ = self._renderer.render(msgspec.convert(messages, list[ChatMessage]), tools=tools or None)
        return ids


def completion_payload(prompt_ids: list[int], max_tokens: int, model: str | None) -> dict[str, object]:
    """The /v1/completions body every server gets when the client renders the prompt."""
    payload: dict[str, object] = {
        "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if model is not None:
        payload["model"] = model
    return payload


async def stream_turn(client: httpx.AsyncClient, url: str, payload: dict[str, object],
                      index: int = 0) -> RequestRecord:
    """Streams one completion (chat, or /v1/completions for a body with a `prompt`) and
    measures it; a failure is recorded, never raised. A reply whose tokens have no text
    (a model writing only special tokens, or bytes of an unfinished character: the random
    demo model did, about once in 50 requests) counts its time to first token at the chunk
    that ends it, when the server reports tokens written; with none written it failed."""
    record = RequestRecord(index)
    start = time.perf_counter()
    last: float | None = None
    ended: float | None = None
    endpoint = "/v1/completions" if "prompt" in payload else "/v1/chat/completions"
    try:
        async for chunk in stream_chunks(client, f"{url}{endpoint}", payload):
            choices = chunk.get("choices") or []
            choice = choices[0] if choices else {}
            delta = choice.get("delta") or {}
            content = delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
            if content or delta.get("tool_calls"):  # a call's deltas are its output, text or not
                now = time.perf_counter()
                record.text += content
                if last is None:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last)
                last = now
            if ended is None and choice.get("finish_reason"):
                ended = time.perf_counter()
            read_usage(chunk, record)
    except StreamFailed as exc:
        record.error = str(exc)
        return record
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.latency_s = time.perf_counter() - start
    if last is None:
        if ended is not None and record.completion_tokens > 0:
            record.ttft_s = ended - start
        else:
            record.error = "no content received"
    return record


def read_usage(chunk: dict[str, object], record: RequestRecord) -> None:
    """Token counts from a chunk's `usage` (OpenAI) and `timings` (llama-server)."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = int(usage.get("prompt_tokens") or record.prompt_tokens)
        record.completion_tokens = int(usage.get("completion_tokens") or record.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = int(details.get("cached_tokens") or record.cached_tokens)
    timings = chunk.get("timings")
    if isinstance(timings, dict) and "cache_n" in timings:
        record.cached_tokens = int(timings["cache_n"])
        if not record.prompt_tokens:
            record.prompt_tokens = int(timings["cache_n"]) + int(timings.get("prompt_n", 0))
        if not record.completion_tokens:
            record.completion_tokens = int(timings.get("predicted_n", 0))


async def run_workload(url: str, workload: PeerWorkload, *, max_tokens: int, model: str | None,
                       timeout_s: float, render: Renderer | None = None,
                       api_key: str | None = None) -> tuple[float, list[RequestRecord]]:
    """All of `workload`'s conversations, `workload.concurrency` at a time (closed loop);
    returns the wall time and every turn's record. With `render`, each request is rendered
    by the client and sent as token ids to /v1/completions. `api_key`: sent as a Bearer token."""
    url = url.rstrip("/")
    queue: asyncio.Queue[tuple[int, Conversation]] = asyncio.Queue()
    first = 0  # each turn's index: the same request of the workload has the same one on every server
    for conversation in workload.conversations:
        queue.put_nowait((first, conversation))
        first += len(conversation.turns)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=max(workload.concurrency, 1))

    async def converse(client: httpx.AsyncClient, first: int, conversation: Conversation) -> None:
        messages: list[dict[str, object]] = [{"role": "system", "content": conversation.system}]
        for step, turn in enumerate(conversation.turns):
            append_turn(messages, turn, step)
            if render is None:
                payload = chat_payload(messages, conversation, max_tokens, model)
            else:
                # Off the event loop: a long history's template and tokenizer would hold up the
                # other conversations' chunks and show up in their latencies.
                ids = await asyncio.to_thread(render, messages, conversation.tools)
                payload = completion_payload(ids, max_tokens, model)
            record = await stream_turn(client, url, payload, index=first + step)
            records.append(record)
            if record.error is not None:
                return
            messages.append({"role": "assistant", "content": record.text})

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            await converse(client, *queue.get_nowait())

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits,
                                 headers=auth_headers(api_key)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(max(workload.concurrency, 1))))
        return time.perf_counter() - start, sorted(records, key=lambda r: r.index)


async def warm_up(url: str, model: str | None, timeout_s: float, api_key: str | None = None) -> str | None:
    """One short request, so that no server pays its first-request costs inside a run; the
    reason it failed (a server down, a key refused), else None."""
    conversation = Conversation("warm up", [])
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), headers=auth_headers(api_key)) as client:
        record = await stream_turn(client, url.rstrip("/"),
                                   chat_payload([{"role": "user", "content": "Hello"}], conversation, 4, model))
    return None if record.error is None else f"warm-up request failed: {record.error}"


async def run_peers(servers: dict[str, str], workloads_by_repeat: list[list[PeerWorkload]], *,
                    max_tokens: int, model: str | None = None, timeout_s: float = 600.0,
                    on_run: object = None, render: Renderer | None = None,
                    api_key: str | None = None) -> tuple[list[RunRecord], dict[str, str]]:
    """Every workload of every repeat on every server that answers a warm-up request, the
    servers' order rotating per repeat. `servers`: name -> base URL. `on_run(record)` is
    called after each run; `render` and `api_key` as in `run_workload`. Returns the runs and,
    by name, why each server left out failed its warm-up."""
    unreachable: dict[str, str] = {}
    for name, url in servers.items():
        error = await warm_up(url, model, timeout_s, api_key)
        if error is not None:
            unreachable[name] = error
    names = [name for name in servers if name not in unreachable]
    runs: list[RunRecord] = []
    if not names:
        return runs, unreachable
    for repeat, workloads in enumerate(workloads_by_repeat):
        for workload in workloads:
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                wall, turns = await run_workload(servers[name], workload, max_tokens=max_tokens,
                                                 model=model, timeout_s=timeout_s, render=render,
                                                 api_key=api_key)
                run = RunRecord(name, workload.name, repeat, wall, turns)
                runs.append(run)
                if callable(on_run):
                    on_run(run)
    return runs, unreachable


def summarise(runs: list[RunRecord]) -> dict[str, dict[str, dict[str, float]]]:
    """workload -> server -> the figures of one run, the median of its repeats by wall time
    (the lower one of an even number), so that a row's figures are those of a run that
    happened; with `repeat`, that run's, and `errors_all_repeats`, the failed requests of all
    the repeats."""
    grouped: dict[str, dict[str, list[RunRecord]]] = {}
    for run in runs:
        grouped.setdefault(run.workload, {}).setdefault(run.server, []).append(run)
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for workload, by_server in grouped.items():
        for server, repeats in by_server.items():
            median = sorted(repeats, key=lambda r: (r.wall_s, r.repeat))[(len(repeats) - 1) // 2]
            failed = sum(t.error is not None for r in repeats for t in r.turns)
            summary.setdefault(workload, {})[server] = {**median.figures(), "repeat": median.repeat,
                                                        "errors_all_repeats": failed}
    return summary


RATIO_FIGURES = ("output_tok_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_s", "decode_ms_per_token")


def ratios(runs: list[RunRecord], baseline: str) -> dict[str, dict[str, dict[str, float]]]:
    """workload -> server -> figure -> the median over repeats of (server / `baseline`), each
    ratio taken within one repeat (the two ran back to back) over the requests both runs
    completed; throughput only from repeats where both completed every request."""
    by_key = {(r.workload, r.server, r.repeat): r for r in runs}
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for (workload, server, repeat), run in by_key.items():
        base_run = by_key.get((workload, baseline, repeat))
        if server == baseline or base_run is None:
            continue
        both = run.completed() & base_run.completed()
        figures, base = run.figures(only=both), base_run.figures(only=both)
        whole = len(both) == len(run.turns) == len(base_run.turns)
        per_figure = out.setdefault(workload, {}).setdefault(server, {})
        for key in RATIO_FIGURES:
            if key == "output_tok_s" and not whole:
                continue  # the runs' output tokens are not of the same requests
            if base[key] and not np.isnan(base[key]) and not np.isnan(figures[key]):
                per_figure.setdefault(key, []).append(figures[key] / base[key])
    return {w: {s: {k: float(np.median(v)) for k, v in f.items()} for s, f in by_server.items()}
            for w, by_server in out.items()}
