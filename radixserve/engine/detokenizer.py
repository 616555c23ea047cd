"""Incremental detokenisation and stop strings: text that never splits a character.

Detokenising runs once per generated token on the engine thread, so it makes at most one
tokenizer call per token, and none for the common tokenizer families: byte-level BPE and
SentencePiece tokens are spelled from a table read once off the vocabulary
(`engine/spelling.py`). Any other tokenizer decodes a short window of recent tokens once per
token and releases the text past what the window already gave, once it no longer ends in
U+FFFD.

Both start from the prompt's last tokens as context: a SentencePiece decode drops the
leading space of its first token, so without context the first generated word would lose
its space; a character or byte run the prompt leaves open continues in the output. The text
a sample streams is what decode(prompt + output) adds to decode(prompt).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from radixserve.engine.spelling import SpelledStream, token_spelling

PROMPT_CONTEXT_TOKENS = 4  # prompt tokens (at least) the detokenizer starts from
WINDOW_TOKENS = 8  # the fallback re-anchors its decode window after this many tokens


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, a piece at a time (module docstring).

    `prompt_ids`: the prompt; its last tokens are the context the output is decoded in.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.decode_calls = 0  # tokenizer calls made (for tests: at most one per token)
        prompt = list(prompt_ids)
        spelling = token_spelling(tokenizer)
        start = max(len(prompt) - PROMPT_CONTEXT_TOKENS, 0)
        if spelling is None:
            self._stream = None
            self._window = prompt[start:]
            self._released = len(self._decode(self._window))  # characters of the window given out
            return
        probe = SpelledStream(spelling)
        while start > 0 and probe.is_byte_token(prompt[start - 1]):
            start -= 1  # a byte-fallback run decodes as a whole: take all of it
        has_text = any(probe.is_visible(t) for t in reversed(prompt[:start]))
        self._stream = SpelledStream(spelling, prompt_has_text=has_text)
        for token_id in prompt[start:]:
            self._stream.push(token_id)
        self._stream.end_prompt()

    def _decode(self, ids: list[int]) -> str:
        self.decode_calls += 1
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (possibly empty)."""
        if self._stream is not None:
            return self._stream.push(token_id)
        self._window.append(token_id)
        text = self._decode(self._window)
        if len(text) <= self._released or text.endswith("\ufffd"):
            return ""
        piece, self._released = text[self._released:], len(text)
        if len(self._window) > WINDOW_TOKENS:
            # Re-anchor: keep a few tokens of context; one more decode every few tokens.
            self._window = self._window[-PROMPT_CONTEXT_TOKENS:]
            self._released = len(self._decode(self._window))
        return piece

    def flush(self) -> str:
        """The text still held back, released as it is when the sequence ends.

        A sample can end inside a multi-byte character; its text then ends in U+FFFD rather
        than losing what the last tokens decode to.
        """
        if self._stream is not None:
            return self._stream.flush()
        text = self._decode(self._window)
        piece = text[self._released:] if len(text) > self._released else ""
        self._window, self._released = [], 0
        return piece


@lru_cache(maxsize=64)
def _failure_function(stop: str) -> tuple[int, ...]:
    """KMP: for each prefix of `stop`, the length of its longest proper border."""
    border = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = border[k - 1]
        if stop[i] == stop[k]:
            k += 1
        border[i] = k
    return tuple(border)


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that may begin one.

    OpenAI semantics: the stop string itself is never emitted; text before the earliest
    stop string is. Text that could still become a stop string is kept until the next piece
    decides it. Each stop string has a Knuth-Morris-Pratt automaton whose state is the
    longest suffix of the text so far that begins it, so a piece costs time in its own
    length only, however long the stop strings or the held-back text (`scanned` counts the
    characters the automata have read).
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self._borders = [_failure_function(s) for s in self.stop]
        self._first_chars = frozenset(s[0] for s in self.stop)
        self._states = [0] * len(self.stop)
        self._held: deque[str] = deque()  # text not yet emitted, oldest first
        self._held_len = 0
        self.scanned = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stop or (not self._held_len and self._first_chars.isdisjoint(piece)):
            # Nothing held and no character that could begin a stop string: the automata
            # stay at their start state (they all are there when nothing is held).
            out = self._take(self._held_len) + piece
            return out, False
        earliest = None  # start of the earliest stop string found, counted from the held text
        for i, (stop, border) in enumerate(zip(self.stop, self._borders)):
            k, n = self._states[i], len(stop)
            for offset, char in enumerate(piece):
                while k and char != stop[k]:
                    k = border[k - 1]
                if char == stop[k]:
                    k += 1
                if k == n:
                    start = self._held_len + offset + 1 - n
                    earliest = start if earliest is None else min(earliest, start)
                    break
            self._states[i] = k
            self.scanned += len(piece) if k != n else offset + 1
        self._held.append(piece)
        self._held_len += len(piece)
        if earliest is not None:
            out = self._take(earliest)
            self._take(self._held_len)
            self._states = [0] * len(self.stop)
            return out, True
        hold = max(self._states)  # the longest suffix that may begin a stop string
        return self._take(self._held_len - hold), False

    def _take(self, count: int) -> str:
        """Removes and returns the oldest `count` held characters."""
        parts: list[str] = []
        while count > 0:
            chunk = self._held.popleft()
            if len(chunk) > count:
                self._held.appendleft(chunk[count:])
                chunk = chunk[:count]
            parts.append(chunk)
            count -= len(chunk)
            self._held_len -= len(chunk)
        return "".join(parts)

    def flush(self) -> str:
        """The held-back text, released when the sequence ends for another reason."""
        return self._take(self._held_len)
