"""The model's tool-call text → OpenAI tool calls, whole (non-streaming) or as it streams.

One parser per output format, chosen from the chat template (`parser_for_template`) unless
`--tool-call-parser` names one:

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number
  (Hermes, Qwen2.5/Qwen3, and the block radixserve injects for templates without tools);
- "llama3": the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by ";" (Llama 3.1/3.2's JSON tool calling).

Streaming and non-streaming agree: `content` is the text before the first call's opening
(None when that is only whitespace), or the whole text when no call parses; a call is emitted
as soon as it is complete (its name with its id, then its arguments), so the deltas of a
stream assemble to the non-streaming message.

A call counts only if it names one of the request's tools (`names`): a model that invents a
function has not called one, and an agent that looks the name up would fail on it (OpenAI's
models call only the functions they are given). With `parallel_tool_calls` false
(`max_calls` 1) only the first call is the reply's; what follows it is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.server.json_text import parse_json_text

PARSERS = ("hermes", "llama3")


@dataclass
class ParsedCall:
    """One tool call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class StreamEvent:
    """What a stream adds: content text, the `index`-th tool call (its name and id, with the
    arguments known so far), or a further fragment of that call's arguments."""

    content: str = ""
    call: ParsedCall | None = None
    index: int = 0
    arguments: str = ""


class ToolCallParser(Protocol):
    """One output format of tool calls. `calls_finish` says whether a reply of complete calls
    finishes with "tool_calls" (OpenAI: for "auto" and "required"; a named tool_choice's
    forced call finishes with "stop"); `only_calls`, whether the reply is known to be calls
    before it is generated (a tool_choice constrains it to them)."""

    calls_finish: bool
    only_calls: bool

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The content and the tool calls of a whole reply."""

    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one choice."""

    def cut_after_calls(self, text: str) -> bool:
        """Whether a reply that max_tokens cut made all its calls whole, the cut falling in
        text after them that the reply drops (it finishes with "tool_calls", not "length")."""


def _call_from_json(text: str, arguments_key: str, names: Collection[str] | None) -> ParsedCall | None:
    """A call from `{"name": ..., "<arguments_key>": {...}}`; None if the text is not one, or
    names a function not in `names` (None: any), or its arguments are not an object (or an
    object's JSON text): OpenAI's clients parse `arguments` as an object, so `[1, 2]` or
    `null` stay the text the model wrote, as an unknown name does."""
    try:
        value = parse_json_text(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            if isinstance(parse_json_text(arguments), dict):
                return ParsedCall(value["name"], arguments)
        except ValueError:
            pass
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


class ToolCallStream:
    """Incremental parsing of one choice: text in, StreamEvents out, in the order of the text.

    Content before the first opening marker streams as it comes (held back while it is only
    whitespace, or while its end could be the start of a marker); from the marker on, text is
    held until a call completes (`_complete_calls`) or the reply ends (`finish`).
    """

    def __init__(self, parser: ToolCallParser, opening: str) -> None:
        self.parser = parser
        self.opening = opening
        self.text = ""
        self.content_sent = 0  # characters of content already streamed
        self.calls_sent = 0
        self.in_calls = False
        self.calls: list[ParsedCall] = []  # the reply's calls, as parsed when it ends (`finish`)

    def feed(self, text: str) -> list[StreamEvent]:
        """Events for `text`, the next piece of the reply."""
        self.text += text
        if not self.in_calls:
            at = self.text.find(self.opening)
            if at < 0:
                keep = _partial_marker(self.text, self.opening)
                visible = self.text[: len(self.text) - keep]
                if not visible.strip():
                    return []
                return self._content(visible)
            self.in_calls = True
        return self._complete_calls(final=False)

    def finish(self) -> list[StreamEvent]:
        """Events for what was held back when the reply ends."""
        content, calls = self.parser.parse(self.text)
        self.calls = calls
        if not calls:  # nothing parsed: the reply is content (all of it, unless the format says less),
            return self._content(content or "")  # whitespace too, as the whole answer has it
        events = self._content(content or "") if not self.calls_sent else []
        return events + self._calls(calls)

    def _content(self, upto: str) -> list[StreamEvent]:
        new = upto[self.content_sent:]
        self.content_sent = max(self.content_sent, len(upto))
        return [StreamEvent(content=new)] if new else []

    def _calls(self, calls: list[ParsedCall]) -> list[StreamEvent]:
        events = [StreamEvent(call=call, index=i) for i, call in enumerate(calls) if i >= self.calls_sent]
        self.calls_sent = max(self.calls_sent, len(calls))
        return events

    def _complete_calls(self, final: bool) -> list[StreamEvent]:
        """Calls that are complete before the reply ends (none in formats known only at the end)."""
        return []


class HermesParser:
    """`<tool_call>{...}</tool_call>` blocks; a block that is not a call of one of `names` is
    dropped, and blocks past the first `max_calls` calls.

    A block is read as JSON first and closed after it (`_hermes_block`), not cut at the first
    closing tag: a call whose arguments hold the text `</tool_call>` (an agent writing a file
    about tool calling) is that call, not the cut-off text of one (the reply was content)."""

    calls_finish = True
    only_calls = False

    OPENING, CLOSING = "<tool_call>", "</tool_call>"

    def __init__(self, names: Collection[str] | None = None, max_calls: int | None = None) -> None:
        self.names = names
        self.max_calls = max_calls

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        at, calls, _ = self._read(text)
        if not calls:
            return text, []
        content = text[:at]
        return (content if content.strip() else None), calls

    def cut_after_calls(self, text: str) -> bool:
        """Every call's block closed by its tag, and after the last one no block opened (a call
        under way, which the reply would lose) unless the reply has its `max_calls` already:
        what max_tokens cut is text the reply drops. (vLLM reports "tool_calls" for any reply
        with calls; a model that writes on after its calls until max_tokens is not rare.)"""
        _, calls, end = self._read(text)
        if not calls or not (end >= len(self.CLOSING) and text.startswith(self.CLOSING, end - len(self.CLOSING))):
            return False
        # (a cut inside the next opening tag, `<tool_ca`, may have cut a call short too)
        return len(calls) == self.max_calls or (text.find(self.OPENING, end) < 0
                                                 and not _partial_marker(text[end:], self.OPENING))

    def _read(self, text: str) -> tuple[int, list[ParsedCall], int]:
        """Where the first block opens (-1: none), the calls, and where the last call's block ends."""
        at = text.find(self.OPENING)
        calls: list[ParsedCall] = []
        end = after_last = max(at, 0)
        while at >= 0 and (self.max_calls is None or len(calls) < self.max_calls) and \
                (opening := text.find(self.OPENING, end)) >= 0:
            block = _hermes_block(text, opening + len(self.OPENING), final=True)
            assert block is not None  # (a final read always decides)
            source, end = block
            call = None if source is None else _call_from_json(source, "arguments", self.names)
            if call is not None:
                calls.append(call)
                after_last = end
        return at, calls, after_last

    def stream(self) -> ToolCallStream:
        return _HermesStream(self, self.OPENING)


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\r\n]*")


def _hermes_block(text: str, start: int, final: bool) -> tuple[str | None, int] | None:
    """The Hermes block whose opening tag ends at `start`: the JSON text of its call (None: the
    block is no JSON object closed by the closing tag, so no call) and where the text after
    the block begins. The object is decoded first and the closing tag expected after it; a
    block that is not so runs to the first closing tag (after the object, if one decoded) or
    the end of the text.
    An object the text ends in, unclosed, is the reply's last call when the reply ends
    (`final`). Not `final` (a stream's text so far), None while more text could change the
    answer; an answer given is the one the whole text gets (the stream emits its call at once)."""
    at = _SPACE.match(text, start).end()  # type: ignore[union-attr]  (matches any text, empty too)
    cut_from = start  # where the closing tag that ends a block of no call is looked for
    if at < len(text) and text[at] == "{":
        try:
            _, end = _DECODER.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):  # not JSON, or not yet whole, or nested past Python's stack
            end = -1
        if end >= 0:
            after = _SPACE.match(text, end).end()  # type: ignore[union-attr]
            if text.startswith(HermesParser.CLOSING, after):
                return text[at:end], after + len(HermesParser.CLOSING)
            if after == len(text):
                return (text[at:end], after) if final else None
            if not final and HermesParser.CLOSING.startswith(text[after:]):
                return None  # the closing tag may be under way
            cut_from = end  # (a closing tag inside the object's strings is text, not markup)
        elif not final:
            return None  # (an object cut short decodes no better than a wrong one)
    elif not final and at == len(text):
        return None
    closing = text.find(HermesParser.CLOSING, cut_from)
    if closing < 0:
        return (None, len(text)) if final else None
    return None, closing + len(HermesParser.CLOSING)


class _HermesStream(ToolCallStream):
    """Hermes blocks are complete at their closing tag: each call is emitted then.

    Incremental: a block is read when a closing tag arrives after it, and the blocks before it
    are never read again, so a reply of many calls costs time in proportion to its length
    (every block read again at every token took 11 s of the event loop for 200 calls). A block
    that is no call holds the calls after it until the reply ends (whether more text would
    make it JSON is not known before)."""

    def __init__(self, parser: HermesParser, opening: str) -> None:
        super().__init__(parser, opening)
        self.first = -1  # where the first opening tag is: the content ends there
        self.next = 0  # where the next block is looked for: after the last one read
        self.looked = 0  # how much of the text was looked through for a closing tag
        self.blank = 0  # the text before this is whitespace (held while nothing was sent)

    def feed(self, text: str) -> list[StreamEvent]:
        # Only the new text (and a tag it may complete) is looked through: the content before
        # a call may be long too.
        since = max(0, len(self.text) - len(self.opening) + 1)
        self.text += text
        if not self.in_calls:
            at = self.text.find(self.opening, since)
            if at < 0:  # content: streamed as it comes, but for an end that may begin the opening
                end = len(self.text) - _partial_marker(self.text, self.opening)
                if end == 0 or (not self.content_sent and self._blank_until(end)):
                    return []  # (only whitespace so far: held, the whole parse's content would be None)
                new = self.text[self.content_sent:end]
                self.content_sent = max(self.content_sent, end)
                return [StreamEvent(content=new)] if new else []
            self.in_calls = True
            self.first = self.next = at
        return self._complete_calls(final=False)

    def _blank_until(self, end: int) -> bool:
        """Whether the text before `end` is all whitespace, looking only past what was seen
        to be (a reply of 200,000 spaces took 5 s of the event loop, checked whole each time)."""
        if self.text[self.blank:end].isspace() or self.blank >= end:
            self.blank = max(self.blank, end)
            return True
        return False

    def _complete_calls(self, final: bool) -> list[StreamEvent]:
        parser: HermesParser = self.parser  # type: ignore[assignment]
        if not final:  # nothing is decided before a closing tag: look only when a new one came
            seen = self.text.find(parser.CLOSING, max(self.next, self.looked - len(parser.CLOSING) + 1))
            self.looked = len(self.text)
            if seen < 0:
                return []
        events: list[StreamEvent] = []
        while (parser.max_calls is None or len(self.calls) < parser.max_calls) and \
                (opening := self.text.find(parser.OPENING, self.next)) >= 0:
            block = _hermes_block(self.text, opening + len(parser.OPENING), final)
            if block is None:
                break
            source, self.next = block
            call = None if source is None else _call_from_json(source, "arguments", parser.names)
            if call is None:
                continue
            if not self.calls:  # the content before the first call, as the whole parse has it
                content = self.text[:self.first]
                events += self._content(content if content.strip() else "")
            self.calls.append(call)
            events += self._calls(self.calls)
        return events

    def finish(self) -> list[StreamEvent]:
        events = self._complete_calls(final=True) if self.in_calls else []
        if not self.calls:  # no call: the reply is content, all of it (whitespace too)
            return events + self._content(self.text)
        return events


class Llama3Parser:
    """Llama 3's JSON tool calls: the reply is one or more `{"name", "parameters"}` objects
    (of functions in `names`; else the reply is content), the first `max_calls` of them."""

    calls_finish = True
    only_calls = False

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, names: Collection[str] | None = None, max_calls: int | None = None) -> None:
        self.names = names
        self.max_calls = max_calls

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _json_objects(body):
            call = _call_from_json(part, "parameters", self.names)
            if call is None:
                return text, []
            calls.append(call)
        return (None, calls[:self.max_calls]) if calls else (text, [])

    def stream(self) -> ToolCallStream:
        return _Llama3Stream(self, self.PYTHON_TAG)

    def cut_after_calls(self, text: str) -> bool:
        return False  # the calls are the whole reply: the cut fell in them, or may have cut one short


class _Llama3Stream(ToolCallStream):
    """A reply is a call when it opens with "{" or the python tag: held to the end then."""

    def feed(self, text: str) -> list[StreamEvent]:
        self.text += text
        body = self.text.lstrip()
        if self.in_calls or body.startswith("{") or body.startswith(Llama3Parser.PYTHON_TAG):
            self.in_calls = True
            return []
        if not body or Llama3Parser.PYTHON_TAG.startswith(body):
            return []
        return self._content(self.text)


class NamedCallParser:
    """tool_choice naming a function: the reply, constrained to the function's parameters
    schema, is that call's arguments; they stream as they are generated."""

    calls_finish = False  # as OpenAI answers a named choice: "stop"
    only_calls = True

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        return None, [ParsedCall(self.name, text)]

    def stream(self) -> ToolCallStream:
        return _NamedStream(self, "")

    def cut_after_calls(self, text: str) -> bool:
        return False  # the calls are the whole reply: the cut fell in them, or may have cut one short


class _NamedStream(ToolCallStream):
    def feed(self, text: str) -> list[StreamEvent]:
        self.text += text
        events = [] if self.calls_sent else [StreamEvent(call=ParsedCall(self.parser.name, ""))]  # type: ignore[attr-defined]
        self.calls_sent = 1
        return events + ([StreamEvent(arguments=text)] if text else [])

    def finish(self) -> list[StreamEvent]:
        events = self.feed("") if not self.calls_sent else []
        self.calls = [ParsedCall(self.parser.name, self.text)]  # type: ignore[attr-defined]
        return events


class RequiredCallsParser:
    """tool_choice "required": the reply, constrained to a JSON array of
    `{"name": ..., "arguments": {...}}` objects (tools.required_calls_schema), is the calls.

    A reply cut short by max_tokens is still calls, never content (an agent would take the
    array's text for its answer): the complete items, then the one it was cut in, when its
    name is complete, with the arguments as far as they got — as a named tool_choice's call
    cut short is (finish_reason "length" says so). A reply that is no array of calls the
    server can use (one nested past what it parses, say) stays text, as in the other formats."""

    calls_finish = True
    only_calls = True

    _CUT_ITEM = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(.*)', re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        try:
            items, cut = parse_json_text(text), ""
        except ValueError:
            leading = _leading_items(text)
            if leading is None:
                return text, []  # not calls the server can use (nested too deeply, say): the text as it is
            items, cut = leading
        if not isinstance(items, list):
            return text, []
        calls = [ParsedCall(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False))
                 for item in items if isinstance(item, dict) and isinstance(item.get("name"), str)]
        if (match := self._CUT_ITEM.match(cut)) is not None:
            try:
                calls.append(ParsedCall(parse_json_text(match[1]), match[2]))
            except ValueError:
                pass  # the name itself is not JSON the server can use: no call to report
        return None, calls

    def stream(self) -> ToolCallStream:
        return _HeldStream(self, "")

    def cut_after_calls(self, text: str) -> bool:
        return False  # the calls are the whole reply: the cut fell in them, or may have cut one short


class _HeldStream(ToolCallStream):
    """Everything is held to the end of the reply."""

    def feed(self, text: str) -> list[StreamEvent]:
        self.text += text
        return []


def calls_complete(calls: list[ParsedCall]) -> bool:
    """Whether the reply made calls and each one's arguments are whole JSON: a stop string or
    stop token can end a constrained reply inside a call, as max_tokens can."""
    if not calls:
        return False
    try:
        for call in calls:
            parse_json_text(call.arguments)
    except ValueError:
        return False
    return True


def _leading_items(text: str) -> tuple[list[Any], str] | None:
    """The complete items of a JSON array cut short, and the text of the object or array it
    was cut in ("" if it was cut between items); None if the text is no such array or a
    complete item is not JSON the server can use. Found by scanning (strings and escapes
    respected), not by a recursive parser: a reply cut short may nest as deep as it got."""
    start = text.find("[")
    if start < 0 or text[:start].strip():
        return None
    items: list[Any] = []
    depth, in_string, escaped, item_at = 0, False, False, -1
    for at in range(start + 1, len(text)):
        char = text[at]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            if depth == 0:
                item_at = at
            depth += 1
        elif char in "}]":
            if depth == 0:  # the array's own end
                break
            depth -= 1
            if depth == 0:
                try:
                    items.append(parse_json_text(text[item_at:at + 1]))
                except ValueError:
                    return None
                item_at = -1
    return items, (text[item_at:] if item_at >= 0 else "")


def _json_objects(text: str) -> list[str]:
    """Top-level JSON values of `text` separated by ";" or whitespace."""
    decoder = json.JSONDecoder()
    parts, at = [], 0
    while at < len(text):
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at >= len(text):
            break
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return [text]  # not a sequence of values: the caller's parse fails on it
        parts.append(text[at:end])
        at = end
    return parts


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def make_parser(name: str, names: Collection[str] | None = None, max_calls: int | None = None) -> ToolCallParser:
    """The parser called `name` (one of PARSERS), of calls of the functions in `names` (None:
    any), at most `max_calls` of them (None: any number)."""
    if name == "hermes":
        return HermesParser(names, max_calls)
    if name == "llama3":
        return Llama3Parser(names, max_calls)
    raise ValueError(f"tool-call parser: one of {', '.join(PARSERS)}, got {name!r}")


def parser_for_template(template: str | None) -> str:
    """The parser for a chat template's tool-call format: Llama 3's JSON when the template
    speaks ipython, Hermes blocks otherwise (those are also what radixserve injects)."""
    if template and ("<|python_tag|>" in template or "Environment: ipython" in template):
        return "llama3"
    return "hermes"
