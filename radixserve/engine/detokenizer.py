"""Incremental detokenisation and stop strings: text that never splits a character."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, a piece at a time.

    Byte-level BPE tokens can end inside a multi-byte UTF-8 character; decoding them alone gives
    U+FFFD. So each step decodes a short window that starts a few tokens back (the prefix) and
    releases only the text past that prefix, and only once it no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.token_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """The text still held back, released as it is when the sequence ends.

        A sample can end inside a multi-byte character; its text then ends in U+FFFD rather
        than losing what the last tokens decode to.
        """
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.token_ids[self.prefix_offset:], skip_special_tokens=True)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that may begin one.

    OpenAI semantics: the stop string itself is never emitted. Text that could still become
    a stop string is kept until the next piece decides it.
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += piece
        if not self.stop:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out = self.pending[:min(hits)]
            self.pending = ""
            return out, True
        hold = max((k for s in self.stop for k in range(1, len(s)) if self.pending.endswith(s[:k])),
                   default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back text, released when the sequence ends for another reason."""
        out, self.pending = self.pending, ""
        return out
