"""Tools and structured outputs through the official `openai` client against a real uvicorn
server on the demo model: tool calls whole and streamed (the deltas assemble to the whole
answer), tool_choice each way, a tool result sent back, response_format and vLLM's guided
fields, and the 400s that name the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import jsonschema
import openai
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two small numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
USER = [{"role": "system", "content": "You are a helpful assistant with tools."},
        {"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
# A grammar that makes the random model write a Hermes tool call, so that "auto" parsing is
# exercised end to end (a real model writes these by itself).
HERMES_GRAMMAR = ('root ::= "<tool_call>\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": " [1-9] '
                  '", \\"b\\": " [1-9] "}}\\n</tool_call>"')
COMMON: dict[str, Any] = {"model": "demo", "max_tokens": 300}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    engine = Engine(model="demo", page_size=16, num_pages=1024)
    app = create_app(AsyncEngine(engine))
    with running_server(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    engine.check_invariants()


def assembled(stream: Iterator[Any]) -> list[dict[str, Any]]:
    """Each choice of a stream, put together from its deltas: content, tool calls, finish."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            entry = choices.setdefault(choice.index, {"content": None, "tool_calls": {}, "finish_reason": None})
            delta = choice.delta
            if delta.content:
                entry["content"] = (entry["content"] or "") + delta.content
            for call in delta.tool_calls or ():
                slot = entry["tool_calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id:
                    assert slot["id"] is None and call.function.name, "id and name come first, once"
                    slot["id"], slot["name"] = call.id, call.function.name
                else:
                    assert slot["id"] is not None, "arguments before the call's name"
                slot["arguments"] += call.function.arguments or ""
            entry["finish_reason"] = choice.finish_reason or entry["finish_reason"]
    return [{"content": c["content"], "finish_reason": c["finish_reason"],
             "tool_calls": [(t["name"], t["arguments"]) for _, t in sorted(c["tool_calls"].items())]}
            for _, c in sorted(choices.items())]


def whole(response: Any) -> list[dict[str, Any]]:
    return [{"content": c.message.content or None, "finish_reason": c.finish_reason,
             "tool_calls": [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()]}
            for c in response.choices]


def both(client: openai.OpenAI, **request: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The same seeded request, non-streaming and streaming."""
    request = {**COMMON, "messages": USER, **request}
    return whole(client.chat.completions.create(**request)), assembled(client.chat.completions.create(**request, stream=True))


def assert_valid_calls(choices: list[dict[str, Any]], finish_reason: str = "tool_calls") -> None:
    for choice in choices:
        assert choice["finish_reason"] == finish_reason and choice["tool_calls"], choice
        for name, arguments in choice["tool_calls"]:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_tool_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    plain, streamed = both(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5, n=4)
    assert plain == streamed
    assert_valid_calls(plain)
    assert all(c["content"] is None for c in plain)
    one, _ = both(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=6)
    assert len(one[0]["tool_calls"]) == 1


def test_named_tool_choice_whole_and_streamed(client: openai.OpenAI) -> None:
    plain, streamed = both(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                           temperature=0.8, seed=2, n=2)
    assert plain == streamed
    assert_valid_calls(plain, "stop")  # OpenAI's finish reason of a forced (named) call
    assert {name for c in plain for name, _ in c["tool_calls"]} == {"get_weather"}


def test_a_named_or_required_stream_assembles_to_content_null(client: openai.OpenAI) -> None:
    """The openai client's stream helper assembles the message: content null, as the whole
    reply's (the stream opened with content "", which the helper kept)."""
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        request = {**COMMON, "messages": USER, "tools": TOOLS, "tool_choice": choice, "temperature": 0.0}
        with client.chat.completions.stream(**request) as stream:
            message = stream.get_final_completion().choices[0].message
        assert message.content is None and {c.function.name for c in message.tool_calls} == {"add"}, choice
        assert client.chat.completions.create(**request).choices[0].message.content is None


def test_auto_parses_the_models_hermes_call(client: openai.OpenAI) -> None:
    plain, streamed = both(client, tools=TOOLS, temperature=1.0, seed=3, extra_body={"guided_grammar": HERMES_GRAMMAR})
    assert plain == streamed
    assert_valid_calls(plain)
    assert plain[0]["tool_calls"][0][0] == "add"


# Two calls, then one of a function the request does not declare (the random model writes
# whatever a grammar makes it write).
TWO_CALLS_GRAMMAR = ('root ::= call "\\n" call\ncall ::= "<tool_call>\\n{\\"name\\": \\"add\\", '
                     '\\"arguments\\": {\\"a\\": " [1-9] ", \\"b\\": " [1-9] "}}\\n</tool_call>"')
UNDECLARED_GRAMMAR = 'root ::= "<tool_call>\\n{\\"name\\": \\"send_email\\", \\"arguments\\": {}}\\n</tool_call>"'


# A call whose arguments hold the closing tag itself (an agent writing about tool calls).
CLOSING_IN_ARGUMENTS_GRAMMAR = ('root ::= "<tool_call>\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": 1, '
                                '\\"b\\": 2, \\"note\\": \\"</tool_call>\\"}}\\n</tool_call>"')


def test_auto_keeps_a_call_whose_arguments_hold_the_closing_tag(client: openai.OpenAI) -> None:
    """Cut at the first `</tool_call>`, the call was lost and the markup came back as content."""
    plain, streamed = both(client, tools=TOOLS, temperature=0.0,
                           extra_body={"guided_grammar": CLOSING_IN_ARGUMENTS_GRAMMAR})
    assert plain == streamed == [{"content": None, "finish_reason": "tool_calls",
                                  "tool_calls": [("add", '{"a": 1, "b": 2, "note": "</tool_call>"}')]}]


def test_max_tokens_cut_in_text_after_whole_calls_is_tool_calls(client: openai.OpenAI) -> None:
    """The model writes on after its call (SmolLM2 does) and max_tokens cuts that text, which
    the reply drops: the call is whole, so "tool_calls" ("length" made the openai client's
    parse() raise LengthFinishReasonError). Cut inside the call, still "length"."""
    grammar = HERMES_GRAMMAR + ' "\\n\\nThe function adds two numbers and returns what they add up to, as asked."'
    request = {**COMMON, "messages": USER, "tools": TOOLS, "temperature": 0.0, "extra_body": {"guided_grammar": grammar}}
    probe = client.chat.completions.create(**request, logprobs=True).choices[0]
    assert probe.finish_reason == "tool_calls"
    tokens = [entry.token for entry in probe.logprobs.content]
    call_tokens = next(n for n in range(len(tokens)) if "</tool_call>" in "".join(tokens[:n]))
    assert call_tokens + 3 < len(tokens)  # the text after the call is longer than what is left
    plain, streamed = both(client, **{**request, "max_tokens": call_tokens + 3})
    assert plain == streamed == [{"content": None, "finish_reason": "tool_calls",
                                  "tool_calls": [(probe.message.tool_calls[0].function.name,
                                                  probe.message.tool_calls[0].function.arguments)]}]
    # Cut in the call: under "auto" the markup is content, as documented.
    plain, streamed = both(client, **{**request, "max_tokens": call_tokens - 1})
    assert plain == streamed == [{"content": "".join(tokens[:call_tokens - 1]), "finish_reason": "length",
                                  "tool_calls": []}]


def test_auto_keeps_the_first_call_without_parallel_tool_calls(client: openai.OpenAI) -> None:
    grammar = {"extra_body": {"guided_grammar": TWO_CALLS_GRAMMAR}}
    plain, streamed = both(client, tools=TOOLS, temperature=1.0, seed=3, **grammar)
    assert plain == streamed and [name for name, _ in plain[0]["tool_calls"]] == ["add", "add"]
    plain, streamed = both(client, tools=TOOLS, temperature=1.0, seed=3, parallel_tool_calls=False, **grammar)
    assert plain == streamed and len(plain[0]["tool_calls"]) == 1
    assert_valid_calls(plain)


def test_auto_never_calls_an_undeclared_function(client: openai.OpenAI) -> None:
    plain, streamed = both(client, tools=TOOLS, temperature=0.0, extra_body={"guided_grammar": UNDECLARED_GRAMMAR})
    assert plain == streamed
    assert plain[0]["tool_calls"] == [] and plain[0]["finish_reason"] == "stop"
    assert plain[0]["content"].startswith('<tool_call>\n{"name": "send_email"')


def test_a_required_call_cut_short_is_a_call_not_content(client: openai.OpenAI) -> None:
    cuts = []
    for max_tokens in (2, 4, 8, 12, 16, 24):
        plain, streamed = both(client, tools=TOOLS, tool_choice="required", temperature=0.0,
                               max_tokens=max_tokens)
        assert plain == streamed
        (choice,) = plain
        assert choice["content"] is None and choice["finish_reason"] == "length"
        cuts.append(choice["tool_calls"])
    # Before the name is complete there is no call to report; then the call, its arguments cut short.
    assert cuts == [[]] * 5 + [[("add", '{"')]]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_call_cut_by_a_stop_string_is_not_reported_as_complete(client: openai.OpenAI, tool_choice: Any) -> None:
    # The stop string ends the reply inside the call's arguments: "tool_calls" would tell the
    # agent to run a call whose arguments are not JSON.
    plain, streamed = both(client, tools=TOOLS, tool_choice=tool_choice, temperature=0.0, stop=["}"], max_tokens=60)
    assert plain == streamed
    ((name, arguments),) = plain[0]["tool_calls"]
    assert plain[0]["finish_reason"] == "stop" and arguments.startswith("{") and "}" not in arguments
    with pytest.raises(ValueError):
        json.loads(arguments)


def strict(tool: dict[str, Any]) -> dict[str, Any]:
    return {**tool, "function": {**tool["function"], "strict": True}}


def test_strict_tools_under_auto_constrain_the_calls_in_the_hermes_format() -> None:
    """The request's calls of strict tools are constrained to their schemas (xgrammar's
    structural tag: any text, then after `<tool_call>` a call of a declared tool), unless
    the request asks for ignore_eos; not in the llama3 format. Beside a structured output of
    its own, the reply is that output or calls (strict or not, either format)."""
    import msgspec

    from radixserve.server.protocol import ChatCompletionRequest
    from radixserve.server.tools import plan_tools
    from radixserve.server.translate import chat_call

    def grammar_of(parser: str, tools: list[dict[str, Any]] = [strict(WEATHER), ADD], **fields: Any) -> Any:
        request = msgspec.json.decode(json.dumps({"messages": USER, "tools": tools, **fields}),
                                      type=ChatCompletionRequest)
        plan = plan_tools(request, parser)
        call = chat_call(request, [1, 2, 3], 0, 4096, tool_grammar=plan.grammar, auto_calls=plan.auto_calls)
        return call.params.grammar

    spec = grammar_of("hermes")
    assert spec.kind == "tool_calls"
    assert json.loads(spec.source) == {"tools": [["get_weather", SCHEMAS["get_weather"]], ["add", None]],
                                       "parallel": True}
    assert json.loads(grammar_of("hermes", parallel_tool_calls=False).source)["parallel"] is False
    assert grammar_of("llama3") is None
    assert grammar_of("hermes", tools=TOOLS) is None  # no strict tool: the reply is free
    assert grammar_of("hermes", ignore_eos=True) is None
    assert grammar_of("hermes", tool_choice="required").kind == "json_schema"
    for parser in ("hermes", "llama3"):
        beside = json.loads(grammar_of(parser, tools=TOOLS, response_format={"type": "json_object"}).source)
        assert beside == {"tools": [["get_weather", None], ["add", None]], "parallel": True,
                          "answer": ["json_object", ""], **({"format": "llama3"} if parser == "llama3" else {})}
    assert grammar_of("hermes", tool_choice="none", response_format={"type": "json_object"}).kind == "json_object"


def test_a_structured_output_beside_tools_under_auto_is_that_output_or_calls(client: openai.OpenAI) -> None:
    """What the OpenAI Agents SDK sends for an agent with an output type and tools: the reply
    is the output (valid under its schema) or a reply opening with calls of the tools (held
    to the strict one's schema); the grammar's two sides checked token by token, and both
    served (the demo model picks one; a Hermes grammar of its own cannot be asked beside)."""
    from radixserve.grammar import GrammarSpec, Grammars
    from radixserve.models.demo import demo_checkpoint_dir
    from transformers import AutoTokenizer

    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    tokenizer = AutoTokenizer.from_pretrained(demo_checkpoint_dir())
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=None)
    calls = [("get_weather", GrammarSpec.json_schema(SCHEMAS["get_weather"], "p")), ("add", None)]

    def accepts(spec: GrammarSpec, text: str) -> bool:
        matcher = grammars.matcher(spec)
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.accept(tokenizer.eos_token_id)

    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    for parallel in (True, False):
        spec = GrammarSpec.tool_calls(calls, parallel, "p", GrammarSpec.json_schema(answer, "q"))
        assert accepts(spec, '{"city": "Paris"}') and accepts(spec, weather)
        assert accepts(spec, f"{weather}\n{add}") is parallel and accepts(spec, f"{weather}\nDone.") is parallel
        for wrong in ('{"city": 5}', '{"town": "Paris"}', "Paris", "Let me look.\n" + weather, weather.replace("Rome", "Constantinople"),
                      weather.replace('"unit": "celsius"', '"unit": "kelvin"'), weather.replace("get_weather", "get_news")):
            assert not accepts(spec, wrong), wrong
    llama = GrammarSpec.tool_calls(calls, True, "p", GrammarSpec.json_schema(answer, "q"), "llama3")
    call = '{"name": "add", "parameters": {"a": 1}}'
    assert accepts(llama, '{"city": "Paris"}') and accepts(llama, call) and accepts(llama, f"{call}; {call}")
    assert not accepts(llama, f"<tool_call>{call}") and not accepts(llama, '{"name": "sub", "parameters": {}}')
    for seed in range(3):
        reply = client.chat.completions.create(**COMMON, messages=USER, tools=[strict(WEATHER), ADD], seed=seed,
                                               temperature=1.0, response_format={"type": "json_schema", "json_schema": {
                                                   "name": "answer", "schema": answer}}).choices[0]
        if reply.message.tool_calls:
            assert reply.finish_reason == "tool_calls"
            assert_valid_calls(whole(SimpleNamespace(choices=[reply])))
        else:
            jsonschema.validate(json.loads(reply.message.content), answer)


def test_streamed_logprobs_with_tools_come_with_their_content(client: openai.OpenAI) -> None:
    """As without tools: one chunk has the text and the logprobs of its tokens (they came in a
    second, empty chunk after it, so clients pairing them misread both)."""
    stream = client.chat.completions.create(**{**COMMON, "max_tokens": 12}, messages=USER, tools=TOOLS, stream=True,
                                            logprobs=True, temperature=0.0)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    assert "<" not in text  # nothing held back as a possible call: every token's text is content at once
    with_logprobs = [c for c in chunks if c.logprobs is not None]
    assert len(with_logprobs) == 12
    assert all(c.delta.content == "".join(t.token for t in c.logprobs.content) for c in with_logprobs)


def test_strict_tools_under_auto_are_served_and_a_bad_strict_schema_is_a_400(client: openai.OpenAI) -> None:
    plain, streamed = both(client, tools=[strict(WEATHER), ADD], temperature=0.0, max_tokens=16)
    assert plain == streamed and plain[0]["finish_reason"] in ("stop", "length")
    bad = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**COMMON, messages=USER, tools=[bad])
    assert raised.value.body["param"] == "tools[0].function.parameters"


def test_null_booleans_are_openais_defaults(client: openai.OpenAI) -> None:
    body = {**COMMON, "max_tokens": 4, "messages": USER, "temperature": 0.0}
    expected = client.chat.completions.create(**body).choices[0].message.content
    nulls = {"stream": None, "logprobs": None, "parallel_tool_calls": None, "ignore_eos": None,
             "return_tokens_as_token_ids": None, "priority": None, "use_beam_search": None,
             "length_penalty": None, "early_stopping": None}
    assert client.chat.completions.create(**body, extra_body=nulls).choices[0].message.content == expected
    legacy = client.completions.create(model="demo", prompt="Hi", max_tokens=4, temperature=0.0,
                                       extra_body={"echo": None, "stream": None})
    assert legacy.choices[0].text


def test_an_assistant_refusal_part_is_its_text(client: openai.OpenAI) -> None:
    refused = [*USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
               {"role": "user", "content": "Why?"}]
    as_text = [*USER, {"role": "assistant", "content": "I cannot."}, {"role": "user", "content": "Why?"}]
    body = {**COMMON, "max_tokens": 4, "temperature": 0.0}
    one = client.chat.completions.create(**body, messages=refused)
    two = client.chat.completions.create(**body, messages=as_text)
    assert one.usage.prompt_tokens == two.usage.prompt_tokens and one.choices[0].message.content == two.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body, messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}])
    assert caught.value.body["param"] == "messages[0].content[0].type"


def test_auto_without_a_call_and_none_are_content(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        plain, streamed = both(client, tools=TOOLS, tool_choice=choice, temperature=0.0, seed=0)
        assert plain == streamed
        assert plain[0]["tool_calls"] == [] and plain[0]["content"] and plain[0]["finish_reason"] in ("stop", "length")
    # "none" on a reply in the model's call format: still only content.
    text = client.chat.completions.create(**COMMON, messages=USER, tools=TOOLS, tool_choice="none", temperature=0.0,
                                          extra_body={"guided_grammar": HERMES_GRAMMAR}).choices[0]
    assert text.message.tool_calls is None and text.message.content.startswith("<tool_call>")


def test_a_tool_result_goes_back_and_the_prefix_is_cached(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(**COMMON, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0.0)
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = USER + [message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "sunny, 21 C"})}]
    second = client.chat.completions.create(**{**COMMON, "max_tokens": 8}, messages=history, tools=TOOLS,
                                            temperature=0.0)
    assert second.choices[0].finish_reason in ("stop", "length")
    # The system prompt and tool block, then the user turn, are the prompt the first step had.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


TEXT_THEN_CALL_GRAMMAR = ('root ::= "Let me look.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", '
                          '\\"arguments\\": {\\"city\\": \\"Paris\\"}}\\n</tool_call>"')


def test_a_turn_with_text_before_its_call_is_found_again_next_turn(client: openai.OpenAI) -> None:
    """The model says something, then calls ("Let me look.\\n<tool_call>..."): sent back as
    history, the assistant turn renders as it was generated, so the next turn's prompt is
    cached through the whole turn (the content kept its newline and got a second one: the
    cache stopped where the assistant turn began)."""
    first = client.chat.completions.create(**COMMON, messages=USER, tools=TOOLS, temperature=0.0,
                                           extra_body={"guided_grammar": TEXT_THEN_CALL_GRAMMAR})
    message = first.choices[0].message
    assert message.content == "Let me look.\n" and first.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    history = USER + [message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(**{**COMMON, "max_tokens": 2}, messages=history, tools=TOOLS,
                                            temperature=0.0)
    generated = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= generated - 1, (second.usage, generated)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "height": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    "pets": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
        "required": ["kind", "legs"]}}},
    "required": ["name", "age", "height", "pets"]}


def test_json_schema_response_format_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    plain, streamed = both(client, response_format=fmt, temperature=1.0, seed=9, n=4)
    assert plain == streamed
    for choice in plain:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["content"]), PERSON)


def test_json_object_and_vllm_extensions(client: openai.OpenAI) -> None:
    obj = client.chat.completions.create(**COMMON, messages=USER, temperature=0.0,
                                         response_format={"type": "json_object"}).choices[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
    regex = client.chat.completions.create(**COMMON, messages=USER, temperature=1.0, seed=1, n=3,
                                           extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert all(len(c.message.content) == 6 and c.message.content[3] == "-" for c in regex.choices)
    picked = client.completions.create(model="demo", prompt="Pick one:", max_tokens=20, temperature=1.0, seed=4, n=4,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert {c.text for c in picked.choices} <= {"alpha", "beta"}


def test_a_schema_that_cannot_fit_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    choice = client.chat.completions.create(**{**COMMON, "max_tokens": 5}, messages=USER, response_format=fmt,
                                            temperature=1.0, seed=1).choices[0]
    assert choice.finish_reason == "length"


@pytest.mark.parametrize(("request_fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": USER + [{"role": "tool", "tool_call_id": "call_x", "content": "42"}]}, "messages[2].tool_call_id"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"extra_body": {"guided_grammar": "root ::= missing_rule"}}, "guided_grammar"),
    ({"extra_body": {"guided_regex": "[0-9]+", "guided_choice": ["a"]}}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos"),
    # a tool's arguments are an object: a string schema gave raw text for them
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {"type": ["object", "null"]}}}]},
     "tools[1].function.parameters"),
    # OpenAI's deprecated forms, refused rather than ignored; an empty call id answers nothing
    ({"extra_body": {"functions": [WEATHER["function"]]}}, "functions"),
    ({"extra_body": {"function_call": "auto"}}, "function_call"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]}, "messages[2].tool_calls[0].id"),
    # a schema the compile would refuse is refused when it is compiled: strict under "auto"
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}}}}]}, "tools[0].function.parameters"),
    # a constraint the grammar engine would drop beside a combinator is refused, not ignored
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"], "allOf": [{}]}}}]},
     "tools[0].function.parameters"),
])
def test_errors_are_400s_naming_the_field(client: openai.OpenAI, request_fields: dict[str, Any], param: str) -> None:
    request = {**COMMON, "messages": USER, **request_fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def nested_arrays(depth: int) -> dict[str, Any]:
    """A valid schema nested `depth` levels deep (an array of arrays of ... integers)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def wide_object(name: str) -> dict[str, Any]:
    """A valid parameters schema of about 54,000 characters: under the 64 KiB a schema may
    have, while two of them together are over it (its properties required: 500 optional ones
    would be refused alone, spec.MAX_OPTIONAL_COST)."""
    names = [f"{name}_{i}_{'x' * 20}" for i in range(500)]
    return {"type": "object", "properties": {n: {"type": "string", "description": "d" * 10} for n in names},
            "required": names}


MAX_ONE_SCHEMA = 64 * 1024  # grammar.spec.MAX_SOURCE_CHARS: one schema's size
DEEP = nested_arrays(300)  # too deep for the JSON Schema validator, which recurses once per level
WIDE_TOOLS = [{"type": "function", "function": {"name": name, "parameters": wide_object(name)}} for name in ("f", "g")]


# These were 500 internal_error: a RecursionError escaped the schema check, and the schema of
# tool_choice "required" (every tool's parameters in one) met the size bound unchecked.
@pytest.mark.parametrize(("request_fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_json": DEEP}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}, "tools[0].function.parameters"),
    ({"tools": WIDE_TOOLS, "tool_choice": "required"}, "tools"),
], ids=["response_format-deep", "guided_json-deep", "tool-deep", "required-tools-too-large-together"])
def test_schemas_too_deep_or_too_large_together_are_400s(client: openai.OpenAI, request_fields: dict[str, Any],
                                                          param: str) -> None:
    test_errors_are_400s_naming_the_field(client, request_fields, param)


def test_required_calls_of_a_tool_whose_parameters_refer_to_their_defs(client: openai.OpenAI) -> None:
    """pydantic writes $defs for every nested model; nested under the calls' array, the
    references pointed at the array (a 400, "cannot find $defs"). Each call validates."""
    parameters = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
                  "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                      "required": ["city"]}}}
    tool = {"type": "function", "function": {"name": "visit", "parameters": parameters}}
    plain, streamed = both(client, tools=[tool, ADD], tool_choice="required", temperature=1.0, seed=4,
                           max_tokens=80, n=2)
    assert plain == streamed
    for choice in plain:
        assert choice["finish_reason"] == "tool_calls" and choice["tool_calls"], choice
        for name, arguments in choice["tool_calls"]:
            jsonschema.validate(json.loads(arguments), parameters if name == "visit" else SCHEMAS[name])


# Valid JSON Schemas that the grammar engine cannot honour (spec.UNSUPPORTED_KEYWORDS and the
# half-honoured shapes), as real tools declare them: pydantic writes propertyNames for a dict
# keyed by a Literal, OpenAPI-derived tools allOf beside properties.
ENGINE_REFUSES = {
    "propertyNames": {"type": "object", "properties": {"tags": {
        "type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "string"}}}},
    "allOf-beside": {"type": "object", "properties": {"a": {"type": "string"}}, "allOf": [{"required": ["a"]}]},
    "not": {"type": "object", "properties": {"a": {"not": {"type": "null"}}}},
    "if-then": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "contains": {"type": "object", "properties": {"l": {"type": "array", "contains": {"type": "integer"}}}},
    "external-ref": {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
    "minimum-untyped": {"type": "object", "properties": {"n": {"minimum": 5}}},
    "ref-to-nothing": {"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}},
}


def declared(name: str, schema: dict[str, Any], **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": schema, **function}}


@pytest.mark.parametrize("shape", sorted(ENGINE_REFUSES))
def test_a_tool_schema_the_grammar_engine_cannot_honour_is_refused_only_where_it_is_compiled(
        client: openai.OpenAI, shape: str) -> None:
    """A tool whose schema is never compiled into a grammar (not strict under "auto", any
    under "none", another tool named) is only shown to the model: any valid JSON Schema is
    taken, as OpenAI and vLLM take it (a 400 before: an agent could not even declare it).
    Where the schema constrains the reply (strict under "auto", the tool named, every tool
    under "required") the grammar engine's refusal stands, naming the tool."""
    schema = ENGINE_REFUSES[shape]
    body = {**COMMON, "messages": USER, "max_tokens": 1, "temperature": 0.0}
    for choice in ("auto", "none", {"type": "function", "function": {"name": "add"}}):
        reply = client.chat.completions.create(**body, tools=[declared("f", schema), ADD], tool_choice=choice)
        assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls"), choice
    for tools, choice in (([declared("f", schema, strict=True), ADD], "auto"),
                          ([declared("f", schema), ADD], {"type": "function", "function": {"name": "f"}}),
                          ([declared("f", schema), ADD], "required")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**body, tools=tools, tool_choice=choice)
        error = caught.value.body
        assert caught.value.status_code == 400 and error["param"] == "tools[0].function.parameters", (choice, error)
        assert error["code"] == "invalid_value" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "invalid JSON Schema at ['properties']['a']"),
    ({"type": "object", "properties": {"a": {"type": "string", "description": "d" * MAX_ONE_SCHEMA}}},
     "at most 65536 characters"),
    (nested_arrays(300) | {"type": "object"}, "nested too deeply"),
], ids=["invalid", "too-large", "too-deep"])
def test_a_tool_schema_that_is_not_compiled_is_still_checked_as_json_schema(
        client: openai.OpenAI, schema: dict[str, Any], message: str) -> None:
    """The bounds that keep checking a schema cheap hold for every tool, compiled or not."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**COMMON, "max_tokens": 1}, messages=USER, tools=[ADD, declared("f", schema)],
                                       tool_choice="none")
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == "tools[1].function.parameters", error
    assert message in error["message"]
