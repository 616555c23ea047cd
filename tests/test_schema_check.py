"""radixserve/schema_check.py: every JSON Schema is checked against its meta-schema in a niced
child process, with the same answers as the check in process. jsonschema's pure-Python check
held the server's GIL: four addresses sending 47 KB tool schemas slowed another client's stream
from 1.6 s to 19 s, and once only schemas past 4 KiB went to the child, 64 tools of 4 KiB
(`allOf` of a thousand empty schemas, 180 ms each) made it 6x slower. The child takes the
waiting schemas round-robin by caller, gives up on one after CHECK_CPU_S of its CPU, and
verdicts are remembered per caller."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

import httpx
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.schema_check import (
    _CHECKER,
    CHECK_CPU_S,
    CheckBudget,
    SchemaProblem,
    _serve,
    check,
    checker_pid,
    checking_for,
    schema_problem,
)
from radixserve.server import create_app

INVALID_TYPE = SchemaProblem("invalid", "'integr' is not valid under any of the given schemas",
                             "['properties']['a']['type']")


def costly(n: int, tag: str = "") -> tuple[dict[str, object], str]:
    """An `allOf` of `n` empty schemas: about 0.2 ms of the check per schema, in any size."""
    schema = {"allOf": [{} for _ in range(n)], "description": tag}
    return schema, json.dumps(schema)


def answered_as(caller: object, schema: dict[str, object]) -> SchemaProblem | None:
    return checking_for(CheckBudget(caller), lambda: schema_problem(schema, json.dumps(schema)))


def test_every_schema_is_checked_in_a_niced_child_with_the_in_process_answers() -> None:
    """A 40-character schema too: size says little of a check's time (4 KiB of `allOf`: 180 ms)."""
    before = _CHECKER.answers
    invalid = {"type": "object", "properties": {"a": {"type": "integr"}}}
    assert answered_as("first", invalid) == check(invalid) == INVALID_TYPE
    overflow = {"type": "string", "pattern": "a{4294967296}"}
    answer = answered_as("first", overflow)
    assert answer is not None and answer.kind == "pattern" and answer == check(overflow)
    assert answered_as("first", {"type": "integer", "minimum": 0}) is None
    assert _CHECKER.answers == before + 3
    pid = checker_pid()
    assert pid is not None and pid != os.getpid()
    assert os.getpriority(os.PRIO_PROCESS, pid) >= 10


def test_a_verdict_is_remembered_for_its_caller_only() -> None:
    """An agent sends the same tools every turn: checked once. Another caller's check of the
    same schema is its own (else its timing would tell that someone had sent it)."""
    schema = {"type": "object", "properties": {"a": {"type": "integr"}}, "description": "remembered"}
    before = _CHECKER.answers
    assert answered_as("alice", schema) == INVALID_TYPE
    assert answered_as("alice", schema) == INVALID_TYPE
    assert _CHECKER.answers == before + 1
    assert answered_as("bob", schema) == INVALID_TYPE
    assert _CHECKER.answers == before + 2 and _CHECKER.answered[-1] == "bob"


def test_the_caller_that_used_the_child_least_goes_next() -> None:
    """Three slow schemas of one caller are queued (one in the child, two waiting) when another
    caller's schema arrives: the caller that has used the child least goes next, so it waits
    for the one being checked only."""
    slow_answers: list[SchemaProblem | None] = []
    threads = [threading.Thread(target=lambda i=i: slow_answers.append(answered_as("flood", costly(3000, str(i))[0])))
               for i in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while _CHECKER.waiting < 2 and time.monotonic() < deadline:  # the first is in the child
        time.sleep(0.01)
    assert _CHECKER.waiting == 2
    assert answered_as("innocent", {"type": "string", "description": "round robin"}) is None
    for thread in threads:
        thread.join()
    assert list(_CHECKER.answered)[-4:] == ["flood", "innocent", "flood", "flood"]
    assert all(a is None or a.kind == "costly" for a in slow_answers)  # (~0.5 s each: past 1 s on a slow machine)


def test_the_child_gives_up_on_a_costly_schema_and_carries_on() -> None:
    """CPU time, not the clock: the 2,000-schema `allOf` takes about 0.4 s of CPU, its line
    gives it 0.05 s; the next line is answered as usual, and each answer says its time."""
    out = io.StringIO()
    _serve(io.StringIO(f"0.05 {costly(2000)[1]}\n1.0 {json.dumps({'type': 'integr'})}\n"), out)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["problem"] == {"kind": "costly", "message": "more than 0.05 s", "where": ""}
    assert 0.05 <= first["cpu_s"] < 1 and second["problem"]["kind"] == "invalid"
    assert SchemaProblem(**first["problem"]).describe("tools[0].function.parameters") == (
        "tools[0].function.parameters: the schema takes too long to check (more than 0.05 s)")
    assert signal.getsignal(signal.SIGVTALRM) is signal.SIG_DFL


def test_a_requests_schemas_share_one_budget_of_the_childs_time() -> None:
    """64 tools of 4 KiB `allOf`s took 11 s of checks a request, holding a slot that starts
    requests: a request's schemas share REQUEST_CPU_S (here 0.02 s). The first runs out of it
    in the child; the rest are refused without a check, however cheap. One schema alone gets
    CHECK_CPU_S."""
    before = _CHECKER.answers

    def checks() -> list[SchemaProblem | None]:
        return [schema_problem(schema, json.dumps(schema)) for schema in
                (costly(2000, "budget")[0], costly(10, "budget")[0], {"type": "string", "description": "budget"})]

    budget = CheckBudget("budgeted", 0.02)
    assert checking_for(budget, checks) == [SchemaProblem("costly", "the request's schemas, more than 0.02 s")] * 3
    # A chat's second check (its reply's constraint) takes from the same budget: nothing left.
    assert checking_for(budget, lambda: schema_problem({"type": "integer"}, '{"type": "integer"}')) == (
        SchemaProblem("costly", "the request's schemas, more than 0.02 s"))
    assert _CHECKER.answers == before + 1
    assert answered_as("budgeted", costly(10, "budget")[0]) is None  # not remembered: a new request's budget
    assert answered_as("budgeted", costly(20000, "alone")[0]) == SchemaProblem("costly", f"more than {CHECK_CPU_S:g} s")


def test_a_dead_child_is_replaced() -> None:
    assert answered_as("first", {"type": "string", "description": "before"}) is None
    first = checker_pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)  # as the system's OOM killer would
    assert answered_as("first", {"type": "string", "description": "after"}) is None
    assert checker_pid() not in (None, first)


def test_the_child_answers_a_schema_too_deep_to_decode_and_carries_on() -> None:
    """The server encoded it; the child, decoding with less stack to spare, hit its recursion
    limit, died with a traceback in the server's log, and was started again for the next."""
    deep = '{"items": ' * 5000 + "{}" + "}" * 5000
    out = io.StringIO()
    _serve(io.StringIO(f"1.0 {deep}\n1.0 {json.dumps({'type': 'integr'})}\n"), out)
    first, second = (json.loads(line)["problem"] for line in out.getvalue().splitlines())
    assert first == {"kind": "nested", "message": "nested too deeply", "where": ""}
    assert second["kind"] == "invalid"


def test_the_server_checks_each_clients_schemas_as_that_clients() -> None:
    """Two addresses send the same bad tool schema twice: each gets its 400 every time, and the
    child checks it once per address (the server passes the client's fair-share key)."""
    schema = {"type": "object", "properties": {"a": {"type": "integr"}}, "description": "per client"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    with running_server(create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=256)))) as url:
        before = _CHECKER.answers
        for address in ("127.0.0.1", "127.0.0.2"):
            with httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60) as client:
                for _ in range(2):
                    response = client.post(f"{url}/v1/chat/completions", json=body)
                    assert response.status_code == 400, response.text
                    assert response.json()["error"]["param"] == "tools[0].function.parameters"
    new = list(_CHECKER.answered)[-2:]
    assert _CHECKER.answers == before + 2
    assert new[0] != new[1] and all(key[0] == "address" for key in new)
