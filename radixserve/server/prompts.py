"""Chat messages → prompt token ids, and how many of them belong to the system prompt.

Two things make the ids cache well across the turns of a conversation:
- assistant messages whose text a completion of this server generated (in the same cache
  scope) are spliced in as the ids the model generated, not re-encoded (turns.py says why);
- a template that injects a default system prompt when the messages have none (SmolLM2's,
  Qwen's) has that injected block counted as system prompt, so `system_retention_priority`
  protects it as it protects one the client sent.

A request's tools go to the template as its `tools` variable, or, for a template that ignores
them, into the system message (tools.py says how).

What the client wrote stays text: a special token's string inside a message, a tool's output
or a tool's definition (`<|im_end|>`, `<|im_start|>system`) is encoded as the characters it
is, never as the token, so no pasted page or tool result can close a turn or open a system
one (OpenAI's API does not let it either; transformers' chat templates, encoded whole, do).
Each occurrence in the client's strings becomes a private-use placeholder before rendering,
and the rendered text is encoded piece by piece around the placeholders, each spelled out
as plain text; without one the encoding is exactly the tokenizer's own.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Hashable
from typing import Any

import msgspec
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from radixserve.server.errors import APIError
from radixserve.server.prompt_work import refuse_by_prefix
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage, RefusalPart
from radixserve.server.tools import conversation_message, template_renders_tools, with_tool_block
from radixserve.server.turns import GeneratedTurns

_SYSTEM_ROLES = ("system", "developer")
# Private-use characters: no client text or template contains them by accident.
_PROBE_USER, _PROBE_SYSTEM = "\ue000", "\ue001"
_MARK_OPEN, _MARK_CLOSE = "\ue002", "\ue003"
_SPELL_OPEN, _SPELL_CLOSE = "\ue004", "\ue005"  # around the number of a client string spelled out

# The markup a chat template writes around one message (ChatML: `<|im_start|>user\n` and
# `<|im_end|>\n`, 28 characters) and around one tool call's name and arguments (the Hermes
# block's `<tool_call>\n{"name": "", "arguments": }\n</tool_call>\n`, 53; Qwen's templates
# write the same), counted in a chat's size (`rendered_chars`) a little under what they render,
# so that a crowd of tiny messages or calls is as large as the work it makes, and no legitimate
# history counts more than it renders.
MESSAGE_MARKUP_CHARS = 16
TOOL_CALL_MARKUP_CHARS = 48

Conversation = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None


class ChatRenderer:
    """Renders chat requests for one tokenizer, with an optional memory of generated turns."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, turns: GeneratedTurns | None = None, *,
                 max_prompt_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        # A prompt of more spelled-out strings than this is refused unencoded: each is a token
        # at least, and encoding them is work per string (the context's length, when serving).
        self.max_prompt_tokens = max_prompt_tokens

    def render(self, messages: list[ChatMessage], scope: Hashable = None,
               tools: Tools = None) -> tuple[list[int], int]:
        """Renders `messages` (and `tools`, OpenAI's function tools) with the chat template and
        a generation prompt.

        Returns the prompt's token ids and the number of leading tokens that the system
        message(s) alone render to — or, without one, the system block the template injects
        (0 if it injects none): the part of the prompt shared by every conversation with the
        same system prompt. `scope` is the request's cache scope, for generated turns.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "This model has no chat template; use /v1/completions instead.",
                           param="messages", code="no_chat_template")
        if self.max_prompt_tokens is not None:
            _refuse_by_count(messages, self.max_prompt_tokens)
        native = bool(tools) and template_renders_tools(self.tokenizer)
        conversation = [_as_dict(message, i, native) for i, message in enumerate(messages)]
        if tools and not native:
            conversation = with_tool_block(conversation, tools)
        tools = tools if native else None
        literal = _Literal.of(self.tokenizer)
        written = [message.get("content") for message in conversation]  # as the client wrote them
        conversation, tools = literal.defuse(conversation), literal.defuse(tools)
        text = _render(self.tokenizer, conversation, add_generation_prompt=True, tools=tools)
        if self.max_prompt_tokens is not None:  # (placeholders left out: they spell to a token or more)
            refuse_by_prefix(functools.partial(self.tokenizer.encode, add_special_tokens=False),
                             literal.without_placeholders(text), self.max_prompt_tokens, "messages")
        prompt_ids = self._encode_turns(conversation, text, scope, tools, written)
        num_system = 0
        while num_system < len(conversation) and conversation[num_system]["role"] == "system":
            num_system += 1
        if num_system:
            system_text = _render(self.tokenizer, conversation[:num_system], add_generation_prompt=False,
                                  tools=tools)
        else:
            system_text = injected_system_text(self.tokenizer)
            if not system_text or not text.startswith(system_text):
                return prompt_ids, 0
        # Templates may close the system block differently when nothing follows it, and BPE may
        # merge across the boundary: only the tokens both renderings share count as the prefix.
        return prompt_ids, _shared_prefix(self._encode(system_text), prompt_ids)

    def _encode(self, text: str) -> list[int]:
        # The template already wrote BOS and friends: no special tokens added here.
        if _SPELL_OPEN not in text:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return _Literal.of(self.tokenizer).encode(text, self.max_prompt_tokens)

    def _encode_turns(self, conversation: Conversation, text: str, scope: Hashable, tools: Tools,
                      written: list[Any]) -> list[int]:
        """`text` encoded, with the ids of generated turns spliced in where the assistant
        messages hold their exact text; plain encoding when the template does not render
        those messages verbatim."""
        if self.turns is None:
            return self._encode(text)
        known: dict[int, list[int]] = {}
        for i, message in enumerate(conversation):
            if message["role"] == "assistant" and message["content"]:
                ids = self.turns.recall(scope, written[i])  # generated text, special strings and all
                if ids is not None:
                    known[i] = ids
        if not known:
            return self._encode(text)
        marks = {i: f"{_MARK_OPEN}{i}{_MARK_CLOSE}" for i in known}
        marked = [dict(m, content=marks[i]) if i in known else m for i, m in enumerate(conversation)]
        marked_text = _render(self.tokenizer, marked, add_generation_prompt=True, tools=tools)
        pieces: list[str] = []
        rest = marked_text
        for i in known:
            before, found, rest = rest.partition(marks[i])
            if not found:
                return self._encode(text)
            pieces += [before, conversation[i]["content"]]
        if "".join(pieces) + rest != text:  # the template changed a message (trimmed it, say)
            return self._encode(text)
        ids: list[int] = []
        for (before, _), turn_ids in zip(zip(pieces[::2], pieces[1::2]), known.values()):
            ids += self._encode(before) + turn_ids
        return ids + self._encode(rest)


class _Literal:
    """The strings of one tokenizer that a client's text must not turn into tokens (its
    special added tokens, and the placeholder's own opening character), and how they are
    spelled out (see the module)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        specials = {added.content for added in tokenizer.added_tokens_decoder.values() if added.special}
        # Spelled out: the specials, longest first (one inside another is replaced as the
        # longer), and, last, the placeholder's opening where a client's text writes a whole
        # placeholder (a lone U+E004 is harmless and stays itself, at no cost).
        self.strings = sorted(specials - {""}, key=len, reverse=True) + [_SPELL_OPEN]
        self._replace = [(string, f"{_SPELL_OPEN}{i}{_SPELL_CLOSE}") for i, string in enumerate(self.strings[:-1])]
        self._forged = re.compile(f"{_SPELL_OPEN}(?=\\d+{_SPELL_CLOSE})")
        self._escape_forged = f"{_SPELL_OPEN}{len(self.strings) - 1}{_SPELL_CLOSE}"
        self._find = re.compile("|".join([*map(re.escape, self.strings[:-1]), self._forged.pattern]))
        self._placeholder = re.compile(f"{_SPELL_OPEN}(\\d+){_SPELL_CLOSE}")
        # Whether every string is written as itself inside a JSON string (no quote, backslash
        # or control character in it): then a value's JSON holds one of them exactly when one
        # of the value's strings does, and one search of it answers for the whole value.
        self._whole_in_json = all(msgspec.json.encode(string)[1:-1].decode() == string for string in self.strings)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def of(tokenizer: PreTrainedTokenizerBase) -> _Literal:
        """The (cached) strings of `tokenizer`."""
        return _Literal(tokenizer)

    def defuse(self, value: Any) -> Any:
        """`value` (a conversation, tools: strings in dicts and lists, keys included) with
        every occurrence of the strings replaced by its placeholder (`value` itself when it
        holds none)."""
        if self._whole_in_json and not isinstance(value, str):
            # Nearly every conversation holds none: one search of its JSON, written in C, says
            # so, where walking it searched each string in turn (and copied every dict and
            # list): 7,000 one-character messages took ~15 ms of the GIL to walk.
            try:
                text = msgspec.json.encode(value).decode()
            except (TypeError, ValueError, OverflowError, msgspec.MsgspecError):  # not JSON's types
                text = None
            if text is not None and self._find.search(text) is None:
                return value
        return self._defused(value)

    def _defused(self, value: Any) -> Any:
        if isinstance(value, str):
            if self._find.search(value) is None:  # nearly always: the string as it is
                return value
            # Replaced in C, whatever their number (a Python call per occurrence, with the GIL
            # held, slowed every other tenant's requests); the forged placeholders first.
            value = self._forged.sub(self._escape_forged, value)
            for string, placeholder in self._replace:
                value = value.replace(string, placeholder)
            return value
        if isinstance(value, dict):
            return {self._defused(key): self._defused(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self._defused(item) for item in value]
        return value

    def without_placeholders(self, text: str) -> str:
        """`text` with its placeholders taken out."""
        return self._placeholder.sub("", text) if _SPELL_OPEN in text else text

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Rendered `text`: the template's own pieces encoded as the tokenizer does, each
        placeholder as the plain characters of its string (pieces in one batch); a 400 when it
        holds more placeholders than `max_tokens`, which it could not fit."""
        pieces = self._placeholder.split(text)  # text, number, text, number, ..., text
        if max_tokens is not None and len(pieces) // 2 > max_tokens:
            raise APIError(400, f"The messages hold {len(pieces) // 2} special tokens' strings, each encoded as "
                                f"text: more tokens than this model's context of {max_tokens} tokens could hold.",
                           param="messages", code="context_length_exceeded")
        encoded = self.tokenizer(pieces[0::2], add_special_tokens=False)["input_ids"]
        ids: list[int] = list(encoded[0])
        for number, after in zip(pieces[1::2], encoded[1:]):
            ids += self._spelled(int(number))
            ids += after
        return ids

    @functools.cache  # noqa: B019 (one per tokenizer, few strings: kept with it)
    def _spelled(self, index: int) -> list[int]:
        return list(self.tokenizer.encode(self.strings[index], add_special_tokens=False, split_special_tokens=True))


def rendered_chars(request: ChatCompletionRequest) -> int:
    """The size of rendering the request's chat prompt, in characters: every string of the
    request's own that the chat template renders (the messages' contents and names, their tool
    calls' ids, names and arguments, tool messages' call ids, the tools' names, descriptions and
    parameter schemas), and the markup the template writes around each message
    (MESSAGE_MARKUP_CHARS) and each tool call (TOOL_CALL_MARKUP_CHARS). A prompt's length is
    checked on all of it, before any of it is converted or rendered: each message and each call
    is Python work (a call's arguments are parsed, the template loops over it) that a count of
    the strings alone missed (80,000 calls of empty name and one-character arguments counted
    80,000, under the demo model's 122,880, and took 0.7 s of the GIL to convert before the
    prompt was refused anyway)."""
    total = 0
    for message in request.messages:
        total += MESSAGE_MARKUP_CHARS + len(message.text()) + len(message.name or "") + \
            len(message.tool_call_id or "")
        for call in message.tool_calls or ():
            total += TOOL_CALL_MARKUP_CHARS + len(call.id) + len(call.function.name) + len(call.function.arguments)
    for tool in request.tools or ():
        function = tool.function
        total += len(function.name) + len(function.description or "") + \
            (len(msgspec.json.encode(function.parameters)) if function.parameters else 0)
    return total


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage]) -> tuple[list[int], int]:
    """`ChatRenderer(tokenizer).render(messages)`: without generated turns."""
    return ChatRenderer(tokenizer).render(messages)


@functools.lru_cache(maxsize=8)
def injected_system_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The system block the template writes when the messages have none ("" if it writes none).

    Three renderings find it: a system message alone (its opening and closing around the
    system text), one user message (U), and the two together (S). U begins with the
    system block's opening exactly when the template injects one; the block then ends
    where the user message's opening (what follows the closing in S) begins in U.
    """
    user = {"role": "user", "content": _PROBE_USER}
    system = {"role": "system", "content": _PROBE_SYSTEM}
    try:
        alone = _render(tokenizer, [user], add_generation_prompt=False)
        both = _render(tokenizer, [system, user], add_generation_prompt=False)
        only = _render(tokenizer, [system], add_generation_prompt=False)
    except Exception:  # any template failure on the probes: count no injected block
        return ""
    opening, _, between = both.partition(_PROBE_SYSTEM)  # between: closing + user opening
    between = between[: between.find(_PROBE_USER)]
    # Templates may close a block differently when nothing follows: the closing is what the
    # system message alone and the pair agree on after the system text.
    closing = _common_prefix(only.partition(_PROBE_SYSTEM)[2], between)
    user_opening = between[len(closing):]
    before_user = alone[: alone.find(_PROBE_USER)]
    if not opening.strip() or not closing or not alone.startswith(opening) \
            or not before_user.endswith(closing + user_opening):
        return ""
    return before_user[: len(before_user) - len(user_opening)]


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _shared_prefix(a: list[int], b: list[int]) -> int:
    shared = 0
    for x, y in zip(a, b):
        if x != y:
            break
        shared += 1
    return shared


def _refuse_by_count(messages: list[ChatMessage], max_tokens: int) -> None:
    """A 400 (`context_length_exceeded`) for more messages and tool calls than `max_tokens`,
    before any is converted or rendered: every template writes each of them as a token or
    more (its role's markup, a call's opening), so they could not fit the context. The size
    check counts them in characters, against the context at the vocabulary's longest token
    (twice: 1.3M characters on SmolLM2, ~80,000 tiny messages, a second of Python to render);
    this holds their number, and so the template's work, to the context's."""
    count = len(messages) + sum(len(message.tool_calls) for message in messages if message.tool_calls)
    if count > max_tokens:
        raise APIError(400, f"The messages hold {count} messages and tool calls, each rendered as a token or more: "
                            f"more than this model's context of {max_tokens} tokens could hold.",
                       param="messages", code="context_length_exceeded")


def _as_dict(message: ChatMessage, position: int, native_tools: bool = False) -> dict[str, Any]:
    if message.content is None and message.role != "assistant":
        raise APIError(400, f"messages[{position}].content is required for role {message.role!r}",
                       param=f"messages[{position}].content", code="missing_field")
    if message.role != "assistant" and isinstance(message.content, list):
        for part_index, part in enumerate(message.content):
            if isinstance(part, RefusalPart):
                raise APIError(400, f"messages[{position}].content[{part_index}]: a refusal part is an assistant's",
                               param=f"messages[{position}].content[{part_index}].type", code="invalid_value")
    # OpenAI's "developer" role is the newer name of "system"; templates know only the latter.
    role = "system" if message.role in _SYSTEM_ROLES else message.role
    if message.tool_calls or message.role == "tool":
        entry = conversation_message(message, message.text(), role, native_tools)
    else:
        entry = {"role": role, "content": message.text()}
    if message.name is not None:  # a participant's name, for templates that write it (most ignore it)
        entry["name"] = message.name
    return entry


def _render(tokenizer: PreTrainedTokenizerBase, conversation: Conversation, *, add_generation_prompt: bool,
            tools: Tools = None) -> str:
    # Render to text, then encode apart: transformers 5.x returns a BatchEncoding from tokenize=True.
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, tools=tools,
                                             add_generation_prompt=add_generation_prompt)
    except TemplateError as exc:  # templates reject some conversations (e.g. role order)
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages",
                       code="invalid_messages") from exc
