"""Generated turns spliced into later prompts, and system prompts that templates inject."""

from __future__ import annotations

import asyncio
import copy
import tracemalloc
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve import AsyncEngine, Engine
from radixserve.models.demo import demo_checkpoint_dir
from radixserve.server.app import create_app
from radixserve.server.prompts import ChatRenderer, injected_system_text, render_chat
from radixserve.server.protocol import ChatMessage
from radixserve.server.turns import UNIT_BYTES, GeneratedTurns, entry_units
from tests.server_util import running_server

# SmolLM2-Instruct's template: a default system block when the messages bring none.
INJECTING_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRIMMING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(demo_checkpoint_dir())


def with_template(tokenizer: PreTrainedTokenizerBase, template: str) -> PreTrainedTokenizerBase:
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def messages(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]


def odd_split(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text` as one token per character: ids its plain encoding never gives."""
    ids = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
    assert ids != tokenizer.encode(text, add_special_tokens=False) and tokenizer.decode(ids) == text
    return ids


# ---------------------------------------------------------------- the memory


def test_turns_are_bounded_by_tokens_and_forget_the_least_recent() -> None:
    a, b, c = entry_units(None, "a", [1] * 4), entry_units(None, "b", [1] * 4), entry_units(None, "c", [1] * 3)
    turns = GeneratedTurns(max_tokens=a + b + c - 1)  # any two, not three
    turns.remember(None, "a", [1, 2, 3, 4])
    turns.remember(None, "b", [5, 6, 7, 8])
    assert turns.recall(None, "a") == [1, 2, 3, 4]  # now b is the least recent
    turns.remember(None, "c", [9, 10, 11])
    assert turns.recall(None, "b") is None
    assert turns.recall(None, "a") == [1, 2, 3, 4] and turns.recall(None, "c") == [9, 10, 11]
    assert turns.num_tokens == a + c and len(turns) == 2
    turns.remember(None, "huge", list(range(a + b + c)))  # larger than the whole memory: not kept
    turns.remember(None, "one", [1])  # too short to matter
    assert turns.recall(None, "huge") is None and turns.recall(None, "one") is None
    assert turns.num_tokens == a + c


def test_an_entry_is_charged_what_it_holds_besides_its_ids() -> None:
    """Counting ids alone, a flood of 2-id answers under long salts took 349 MiB of a bound
    documented as 4 MiB: each entry is charged its text, its scope's strings and its
    bookkeeping too, so the memory traced stays within the bound."""
    bound = 1 << 16  # 256 KiB in 4-byte units
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        turns = GeneratedTurns(max_tokens=bound)
        for i in range(3000):
            turns.remember(("tenant", f"{i:0256d}"), f"Answer {i:08d}.", [17, 42], "tenant")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < turns.num_tokens <= bound and len(turns) < 3000  # the bound was reached
    assert held <= bound * UNIT_BYTES, held
    assert entry_units(("t", "s" * 256), "abc", [1, 2]) - entry_units(("t", "s"), "abc", [1, 2]) == 255 // UNIT_BYTES + 1


def test_one_tenants_turns_do_not_push_out_anothers_within_its_share() -> None:
    """Past the bound the tenant holding the most loses its least recent turn: b's flood of
    answers pushes out its own, never a's (which holds less than half); alone, a tenant has
    the whole memory."""
    unit = entry_units(("b", None), "b's answer 0", [5, 6, 7, 8])  # each of b's answers (and a's, within 1)
    turns = GeneratedTurns(max_tokens=5 * unit)
    turns.remember(("a", None), "a's answer", [1, 2, 3, 4], "a")
    for i in range(10):
        turns.remember(("b", None), f"b's answer {i}", [5, 6, 7, 8], "b")
    assert turns.recall(("a", None), "a's answer") == [1, 2, 3, 4]
    assert turns.held("a") == entry_units(("a", None), "a's answer", [1, 2, 3, 4]) and turns.held("b") == 4 * unit
    assert [turns.recall(("b", None), f"b's answer {i}") is not None for i in range(10)] == [False] * 6 + [True] * 4
    alone = GeneratedTurns(max_tokens=5 * unit)
    for i in range(5):
        alone.remember(("b", None), f"b's answer {i}", [5, 6, 7, 8], "b")
    assert alone.num_tokens == 5 * unit and len(alone) == 5


def test_turns_are_scoped() -> None:
    turns = GeneratedTurns()
    turns.remember("tenant-a", "again", [1, 2])
    turns.remember("tenant-a", "again", [3, 4, 5])  # the same text generated anew: its latest ids
    assert turns.recall("tenant-a", "again") == [3, 4, 5] and len(turns) == 1
    turns.remember("tenant-a", "Hello there", [1, 2, 3])
    assert turns.recall("tenant-b", "Hello there") is None
    assert turns.recall(None, "Hello there") is None
    assert turns.recall("tenant-a", "Hello there") == [1, 2, 3]


# ---------------------------------------------------------------- rendering


def test_generated_ids_are_spliced_where_the_history_holds_their_text(tokenizer: PreTrainedTokenizerBase) -> None:
    renderer = ChatRenderer(tokenizer, GeneratedTurns())
    first = messages(("system", "Be brief."), ("user", "Tell me about pages."))
    first_ids, _ = renderer.render(first)
    answer = "Pages hold\n\nKV slots."
    generated = odd_split(tokenizer, answer)
    renderer.turns.remember(None, answer, generated)
    second = first + messages(("assistant", answer), ("user", "And trees?"))
    ids, system_tokens = renderer.render(second)
    assert ids[: len(first_ids)] == first_ids
    assert ids[len(first_ids): len(first_ids) + len(generated)] == generated
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.text()} for m in second], tokenize=False, add_generation_prompt=True)
    assert system_tokens == render_chat(tokenizer, second)[1] > 0
    # Another scope, or no memory at all: plain encoding.
    plain = render_chat(tokenizer, second)[0]
    assert renderer.render(second, "other scope")[0] == plain != ids


def test_a_generated_answer_writing_a_special_tokens_string_is_spliced_as_generated(
        tokenizer: PreTrainedTokenizerBase) -> None:
    """Client text is defused before rendering (prompts.py), but an answer is looked up by the
    text it was generated as: one that wrote `<|im_end|>` as characters is still spliced in."""
    renderer = ChatRenderer(tokenizer, GeneratedTurns())
    first = messages(("user", "Echo it."))
    first_ids, _ = renderer.render(first)
    answer = "ok <|im_end|> done"
    generated = odd_split(tokenizer, answer)  # ids that encoding the text would not give
    assert generated != tokenizer.encode(answer, add_special_tokens=False, split_special_tokens=True)
    renderer.turns.remember(None, answer, generated)
    ids, _ = renderer.render(first + messages(("assistant", answer), ("user", "More.")))
    assert ids[len(first_ids): len(first_ids) + len(generated)] == generated


def test_a_recalled_turn_after_a_special_tokens_string_keeps_that_string_spelled_out(
        tokenizer: PreTrainedTokenizerBase) -> None:
    """The text between recalled turns is client text too: its special tokens' strings stay
    characters (encoded plainly, they were placeholders, or real special tokens)."""
    renderer = ChatRenderer(tokenizer, GeneratedTurns())
    answer = "Sure, here it is."
    generated = odd_split(tokenizer, answer)
    renderer.turns.remember(None, answer, generated)
    conversation = messages(("user", "quote <|im_end|> please"), ("assistant", answer),
                            ("user", "and <|im_start|>system again"))
    ids, _ = renderer.render(conversation)
    assert any(ids[k: k + len(generated)] == generated for k in range(len(ids)))  # spliced
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.text()} for m in conversation], tokenize=False, add_generation_prompt=True)
    specials = set(tokenizer.all_special_ids)
    assert sum(i in specials for i in ids) == sum(i in specials for i in render_chat(tokenizer, conversation)[0])


def test_a_turn_is_remembered_only_when_its_ids_are_its_text() -> None:
    """The ids are spliced back where the text comes back: only a finished answer ("stop" or
    "length") whose ids, less a trailing end token, decode to exactly its text. Not one with a
    special token inside (its text leaves the token out: the next prompt would hold a real
    special token the client never sent), not one a stop string cut short (its ids run past
    the text), not an aborted one."""
    from radixserve.server.formatting import ChoiceResult

    engine = Engine(model="demo", page_size=16, num_pages=64)
    server = create_app(AsyncEngine(engine)).state.server
    tokenizer = engine.tokenizer
    end = tokenizer.eos_token_id
    inside = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode([inside], skip_special_tokens=True) == "" and inside != end  # the text leaves it out
    hello, more = odd_split(tokenizer, "Hello there"), odd_split(tokenizer, " more")
    cases = {
        "whole, its end token trailing": (ChoiceResult("Hello there more", hello + more + [end], [], "stop"), True),
        "cut by max_tokens": (ChoiceResult("Hello there more", hello + more, [], "length"), True),
        "a special token inside": (ChoiceResult("Hello there more", hello + [inside] + more + [end], [], "stop"), False),
        "an end token inside": (ChoiceResult("Hello there more", hello + [end] + more + [end], [], "stop"), False),
        "cut by a stop string": (ChoiceResult("Hello there", hello + more, [], "stop"), False),
        "aborted": (ChoiceResult("Hello there more", hello + more, [], "abort"), False),
    }
    for name, (result, kept) in cases.items():
        server.turns = GeneratedTurns()
        server._remember_turn("scope", "tenant", result)
        recalled = server.turns.recall("scope", result.text)
        assert recalled == ([i for i in result.token_ids if i != end] if kept else None), name
        assert server.turns.held("tenant") == (entry_units("scope", result.text, recalled) if kept else 0), name


def test_a_template_that_changes_the_text_gets_plain_encoding(tokenizer: PreTrainedTokenizerBase) -> None:
    trimming = with_template(tokenizer, TRIMMING_TEMPLATE)
    renderer = ChatRenderer(trimming, GeneratedTurns())
    answer = " spaced answer "
    renderer.turns.remember(None, answer, odd_split(trimming, answer))
    conversation = messages(("user", "q"), ("assistant", answer), ("user", "more"))
    assert renderer.render(conversation) == render_chat(trimming, conversation)


def test_an_injected_system_block_counts_as_the_system_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    injecting = with_template(tokenizer, INJECTING_TEMPLATE)
    block = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert injected_system_text(injecting) == block
    assert injected_system_text(tokenizer) == ""  # the demo template injects nothing
    ids, system_tokens = render_chat(injecting, messages(("user", "hi")))
    assert ids[:system_tokens] == tokenizer.encode(block, add_special_tokens=False)
    assert tokenizer.decode(ids[:system_tokens]) == block
    # A system message the client sends replaces the default and is counted as before.
    sent = render_chat(injecting, messages(("system", "Rules."), ("user", "hi")))
    assert tokenizer.decode(sent[0][: sent[1]]) == "<|im_start|>system\nRules.<|im_end|>\n"
    assert render_chat(tokenizer, messages(("user", "hi")))[1] == 0


# ---------------------------------------------------------------- over HTTP


@pytest.mark.parametrize("stream", [False, True])
def test_multi_turn_chat_is_cached_through_the_previous_answer(stream: bool) -> None:
    """Turn k+1 finds turn k's prompt and all of its answer but the last token in the cache.

    Sampled answers of a random model are strings of odd tokens that re-encode differently:
    without the memory of generated turns the match stops inside them (checked, so this
    test exercises the splice)."""
    cached, expected = _conversation(stream, memory=True)
    assert cached == expected
    cached, expected = _conversation(stream, memory=False)
    assert any(c < e for c, e in zip(cached, expected))


@pytest.mark.parametrize("partial", [True, False])
def test_multi_turn_chat_at_page_size_16_is_cached_through_the_partial_page(partial: bool) -> None:
    """At page size 16 a turn's last, partly filled page is cached too (cache_partial_pages),
    so the next turn still finds all but the previous answer's last token; without it, only
    the whole pages of that."""
    cached, expected = _conversation(False, memory=True, page_size=16, partial=partial)
    if partial:
        assert cached == expected
    else:
        assert cached == [e // 16 * 16 for e in expected] and cached != expected


def test_answers_are_decoded_off_the_event_loop_and_remembered_before_the_response_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Remembering a turn decodes its tokens to compare them with its text: in a worker thread,
    not on the event loop that serves every other stream. The turn is remembered by the time
    its response (or stream) ends, so the next turn of the conversation finds it."""
    engine = Engine(model="demo", page_size=16, num_pages=256)
    app = create_app(AsyncEngine(engine))
    decode = engine.tokenizer.decode
    on_the_loop: list[bool] = []

    def recording_decode(*args: Any, **kwargs: Any) -> str:
        on_the_loop.append(_in_an_event_loop())
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "decode", recording_decode)
    with running_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": f"Say something, stream={stream}."}], "max_tokens": 12,
                    "temperature": 1.0, "seed": 3, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            text, _ = _answer(response, stream)
            assert app.state.server.turns.recall(None, text) is not None
    assert on_the_loop and not any(on_the_loop)


def _in_an_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _conversation(stream: bool, *, memory: bool, turns: int = 4, page_size: int = 1,
                  partial: bool = True) -> tuple[list[int], list[int]]:
    """(cached tokens of turns 2.., previous prompt + completion - 1 for each of them)."""
    engine = Engine(model="demo", page_size=page_size, num_pages=4096 // page_size, cache_partial_pages=partial)
    app = create_app(AsyncEngine(engine), turn_memory_tokens=4096 if memory else 0)
    history = [{"role": "system", "content": "You answer questions about caches."}]
    cached, expected = [], []
    previous = 0  # the previous turn's prompt + completion - 1
    with running_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        for turn in range(turns):
            history.append({"role": "user", "content": f"Question number {turn}: what is a radix tree?"})
            body = {"messages": history, "max_tokens": 24, "temperature": 1.0, "seed": turn, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            text, usage = _answer(response, stream)
            if turn:  # the last generated token (EOS, or the 24th) was never computed
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
                expected.append(previous)
            previous = usage["prompt_tokens"] + usage["completion_tokens"] - 1
            history.append({"role": "assistant", "content": text})
    return cached, expected


def _answer(response: httpx.Response, stream: bool) -> tuple[str, dict]:
    if not stream:
        data = response.json()
        return data["choices"][0]["message"]["content"], data["usage"]
    from tests.server_util import sse_chunks

    chunks = sse_chunks(response.text)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]
