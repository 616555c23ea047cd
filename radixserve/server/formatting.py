"""Engine StreamDeltas → OpenAI response objects, in the chat and the completions flavour."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xgrammar
from msgspec import UNSET, Struct
from transformers import PreTrainedTokenizerBase

from radixserve import StreamDelta
from radixserve.engine.params import TokenLogprob
from radixserve.engine.spelling import hidden_token_ids
from radixserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    Usage,
)
from radixserve.server.tool_parsers import ParsedCall, StreamEvent, ToolCallParser, ToolCallStream, calls_complete


@dataclass
class ChoiceResult:
    """Everything one choice produced, gathered from its deltas (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: StreamDelta) -> None:
        """Appends what `delta` brings to this choice."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        self.finish_reason = delta.finish_reason or self.finish_reason


class UsageCounter:
    """Token counts over a request's deltas; a batch of prompts sums over its prompts.

    Choices `i * n .. i * n + n - 1` belong to prompt `i`. Each prompt is counted once
    whatever n is, with its cached_tokens (the engine reports one count per request: how much
    of the prompt its first sample found cached).
    """

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.prompt_tokens: dict[int, int] = {}  # prompt position → its tokens
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def add(self, delta: StreamDelta) -> None:
        """Counts one delta."""
        prompt = delta.index // self.n
        self.prompt_tokens[prompt] = delta.prompt_tokens
        self.cached_tokens[prompt] = delta.cached_tokens
        self.completion_tokens += len(delta.token_ids)

    def usage(self) -> Usage:
        """The `usage` object of the response."""
        prompt_tokens = sum(self.prompt_tokens.values())
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())))


class TokenNamer:
    """Token id → the string logprobs show: its text, or "token_id:<id>" when asked for ids;
    and the token's own bytes (`vocab_bytes`: each token's, else its text's)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, as_ids: bool,
                 vocab_bytes: Sequence[bytes] | None = None) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.vocab_bytes = vocab_bytes
        self._hidden_ids = hidden_token_ids(tokenizer)  # cached per tokenizer

    def is_special(self, token_id: int) -> bool:
        """Whether the text leaves the token out (the detokenizer skips special tokens)."""
        return token_id in self._hidden_ids

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def text(self, token_id: int) -> str:
        """The token decoded on its own."""
        return self.tokenizer.decode([token_id])

    def legacy_name(self, token_id: int) -> str:
        """The token as the legacy (completions) logprobs name it: its text, or, for a token
        holding part of a character, `bytes:` and its bytes escaped (`bytes:\\xe2\\x80`), as
        OpenAI writes them (its text alone would be U+FFFD)."""
        if self.as_ids or self.vocab_bytes is None:
            return self(token_id)
        raw = bytes(self.bytes_of(token_id))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return self.text(token_id)

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes as chat logprobs give them: its own, which may be part of
        a character (a token's text alone shows U+FFFD there, and joining the tokens' bytes
        would not give the content back)."""
        if self.vocab_bytes is not None and 0 <= token_id < len(self.vocab_bytes):
            return list(self.vocab_bytes[token_id])
        return list(self.text(token_id).encode())


def vocab_bytes(tokenizer: PreTrainedTokenizerBase) -> list[bytes] | None:
    """Each token's bytes, as the grammar engine reads them from the tokenizer (byte-level
    and byte-fallback vocabularies alike); None for a tokenizer it cannot read."""
    try:
        return list(xgrammar.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab)
    except Exception:  # noqa: BLE001 (it reports an unknown tokenizer in several ways): text bytes then
        return None


@dataclass
class ResponseIdentity:
    """What every object of one response repeats."""

    id: str
    created: int
    model: str
    include_usage: bool  # stream_options.include_usage: other chunks then carry "usage": null


class ResponseFormatter(Protocol):
    """Builds the objects of one response; one implementation per endpoint."""

    identity: ResponseIdentity

    def opening_chunks(self, n: int) -> list[Struct]:
        """Chunks sent before any content (the chat role announcement)."""

    def chunk(self, delta: StreamDelta) -> Struct | None:
        """The chunk for one delta, or None when it carries nothing to send."""

    def chunks(self, delta: StreamDelta) -> list[Struct]:
        """The chunks for one delta (a tool call's name and arguments are two)."""

    def usage_chunk(self, usage: Usage) -> Struct:
        """The last chunk with stream_options.include_usage: usage and no choices."""

    def response(self, choices: list[ChoiceResult], usage: Usage) -> Struct:
        """The whole non-streaming response."""


class ChatFormatter:
    """`chat.completion` and `chat.completion.chunk` objects; with a tool-call parser, the
    reply's tool calls become `message.tool_calls` (finish_reason "tool_calls"), or, streaming,
    OpenAI's tool-call deltas: each call's id and name first, then its arguments."""

    def __init__(self, identity: ResponseIdentity, namer: TokenNamer, tool_parser: ToolCallParser | None = None,
                 logprobs: bool = False) -> None:
        self.identity = identity
        self.namer = namer
        self.tool_parser = tool_parser
        self.logprobs = logprobs  # asked for: a whole choice has them, an empty list if no token of its content
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice index → its parser state

    def opening_chunks(self, n: int) -> list[Struct]:
        # A reply a tool_choice makes calls opens with content null, as OpenAI streams one and
        # as the whole reply has it ("" left the openai client's assembled message with "").
        # Under "auto" the reply may be text: "", as OpenAI opens a text reply.
        content = None if self.tool_parser is not None and self.tool_parser.only_calls else ""
        return [self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=content))])
                for i in range(n)]

    def chunk(self, delta: StreamDelta) -> Struct | None:
        logprobs = self._logprobs(delta.logprobs, delta.finish_reason)
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return None
        content = delta.text if delta.text or logprobs is not None else UNSET
        choice = ChatChunkChoice(index=delta.index, delta=DeltaMessage(content=content),
                                 finish_reason=delta.finish_reason, logprobs=logprobs)
        return self._chunk([choice])

    def chunks(self, delta: StreamDelta) -> list[Struct]:
        if self.tool_parser is None:
            plain = self.chunk(delta)
            return [] if plain is None else [plain]
        stream = self._tool_streams.setdefault(delta.index, self.tool_parser.stream())
        events = stream.feed(delta.text)
        if delta.finish_reason is not None:
            events += stream.finish()
        out: list[Struct] = []
        logprobs = self._logprobs(delta.logprobs, delta.finish_reason)
        choices = [ChatChunkChoice(index=delta.index, delta=message) for event in events for message in _tool_messages(event)]
        if logprobs is not None:
            if choices and isinstance(choices[-1].delta.content, str):
                # with the content they came with, as without tools (one chunk, not two)
                choices[-1].logprobs = logprobs
            else:  # their text held back (it may open a call) or a call's: a chunk of their own
                choices.append(ChatChunkChoice(index=delta.index, delta=DeltaMessage(), logprobs=logprobs))
        out += [self._chunk([choice]) for choice in choices]
        if delta.finish_reason is not None:
            reason = _calls_reason(delta.finish_reason, stream.calls, self.tool_parser, stream.text)
            out.append(self._chunk([ChatChunkChoice(index=delta.index, delta=DeltaMessage(), finish_reason=reason)]))
        return out

    def usage_chunk(self, usage: Usage) -> Struct:
        return ChatCompletionChunk(id=self.identity.id, created=self.identity.created,
                                   model=self.identity.model, choices=[], usage=usage)

    def response(self, choices: list[ChoiceResult], usage: Usage) -> Struct:
        return ChatCompletion(
            id=self.identity.id, created=self.identity.created, model=self.identity.model,
            choices=[self._choice(i, c) for i, c in enumerate(choices)], usage=usage)

    def _choice(self, index: int, result: ChoiceResult) -> ChatChoice:
        logprobs = self._logprobs(result.logprobs, result.finish_reason)
        if logprobs is None and self.logprobs:  # OpenAI's clients read `.content` of what they asked for
            logprobs = ChatLogprobs(content=[])
        if self.tool_parser is None:
            return ChatChoice(index=index, message=AssistantMessage(content=result.text),
                              finish_reason=result.finish_reason, logprobs=logprobs)
        content, calls = self.tool_parser.parse(result.text)
        if not calls:
            return ChatChoice(index=index, message=AssistantMessage(content=content),
                              finish_reason=result.finish_reason, logprobs=logprobs)
        tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        reason = _calls_reason(result.finish_reason, calls, self.tool_parser, result.text)
        return ChatChoice(index=index, message=AssistantMessage(content=content, tool_calls=tool_calls),
                          finish_reason=reason, logprobs=logprobs)

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.identity.id, created=self.identity.created,
                                   model=self.identity.model, choices=choices,
                                   usage=None if self.identity.include_usage else UNSET)

    def _logprobs(self, entries: list[TokenLogprob] | None, finish_reason: str | None) -> ChatLogprobs | None:
        """A sample that stops on a special token (the chat template's end of turn, or a
        special token named in stop_token_ids) has it in its token ids but not in its content:
        that last token is not listed, as OpenAI's `logprobs.content` lists the content's
        tokens. (Special tokens inside a sample, with ignore_eos, and the tokens of a matched
        stop string are still listed.)"""
        if entries and finish_reason == "stop" and self.namer.is_special(entries[-1].token_id):
            entries = entries[:-1]
        if not entries:
            return None
        return ChatLogprobs(content=[
            ChatTokenLogprob(token=self.namer(e.token_id), logprob=e.logprob, bytes=self.namer.bytes_of(e.token_id),
                             top_logprobs=[TopLogprob(token=self.namer(t), logprob=lp, bytes=self.namer.bytes_of(t))
                                           for t, lp in e.top])
            for e in entries])


def _calls_reason(finish_reason: str | None, calls: list[ParsedCall], parser: ToolCallParser,
                  text: str) -> str | None:
    """A reply that stopped after complete calls finishes with "tool_calls" (unless its format
    says "stop": a named tool_choice); one a stop string cut inside a call keeps "stop" (as one
    cut by max_tokens keeps "length"): the agent must not run a call whose arguments are not
    JSON. One that max_tokens cut in text after its whole calls, which the reply drops (`text`,
    the reply's, tells), is "tool_calls" too: "length" made OpenAI's clients raise
    (LengthFinishReasonError) over calls that are whole."""
    complete = (finish_reason == "stop" and calls_complete(calls)) or \
        (finish_reason == "length" and bool(calls) and parser.cut_after_calls(text))
    return "tool_calls" if complete and parser.calls_finish else finish_reason


def _tool_messages(event: StreamEvent) -> list[DeltaMessage]:
    """The chunk deltas of one stream event: content, a call's header then its arguments, or
    a fragment of arguments."""
    if event.call is not None:
        header = DeltaToolCall(index=event.index, id=event.call.id, type="function",
                               function=DeltaFunctionCall(name=event.call.name, arguments=""))
        messages = [DeltaMessage(tool_calls=[header])]
        if event.call.arguments:
            messages.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=event.index, function=DeltaFunctionCall(arguments=event.call.arguments))]))
        return messages
    if event.arguments:
        return [DeltaMessage(tool_calls=[DeltaToolCall(index=event.index,
                                                       function=DeltaFunctionCall(arguments=event.arguments))])]
    return [DeltaMessage(content=event.content)] if event.content else []


class CompletionFormatter:
    """`text_completion` objects, whole or as chunks, with the legacy logprobs format."""

    def __init__(self, identity: ResponseIdentity, namer: TokenNamer) -> None:
        self.identity = identity
        self.namer = namer
        self.text_offsets: dict[int, int] = {}  # choice index → characters of its tokens so far
        # choice index → its tokens' bytes decoded so far: a character split over tokens
        # counts where it completes (each token decoded alone counted one U+FFFD a piece)
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}

    def opening_chunks(self, n: int) -> list[Struct]:
        return []

    def chunk(self, delta: StreamDelta) -> Struct | None:
        logprobs = self._logprobs(delta.index, delta.logprobs, delta.finish_reason)
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return None
        choice = CompletionChoice(index=delta.index, text=delta.text,
                                  finish_reason=delta.finish_reason, logprobs=logprobs)
        return Completion(id=self.identity.id, created=self.identity.created,
                          model=self.identity.model, choices=[choice],
                          usage=None if self.identity.include_usage else UNSET)

    def chunks(self, delta: StreamDelta) -> list[Struct]:
        plain = self.chunk(delta)
        return [] if plain is None else [plain]

    def usage_chunk(self, usage: Usage) -> Struct:
        return Completion(id=self.identity.id, created=self.identity.created,
                          model=self.identity.model, choices=[], usage=usage)

    def response(self, choices: list[ChoiceResult], usage: Usage) -> Struct:
        return Completion(
            id=self.identity.id, created=self.identity.created, model=self.identity.model,
            choices=[CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                                      logprobs=self._logprobs(i, c.logprobs, c.finish_reason))
                     for i, c in enumerate(choices)],
            usage=usage)

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        """The `logprobs` most likely tokens and the sampled one, which OpenAI always lists
        (up to logprobs + 1 of them)."""
        top = {self.namer.legacy_name(t): lp for t, lp in entry.top}
        top.setdefault(self.namer.legacy_name(entry.token_id), entry.logprob)
        return top

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None,
                  finish_reason: str | None) -> CompletionLogprobs | None:
        # The special token a sample stopped on is not in its text: not listed (as in chat).
        if entries and finish_reason == "stop" and self.namer.is_special(entries[-1].token_id):
            entries = entries[:-1]
        if not entries:
            return None
        offsets = []
        offset = self.text_offsets.get(index, 0)
        decoder = self._decoders.setdefault(index, codecs.getincrementaldecoder("utf-8")("replace"))
        for entry in entries:
            offsets.append(offset)
            if self.namer.vocab_bytes is None:
                offset += len(self.namer.text(entry.token_id))
            elif not self.namer.is_special(entry.token_id):  # (the text leaves those out)
                offset += len(decoder.decode(bytes(self.namer.bytes_of(entry.token_id))))
        self.text_offsets[index] = offset
        return CompletionLogprobs(
            tokens=[self.namer.legacy_name(e.token_id) for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[self._top(e) for e in entries],
            text_offset=offsets)
