"""Benchmark workloads: token-id request streams, deterministic from a seed.

Every generator returns a `Workload` whose requests carry numpy int32 prompts, so the
simulator and the HTTP client replay exactly the same tokens. Shared parts (system prompts,
few-shot examples, earlier turns) are the *same* token ids in every request that shares
them; unrelated parts never share a token by accident: siblings that branch off the same
prefix start with distinct first tokens.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

DEFAULT_VOCAB_SIZE = 32000
FIRST_ORDINARY_TOKEN = 10  # ids below this are left to special tokens (BOS/EOS/pad...)


@dataclass
class BenchRequest:
    """One request of a workload.

    `output_ids` are the reply tokens later requests build on (a chat turn's answer that
    the next turn repeats); None when nothing depends on the reply's content. `parent` is
    the index of the request whose reply this one extends: it may not start before the
    parent finished. `shared_len` is how many leading prompt tokens are a shared system
    prompt or example block (what a retention priority protects).
    """

    index: int
    prompt_ids: np.ndarray
    output_len: int
    arrival_time: float = 0.0
    group_id: int = 0
    client_id: int = -1
    output_ids: np.ndarray | None = None
    parent: int | None = None
    shared_len: int = 0

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_ids)


@dataclass
class Workload:
    """A named, ordered list of requests plus the parameters that generated it."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        """Total prompt tokens over all requests."""
        return sum(r.prompt_len for r in self.requests)


class _TokenSource:
    """Random token ids in the ordinary range of a vocabulary."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        if vocab_size <= FIRST_ORDINARY_TOKEN + 1:
            raise ValueError(f"vocab_size: must exceed {FIRST_ORDINARY_TOKEN + 1}, got {vocab_size}")
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(FIRST_ORDINARY_TOKEN, self.vocab_size, size=n, dtype=np.int32)

    def siblings(self, count: int, length: int) -> list[np.ndarray]:
        """`count` random sequences of `length` tokens with pairwise distinct first tokens."""
        if length == 0:
            return [np.zeros(0, np.int32) for _ in range(count)]
        span = self.vocab_size - FIRST_ORDINARY_TOKEN
        if count > span:
            raise ValueError(f"need {count} distinct first tokens but the vocabulary has {span}")
        firsts = self.rng.choice(span, size=count, replace=False) + FIRST_ORDINARY_TOKEN
        out = []
        for first in firsts:
            seq = self.tokens(length)
            seq[0] = first
            out.append(seq)
        return out


def generated_shared_prefix(num_groups: int = 64, prompts_per_group: int = 16, system_len: int = 2048,
                            question_len: int = 128, output_len: int = 256, *, shuffle: bool = True,
                            seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """SGLang's generated-shared-prefix: groups of prompts sharing one system prompt each.

    With an unbounded cache the best hit rate is
    (prompts_per_group - 1) * system_len / (prompts_per_group * (system_len + question_len)).
    `shuffle` interleaves the groups (the order a scheduler must undo).
    """
    src = _TokenSource(seed, vocab_size)
    systems = src.siblings(num_groups, system_len)
    requests: list[BenchRequest] = []
    for group, system in enumerate(systems):
        for question in src.siblings(prompts_per_group, question_len):
            requests.append(BenchRequest(index=0, prompt_ids=np.concatenate([system, question]),
                                         output_len=output_len, group_id=group, shared_len=system_len))
    if shuffle:
        requests = [requests[i] for i in src.rng.permutation(len(requests))]
    return Workload("gsp", _reindexed(requests), dict(
        num_groups=num_groups, prompts_per_group=prompts_per_group, system_len=system_len,
        question_len=question_len, output_len=output_len, shuffle=shuffle, seed=seed))


def multi_turn(num_clients: int = 32, num_turns: int = 6, num_system_prompts: int = 4,
               system_len: int = 1024, message_len: int = 128, output_len: int = 128, *,
               seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Chat sessions sharing a few system prompts, requests round-robin across clients.

    Turn t of a client is its previous prompt + the previous reply + a new message; the order
    A1 B1 C1 ... A2 B2 ... is the worst case for reuse distance (SGLang's multi-turn bench).
    """
    requests = _sessions(num_clients, num_turns, num_system_prompts, system_len,
                         first_len=message_len, step_len=message_len, output_len=output_len,
                         seed=seed, vocab_size=vocab_size)
    return Workload("multiturn", requests, dict(
        num_clients=num_clients, num_turns=num_turns, num_system_prompts=num_system_prompts,
        system_len=system_len, message_len=message_len, output_len=output_len, seed=seed))


def agent_loop(num_agents: int = 16, num_steps: int = 10, system_len: int = 2048, task_len: int = 256,
               tool_len: int = 512, output_len: int = 64, *, seed: int = 0,
               vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Tool-using agents: one shared system prompt, each step appends the model's reply and a
    tool result to the agent's context. Steps are round-robin across agents."""
    requests = _sessions(num_agents, num_steps, 1, system_len, first_len=task_len,
                         step_len=tool_len, output_len=output_len, seed=seed, vocab_size=vocab_size)
    return Workload("agent", requests, dict(
        num_agents=num_agents, num_steps=num_steps, system_len=system_len, task_len=task_len,
        tool_len=tool_len, output_len=output_len, seed=seed))


def tool_agents(num_agents: int = 16, num_steps: int = 8, num_toolsets: int = 2, system_len: int = 512,
                tools_len: int = 1024, task_len: int = 128, call_len: int = 48, result_len: int = 256, *,
                stable_tools: bool = True, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Agents calling tools (issue 25): a system prompt all agents share, then the definitions
    of their toolset (`num_toolsets` sets; agent a uses set a % num_toolsets), the agent's
    task, and per step the model's tool call (its reply, `call_len` tokens) and the tool's
    result. Steps are round-robin across agents.

    The tool definitions are rendered into the prompt on every step; a server renders them
    byte-stable, so a step's prompt extends the previous one. `stable_tools=False` models a
    rendering that changes between steps (a timestamp or an unordered dict in the tool
    block): every step then gets a fresh tool block and shares only the system prompt.
    """
    src = _TokenSource(seed, vocab_size)
    (system,) = src.siblings(1, system_len)
    toolsets = src.siblings(num_toolsets, tools_len)
    tasks = src.siblings(num_agents, task_len)
    previous: dict[int, BenchRequest] = {}
    requests: list[BenchRequest] = []
    for step in range(num_steps):
        for agent in range(num_agents):
            tools = toolsets[agent % num_toolsets]
            if not stable_tools and step > 0:
                tools = np.concatenate([src.siblings(1, 1)[0], tools[1:]])  # changed on every step
            history = np.zeros(0, np.int32)
            if step > 0:
                last = previous[agent]
                start = system_len + tools_len
                history = np.concatenate([last.prompt_ids[start:], last.output_ids, src.tokens(result_len)])
            prompt = np.concatenate([system, tools, tasks[agent]]) if step == 0 else np.concatenate(
                [system, tools, history])
            request = BenchRequest(index=len(requests), prompt_ids=prompt, output_len=call_len,
                                   group_id=agent % num_toolsets, client_id=agent, output_ids=src.tokens(call_len),
                                   parent=previous[agent].index if step > 0 else None,
                                   shared_len=system_len + tools_len)
            previous[agent] = request
            requests.append(request)
    return Workload("tools", requests, dict(
        num_agents=num_agents, num_steps=num_steps, num_toolsets=num_toolsets, system_len=system_len,
        tools_len=tools_len, task_len=task_len, call_len=call_len, result_len=result_len,
        stable_tools=stable_tools, seed=seed))


def few_shot(num_tasks: int = 4, num_examples: int = 8, example_len: int = 256,
             questions_per_task: int = 64, question_len: int = 64, output_len: int = 16, *,
             shuffle: bool = True, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Few-shot prompting: per task a fixed block of examples, then a varying question."""
    src = _TokenSource(seed, vocab_size)
    prefix_len = num_examples * example_len
    requests: list[BenchRequest] = []
    for task, first_example in enumerate(src.siblings(num_tasks, example_len)):
        rest = [src.tokens(example_len) for _ in range(num_examples - 1)]
        examples = np.concatenate([first_example, *rest]) if num_examples else np.zeros(0, np.int32)
        for question in src.siblings(questions_per_task, question_len):
            requests.append(BenchRequest(index=0, prompt_ids=np.concatenate([examples, question]),
                                         output_len=output_len, group_id=task, shared_len=prefix_len))
    if shuffle:
        requests = [requests[i] for i in src.rng.permutation(len(requests))]
    return Workload("fewshot", _reindexed(requests), dict(
        num_tasks=num_tasks, num_examples=num_examples, example_len=example_len,
        questions_per_task=questions_per_task, question_len=question_len, output_len=output_len,
        shuffle=shuffle, seed=seed))


def mooncake_trace(path: str | Path, *, limit: int | None = None, vocab_size: int | None = None) -> Workload:
    """Replays a Mooncake trace: timestamps (ms) become arrival times in seconds.

    Output tokens are unknown in the trace (`output_ids` None): later turns reuse the earlier
    prompt's blocks only, as the trace's hash ids say. The loader's token ids run past any
    real vocabulary; `vocab_size` rehashes them into the ordinary range of one (for serve
    mode), which keeps equal blocks equal and makes accidental sharing negligible.
    """
    from radixserve.workloads.mooncake import expand_tokens, load_mooncake_trace

    trace = load_mooncake_trace(path)
    if limit is not None:
        trace = trace[:limit]
    requests = []
    for i, t in enumerate(trace):
        tokens = expand_tokens(t)
        if vocab_size is not None:
            tokens = _rehash(tokens, vocab_size)
        requests.append(BenchRequest(index=i, prompt_ids=np.asarray(tokens, dtype=np.int32),
                                     output_len=int(t.output_length), arrival_time=t.timestamp_ms / 1000.0))
    return Workload("mooncake", requests, dict(path=str(path), limit=limit))


def _rehash(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Maps token ids pseudo-randomly into [FIRST_ORDINARY_TOKEN, vocab_size) (splitmix64)."""
    x = tokens.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    span = np.uint64(vocab_size - FIRST_ORDINARY_TOKEN)
    return (x % span).astype(np.int64) + FIRST_ORDINARY_TOKEN


def with_poisson_arrivals(workload: Workload, rate: float, *, seed: int = 0) -> Workload:
    """A copy whose requests arrive as a Poisson process of `rate` requests per second."""
    if rate <= 0:
        raise ValueError(f"rate: must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(workload.requests))
    times = np.cumsum(gaps) - gaps[0]
    requests = [replace(r, arrival_time=float(t)) for r, t in zip(workload.requests, times)]
    return Workload(workload.name, requests, dict(workload.params, request_rate=rate))


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "gsp": generated_shared_prefix,
    "multiturn": multi_turn,
    "agent": agent_loop,
    "tools": tool_agents,
    "fewshot": few_shot,
}
from radixserve.benchmark.families import FAMILIES  # noqa: E402 (families import this module lazily)

WORKLOADS.update(FAMILIES)


class _ImportedOnUse:
    """A generator of a module that imports this one, imported when first called; its
    signature is the generator's (bench checks --workload-args against it)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def _generator(self) -> Callable[..., Workload]:
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, **params: Any) -> Workload:
        return self._generator()(**params)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._generator())


WORKLOADS["gapped-chat"] = _ImportedOnUse("radixserve.benchmark.gapped_chat", "gapped_conversations")


def make_workload(name: str, **params: Any) -> Workload:
    """Builds a synthetic workload by name (`WORKLOADS`), overriding generator defaults."""
    try:
        generator = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"workload: unknown {name!r}, expected one of {sorted(WORKLOADS)}") from None
    return generator(**params)


def _sessions(num_clients: int, num_turns: int, num_system_prompts: int, system_len: int, *,
              first_len: int, step_len: int, output_len: int, seed: int,
              vocab_size: int) -> list[BenchRequest]:
    """Round-robin multi-turn sessions; each turn extends the previous prompt and reply."""
    src = _TokenSource(seed, vocab_size)
    systems = src.siblings(num_system_prompts, system_len)
    clients_of = [list(range(c, num_clients, num_system_prompts)) for c in range(num_system_prompts)]
    first_messages: dict[int, np.ndarray] = {}
    for clients in clients_of:
        for client, message in zip(clients, src.siblings(len(clients), first_len)):
            first_messages[client] = message
    context = {c: np.concatenate([systems[c % num_system_prompts], first_messages[c]])
               for c in range(num_clients)}
    previous: dict[int, BenchRequest] = {}
    requests: list[BenchRequest] = []
    for turn in range(num_turns):
        for client in range(num_clients):
            if turn > 0:
                last = previous[client]
                context[client] = np.concatenate([last.prompt_ids, last.output_ids, src.tokens(step_len)])
            request = BenchRequest(index=len(requests), prompt_ids=context[client], output_len=output_len,
                                   group_id=client % num_system_prompts, client_id=client,
                                   output_ids=src.tokens(output_len),
                                   parent=previous[client].index if turn > 0 else None,
                                   shared_len=system_len)
            previous[client] = request
            requests.append(request)
    return requests


def _reindexed(requests: list[BenchRequest]) -> list[BenchRequest]:
    for i, r in enumerate(requests):
        r.index = i
    return requests
