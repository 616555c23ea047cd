"""A tool-call reply's chat objects (formatting.ChatFormatter with the tool parsers), whole and
streamed, in process: the finish reason of calls that max_tokens cut after, how a streamed
reply of calls opens, and what its logprobs list; and the size bound of "required"."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve import StreamDelta
from radixserve.models.demo import demo_checkpoint_dir
from radixserve.server.formatting import ChatFormatter, ChoiceResult, ResponseIdentity, TokenNamer
from radixserve.server.protocol import PromptTokensDetails, Usage
from radixserve.server.tool_parsers import HermesParser, NamedCallParser, RequiredCallsParser, ToolCallParser

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
USAGE = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2,
              prompt_tokens_details=PromptTokensDetails(cached_tokens=0))


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(demo_checkpoint_dir()))


def formatter(tokenizer: PreTrainedTokenizerBase, parser: ToolCallParser | None) -> ChatFormatter:
    return ChatFormatter(ResponseIdentity("chatcmpl-x", 1, "demo", include_usage=False),
                         TokenNamer(tokenizer, as_ids=False), parser)


def whole_reason(tokenizer: PreTrainedTokenizerBase, parser: ToolCallParser, text: str, finish: str) -> str:
    response = formatter(tokenizer, parser).response([ChoiceResult(text=text, finish_reason=finish)], USAGE)
    return msgspec.to_builtins(response)["choices"][0]["finish_reason"]


def streamed_reason(tokenizer: PreTrainedTokenizerBase, parser: ToolCallParser, text: str, finish: str) -> str:
    chat = formatter(tokenizer, parser)
    pieces = [text[at:at + 5] for at in range(0, len(text), 5)]
    chunks: list[Any] = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunks += chat.chunks(StreamDelta(index=0, token_ids=[1], text=piece, logprobs=None,
                                          finish_reason=finish if last else None, prompt_tokens=1, cached_tokens=0))
    (reason,) = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason is not None]
    return reason


@pytest.mark.parametrize(("parser", "text", "reason"), [
    # whole calls, then text the reply drops, cut there: the calls are the reply
    (HermesParser(), CALL + "\n\nThe function is called with a", "tool_calls"),
    (HermesParser(), f"Let me see.\n{CALL}\n{CALL} and then", "tool_calls"),
    (HermesParser(None, 1), f"{CALL}\n<tool_call>\n{{\"name\": \"g\", \"argu", "tool_calls"),  # one call is all
    # a call cut itself, or one under way after the whole ones: "length", as before
    (HermesParser(), f"{CALL}\n<tool_call>\n{{\"name\": \"g\", \"argu", "length"),
    (HermesParser(), f"{CALL}\n<tool_ca", "length"),  # cut in the next call's opening tag
    (HermesParser(), CALL[:-len("</tool_call>")], "length"),
    (HermesParser(), CALL[:-3], "length"),
    (HermesParser(), "Just words, cut", "length"),
    (RequiredCallsParser(), '[{"name": "f", "arguments": {"x": 1}}', "length"),
    (NamedCallParser("f"), '{"x": 1', "length"),
], ids=["tail", "two-calls-tail", "max-calls", "call-under-way", "cut-in-next-opening", "unclosed", "cut-in-tag",
        "no-call",
        "required", "named"])
def test_max_tokens_cut_in_text_after_whole_calls_finishes_with_tool_calls(
        tokenizer: PreTrainedTokenizerBase, parser: ToolCallParser, text: str, reason: str) -> None:
    assert whole_reason(tokenizer, parser, text, "length") == reason
    assert streamed_reason(tokenizer, parser, text, "length") == reason


def test_required_says_its_size_bound_is_on_every_tool_together() -> None:
    """Two tools of about 50,000 characters each: taken under "auto" (64 KiB a tool, 256 KiB in all);
    under "required" all of them make one schema, and the 400 says so (it said only "tools: at
    most 65536 characters")."""
    import json

    from radixserve.server.errors import APIError
    from radixserve.server.protocol import ChatCompletionRequest
    from radixserve.server.tools import plan_tools

    def tool(name: str) -> dict[str, Any]:
        names = [f"{name}{i}" for i in range(1000)]
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {n: {"type": "string", "maxLength": 3} for n in names},
            "required": names}}}

    def request(choice: str) -> ChatCompletionRequest:
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool("f"), tool("g")], "tool_choice": choice}
        return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)

    assert plan_tools(request("auto"), "hermes").parser is not None
    with pytest.raises(APIError) as caught:
        plan_tools(request("required"), "hermes")
    assert caught.value.status == 400 and caught.value.param == "tools"
    assert str(caught.value) == (
        'tools: under tool_choice "required" every tool\'s parameters together make one schema, at most 65536 '
        'characters (103930 here); send fewer or smaller tools, or use "auto" (65536 characters per tool, '
        '262144 together)')


@pytest.mark.parametrize(("parser", "content"), [
    (NamedCallParser("f"), None), (RequiredCallsParser(), None), (HermesParser(), ""), (None, "")])
def test_a_stream_known_to_be_calls_opens_with_content_null(tokenizer: PreTrainedTokenizerBase,
                                                          parser: ToolCallParser | None, content: str | None) -> None:
    """A named or "required" choice's reply is calls: its stream opens with `content: null`, as
    OpenAI's and as the whole reply's message (it opened with "", which the openai client kept
    as the message's content). Under "auto" (or without tools) the reply may be text: ""."""
    chunks = formatter(tokenizer, parser).opening_chunks(2)
    assert [msgspec.to_builtins(c)["choices"] for c in chunks] == [
        [{"index": i, "delta": {"role": "assistant", "content": content}, "finish_reason": None, "logprobs": None}]
        for i in range(2)]
    assert [msgspec.json.decode(msgspec.json.encode(c))["choices"][0]["delta"] for c in chunks] == \
        [{"role": "assistant", "content": content}] * 2


def test_serve_refuses_the_llama3_parser_on_a_template_that_ignores_tools(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo model's template ignores tools: `serve --tool-call-parser llama3` is a one-line
    error and status 2 once the model is loaded, and its port is free again (it served, and
    every call came back as content)."""
    from radixserve.cli import main
    from radixserve.ports import free_port
    from tests.test_ports import plain_bind_fails

    port = free_port()
    code = main(["serve", "--port", str(port), "--num-pages", "16", "--tool-call-parser", "llama3"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    (error,) = [line for line in stderr.splitlines() if "error" in line]
    assert error == ("radixserve: error: --tool-call-parser llama3: the chat template ignores tools, so they are "
                     "given to the model in a Hermes block that asks for <tool_call> blocks, which the llama3 parser "
                     "does not read; use --tool-call-parser hermes (this template's default) or a chat template "
                     "that renders tools")
    assert not plain_bind_fails(port)


def test_the_llama3_parser_on_a_template_that_ignores_tools_is_a_mismatch(tokenizer: PreTrainedTokenizerBase) -> None:
    """Such a template gets the tools in the Hermes block: the llama3 parser cannot read the
    calls it asks for (they came back as content). A template that renders tools is fine."""
    from radixserve.server.tools import parser_template_mismatch

    assert parser_template_mismatch("llama3", tokenizer) == (
        "--tool-call-parser llama3: the chat template ignores tools, so they are given to the model in a Hermes "
        "block that asks for <tool_call> blocks, which the llama3 parser does not read; use --tool-call-parser "
        "hermes (this template's default) or a chat template that renders tools")
    assert parser_template_mismatch("hermes", tokenizer) is None
    renders = AutoTokenizer.from_pretrained(str(demo_checkpoint_dir()))
    renders.chat_template = ("{% if tools %}TOOLS{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert parser_template_mismatch("llama3", renders) is None
