"""The chat workloads of `radixserve bench peers`: real text, sent as OpenAI chat messages.

Every workload is a list of conversations; a conversation is a fixed system prompt and a list
of turns, run one after another (each turn's request carries the whole history so far, the
model's own replies included, as a chat client does). The text is the project's demo corpus
(radixserve/data/demo_corpus.txt) cut into windows, so any real tokenizer sees real words.

- shared:    one long system prompt (--system-chars), N one-turn questions: what the prefix
             tree shares across requests.
- multiturn: N / 4 conversations of 4 turns each: each turn reuses the previous one.
- agent:     N / 4 agents of 4 steps with `tools` declared; each step after the first returns
             a tool result (an assistant tool call plus a `tool` message) for the model to read.
- distinct:  N prompts of --prompt-chars with nothing in common: no reuse at all.
- single:    a few distinct prompts one at a time (concurrency 1): the single-stream decode.

`run_tag` starts every system prompt, so that a repeated run finds nothing cached from the one
before it on any server (each run measures the workload cold); `bench peers` puts a random
nonce in it per invocation, so a second invocation against the same servers is cold too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "demo_corpus.txt"
WORKLOAD_NAMES = ("shared", "multiturn", "agent", "distinct", "single")
TURNS_PER_CONVERSATION = 4
SINGLE_STREAM_PROMPTS = 6
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_library",
        "description": "Search the library's catalogue and return the matching passage.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look for"}},
            "required": ["query"],
        },
    },
}


@dataclass
class Turn:
    """One request of a conversation: the messages it appends before asking for a reply.

    `tool_result` set: the previous reply is followed by a synthetic call of the search tool
    and this text comes back as the tool's result (an agent step)."""

    user: str | None = None
    tool_result: str | None = None


@dataclass
class Conversation:
    """A system prompt and turns run in order; `tools` are declared on each request."""

    system: str
    turns: list[Turn]
    tools: list[dict[str, object]] = field(default_factory=list)


@dataclass
class PeerWorkload:
    """A named list of conversations and how many run at once."""

    name: str
    conversations: list[Conversation]
    concurrency: int

    @property
    def num_requests(self) -> int:
        """Requests the workload sends (one per turn)."""
        return sum(len(c.turns) for c in self.conversations)


def corpus_text(path: Path = CORPUS_PATH) -> str:
    """The corpus with its paragraphs joined by blank lines, whitespace normalised."""
    paragraphs = [" ".join(p.split()) for p in path.read_text(encoding="utf-8").split("\n\n")]
    return "\n\n".join(p for p in paragraphs if p)


def window(text: str, start: int, length: int) -> str:
    """`length` characters of `text` from `start`, wrapping around, cut at word boundaries."""
    doubled = text + "\n\n" + text
    while len(doubled) < start % len(text) + length + 64:
        doubled += "\n\n" + text
    begin = start % len(text)
    if begin and not doubled[begin - 1].isspace():  # move to the next word
        space = doubled.find(" ", begin)
        begin = space + 1 if space != -1 else begin
    piece = doubled[begin:begin + length]
    cut = piece.rfind(" ")
    return piece[:cut] if cut > length // 2 else piece


def sentences(text: str) -> list[str]:
    """The corpus' sentences that read as questions or statements of a useful length."""
    out = []
    for raw in text.replace("\n", " ").split(". "):
        sentence = raw.strip().strip('"')
        if 30 <= len(sentence) <= 160:
            out.append(sentence)
    return out


def build_workloads(names: list[str], *, requests: int, concurrency: int, system_chars: int,
                    prompt_chars: int, run_tag: str) -> list[PeerWorkload]:
    """The named workloads (see the module docstring), `requests` requests each ('single':
    SINGLE_STREAM_PROMPTS at concurrency 1), every system prompt starting with `run_tag`."""
    unknown = sorted(set(names) - set(WORKLOAD_NAMES))
    if unknown:
        raise ValueError(f"unknown workloads {unknown} (choose from: {', '.join(WORKLOAD_NAMES)})")
    text = corpus_text()
    asks = sentences(text)
    tag = f"[{run_tag}] "

    def question(i: int) -> str:
        return f"Question {i + 1}: explain in your own words: {asks[i % len(asks)]}."

    def distinct_prompt(i: int) -> Conversation:
        body = window(text, i * 131, prompt_chars)
        return Conversation(f"{tag}You summarise passages. Passage {i + 1}.",
                            [Turn(user=f"{body}\n\nSummarise the passage above.")])

    built = []
    for name in names:
        if name == "shared":
            system = tag + "You answer questions about this text.\n\n" + window(text, 0, system_chars)
            conversations = [Conversation(system, [Turn(user=question(i))]) for i in range(requests)]
            built.append(PeerWorkload(name, conversations, concurrency))
        elif name == "multiturn":
            count = max(requests // TURNS_PER_CONVERSATION, 1)
            conversations = [
                Conversation(f"{tag}You are tutor number {c + 1}. Answer briefly.",
                             [Turn(user=question(c * TURNS_PER_CONVERSATION + t))
                              for t in range(TURNS_PER_CONVERSATION)])
                for c in range(count)
            ]
            built.append(PeerWorkload(name, conversations, concurrency))
        elif name == "agent":
            count = max(requests // TURNS_PER_CONVERSATION, 1)
            conversations = [
                Conversation(f"{tag}You are research agent {c + 1}. Use search_library to read "
                             "the catalogue before you answer.",
                             [Turn(user=question(c))]
                             + [Turn(tool_result=window(text, (c * 7 + t) * 211, prompt_chars // 2))
                                for t in range(1, TURNS_PER_CONVERSATION)],
                             tools=[SEARCH_TOOL])
                for c in range(count)
            ]
            built.append(PeerWorkload(name, conversations, concurrency))
        elif name == "distinct":
            built.append(PeerWorkload(name, [distinct_prompt(i) for i in range(requests)], concurrency))
        else:  # single
            built.append(PeerWorkload(name, [distinct_prompt(1000 + i) for i in range(SINGLE_STREAM_PROMPTS)], 1))
    return built


def append_turn(messages: list[dict[str, object]], turn: Turn, step: int) -> None:
    """Add `turn`'s messages to the history (a synthetic tool call before a tool result)."""
    if turn.tool_result is not None:
        call_id = f"call_{step}"
        if messages and messages[-1]["role"] == "assistant":
            messages[-1]["tool_calls"] = [{
                "id": call_id, "type": "function",
                "function": {"name": "search_library", "arguments": json.dumps({"query": f"topic {step}"})},
            }]
        messages.append({"role": "tool", "tool_call_id": call_id, "content": turn.tool_result})
    if turn.user is not None:
        messages.append({"role": "user", "content": turn.user})
