"""A chat request's tools: checked, put into the prompt, and turned into a constraint and a
parser of the reply (ToolPlan).

Into the prompt. Tools reach the model through its chat template, which receives them as the
`tools` variable (transformers' convention), and assistant tool calls and tool results as
message fields. A template that ignores `tools` (SmolLM2's ChatML, the demo model's) gets
them as vLLM and SGLang give them to such models: a Hermes-style block (`TOOL_BLOCK`) at the
end of the system message, or as the system message when there is none; assistant tool calls
become `<tool_call>` blocks in the message text and tool results `<tool_response>` blocks.
Both renderings are functions of the request alone (no date, no ids of the server's own), so
an agent that sends the same tools every step gets the same prompt prefix every step, and the
prefix cache serves it.

Out of the reply. tool_choice "auto" parses the reply with the model's format
(tool_parsers.py), keeping only calls of the request's tools (the first alone with
parallel_tool_calls false); "none" leaves it as content (the tools stay in the prompt, so the prefix
still matches the agent's other steps); "required" constrains the reply to a JSON array of
calls and a named choice to the function's arguments (radixserve/grammar), so the call is
well-formed whatever the model.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from radixserve.grammar import GrammarError, GrammarSpec
from radixserve.grammar.spec import MAX_SOURCE_CHARS
from radixserve.schema_check import schema_problem
from radixserve.server.errors import APIError
from radixserve.server.json_text import parse_json_text
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from radixserve.server.structured import grammar_error, json_schema_spec
from radixserve.server.tool_parsers import (
    NamedCallParser,
    RequiredCallsParser,
    ToolCallParser,
    make_parser,
)

TOOL_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_TOOLS = 128  # OpenAI's own limit on a request's functions
# Each tool's parameters are checked as a JSON Schema (time in proportion to their size, held
# within one schema's 64 KiB each); all of them together within four such schemas. (Under
# tool_choice "required" they make one schema together: 64 KiB in all.)
MAX_TOOLS_SCHEMA_CHARS = 4 * MAX_SOURCE_CHARS
_PROBE_TOOL = [{"type": "function", "function": {"name": "\ue004", "description": "",
                                                   "parameters": {"type": "object", "properties": {}}}}]


@dataclass(frozen=True)
class AutoCalls:
    """Under tool_choice "auto": the calls a reply may make, for the constraint they put on it
    beside what else the request asks (`constraint`)."""

    calls: list[tuple[str, GrammarSpec | None]]  # each tool's name and, if strict, its arguments' spec
    parallel: bool
    call_format: str  # the reply's parser: "hermes" or "llama3"

    def constraint(self, answer: tuple[GrammarSpec, str] | None) -> tuple[GrammarSpec, str] | None:
        """What the reply must match, and the field named if it cannot be compiled. Beside a
        `response_format` the request asks for (`answer`): that output, or calls of the tools
        (the OpenAI Agents SDK sends both for an agent with an output type and tools; the
        output's grammar alone left no way to call one). vLLM's guided_* fields constrain the
        whole reply, as in vLLM: their grammar is returned as it is. Else, with a strict tool
        in the Hermes format: free text whose calls are held to the tools' schemas (the llama3
        format's calls have no opening marker to trigger on). Else nothing."""
        if answer is not None and not answer[1].startswith("response_format"):
            return answer
        if answer is None and (self.call_format != "hermes" or all(spec is None for _, spec in self.calls)):
            return None
        try:  # (too long together: the tools' schemas are most of it, and the 400 names them)
            spec = GrammarSpec.tool_calls(self.calls, self.parallel, "tools", None if answer is None else answer[0],
                                          self.call_format)
            return spec, "tools" if answer is None else answer[1]
        except GrammarError as exc:
            raise grammar_error(exc) from None


@dataclass
class ToolPlan:
    """What a chat request's tools mean: `tools` for the template (None: no tools), the parser
    of its reply (None: plain content), the constraint tool_choice "required" or a named
    choice puts on the reply (`grammar`), and under "auto" the calls the reply may make
    (translate.chat_call constrains them unless the request asks for ignore_eos)."""

    tools: list[dict[str, Any]] | None = None
    parser: ToolCallParser | None = None
    grammar: tuple[GrammarSpec, str] | None = None
    auto_calls: AutoCalls | None = None


def plan_tools(request: ChatCompletionRequest, parser_name: str) -> ToolPlan:
    """Checks `tools`, `tool_choice` and the history's tool messages; 400s name the field."""
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(request, legacy) is not None:
            raise APIError(400, f"{legacy} (OpenAI's deprecated form) is not supported by radixserve; use {current}",
                           param=legacy, code="unsupported_parameter")
    check_tool_messages(request.messages)
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice: needs tools", param="tool_choice", code="invalid_value")
        return ToolPlan()
    if len(request.tools) > MAX_TOOLS:
        raise APIError(400, f"tools: at most {MAX_TOOLS}, got {len(request.tools)}", param="tools",
                       code="invalid_value")
    try:
        size = sum(len(json.dumps(tool.function.parameters)) for tool in request.tools)
    except RecursionError:  # nested deeper than json.dumps recurses: the request's doing, as in json_schema_spec
        raise APIError(400, "tools: a tool's parameters are nested too deeply", param="tools",
                       code="invalid_value") from None
    if size > MAX_TOOLS_SCHEMA_CHARS:
        raise APIError(400, f"tools: their parameters' schemas add up to {size} characters, at most "
                            f"{MAX_TOOLS_SCHEMA_CHARS}", param="tools", code="invalid_value")
    names = [tool.function.name for tool in request.tools]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: function names must be unique", param="tools", code="invalid_value")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice: no tool is named {choice.function.name[:64]!r}",
                       param="tool_choice.function.name", code="invalid_value")
    enforced = _enforced(request, names)
    specs = [_parameters(tool, i, i in enforced) for i, tool in enumerate(request.tools)]
    plan = ToolPlan(tools=[_template_tool(tool) for tool in request.tools])
    parallel = request.parallel_tool_calls is not False  # null: OpenAI's default, true
    if choice is None or choice == "auto":
        plan.parser = make_parser(parser_name, frozenset(names), None if parallel else 1)
        plan.auto_calls = AutoCalls(list(zip(names, specs)), parallel, parser_name)
    elif choice == "required":
        plan.parser = RequiredCallsParser()
        schema = required_calls_schema(names, [json.loads(spec.source) for spec in specs if spec is not None],
                                       parallel)
        size = len(json.dumps(schema))
        if size > MAX_SOURCE_CHARS:
            # One schema for all the calls: one schema's bound holds for every tool together,
            # where "auto" gives each tool its own (an unexplained "at most 65536" named no tool).
            raise APIError(400, f"tools: under tool_choice \"required\" every tool's parameters together make one "
                                f"schema, at most {MAX_SOURCE_CHARS} characters ({size} here); send fewer or "
                                f"smaller tools, or use \"auto\" ({MAX_SOURCE_CHARS} characters per tool, "
                                f"{MAX_TOOLS_SCHEMA_CHARS} together)", param="tools", code="invalid_value")
        plan.grammar = (json_schema_spec(schema, "tools"), "tools")
    elif isinstance(choice, NamedToolChoice):
        position = names.index(choice.function.name)
        plan.parser = NamedCallParser(choice.function.name)
        named = specs[position]
        assert named is not None  # `_enforced` has it
        plan.grammar = (named, f"tools[{position}].function.parameters")
    return plan


def _enforced(request: ChatCompletionRequest, names: list[str]) -> set[int]:
    """The positions of the tools whose parameters the grammar engine compiles for this
    request: under "auto" the strict ones, under "required" all, under a named choice that
    tool, under "none" none. Only those are held to what the engine supports; the others are
    only shown to the model, and, as OpenAI and vLLM take them, may be any valid JSON Schema."""
    choice = request.tool_choice
    assert request.tools is not None
    if choice is None or choice == "auto":
        return {i for i, tool in enumerate(request.tools) if tool.function.strict}
    if choice == "required":
        return set(range(len(request.tools)))
    if isinstance(choice, NamedToolChoice):
        return {names.index(choice.function.name)}
    return set()


def required_calls_schema(names: list[str], schemas: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more (one only, unless `parallel`) calls of the given tools. A
    tool's schema that refers within itself (`#/$defs/...`: pydantic writes one for every
    nested model) is kept whole under the array's `$defs`, its references rewritten to start
    there: nested as `arguments`, they pointed at the array (a 400, "cannot find $defs")."""
    definitions: dict[str, Any] = {}
    calls = []
    for i, (name, schema) in enumerate(zip(names, schemas)):
        if _refers_within(schema):
            definitions[f"tool{i}"] = _rerooted(schema, f"#/$defs/tool{i}")
            schema = {"$ref": f"#/$defs/tool{i}"}
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"]})
    array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                             "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    if definitions:
        array["$defs"] = definitions
    return array


def _refers_within(schema: Any) -> bool:
    if isinstance(schema, dict):
        return any((key == "$ref" and isinstance(value, str) and value.startswith("#")) or _refers_within(value)
                   for key, value in schema.items())
    return isinstance(schema, list) and any(_refers_within(item) for item in schema)


def _rerooted(schema: Any, root: str) -> Any:
    """`schema` with its references within itself ("#...") made to start at `root`."""
    if isinstance(schema, dict):
        return {key: root + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                else _rerooted(value, root) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_rerooted(item, root) for item in schema]
    return schema


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """Every tool message answers a call an earlier assistant message made."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        if message.tool_calls:
            if message.role != "assistant":
                raise APIError(400, f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                               param=f"messages[{i}].tool_calls", code="invalid_value")
            called.update(call.id for call in message.tool_calls)
        if message.role == "tool":
            if message.tool_call_id is None:
                raise APIError(400, f"messages[{i}].tool_call_id is required for role 'tool'",
                               param=f"messages[{i}].tool_call_id", code="missing_field")
            if message.tool_call_id not in called:
                raise APIError(400, f"messages[{i}].tool_call_id: no earlier assistant message made a tool "
                                    f"call with id {message.tool_call_id[:64]!r}",
                               param=f"messages[{i}].tool_call_id", code="invalid_value")


def _parameters(tool: Tool, position: int, enforced: bool) -> GrammarSpec | None:
    """The tool's parameters schema, checked: as a spec for the grammar engine when this
    request compiles it (`enforced`: a tool_choice or `strict` constrains the reply to it), else
    only as a JSON Schema (None): keywords the engine cannot honour do not matter in a schema
    it never compiles, and refusing them refused tools an agent only declares."""
    schema = tool.function.parameters if tool.function.parameters is not None else _ANY_OBJECT
    param = f"tools[{position}].function.parameters"
    if isinstance(schema, dict) and schema.get("type", "object") != "object":
        # Arguments are a JSON object (OpenAI refuses other types too): a string schema gave
        # raw text for arguments, which no client can parse.
        raise APIError(400, f"{param}: a tool's parameters must be a JSON Schema of type \"object\", "
                            f"not {json.dumps(schema['type'])}", param=param, code="invalid_value")
    if enforced:
        return json_schema_spec(schema, param)
    _check_json_schema(schema, param)
    return None


def _check_json_schema(schema: Any, param: str) -> None:
    """A 400 naming `param` unless `schema` is a valid JSON Schema (draft 2020-12) within the
    size of one that could be compiled: the same bounds as a compiled schema's first checks
    (its size first, as checking takes time in proportion to it; nesting past what the
    validator recurses through), none of the grammar engine's own."""
    try:
        source = json.dumps(schema)
    except RecursionError:
        raise APIError(400, f"{param}: the schema is nested too deeply", param=param, code="invalid_value") from None
    if len(source) > MAX_SOURCE_CHARS:
        raise APIError(400, f"{param}: at most {MAX_SOURCE_CHARS} characters", param=param, code="invalid_value")
    problem = schema_problem(schema, source)  # a large one in a child process, off the GIL
    if problem is not None:
        raise APIError(400, problem.describe(param), param=param, code="invalid_value")


def _template_tool(tool: Tool) -> dict[str, Any]:
    """A tool as templates read it (OpenAI's shape, unset fields left out)."""
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters if tool.function.parameters is not None else _ANY_OBJECT
    return {"type": "function", "function": function}


# ---------------------------------------------------------------- the prompt


@functools.lru_cache(maxsize=8)
def template_renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template writes the `tools` it is given (rendering with and without
    a probe tool differ)."""
    user = [{"role": "user", "content": "\ue000"}]
    try:
        with_tools = tokenizer.apply_chat_template(user, tools=_PROBE_TOOL, tokenize=False)
        without = tokenizer.apply_chat_template(user, tokenize=False)
    except Exception:  # a template that fails on tools cannot render them either
        return False
    return with_tools != without


def parser_template_mismatch(parser_name: str, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """Why the tool-call parser `parser_name` cannot read a model's calls under this tokenizer's
    chat template (a one-line startup error), or None. A template that ignores tools gets them
    in the Hermes block (`TOOL_BLOCK`), which asks for `<tool_call>` blocks: only the hermes
    parser reads those (with llama3 the calls came back as content, and strict tools went
    unenforced)."""
    if parser_name == "hermes" or template_renders_tools(tokenizer):
        return None
    return (f"--tool-call-parser {parser_name}: the chat template ignores tools, so they are given to the model "
            f"in a Hermes block that asks for <tool_call> blocks, which the {parser_name} parser does not read; "
            "use --tool-call-parser hermes (this template's default) or a chat template that renders tools")


def tool_block(tools: list[dict[str, Any]]) -> str:
    """The Hermes-style system text that gives `tools` to a template that ignores them."""
    return TOOL_BLOCK.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def conversation_message(message: ChatMessage, text: str, role: str, native: bool) -> dict[str, Any]:
    """One message for the template: tool calls and tool results as the template's own
    fields (`native`), or written into the text as Hermes blocks."""
    if native:
        entry: dict[str, Any] = {"role": role, "content": text}
        if message.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name,
                                                 "arguments": _arguments(call.function.arguments)}}
                                   for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        return entry
    if message.tool_calls:
        blocks = [f"<tool_call>\n{json.dumps({'name': c.function.name, 'arguments': _arguments(c.function.arguments)}, ensure_ascii=False)}\n</tool_call>"
                  for c in message.tool_calls]
        # As the model wrote it: text it ended with a newline before its first call ("Let me
        # add.\n<tool_call>...") gets no second one, so the generated turn is found again.
        lead = text if not text or text.endswith("\n") else text + "\n"
        text = lead + "\n".join(blocks)
    elif role == "tool":
        text = f"<tool_response>\n{text}\n</tool_response>"
    return {"role": role, "content": text}


def with_tool_block(conversation: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tool block closing its system message (or as one)."""
    block = tool_block(tools)
    if conversation and conversation[0]["role"] == "system":
        first = dict(conversation[0], content=f"{conversation[0]['content']}\n\n{block}")
        return [first, *conversation[1:]]
    return [{"role": "system", "content": block}, *conversation]


def _arguments(arguments: str) -> Any:
    """Arguments as templates expect them (an object); text that is not JSON the server can
    use (`parse_json_text`) stays text."""
    try:
        return parse_json_text(arguments)
    except ValueError:
        return arguments
