"""How much generation one request may ask for: the bound on prompts x samples x max_tokens.

One request can otherwise take the engine for minutes (64 prompts x n=16 x 256 tokens is
262,144 generated tokens). Fair share (engine/fair_share.py) keeps other tenants served
beside such a request; this bound keeps any one request's size sane. `--max-request-tokens`
sets it (docs/server.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.server.errors import APIError

DEFAULT_MAX_REQUEST_TOKENS = 65536


@dataclass(frozen=True)
class WorkLimit:
    """At most `max_request_tokens` generated tokens over a request's `num_prompts` prompts and
    each prompt's samples (n, or the beam width: every beam generates)."""

    max_request_tokens: int
    num_prompts: int = 1

    def bound(self, max_tokens: int, explicit: bool, width: int, param: str) -> int:
        """`max_tokens` per sample within the bound. An unset max_tokens (`explicit` False:
        the default, or the rest of the context) shrinks to fit; a requested one past the
        bound is a 400 naming `param`, as is a request whose prompts and samples alone
        leave no token each."""
        per_sample = self.max_request_tokens // (self.num_prompts * width)
        if max_tokens <= per_sample:
            return max_tokens
        if not explicit and per_sample >= 1:
            return per_sample
        asked = self.num_prompts * width * max(max_tokens, 1)
        raise APIError(400, f"This request asks for up to {asked} generated tokens ({self.num_prompts} prompt(s) "
                            f"x {width} sample(s) or beams x {max_tokens} max tokens); this server allows at most "
                            f"{self.max_request_tokens} per request. Ask for fewer, or send several requests.",
                       param=param, code="request_too_large")
