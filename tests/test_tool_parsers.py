"""Tool calls out of the reply (tool_parsers.py) and into the prompt (tools.py): streaming
agrees with whole parsing however the text is cut; templates that ignore tools get the Hermes
block, byte-stable; templates that render tools get them as `tools`."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve.models.demo import demo_checkpoint_dir
from radixserve.server.errors import APIError
from radixserve.server.prompts import ChatRenderer
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage
from radixserve.server.tool_parsers import (
    HermesParser,
    Llama3Parser,
    NamedCallParser,
    RequiredCallsParser,
    ToolCallParser,
    parser_for_template,
)
from radixserve.server.tools import plan_tools, required_calls_schema, template_renders_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
HERMES_REPLIES = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>',
    "\n\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"q\": \"<tool_call>\"}}\n</tool_call>",
    "No tools needed: the answer is 4.",
    "Broken <tool_call>\n{not json}\n</tool_call>",
    "<tool",
    "<tool_call>\n{\"name\": \"unclosed\", \"arguments\": {\"k\": 1}}",
    " \n\n ",  # only whitespace: content, whole and streamed alike
    # arguments holding the markup itself (a coding agent writing about tool calls)
    '<tool_call>\n{"name": "a", "arguments": {"s": "x</tool_call>y"}}\n</tool_call>',
    'Ok.\n<tool_call>\n{"name": "a", "arguments": {"s": "</tool_call>\\n<tool_call>\\n{}"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "</tool_call>"}}</tool_call> trailing',
    # a block that is no call, then a call; an object with text between it and the closing tag
    '<tool_call>\n{nope</tool_call>\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}} extra</tool_call><tool_call>{"name": "a", "arguments": {"k": 2}}</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {"k": 1}}\n</tool_',  # cut in the closing tag
    '<tool_call>\n["a"]\n</tool_call>',
    # an object holding the closing tag, then text before the real one: no call, and the block
    # ends at the tag after the object (the tag inside its string is text)
    '<tool_call>{"name": "a", "arguments": {"s": "</tool_call><tool_call>"}} x</tool_call>'
    '<tool_call>{"name": "a", "arguments": {}}</tool_call>',
]
LLAMA_REPLIES = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}',
    "Plain words, no call.",
    '{"name": 3}',
    "  <|python",
    "\n ",
]


def streamed(parser: ToolCallParser, text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and (name, arguments) of the calls, assembled from a stream cut at `cuts`."""
    stream = parser.stream()
    events = []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for piece in pieces:
        events += stream.feed(piece)
    events += stream.finish()
    content = "".join(e.content for e in events) or None
    calls: dict[int, list[str]] = {}
    for e in events:
        if e.call is not None:
            calls[e.index] = [e.call.name, e.call.arguments]
        elif e.arguments:
            calls[e.index][1] += e.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def whole(parser: ToolCallParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parser.parse(text)
    return content, [(c.name, c.arguments) for c in calls]


DECLARED = frozenset({"get_weather", "a"})  # the request's tools: "b" and "unclosed" are not among them
REQUIRED_REPLIES = [
    '[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"s": "a]}"}}]',
    '[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"s": "a]}',  # cut in g's arguments
    '[{"name": "f", "arguments": {"x": [1, {"y": 2}]}}, {"na',  # cut in g's name
    '[{"name": "f", "argu',
    "[",
]


@pytest.mark.parametrize(("parser", "text"), [(HermesParser(), t) for t in HERMES_REPLIES]
                         + [(HermesParser(DECLARED), t) for t in HERMES_REPLIES]
                         + [(HermesParser(None, 1), t) for t in HERMES_REPLIES]
                         + [(Llama3Parser(), t) for t in LLAMA_REPLIES]
                         + [(Llama3Parser(DECLARED, 1), t) for t in LLAMA_REPLIES]
                         + [(RequiredCallsParser(), t) for t in REQUIRED_REPLIES]
                         + [(NamedCallParser("f"), '{"a": 1}'), (NamedCallParser("f"), "")])
def test_streaming_assembles_to_the_whole_parse(parser: ToolCallParser, text: str) -> None:
    expected = whole(parser, text)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 8)))) if len(text) > 1 else []
        assert streamed(parser, text, cuts) == expected, cuts
    assert streamed(parser, text, list(range(1, len(text)))) == expected  # a character at a time


def test_hermes_parses_calls_and_content() -> None:
    content, calls = HermesParser().parse(HERMES_REPLIES[0])
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")
    assert HermesParser().parse(HERMES_REPLIES[3]) == (HERMES_REPLIES[3], [])
    assert HermesParser().parse(HERMES_REPLIES[4]) == (HERMES_REPLIES[4], [])  # bad JSON: all content
    _, two = HermesParser().parse(HERMES_REPLIES[1])
    assert [c.name for c in two] == ["a", "b"] and two[0].id != two[1].id


def test_only_calls_of_the_requests_tools_count() -> None:
    # A block naming a function the request did not declare is no call: dropped beside real
    # calls, and a reply whose only call is undeclared is content (an agent would fail on it).
    _, calls = HermesParser(DECLARED).parse(HERMES_REPLIES[1])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {})]
    assert HermesParser(DECLARED).parse(HERMES_REPLIES[6]) == (HERMES_REPLIES[6], [])
    assert Llama3Parser(DECLARED).parse(LLAMA_REPLIES[1]) == (LLAMA_REPLIES[1], [])  # "b" is not declared
    assert [c.name for c in Llama3Parser(DECLARED).parse(LLAMA_REPLIES[0])[1]] == ["get_weather"]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    assert [c.name for c in HermesParser(None, 1).parse(HERMES_REPLIES[1])[1]] == ["a"]
    assert [c.name for c in Llama3Parser(None, 1).parse(LLAMA_REPLIES[1])[1]] == ["a"]
    assert plan_tools(chat(tools=[WEATHER], parallel_tool_calls=False), "hermes").parser.max_calls == 1
    for parallel in (True, None):  # null is OpenAI's default: any number
        plan = plan_tools(chat(tools=[WEATHER], parallel_tool_calls=parallel), "hermes")
        assert plan.parser.max_calls is None and plan.parser.names == {"get_weather"}


def test_a_required_reply_cut_short_is_still_calls() -> None:
    # max_tokens can cut the constrained array anywhere: the complete calls, then the one it
    # was cut in (once its name is complete) with its arguments so far; never the text as content.
    parse = RequiredCallsParser().parse
    assert [(c.name, c.arguments) for c in parse(REQUIRED_REPLIES[0])[1]] == \
        [("f", '{"x": 1}'), ("g", '{"s": "a]}"}')]
    assert parse(REQUIRED_REPLIES[1])[0] is None
    assert [(c.name, c.arguments) for c in parse(REQUIRED_REPLIES[1])[1]] == [("f", '{"x": 1}'), ("g", '{"s": "a]}')]
    assert [(c.name, c.arguments) for c in parse(REQUIRED_REPLIES[2])[1]] == [("f", '{"x": [1, {"y": 2}]}')]
    assert parse(REQUIRED_REPLIES[3]) == (None, []) and parse(REQUIRED_REPLIES[4]) == (None, [])


@pytest.mark.parametrize("arguments", ['[1, 2]', "null", '"not an object"', "3", '"[1, 2]"'])
def test_arguments_that_are_not_an_object_stay_text(arguments: str) -> None:
    """OpenAI's clients parse a call's `arguments` as an object: a block whose arguments are
    an array, null, a number or a string that is not an object's JSON is the text it is."""
    block = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    assert HermesParser().parse(block) == (block, [])
    assert streamed(HermesParser(), block, list(range(1, len(block)))) == (block, [])
    line = f'{{"name": "get_weather", "parameters": {arguments}}}'
    assert Llama3Parser().parse(line) == (line, [])
    as_text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
    assert [(c.name, c.arguments) for c in HermesParser().parse(as_text)[1]] == [("get_weather", '{"city": "Oslo"}')]


def test_arguments_keep_their_characters() -> None:
    """Arguments re-serialized from a call's object keep non-ASCII characters as they are
    (as the model wrote them), not as \\u escapes."""
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🙂"}}\n</tool_call>'
    assert [c.arguments for c in HermesParser().parse(block)[1]] == ['{"city": "Zürich 🙂"}']
    assert [c.arguments for c in Llama3Parser().parse('{"name": "a", "parameters": {"s": "ß"}}')[1]] == ['{"s": "ß"}']
    assert [c.arguments for c in RequiredCallsParser().parse('[{"name": "f", "arguments": {"s": "é"}}]')[1]] == \
        ['{"s": "é"}']


def test_llama3_parses_json_calls() -> None:
    _, calls = Llama3Parser().parse(LLAMA_REPLIES[1])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {}), ("b", {"y": 2})]
    assert Llama3Parser().parse(LLAMA_REPLIES[3]) == (LLAMA_REPLIES[3], [])


def test_the_parser_follows_the_template() -> None:
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3"
    assert parser_for_template("<tool_call>") == parser_for_template(None) == "hermes"


@pytest.fixture(scope="module")
def demo_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(demo_checkpoint_dir()))


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def test_a_template_without_tools_gets_the_hermes_block_byte_stable(demo_tokenizer: PreTrainedTokenizerBase) -> None:
    assert not template_renders_tools(demo_tokenizer)
    renderer = ChatRenderer(demo_tokenizer)
    plan = plan_tools(chat(tools=[WEATHER]), "hermes")
    first = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Weather in Paris?")]
    ids1, system1 = renderer.render(first, tools=plan.tools)
    text = demo_tokenizer.decode(ids1)
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text
    assert text.index("Be brief.") < text.index("<tools>") < text.index("Weather in Paris?")
    # The next step of the agent: its call and the tool's answer appended.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    later = first + [msgspec.convert({"role": "assistant", "content": None, "tool_calls": [call]}, ChatMessage),
                     ChatMessage(role="tool", content="18 C", tool_call_id="call_1")]
    ids2, system2 = renderer.render(later, tools=plan_tools(chat(tools=[WEATHER]), "hermes").tools)
    assert system2 == system1 > 0
    assert ids2[:system1] == ids1[:system1]  # the tool block is a shared prefix
    text2 = demo_tokenizer.decode(ids2)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text2
    assert "<tool_response>\n18 C\n</tool_response>" in text2


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_tools_renders_them_itself(demo_tokenizer: PreTrainedTokenizerBase) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(demo_checkpoint_dir()))
    tokenizer.chat_template = QWEN_LIKE
    assert template_renders_tools(tokenizer)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [ChatMessage(role="user", content="Weather?"),
                msgspec.convert({"role": "assistant", "content": None, "tool_calls": [call]}, ChatMessage),
                ChatMessage(role="tool", content="3 C", tool_call_id="c1")]
    ids, _ = ChatRenderer(tokenizer).render(messages, tools=plan_tools(chat(tools=[WEATHER]), "hermes").tools)
    text = tokenizer.decode(ids)
    assert "TOOLS:get_weather;" in text and 'CALL get_weather {"city": "Oslo"}' in text and "<tools>" not in text


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"not": {}}}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x", "tool_call_id": "c9"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
])
def test_tool_errors_name_the_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as caught:
        plan_tools(chat(**fields), "hermes")
    assert caught.value.status == 400 and caught.value.param == param


def test_required_calls_schema_shapes() -> None:
    one = required_calls_schema(["f"], [{"type": "object"}], parallel=False)
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"] == {"const": "f"}
    many = required_calls_schema(["f", "g"], [{"type": "object"}] * 2, parallel=True)
    assert "maxItems" not in many and len(many["items"]["anyOf"]) == 2


CLOSING_IN_ARGUMENTS = {"path": "notes.md", "content": "Close a call with </tool_call>, open one with <tool_call>."}


def test_a_call_whose_arguments_hold_the_markup_is_that_call() -> None:
    """The block's JSON is read before its closing tag is looked for: cut at the first
    `</tool_call>`, the call was lost and the whole reply came back as content."""
    arguments = json.dumps(CLOSING_IN_ARGUMENTS)
    text = (f'Writing it.\n<tool_call>\n{{"name": "write_file", "arguments": {arguments}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "a", "arguments": {"q": "<tool_call>"}}\n</tool_call>')
    parser = HermesParser(frozenset({"write_file", "a"}))
    expected = ("Writing it.\n", [("write_file", arguments), ("a", '{"q": "<tool_call>"}')])
    assert whole(parser, text) == expected
    assert streamed(parser, text, list(range(1, len(text)))) == expected
    assert streamed(parser, text, [text.index("</tool_call>") + 3]) == expected


def test_the_hermes_stream_reads_each_block_once() -> None:
    """200 calls fed 4 characters at a time: each block is decoded once, when its closing tag
    arrives, and turned into a call once (the text up to the last closing tag was parsed again
    at every piece: quadratic, 11 s of the event loop for these 200 calls). Counted, not timed."""
    import radixserve.server.tool_parsers as tool_parsers

    call = '<tool_call>\n{"name": "f", "arguments": {"x": "%s"}}\n</tool_call>\n'
    text = "".join(call % ("a" * 40) for _ in range(200))
    counts = {"calls": 0, "decodes": 0}
    real_call, real_decoder = tool_parsers._call_from_json, tool_parsers._DECODER

    def counting_call(*args: object) -> object:
        counts["calls"] += 1
        return real_call(*args)  # type: ignore[arg-type]

    class CountingDecoder:
        def raw_decode(self, s: str, at: int) -> tuple[object, int]:
            counts["decodes"] += 1
            return real_decoder.raw_decode(s, at)

    mp = pytest.MonkeyPatch()
    mp.setattr(tool_parsers, "_call_from_json", counting_call)
    mp.setattr(tool_parsers, "_DECODER", CountingDecoder())
    try:
        stream = HermesParser(frozenset({"f"})).stream()
        events = [e for at in range(0, len(text), 4) for e in stream.feed(text[at:at + 4])] + stream.finish()
    finally:
        mp.undo()
    assert sum(e.call is not None for e in events) == 200
    assert counts == {"calls": 200, "decodes": 200}
