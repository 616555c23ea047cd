"""A compiled grammar's first few steps, walked once before any request follows it.

The engine computes each constrained row's allowed tokens on its own thread, and xgrammar's
fill cannot be interrupted: the per-fill budget (matcher.py's FILL_BUDGET_S) ends a request
only after a slow fill has run, and grammar pacing (engine/grammar_pace.py) only after a slow
step. Some legal regexes compile in 2 ms but take seconds at their second step:
`(\\w+\\s?){0,100}` after one long word token 1.3 s of CPU on SmolLM2's vocabulary,
`(\\w+\\s?\\w+\\s?){0,1000}` 6.7 s, `(.+\\s?){0,1000}` 11 s (the ways to split the token into
repetitions multiply), so each such request stalled every stream for that long, once.

So a compile worker (compile_workers.py), under its CPU limit, walks a few steps from the
start: at each state it fills the mask and follows the `PICKS` longest allowed tokens (long
tokens are what make a repetition ambiguous), up to `BREADTH` states a step, `DEPTH` steps.
A fill or accept past the budget refuses the grammar before generation (a 400); one past the
worker's CPU limit is a compile timeout. Real schemas and regexes walk in 1-20 ms. It is a
probe, not a proof: an ambiguity further in (or behind tokens a long-first walk does not
take) still reaches the engine, where the fill budget and pacing bound it.
"""

from __future__ import annotations

import time

import numpy as np
import xgrammar

DEPTH = 4  # steps walked from the start
PICKS = 3  # longest allowed tokens followed from each state
BREADTH = 6  # states kept per step


def token_lengths(info: xgrammar.TokenizerInfo) -> np.ndarray:
    """Each token's length in bytes (0 past the decoded vocabulary: special or padding)."""
    lengths = np.zeros(info.vocab_size, dtype=np.int64)
    decoded = info.decoded_vocab
    lengths[:len(decoded)] = [len(token) for token in decoded]
    return lengths


def first_slow_step(compiled: xgrammar.CompiledGrammar, lengths: np.ndarray, budget_s: float) -> float | None:
    """The CPU seconds of the first fill or accept past `budget_s` in the walk, or None."""
    vocab_size = len(lengths)
    mask = xgrammar.allocate_token_bitmask(1, vocab_size).numpy()
    frontier = [xgrammar.GrammarMatcher(compiled)]
    for _ in range(DEPTH):
        following = []
        for matcher in frontier:
            start = time.thread_time()
            matcher.fill_next_token_bitmask(mask, 0)
            if (spent := time.thread_time() - start) > budget_s:
                return spent
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size])
            for token in allowed[np.argsort(-lengths[allowed], kind="stable")[:PICKS]]:
                child = matcher.fork()
                start = time.thread_time()
                accepted = child.accept_token(int(token))
                if (spent := time.thread_time() - start) > budget_s:
                    return spent
                if accepted and not child.is_terminated():
                    following.append(child)
        frontier = following[:BREADTH]
    return None
