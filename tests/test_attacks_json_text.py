"""JSON inside a request's strings, and compiled grammars shared between tenants, on a real
server (uvicorn on a real port, httpx, two tenants' API keys).

The body is decoded by msgspec, which bounds nesting and refuses lone surrogates; JSON given
as text inside it (a tool call's `arguments` in the history, `guided_json` or
`structured_outputs.json` as a string) was parsed with `json.loads`, catching only its decode
error: nesting past the recursion limit (RecursionError), a 5,000-digit integer (Python's conversion limit)
or a lone surrogate (`"\\ud800"`, which reached the tokenizer) were 500s with a traceback. A
schema given as text is now a 400 naming its field; arguments the server cannot use are kept
as the text they were.

Compiled grammars were cached by spec for every tenant: a tenant could tell whether another
had used a schema lately (a guessed enum of secrets answers in a fraction of a fresh
compile's time). The cache is now per tenant and cache salt, as the prefix cache is.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from server_util import running_server, wait_for

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.json_text import parse_json_text
from radixserve.server.tenancy import Caller
from radixserve.server.tool_parsers import HermesParser, RequiredCallsParser
from radixserve.server.tools import _arguments

KEY_A, KEY_B = "k-tenant-a", "k-tenant-b"
KEYS = {KEY_A: Caller("tenant-a", admin=False), KEY_B: Caller("tenant-b", admin=False)}
INNOCENT = {"messages": [{"role": "user", "content": "an innocent question"}], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
DEEP = "[" * 1500 + "]" * 1500  # past the interpreter's recursion limit, within the demo's context
BIG_INTEGER = "1" * 5000
LONE_SURROGATE = '"\\ud800"'


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    engine = AsyncEngine(Engine(model="demo", page_size=16, num_pages=256))
    with running_server(create_app(engine, tenant_keys=KEYS)) as url:
        yield SimpleNamespace(url=url, engine=engine)


def _post(url: str, path: str, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120.0)


def _assert_clean(server: SimpleNamespace) -> None:
    assert wait_for(lambda: server.engine.stats()["running"] == 0 and server.engine.stats()["waiting"] == 0)
    assert server.engine.stats()["pages_locked"] == 0
    server.engine.engine.check_invariants()


def test_parse_json_text_refuses_what_the_server_cannot_use() -> None:
    assert parse_json_text('{"a": [1, "b", null]}') == {"a": [1, "b", None]}
    assert parse_json_text('"\\u00e9"') == "é"  # an escaped character that is not a surrogate
    assert parse_json_text('[1e308, -0.5, 2]') == [1e308, -0.5, 2]
    for text, reason in ((DEEP, "nested too deeply"), (BIG_INTEGER, "digits"),
                         (LONE_SURROGATE, "surrogates not allowed"), ("{", "Expecting"),
                         ('{"a": NaN}', "NaN is not JSON"), ("[-Infinity]", "Infinity is not JSON"),
                         ('{"b": 1e999}', "too large")):
        with pytest.raises(ValueError, match=reason):
            parse_json_text(text)


def test_a_model_s_unusable_tool_call_is_text_not_a_crash() -> None:
    # A model can write these too (asked to, or fed them): its reply stays text.
    for text in (DEEP, BIG_INTEGER):
        content, calls = HermesParser().parse(f"<tool_call>{text}</tool_call>")
        assert calls == [] and content is not None
        assert RequiredCallsParser().parse(text) == (text, [])
    # Python reads NaN and Infinity, and would write them back into the arguments, which no
    # client's JSON parser then reads: such a call is no call.
    not_json = '<tool_call>{"name": "f", "arguments": {"a": NaN, "b": 1e999}}</tool_call>'
    assert HermesParser().parse(not_json) == (not_json, [])
    assert RequiredCallsParser().parse('[{"name": "f", "arguments": {"a": Infinity}}]')[1] == []


SCHEMA_TEXTS = {
    ("guided_json", "/v1/chat/completions"): {"messages": [{"role": "user", "content": "hi"}]},
    ("structured_outputs.json", "/v1/completions"): {"prompt": "hi"},
}


@pytest.mark.parametrize("text", [DEEP, '{"type": "integer", "maximum": ' + BIG_INTEGER + "}",
                                  '{"enum": [' + LONE_SURROGATE + "]}"], ids=["deep", "big-integer", "surrogate"])
@pytest.mark.parametrize("field,path", list(SCHEMA_TEXTS))
def test_a_schema_given_as_unusable_json_text_is_a_400_naming_its_field(
        server: SimpleNamespace, field: str, path: str, text: str) -> None:
    body: dict[str, Any] = {**SCHEMA_TEXTS[field, path], "max_tokens": 2}
    if field == "guided_json":
        body["guided_json"] = text
    else:
        body["structured_outputs"] = {"json": text}
    answer = _post(server.url, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and error["code"] == "invalid_value", error
    assert error["message"].startswith(f"{field}: not valid JSON"), error
    _assert_clean(server)


def test_tool_call_arguments_the_server_cannot_use_stay_text() -> None:
    assert _arguments('{"city": "Paris"}') == {"city": "Paris"}
    for text in (DEEP, BIG_INTEGER, LONE_SURROGATE, "not json"):
        assert _arguments(text) == text


# (A 5,000-digit integer is past the demo model's context as a prompt: the unit test above.)
@pytest.mark.parametrize("arguments", [DEEP, LONE_SURROGATE], ids=["deep", "surrogate"])
def test_history_tool_call_arguments_the_server_cannot_parse_are_kept_as_text(
        server: SimpleNamespace, arguments: str) -> None:
    alone = _post(server.url, "/v1/chat/completions", INNOCENT)
    assert alone.status_code == 200, alone.text
    history = [{"role": "user", "content": "call f"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    answer = _post(server.url, "/v1/chat/completions", {"messages": history, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    again = _post(server.url, "/v1/chat/completions", INNOCENT)
    assert again.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]
    _assert_clean(server)


def test_compiled_grammars_are_kept_per_tenant_and_salt(server: SimpleNamespace) -> None:
    schema = {"type": "object", "properties": {"pin": {"enum": ["4821", "1234"]}}, "required": ["pin"]}
    grammars = server.engine.engine.grammars

    def scopes() -> set[Any]:
        return {spec.scope for spec in grammars._cache if '"4821"' in spec.source}

    body = {"messages": [{"role": "user", "content": "pin?"}], "max_tokens": 8, "guided_json": schema}
    assert _post(server.url, "/v1/chat/completions", body, KEY_A).status_code == 200
    assert scopes() == {("tenant-a", None)}
    assert _post(server.url, "/v1/chat/completions", body, KEY_A).status_code == 200
    assert scopes() == {("tenant-a", None)}  # shared within a tenant
    assert _post(server.url, "/v1/chat/completions", body, KEY_B).status_code == 200
    assert scopes() == {("tenant-a", None), ("tenant-b", None)}  # compiled again for another
    salted = _post(server.url, "/v1/chat/completions", {**body, "cache_salt": "s1"}, KEY_B)
    assert salted.status_code == 200, salted.text
    assert scopes() == {("tenant-a", None), ("tenant-b", None), ("tenant-b", "s1")}
    # Every request's matcher came from its own scope's entry: one per scope, nothing unscoped.
    assert all(spec.scope is not None for spec in grammars._cache)
    _assert_clean(server)


# A template that renders tool calls and tools natively (`tojson`, as Qwen's and Hermes' do):
# it recurses into what is nested, about two frames a level, far below the parser's own limit.
NATIVE_TEMPLATE = (
    "{%- if tools %}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}<tool_call>{\"name\": "
    "\"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}</tool_call>"
    "{%- endfor %}{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def native_server() -> Iterator[SimpleNamespace]:
    engine = Engine(model="demo", page_size=16, num_pages=256)
    engine.tokenizer.chat_template = NATIVE_TEMPLATE
    async_engine = AsyncEngine(engine)
    with running_server(create_app(async_engine)) as url:
        yield SimpleNamespace(url=url, engine=async_engine)


@pytest.mark.parametrize("depth", [127, 129, 984])
def test_deep_arguments_under_a_native_template_are_never_a_500(native_server: SimpleNamespace, depth: int) -> None:
    # Up to 128 levels are parsed and rendered as JSON, deeper ones as text: parsed up to the
    # interpreter's limit, 500-984 levels overflowed the template (a 500).
    history = [{"role": "user", "content": "call f"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    answer = _post(native_server.url, "/v1/chat/completions", {"messages": history, "max_tokens": 2, "tools": TOOLS})
    assert answer.status_code == 200, answer.text
    _assert_clean(native_server)


def test_a_tool_nested_too_deeply_for_the_template_is_a_400(native_server: SimpleNamespace) -> None:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(300):  # too deep to check: refused before the template could overflow on it
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    answer = _post(native_server.url, "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "tools[0].function.parameters", answer.text
    _assert_clean(native_server)
