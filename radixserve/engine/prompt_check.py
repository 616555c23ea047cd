"""Whether a prompt and its sampling parameters can run on an engine: the checks add_request
makes before queueing (the errors the server turns into 400s)."""

from __future__ import annotations

import math

from radixserve.engine.params import PromptTooLong, SamplingParams


def check_prompt(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_context_len: int,
                 num_pages: int, page_size: int, max_running: int) -> None:
    """Raises ValueError or PromptTooLong if the prompt cannot run; see Engine.add_request."""
    if not prompt_ids:
        raise ValueError("prompt: must not be empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt: token ids must be in [0, {vocab_size})")
    if any(not 0 <= token < vocab_size for token in params.stop_token_ids):
        raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab_size})")
    total = len(prompt_ids) + params.max_tokens
    if total > max_context_len:
        raise PromptTooLong(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                            f"exceeds the model's context of {max_context_len} tokens",
                            param=_cause(len(prompt_ids), max_context_len))
    # Every sample must fit the pool on its own, or preemption could never make room; the
    # beams of a group run together, so all of them must (counted without sharing: a
    # group resumed after its cached pages were evicted recomputes each beam in full).
    beams = params.beam_width if params.beam_search else 1
    if beams * (math.ceil(total / page_size) + 1) > num_pages:
        what = f"{beams} beams of " if beams > 1 else ""
        limit = max_sequence_len(max_context_len, num_pages, page_size)
        raise PromptTooLong(f"{what}prompt + max_tokens ({total} tokens) needs more KV pages than the "
                            f"pool holds ({num_pages} pages of {page_size} tokens)",
                            param=_cause(len(prompt_ids), limit))
    if beams > max_running:
        raise ValueError(f"beam_width: {beams} beams run at once, more than max_running ({max_running})")


def max_sequence_len(max_context_len: int, num_pages: int, page_size: int) -> int:
    """The longest prompt + output one sample can have: the context, or the pool if smaller."""
    return min(max_context_len, (num_pages - 1) * page_size)


def _cause(prompt_len: int, limit: int) -> str:
    """What PromptTooLong blames: the prompt if it leaves no room for one token, else max_tokens."""
    return "prompt" if prompt_len + 1 > limit else "max_tokens"
