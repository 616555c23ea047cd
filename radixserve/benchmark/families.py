"""Workload families whose shape differs from the Mooncake synthetic trace, to check cache
policies on traffic they were not tuned on (issue 23).

- `chat-gaps`: conversations that resend their whole history every turn, with heavy-tailed
  gaps between turns (Pareto, minutes; some conversations pause for an hour);
- `chat-crowd`: many concurrent conversations, their histories together far larger than
  any cache of the matrix;
- `agent-tools`: agent loops whose every step appends the model's call and a tool output of
  heavy-tailed length (most short, a few long file or search dumps);
- `zipf-docs`: a document set with Zipf popularity, each request a document plus a question;
- `scan`: every request new, touching everything once (no policy can hit; none should lose
  to LRU either).

Like a trace, no request declares a session (`client_id` -1): a turn waits for the previous
one (`parent`), but which prefixes come back is for the cache to find out. Every generator
is seeded and deterministic, draws its token ids in bulk (a few seconds at
scale 1), and takes `scale`: the number of conversations, agents, documents or requests is
multiplied by it (lengths are not), so `scale=1/8` is the same shape one eighth the size,
for caches one eighth the size (`radixserve bench matrix --scale`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # workloads.py registers these families: import it only when one runs
    from radixserve.benchmark.workloads import BenchRequest, Workload, _TokenSource

DEFAULT_VOCAB_SIZE = 32000  # workloads.DEFAULT_VOCAB_SIZE


def _source(seed: int, vocab_size: int) -> _TokenSource:
    from radixserve.benchmark.workloads import _TokenSource
    return _TokenSource(seed, vocab_size)


@dataclass
class _Turn:
    """A request before indexing: its arrival, its conversation and its prompt."""

    arrival: float
    conversation: int
    prompt: np.ndarray
    reply: np.ndarray
    shared_len: int


def _count(base: float, scale: float) -> int:
    """`base` (a count or a length) times `scale`, at least 1."""
    return max(1, int(round(base * scale)))


def _lengths(rng: np.random.Generator, median: float, sigma: float, size: int, lo: int, hi: int) -> np.ndarray:
    """Lognormal lengths (heavy right tail) around `median`, clipped to [lo, hi]."""
    return np.clip(rng.lognormal(np.log(median), sigma, size=size), lo, hi).astype(int)


def _indexed(name: str, turns: list[_Turn], params: dict[str, object]) -> Workload:
    """Requests in arrival order; a turn's parent is the previous turn of its conversation."""
    from radixserve.benchmark.workloads import BenchRequest, Workload
    order = sorted(range(len(turns)), key=lambda i: (turns[i].arrival, i))
    last_of: dict[int, int] = {}
    requests: list[BenchRequest] = []
    for index, i in enumerate(order):
        turn = turns[i]
        parent = last_of.get(turn.conversation)
        requests.append(BenchRequest(index=index, prompt_ids=turn.prompt, output_len=len(turn.reply),
                                     arrival_time=turn.arrival, group_id=turn.conversation % 8,
                                     client_id=-1, output_ids=turn.reply, parent=parent,
                                     shared_len=turn.shared_len))
        last_of[turn.conversation] = index
    return Workload(name, requests, params)


def _conversations(src: _TokenSource, num: int, *, system_len: int, num_systems: int, mean_turns: float,
                   message_median: int, reply_median: int, start_span_s: float, gap_s: float,
                   gap_shape: float, max_context: int) -> list[_Turn]:
    """Conversations sharing `num_systems` system prompts: Poisson starts over `start_span_s`,
    geometric turn counts, Pareto gaps of scale `gap_s` between a reply and the next turn."""
    rng = src.rng
    systems = src.siblings(num_systems, system_len)
    turns: list[_Turn] = []
    starts = np.sort(rng.uniform(0, start_span_s, size=num))
    num_turns = rng.geometric(1 / mean_turns, size=num)
    for conv in range(num):
        context = np.concatenate([systems[conv % num_systems], src.siblings(1, 1)[0]])
        t = float(starts[conv])
        messages = _lengths(rng, message_median, 1.0, int(num_turns[conv]), 1, 8 * message_median)
        replies = _lengths(rng, reply_median, 0.8, int(num_turns[conv]), 1, 8 * reply_median)
        for k in range(int(num_turns[conv])):
            prompt = np.concatenate([context, src.tokens(int(messages[k]))])
            if len(prompt) > max_context:
                break
            reply = src.tokens(int(replies[k]))
            turns.append(_Turn(t, conv, prompt, reply, system_len))
            context = np.concatenate([prompt, reply])
            t += gap_s * (rng.pareto(gap_shape) + 1)
    return turns


def chat_gaps(num_conversations: int = 400, *, scale: float = 1.0, mean_turns: float = 8.0,
              system_len: int = 1024, message_median: int = 300, reply_median: int = 250,
              gap_s: float = 60.0, gap_shape: float = 1.2, start_span_s: float = 3600.0,
              max_context: int = 32768, token_scale: float = 1.0, seed: int = 0,
              vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Conversations resending their history, heavy-tailed (Pareto, scale `gap_s`) gaps."""
    src = _source(seed, vocab_size)
    num, t = _count(num_conversations, scale), token_scale
    turns = _conversations(src, num, system_len=_count(system_len, t), num_systems=4, mean_turns=mean_turns,
                           message_median=_count(message_median, t), reply_median=_count(reply_median, t),
                           start_span_s=start_span_s, gap_s=gap_s, gap_shape=gap_shape,
                           max_context=_count(max_context, t))
    return _indexed("chat-gaps", turns, dict(num_conversations=num, scale=scale, mean_turns=mean_turns,
                                             gap_s=gap_s, gap_shape=gap_shape, token_scale=token_scale, seed=seed))


def chat_crowd(num_conversations: int = 1500, *, scale: float = 1.0, mean_turns: float = 4.0,
               system_len: int = 512, message_median: int = 1000, reply_median: int = 600,
               gap_s: float = 20.0, start_span_s: float = 600.0, max_context: int = 32768,
               token_scale: float = 1.0, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Many conversations at once: their histories add up to far more than the cache."""
    src = _source(seed, vocab_size)
    num, t = _count(num_conversations, scale), token_scale
    turns = _conversations(src, num, system_len=_count(system_len, t), num_systems=16, mean_turns=mean_turns,
                           message_median=_count(message_median, t), reply_median=_count(reply_median, t),
                           start_span_s=start_span_s, gap_s=gap_s, gap_shape=2.0, max_context=_count(max_context, t))
    return _indexed("chat-crowd", turns, dict(num_conversations=num, scale=scale, mean_turns=mean_turns, token_scale=token_scale, seed=seed))


def agent_tools(num_agents: int = 300, *, scale: float = 1.0, mean_steps: float = 12.0, system_len: int = 3000,
                task_median: int = 400, call_median: int = 80, tool_median: int = 600, start_span_s: float = 1800.0,
                step_gap_s: float = 2.0, max_context: int = 65536, token_scale: float = 1.0, seed: int = 0,
                vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Agent loops: a shared system prompt, a task, then per step the model's call and a
    tool output of lognormal length (sigma 1.2: most short, a few ten times the median)."""
    src = _source(seed, vocab_size)
    rng = src.rng
    num, t = _count(num_agents, scale), token_scale
    system_len, task_median, call_median = _count(system_len, t), _count(task_median, t), _count(call_median, t)
    tool_median, max_context = _count(tool_median, t), _count(max_context, t)
    (system,) = src.siblings(1, system_len)
    starts = np.sort(rng.uniform(0, start_span_s, size=num))
    turns: list[_Turn] = []
    for agent in range(num):
        steps = int(rng.geometric(1 / mean_steps))
        task = src.siblings(1, int(_lengths(rng, task_median, 0.7, 1, 1, 8 * task_median)[0]))[0]
        context = np.concatenate([system, task])
        t = float(starts[agent])
        calls = _lengths(rng, call_median, 0.5, steps, 1, 8 * call_median)
        tools = _lengths(rng, tool_median, 1.2, steps, 1, 32 * tool_median)
        for k in range(steps):
            if len(context) > max_context:
                break
            reply = src.tokens(int(calls[k]))
            turns.append(_Turn(t, agent, context, reply, system_len))
            context = np.concatenate([context, reply, src.tokens(int(tools[k]))])
            t += step_gap_s * (rng.pareto(2.0) + 1)
    return _indexed("agent-tools", turns, dict(num_agents=num, scale=scale, mean_steps=mean_steps, token_scale=token_scale, seed=seed))


def zipf_docs(num_docs: int = 2000, *, scale: float = 1.0, num_requests: int = 4000, zipf_s: float = 1.0,
              doc_median: int = 3000, question_len: int = 64, output_len: int = 64, rate: float = 4.0,
              token_scale: float = 1.0, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Questions about documents drawn with Zipf popularity (weight 1 / rank^zipf_s)."""
    from radixserve.benchmark.workloads import BenchRequest, Workload
    src = _source(seed, vocab_size)
    rng = src.rng
    docs_n, reqs_n = _count(num_docs, scale), _count(num_requests, scale)
    doc_median, question_len = _count(doc_median, token_scale), _count(question_len, token_scale)
    lengths = _lengths(rng, doc_median, 0.8, docs_n, 2, 16 * doc_median)
    firsts = src.siblings(docs_n, 1)
    docs = [np.concatenate([first, src.tokens(int(n) - 1)]) for first, n in zip(firsts, lengths)]
    weights = 1.0 / np.arange(1, docs_n + 1) ** zipf_s
    picks = rng.choice(docs_n, size=reqs_n, p=weights / weights.sum())
    times = np.cumsum(rng.exponential(1 / rate, size=reqs_n))
    questions = src.tokens(reqs_n * question_len).reshape(reqs_n, question_len)
    requests = [BenchRequest(index=i, prompt_ids=np.concatenate([docs[d], questions[i]]), output_len=output_len,
                             arrival_time=float(times[i]), group_id=int(d), shared_len=len(docs[d]))
                for i, d in enumerate(picks)]
    return Workload("zipf-docs", requests, dict(num_docs=docs_n, num_requests=reqs_n, zipf_s=zipf_s, scale=scale,
                                                token_scale=token_scale, seed=seed))


def scan(num_requests: int = 2000, *, scale: float = 1.0, prompt_median: int = 4000, output_len: int = 32,
         rate: float = 4.0, token_scale: float = 1.0, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Every request new: nothing is ever hit again."""
    from radixserve.benchmark.workloads import BenchRequest, Workload
    src = _source(seed, vocab_size)
    rng = src.rng
    n, prompt_median = _count(num_requests, scale), _count(prompt_median, token_scale)
    lengths = _lengths(rng, prompt_median, 0.6, n, 2, 8 * prompt_median)
    firsts = src.siblings(n, 1)
    times = np.cumsum(rng.exponential(1 / rate, size=n))
    requests = [BenchRequest(index=i, prompt_ids=np.concatenate([firsts[i], src.tokens(int(lengths[i]) - 1)]),
                             output_len=output_len, arrival_time=float(times[i])) for i in range(n)]
    return Workload("scan", requests, dict(num_requests=n, scale=scale, token_scale=token_scale, seed=seed))


FAMILIES = {"chat-gaps": chat_gaps, "chat-crowd": chat_crowd, "agent-tools": agent_tools,
            "zipf-docs": zipf_docs, "scan": scan}
