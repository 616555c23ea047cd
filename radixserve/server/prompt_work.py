"""Tokenizing and rendering prompts: sized first, large ones shared fairly between tenants.

Tokenizing takes time in proportion to a prompt's characters (200,000 of them: 0.1 s of a
core), and every request's prompt was tokenized in full, in anyio's shared pool of worker
threads, before its length was checked: fifty clients sending long prompts that were refused
anyway (400) kept both cores busy, and another tenant's short chat took 11-14 s instead of
0.4 s. Now:

- a prompt with more characters than the context could hold at the vocabulary's longest
  token (twice that: a normalizer may merge characters) is refused without tokenizing;
- a prompt longer than PREFIX_CHARS_PER_TOKEN characters a token of context has that much of
  it encoded first, and is refused when the prefix alone is over the context
  (`refuse_by_prefix`): prompts just under the first bound (1.33M characters on SmolLM2) took
  seconds each to encode before their token count refused them, holding the fair slot below
  and a core (an attack round's tenant sending them: another's chats 0.29 -> 0.76 s);
- a prompt of more than LARGE_PROMPT_CHARS characters is tokenized (or rendered with the chat
  template) in one of PROMPT_WORK_SLOTS slots handed out fairly between tenants
  (`FairSlots`), so one tenant's flood of them waits on itself; shorter ones, which take a
  few milliseconds, run at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import anyio

from radixserve.server.errors import APIError
from radixserve.server.fair_slots import FairSlots

LARGE_PROMPT_CHARS = 32_768  # about 15 ms of tokenizing on one core
PREFIX_CHARS_PER_TOKEN = 8  # the prefix encoded first, per token of context (ordinary text: 3-5 a token)
PROMPT_WORK_SLOTS = 1  # large prompts tokenized at once, whoever sent them

T = TypeVar("T")


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters any one token of `tokenizer` stands for (its vocabulary's longest
    entry: byte-level entries have a character per byte, so never fewer than their text), or
    None when the tokenizer does not list its vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else None
    return max(map(len, vocab), default=1) if vocab else None


class PromptWork:
    """The server's tokenizing and rendering of prompts (see the module docstring)."""

    def __init__(self, tokenizer: Any, max_context_len: int) -> None:
        longest = longest_token_chars(tokenizer)
        self.max_chars = math.inf if longest is None else 2 * max_context_len * longest
        self.max_context_len = max_context_len
        self.slots = FairSlots(PROMPT_WORK_SLOTS)

    def check_size(self, chars: int, param: str) -> None:
        """A 400 (`context_length_exceeded`, naming `param`) for a prompt of `chars`
        characters that cannot fit the context whatever it tokenizes to."""
        if chars > self.max_chars:
            raise APIError(400, f"The prompt has {chars} characters: more tokens than this model's context of "
                                f"{self.max_context_len} tokens could hold.", param=param,
                           code="context_length_exceeded")

    async def run(self, tenant: Hashable, chars: int, work: Callable[[], T]) -> T:
        """`work()` (tokenizing or rendering a prompt of `chars` characters) in a worker
        thread; a large prompt's in one of the fair slots."""
        if chars <= LARGE_PROMPT_CHARS:
            return await anyio.to_thread.run_sync(work)
        async with self.slots.hold(tenant):
            return await anyio.to_thread.run_sync(work)


def refuse_by_prefix(encode: Callable[[str], list[int]], text: str, max_tokens: int, param: str) -> None:
    """A 400 (`context_length_exceeded`, naming `param`) when the first PREFIX_CHARS_PER_TOKEN x
    `max_tokens` characters of `text` alone `encode` to more than `max_tokens` tokens (and a
    tenth more, for where the cut falls: a prefix's tokens are the whole's up to the last
    word it cuts); nothing for a shorter text."""
    limit = PREFIX_CHARS_PER_TOKEN * max_tokens
    if len(text) <= limit:
        return
    count = len(encode(text[:limit]))
    if count > max_tokens + max_tokens // 10:
        raise APIError(400, f"The prompt's first {limit} characters alone are {count} tokens: more than this "
                            f"model's context of {max_tokens} tokens.", param=param, code="context_length_exceeded")
