"""Token spellings: what each token id decodes to, read once off a tokenizer's vocabulary.

Byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece-style tokenizers (Llama 2, Mistral:
"▁" for a space, optionally <0xHH> byte-fallback tokens) decode every token to a fixed
string, so a stream of tokens can be turned into text by table lookups, with no tokenizer
call per token. `token_spelling` recognises the two families from the fast tokenizer's
decoder and checks every token against the tokenizer's own decode, both in the middle of a
text and at its start; a tokenizer it does not recognise, or that disagrees anywhere, gets
None (the caller then decodes windows of tokens instead).

`SpelledStream` reproduces the decoders' rules, so that streamed text equals the
tokenizer's decode of the whole sequence:
- byte-level: the text is one UTF-8 decode of all tokens' bytes (invalid bytes become
  U+FFFD, as in Rust's `from_utf8_lossy` and Python's errors="replace");
- SentencePiece: a run of byte-fallback tokens is decoded when it ends, to one U+FFFD per
  byte token if it is not valid UTF-8 (`ByteFallback`); at the start of a text, `Strip`
  drops one leading space and `Metaspace` drops the first token's "▁" spaces;
- special tokens decode to nothing (skip_special_tokens) and do not end a byte run.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from dataclasses import dataclass
from functools import cached_property

from transformers import PreTrainedTokenizerBase

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


@dataclass(frozen=True)
class TokenSpelling:
    """What each token id decodes to, and the decoder's rules for the start of a text.

    byte_level: `entries[i]` is token i's bytes. Otherwise (SentencePiece) it is its text with
    "▁" as " ", or an int for a byte-fallback token <0xHH>. None: decodes to nothing.
    """

    byte_level: bool
    entries: list[bytes | str | int | None]
    strip_leading_spaces: int = 0  # `Strip` decoder: spaces dropped at the start of a text
    first_token_drops_spaces: bool = False  # `Metaspace` decoder: the first token loses its "▁"

    @cached_property
    def whole_texts(self) -> list[str | None]:
        """Byte-level: each token's text when its bytes are whole UTF-8 characters on their
        own (most tokens), else None; decoding those needs no UTF-8 decoder state."""
        texts: list[str | None] = []
        for entry in self.entries:
            try:
                texts.append(entry.decode() if isinstance(entry, bytes) else None)
            except UnicodeDecodeError:
                texts.append(None)
        return texts


_SPELLINGS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, TokenSpelling | None] = weakref.WeakKeyDictionary()


def token_spelling(tokenizer: PreTrainedTokenizerBase) -> TokenSpelling | None:
    """The spelling of every token, or None (see the module docstring). Built and checked
    once per tokenizer: two batched decodes of the vocabulary."""
    if tokenizer not in _SPELLINGS:
        _SPELLINGS[tokenizer] = _read_spelling(tokenizer)
    return _SPELLINGS[tokenizer]


_HIDDEN: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, frozenset[int]] = weakref.WeakKeyDictionary()


def hidden_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokens that decoding with skip_special_tokens leaves out: the named special tokens
    and every added token marked special (SmolLM2's <file_sep> and its like, which
    `all_special_ids` does not list). Read once per tokenizer."""
    if tokenizer not in _HIDDEN:
        added = getattr(tokenizer, "added_tokens_decoder", {})
        _HIDDEN[tokenizer] = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    return _HIDDEN[tokenizer]


def _decoder_parts(tokenizer: PreTrainedTokenizerBase) -> list[dict] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # a slow tokenizer, or a clean-up pass that rewrites text after decoding
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return decoder.get("decoders") or [decoder]


def _read_spelling(tokenizer: PreTrainedTokenizerBase) -> TokenSpelling | None:
    parts = _decoder_parts(tokenizer)
    if parts is None:
        return None
    kinds = {part.get("type") for part in parts}
    byte_level = "ByteLevel" in kinds
    if not byte_level and not kinds & {"Metaspace", "Replace"}:
        return None
    byte_fallback = "ByteFallback" in kinds
    strip = sum(int(p.get("start", 0)) for p in parts if p.get("type") == "Strip" and p.get("content") == " ")
    metaspace_first = any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
                          for p in parts)
    alphabet = _byte_level_alphabet()
    size = len(tokenizer)
    special = hidden_token_ids(tokenizer)
    entries: list[bytes | str | int | None] = []
    for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(size)))):
        if token_id in special or token is None:
            entries.append(None)
        elif byte_level:
            if any(c not in alphabet for c in token):
                return None
            entries.append(bytes(alphabet[c] for c in token))
        else:
            fallback = _BYTE_FALLBACK.fullmatch(token) if byte_fallback else None
            entries.append(int(fallback.group(1), 16) if fallback else token.replace("\u2581", " "))
    spelling = TokenSpelling(byte_level, entries, strip, metaspace_first)
    return spelling if _agrees(tokenizer, spelling) else None


def _agrees(tokenizer: PreTrainedTokenizerBase, spelling: TokenSpelling) -> bool:
    """Every token alone (the start of a text) and after a plain anchor token (the middle)
    spells as the tokenizer decodes it."""
    size = len(spelling.entries)
    anchor = next((i for i, e in enumerate(spelling.entries)
                   if isinstance(e, (bytes, str)) and _spell([i], spelling).strip().isalnum()), None)
    if anchor is None:
        return False
    alone = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=True)
    after = tokenizer.batch_decode([[anchor, i] for i in range(size)], skip_special_tokens=True)
    return all(alone[i] == _spell([i], spelling) and after[i] == _spell([anchor, i], spelling)
               for i in range(size))


def _spell(ids: list[int], spelling: TokenSpelling) -> str:
    """The text of `ids` decoded from the start of a text."""
    stream = SpelledStream(spelling)
    return "".join(stream.push(i) for i in ids) + stream.flush()


class SpelledStream:
    """Text from token ids by their spelling, released as soon as it is final.

    `push` the prompt's last tokens, then `end_prompt`, then the generated ones: the output is
    what the generated tokens add to the prompt's decoded text (`prompt_has_text` says whether
    the prompt decodes to any text before the tokens pushed; if not, the start-of-text rules
    apply to the first visible token).
    """

    def __init__(self, spelling: TokenSpelling, *, prompt_has_text: bool = False) -> None:
        self.entries = spelling.entries
        self.byte_level = spelling.byte_level
        self._whole = spelling.whole_texts if spelling.byte_level else None
        self._utf8_pending = False  # the UTF-8 decoder holds bytes of an unfinished character
        self._strip = 0 if prompt_has_text else spelling.strip_leading_spaces
        self._drop_first_spaces = spelling.first_token_drops_spaces and not prompt_has_text
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._run = bytearray()  # SentencePiece byte tokens not yet decoded
        self._run_tokens = 0
        self._prompt_run_tokens = 0  # of those, pushed before end_prompt
        self._prompt_bytes_pending = False  # byte-level: the prompt ended inside a character

    def push(self, token_id: int) -> str:
        """The text that token completes (possibly empty)."""
        entry = self.entries[token_id] if 0 <= token_id < len(self.entries) else None
        if entry is None:
            return ""
        if self.byte_level:
            whole = self._whole[token_id]  # type: ignore[index]
            if whole is not None and not self._utf8_pending:
                return whole  # the common case: no decoder call
            text = self._utf8.decode(entry)  # type: ignore[arg-type]
            self._utf8_pending = bool(self._utf8.getstate()[0])
            if self._prompt_bytes_pending and text:
                # The prompt's unfinished bytes resolved: into a character (ours), or into a
                # U+FFFD that the prompt's own decode already shows.
                self._prompt_bytes_pending = False
                text = text[1:] if text[0] == "\ufffd" else text
            return text
        first, self._drop_first_spaces = self._drop_first_spaces, False
        if isinstance(entry, int):
            self._run.append(entry)
            self._run_tokens += 1
            return ""
        return self._emit(self._end_run() + (entry.replace(" ", "") if first else entry))  # type: ignore[union-attr]

    def _end_run(self) -> str:
        if not self._run_tokens:
            return ""
        try:
            text = self._run.decode()
        except UnicodeDecodeError:  # the prompt's share of the U+FFFDs is the prompt's text
            text = "\ufffd" * (self._run_tokens - self._prompt_run_tokens)
        self._run, self._run_tokens, self._prompt_run_tokens = bytearray(), 0, 0
        return text

    def _emit(self, text: str) -> str:
        while self._strip and text:
            self._strip -= 1
            if text[0] == " ":
                text = text[1:]
            else:
                self._strip = 0
        return text

    def end_prompt(self) -> None:
        """Marks the end of the prompt's tokens; what they decoded to was the prompt's text."""
        if self.byte_level:
            self._prompt_bytes_pending = self._utf8_pending
            return
        try:
            self._run.decode()
        except UnicodeDecodeError:  # unfinished: the run continues into the output
            self._prompt_run_tokens = self._run_tokens
            return
        self._run, self._run_tokens = bytearray(), 0  # decodes already: the prompt's text

    def flush(self) -> str:
        """Whatever is still held back, at the end of the text."""
        if self.byte_level:
            text = self._utf8.decode(b"", final=True)
            if self._prompt_bytes_pending and text:
                text = text[1:]
            self._prompt_bytes_pending = self._utf8_pending = False
            return text
        return self._emit(self._end_run())

    def is_byte_token(self, token_id: int) -> bool:
        """Whether the token is a SentencePiece byte-fallback token."""
        return 0 <= token_id < len(self.entries) and isinstance(self.entries[token_id], int)

    def is_visible(self, token_id: int) -> bool:
        """Whether the token decodes to anything at all."""
        return 0 <= token_id < len(self.entries) and self.entries[token_id] is not None
