"""`radixserve bench peers`: the chat workloads, the client's reading of each server's usage
report, and a whole side-by-side run against two real radixserve servers (demo model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.cli import main
from radixserve.benchmark.cli_peers import parse_servers
from radixserve.benchmark.peer_workloads import (
    SINGLE_STREAM_PROMPTS,
    TURNS_PER_CONVERSATION,
    WORKLOAD_NAMES,
    append_turn,
    build_workloads,
)
from radixserve.benchmark.peers import chat_payload, read_usage
from radixserve.benchmark.serve import RequestRecord
from radixserve.server import create_app

SMALL = dict(requests=4, concurrency=2, system_chars=600, prompt_chars=300)


def test_workloads_have_the_promised_shapes() -> None:
    workloads = {w.name: w for w in build_workloads(list(WORKLOAD_NAMES), run_tag="t", **SMALL)}
    assert [w.num_requests for w in workloads.values()] == [4, 4, 4, 4, SINGLE_STREAM_PROMPTS]
    shared = workloads["shared"].conversations
    assert len({c.system for c in shared}) == 1 and len(shared[0].system) > 500
    assert len({c.turns[0].user for c in shared}) == 4  # distinct questions
    assert len(workloads["multiturn"].conversations[0].turns) == TURNS_PER_CONVERSATION
    distinct = workloads["distinct"].conversations
    assert len({c.turns[0].user[:40] for c in distinct}) == 4  # no two begin alike
    assert workloads["single"].concurrency == 1
    assert all(c.system.startswith("[t] ") for w in workloads.values() for c in w.conversations)
    assert build_workloads(["shared"], run_tag="u", **SMALL)[0].conversations[0].system.startswith("[u] ")
    with pytest.raises(ValueError, match="unknown workloads"):
        build_workloads(["shared", "nope"], run_tag="t", **SMALL)


def test_an_agent_step_answers_a_tool_call_with_a_tool_message() -> None:
    agent = build_workloads(["agent"], run_tag="t", **SMALL)[0].conversations[0]
    messages: list[dict[str, object]] = [{"role": "system", "content": agent.system}]
    append_turn(messages, agent.turns[0], 0)
    assert messages[-1]["role"] == "user"
    messages.append({"role": "assistant", "content": "Let me look."})
    append_turn(messages, agent.turns[1], 1)
    call = messages[-2]["tool_calls"][0]
    assert messages[-2]["role"] == "assistant" and call["function"]["name"] == "search_library"
    assert messages[-1] == {"role": "tool", "tool_call_id": call["id"], "content": agent.turns[1].tool_result}
    payload = chat_payload(messages, agent, 8, None)
    assert payload["tools"] == agent.tools and payload["ignore_eos"] is True and payload["max_tokens"] == 8


def test_cached_tokens_come_from_either_servers_report() -> None:
    openai_style = RequestRecord(0)
    read_usage({"usage": {"prompt_tokens": 100, "completion_tokens": 8,
                          "prompt_tokens_details": {"cached_tokens": 64}}}, openai_style)
    assert (openai_style.prompt_tokens, openai_style.completion_tokens, openai_style.cached_tokens) == (100, 8, 64)
    llama_style = RequestRecord(0)  # llama-server: timings on the last chunk, usage without details
    read_usage({"choices": [], "timings": {"cache_n": 90, "prompt_n": 10, "predicted_n": 8}}, llama_style)
    assert (llama_style.prompt_tokens, llama_style.completion_tokens, llama_style.cached_tokens) == (100, 8, 90)
    both = RequestRecord(0)
    read_usage({"usage": {"prompt_tokens": 100, "completion_tokens": 8}, "timings": {"cache_n": 90}}, both)
    assert both.cached_tokens == 90 and both.prompt_tokens == 100


def test_names_sharing_a_server_are_found() -> None:
    """Two names on one URL: the second runs warm (the first one's prompts are in its cache)."""
    from radixserve.benchmark.cli_peers import shared_urls

    assert shared_urls({"a": "http://h:1", "b": "http://h:2"}) == []
    assert shared_urls({"a": "http://h:1", "b": "http://h:1/", "c": "http://h:2", "d": "http://h:1"}) == ["b", "d"]


def test_server_arguments_are_checked() -> None:
    assert parse_servers(["a=http://h:1", "b=http://h:2"]) == {"a": "http://h:1", "b": "http://h:2"}
    for bad in (["a"], ["a=h:1"], ["=http://h:1"], ["a=http://h:1", "a=http://h:2"]):
        with pytest.raises(ValueError, match="--server"):
            parse_servers(bad)


def test_two_radixserve_servers_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole command: every workload on both servers, alternating, each reply exactly
    max_tokens long, cache shares from each server's own report, ratios to the first."""
    engines = [Engine(model="demo", page_size=16, num_pages=256) for _ in range(2)]
    out = tmp_path / "peers.json"
    with running_server(create_app(AsyncEngine(engines[0]))) as first, \
            running_server(create_app(AsyncEngine(engines[1]))) as second:
        code = main(["bench", "peers", "--server", f"first={first}", "--server", f"second={second}",
                           "--repeat", "2", "--requests", "4", "--concurrency", "2", "--max-tokens", "3",
                           "--system-chars", "600", "--prompt-chars", "300", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert len(runs) == len(WORKLOAD_NAMES) * 2 * 2
    order = [(r["workload"], r["repeat"], r["server"]) for r in runs]
    assert order[:2] == [("shared", 0, "first"), ("shared", 0, "second")]
    assert ("shared", 1, "second") in order and order.index(("shared", 1, "second")) < order.index(("shared", 1, "first"))
    for run in runs:
        requests = SINGLE_STREAM_PROMPTS if run["workload"] == "single" else 4
        assert run["errors"] == 0 and run["output_tokens"] == requests * 3, run
    by = {(r["workload"], r["server"], r["repeat"]): r for r in runs}
    for server in ("first", "second"):
        for repeat in (0, 1):
            # the shared system prompt and earlier turns are found cached ...
            assert by[("shared", server, repeat)]["cached_share"] > 0.3
            assert by[("multiturn", server, repeat)]["cached_share"] > 0.3
            # ... a repeat finds nothing of the run before it (each run is tagged)
            assert by[("distinct", server, repeat)]["cached_share"] < 0.5
    assert set(result["ratios"]) == set(WORKLOAD_NAMES) and result["ratios_to"] == "first"
    assert result["ratios"]["shared"]["second"]["output_tok_s"] > 0
    assert "| shared | first |" in stdout and "| single | second |" in stdout


def test_rendered_prompts_are_the_tokens_the_server_renders_for_the_chat() -> None:
    """`--render-with`: the client's token ids for an agent step (tools and a tool result
    included) are exactly what the server renders for the same chat request, and sent as ids
    to /v1/completions they prefill that many tokens and stream exactly max_tokens."""
    import asyncio

    import httpx

    from radixserve.benchmark.peers import TokenRenderer, completion_payload, run_workload, stream_turn

    agent = build_workloads(["agent"], run_tag="t", **SMALL)[0]
    conversation = agent.conversations[0]
    messages: list[dict[str, object]] = [{"role": "system", "content": conversation.system}]
    append_turn(messages, conversation.turns[0], 0)
    messages.append({"role": "assistant", "content": "Let me look."})
    append_turn(messages, conversation.turns[1], 1)
    render = TokenRenderer("demo")
    ids = render(messages, conversation.tools)
    assert len(ids) > len(render(messages, None)) + 20  # the tools' block is in the ids

    async def both(url: str) -> tuple[RequestRecord, RequestRecord, list[RequestRecord]]:
        async with httpx.AsyncClient(timeout=60) as client:
            chat = await stream_turn(client, url, chat_payload(messages, conversation, 3, None))
            rendered = await stream_turn(client, url, completion_payload(ids, 3, None))
        _, turns = await run_workload(url, agent, max_tokens=3, model=None, timeout_s=60, render=render)
        return chat, rendered, turns

    with running_server(create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=256)))) as url:
        chat, rendered, turns = asyncio.run(both(url))
    assert chat.error is None and rendered.error is None
    assert chat.prompt_tokens == rendered.prompt_tokens == len(ids)
    assert rendered.completion_tokens == 3 and rendered.text
    assert len(turns) == agent.num_requests and all(t.error is None and t.completion_tokens == 3 for t in turns)
    first = render([{"role": "system", "content": conversation.system}, {"role": "user", "content": conversation.turns[0].user}],
                   conversation.tools)
    assert len(first) in {t.prompt_tokens for t in turns}  # a first step, rendered by the client


def _keyed_chat_app(key: str):
    """A scripted OpenAI-style chat server: 401 without `Authorization: Bearer key`, else
    `max_tokens` one-character chunks and a usage chunk."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def chat(request):  # noqa: ANN001, ANN202
        if request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        body = await request.json()

        async def events():  # noqa: ANN202
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.001)
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]}) + "\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": body["max_tokens"]}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n" + "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


PEERS_SMALL = ["--workloads", "shared", "--repeat", "1", "--requests", "2", "--concurrency", "2",
               "--max-tokens", "2", "--system-chars", "100", "--prompt-chars", "50"]


def test_a_server_down_or_refusing_the_key_is_reported_and_the_others_measured(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A down server (or a keyed one) was a RuntimeError traceback from the warm-up, with no
    table and no JSON for the healthy ones; there was no --api-key. The key comes from
    --api-key or $RADIXSERVE_API_KEY, as in `bench serve`."""
    from radixserve.ports import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
    with running_server(_keyed_chat_app("sk-test")) as keyed:
        for key_args, env in (([], "sk-test"), (["--api-key", "sk-test"], None), ([], None)):
            if env:
                monkeypatch.setenv("RADIXSERVE_API_KEY", env)
            else:
                monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
            out = tmp_path / "peers.json"
            code = main(["bench", "peers", "--server", f"keyed={keyed}", "--server", f"dead={dead}",
                         *PEERS_SMALL, *key_args, "--json", str(out)])
            captured = capsys.readouterr()
            assert code == 1 and "Traceback" not in captured.err
            result = json.loads(out.read_text())
            assert set(result["unreachable"]) == ({"dead"} if (key_args or env) else {"keyed", "dead"})
            assert "warm-up request failed: ConnectError" in result["unreachable"]["dead"]
            table = {line.split("|")[2].strip(): line for line in captured.out.splitlines() if line.startswith("| shared")}
            assert "warm-up request failed: ConnectError" in table["dead"]
            if key_args or env:  # measured: every request answered
                assert [(r["server"], r["errors"], r["output_tokens"]) for r in result["runs"]] == [("keyed", 0, 4)]
                assert "warm-up" not in table["keyed"]
            else:
                assert result["runs"] == [] and "HTTP 401" in table["keyed"]


def _turn(index: int, ttft: float, error: str | None = None) -> RequestRecord:
    return RequestRecord(index, prompt_tokens=100, cached_tokens=50, completion_tokens=4, ttft_s=ttft,
                         latency_s=ttft + 0.3, itl_s=[0.1, 0.1, 0.1], error=error)


def test_a_row_is_one_run_and_ratios_compare_the_same_requests() -> None:
    """Each column was its own median over repeats (with two repeats, averages no run had:
    wall 2.0 s and 3 tok/s from runs of 1 s / 12 tok/s and 3 s / 4 tok/s), the table had no
    errors, and ratios compared a server's successful requests with the baseline's, whichever
    those were."""
    from radixserve.benchmark.cli_peers import peers_table
    from radixserve.benchmark.peers import RunRecord, ratios, summarise

    runs = [RunRecord("a", "w", 0, 1.0, [_turn(0, 0.9), _turn(1, 0.1), _turn(2, 0.1)]),
            RunRecord("b", "w", 0, 1.0, [_turn(0, 5.0, "HTTP 500"), _turn(1, 0.2), _turn(2, 0.2)]),
            RunRecord("a", "w", 1, 3.0, [_turn(0, 0.1), _turn(1, 0.1), _turn(2, 0.1)]),
            RunRecord("b", "w", 1, 2.0, [_turn(0, 0.2), _turn(1, 0.2), _turn(2, 0.2)])]
    summary = summarise(runs)
    a, b = summary["w"]["a"], summary["w"]["b"]
    # the lower-median run by wall time, whole: repeat 0 for a (1 s of 1 s and 3 s), repeat 0 for b
    assert (a["repeat"], a["wall_s"], a["output_tok_s"]) == (0, 1.0, 12.0)
    assert a == {**runs[0].figures(), "repeat": 0, "errors_all_repeats": 0}
    assert (b["repeat"], b["errors"], b["errors_all_repeats"]) == (0, 1, 1)
    relative = ratios(runs, "a")["w"]["b"]
    # repeat 0 over requests 1 and 2 only (0.2 / 0.1), repeat 1 over all three (0.2 / 0.1)
    assert relative["ttft_p50_s"] == pytest.approx(2.0) and relative["ttft_p90_s"] == pytest.approx(2.0)
    # throughput only from the repeat where both completed everything: 12 / 4 tok/s... b 6 tok/s, a 4
    assert relative["output_tok_s"] == pytest.approx((12 / 2.0) / (12 / 3.0))
    table = peers_table(summary, ratios(runs, "a"), "a")
    header, _, row_a, row_b = table.splitlines()
    assert "| run |" in header and header.endswith("| errors (all repeats) |")
    assert row_a.startswith("| w | a | 1 | 1.0 | 12.0 |") and row_a.endswith("| 0 |")
    assert row_b.startswith("| w | b | 1 | 1.0 | 8.0 |") and row_b.endswith("| 1 |")


def test_a_second_invocation_against_the_same_server_is_cold(tmp_path: Path) -> None:
    """Every invocation tagged its prompts "[run 1] ...": a second `bench peers` against a
    long-running server found the first one's prompts in the radix cache (99% cached on
    `distinct`, where nothing is shared)."""
    argv = ["--workloads", "distinct", "--repeat", "1", "--requests", "2", "--concurrency", "2",
            "--max-tokens", "2", "--system-chars", "300", "--prompt-chars", "600"]
    results = []
    with running_server(create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=512)))) as url:
        for i in range(2):
            out = tmp_path / f"peers{i}.json"
            assert main(["bench", "peers", "--server", f"rs={url}", *argv, "--json", str(out)]) == 0
            results.append(json.loads(out.read_text()))
    first, second = (r["runs"][0]["cached_share"] for r in results)
    assert second < 0.5 and second <= first + 0.1, (first, second)
    assert results[0]["run_tags"] != results[1]["run_tags"]


def _scripted_reply_app(completion_tokens: int, call: bool = False):
    """A scripted chat server whose reply has no text: the role chunk, (with `call`, a tool
    call's delta,) the finishing chunk and a usage chunk reporting `completion_tokens` (what
    radixserve sends when the tokens a model wrote decode to nothing)."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def chat(request):  # noqa: ANN001, ANN202
        async def events():  # noqa: ANN202
            call_delta = {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                                                "function": {"name": "f", "arguments": "{}"}}]},
                          "finish_reason": None}
            for choice in ({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                           *([call_delta] if call else []), {"index": 0, "delta": {}, "finish_reason": "length"}):
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": completion_tokens}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n" + "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.mark.parametrize(("completion_tokens", "call"), [(2, False), (0, False), (0, True)])
def test_a_reply_with_no_text_is_timed_at_its_end_if_tokens_were_written(completion_tokens: int, call: bool) -> None:
    """The demo model sometimes writes two special tokens: the reply streamed no text, and
    `bench peers` called the request failed ("no content received") and the whole run red
    (a CI failure of test_a_second_invocation_against_the_same_server_is_cold). A reply of
    written tokens is timed at its finishing chunk; one of none still fails."""
    import asyncio

    import httpx

    from radixserve.benchmark.peers import stream_turn

    async def one(url: str) -> RequestRecord:
        async with httpx.AsyncClient(timeout=30) as client:
            return await stream_turn(client, url, {"messages": [], "max_tokens": 2, "stream": True})

    with running_server(_scripted_reply_app(completion_tokens, call)) as url:
        record = asyncio.run(one(url))
    if call:  # a tool call's delta is output, whatever the usage says (here none: it would have failed)
        assert record.error is None and record.text == "" and len(record.itl_s) == 0
        assert 0 < record.ttft_s <= record.latency_s
    elif completion_tokens:
        assert record.error is None and record.text == "" and record.itl_s == []
        assert 0 < record.ttft_s <= record.latency_s and record.completion_tokens == 2
    else:
        assert record.error == "no content received"
