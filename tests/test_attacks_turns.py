"""Generated turns (server/turns.py) must not cross tenants: a real server with API keys, real httpx.

The server remembers how recent chat answers were tokenized, keyed by their text, and splices
those ids in when a later request sends the text back as an assistant message. The key was the
request's `cache_salt` alone, so two tenants without a salt (or with the same one) shared it: a tenant that sent back
a guessed answer text saw from `usage.prompt_tokens` (the generated ids, which differ from a
fresh encoding) whether anyone had recently been given exactly that answer, i.e. asked that
question (greedy answers are a function of the prompt). The key now includes the tenant.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.tenancy import Caller

KEYS = {"sk-victim": Caller(tenant="victim", admin=False), "sk-spy": Caller(tenant="spy", admin=False)}
QUESTION = "what is my diagnosis, doctor?"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server(create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=512)),
                                   tenant_keys=KEYS)) as base:
        yield base


def _chat(url: str, key: str, messages: list[dict], **extra) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"messages": messages, "max_tokens": 24, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _probe(url: str, key: str, answer: str, **extra) -> int:
    """The prompt tokens of a conversation that sends `answer` back as the assistant's turn."""
    return _chat(url, key, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": answer},
                            {"role": "user", "content": "thanks"}], max_tokens=1, **extra)["usage"]["prompt_tokens"]


@pytest.mark.parametrize("salt", [None, "the-same-salt"])
def test_a_tenant_cannot_tell_from_prompt_tokens_what_another_was_answered(url: str, salt: str | None) -> None:
    shared = {} if salt is None else {"cache_salt": salt}
    # The spy learns the greedy answer to a question in a salted namespace of its own (one
    # whose generated ids differ in number from a fresh encoding of its text).
    for i in range(40):
        question = f"{QUESTION} ({salt}, {i})"
        answer = _chat(url, "sk-spy", [{"role": "user", "content": question}], cache_salt="learn")
        answer = answer["choices"][0]["message"]["content"]
        fresh = _probe(url, "sk-spy", answer, cache_salt="never-used")  # the text encoded afresh
        remembered = _probe(url, "sk-spy", answer, cache_salt="learn")  # its own generated ids
        if remembered != fresh:
            break
    assert remembered != fresh, "no answer re-encodes to other ids: the probe would show nothing"
    before = _probe(url, "sk-spy", answer, **shared)  # nobody in this scope has been answered this yet
    assert before == fresh
    # The victim asks the question (no salt, or the spy's); the spy probes again in that scope.
    victim = _chat(url, "sk-victim", [{"role": "user", "content": question}], **shared)
    assert victim["choices"][0]["message"]["content"] == answer
    assert _probe(url, "sk-spy", answer, **shared) == fresh
    # The victim's own later turns still use the ids it was given.
    assert _probe(url, "sk-victim", answer, **shared) == remembered


def test_a_turn_is_remembered_as_its_tenants_so_another_tenants_flood_pushes_out_its_own_and_a_flush_all() -> None:
    """The memory's fair share is by tenant (turns.py): the server must remember a turn under
    the tenant whose key asked for it (under None, one tenant's flood of answers pushes out
    every other tenant's turns). A flush forgets them all."""
    app = create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=256)), tenant_keys=KEYS,
                     admin_api_key="sk-admin")
    with running_server(app) as base:
        victim = _chat(base, "sk-victim", [{"role": "user", "content": QUESTION}])["choices"][0]["message"]["content"]
        turns = app.state.server.turns
        assert turns.held("victim") > 0 and turns.held(None) == 0
        assert turns.recall(("victim", None), victim) is not None
        turns.max_tokens = 3 * turns.held("victim")  # room for about three answers
        for i in range(6):
            _chat(base, "sk-spy", [{"role": "user", "content": f"flood {i}"}])
        assert turns.recall(("victim", None), victim) is not None  # the spy's flood pushed out its own
        assert turns.held("spy") > 0
        # An admin's flush forgets the answers too (their texts and ids), not only the pages.
        assert httpx.post(f"{base}/v1/cache/flush", headers={"Authorization": "Bearer sk-admin"}).status_code == 200
        assert turns.recall(("victim", None), victim) is None and turns.num_tokens == 0 and len(turns) == 0
