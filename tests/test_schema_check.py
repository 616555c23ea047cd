"""radixserve/schema_check.py: a large JSON Schema is checked against its meta-schema in a
niced child process (pure-Python jsonschema held the server's GIL against the engine: an
attack round's four addresses sending 47 KB tool schemas slowed another client's stream
from 1.6 s to 19 s), with the same answers as the check in process; a small one in process."""

from __future__ import annotations

import io
import json
import os
import signal

from radixserve.schema_check import IN_PROCESS_CHARS, SchemaProblem, _serve, check, checker_pid, schema_problem


def large(properties: dict[str, object]) -> tuple[dict[str, object], str]:
    """An object schema of `properties` padded past IN_PROCESS_CHARS with plain ones."""
    schema = {"type": "object", "properties": {**properties, **{f"pad{i}": {"type": "string", "description": "x" * 100}
                                                                for i in range(IN_PROCESS_CHARS // 100)}}}
    return schema, json.dumps(schema)


def test_a_large_schema_is_checked_in_a_niced_child_with_the_in_process_answers() -> None:
    valid, source = large({"a": {"type": "integer", "minimum": 0}})
    assert len(source) > IN_PROCESS_CHARS
    assert schema_problem(valid, source) is None
    pid = checker_pid()
    assert pid is not None and pid != os.getpid()
    assert os.getpriority(os.PRIO_PROCESS, pid) >= 10
    invalid, source = large({"a": {"type": "integr"}})
    assert schema_problem(invalid, source) == check(invalid) == SchemaProblem(
        "invalid", "'integr' is not valid under any of the given schemas", "['properties']['a']['type']")
    overflow, source = large({"a": {"type": "string", "pattern": "a{4294967296}"}})
    answer = schema_problem(overflow, source)
    assert answer is not None and answer.kind == "pattern" and answer == check(overflow)
    assert checker_pid() == pid  # one child serves them all


def test_a_small_schema_is_checked_in_process_and_a_dead_child_is_replaced() -> None:
    small = {"type": "object", "properties": {"a": {"type": "integr"}}}
    assert schema_problem(small, json.dumps(small)) == SchemaProblem(
        "invalid", "'integr' is not valid under any of the given schemas", "['properties']['a']['type']")
    valid, source = large({})
    assert schema_problem(valid, source) is None
    first = checker_pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)  # as the system's OOM killer would
    assert schema_problem(valid, source) is None  # answered (in process, or by a new child)
    assert schema_problem(valid, source) is None
    assert checker_pid() not in (None, first)


def test_the_child_answers_a_schema_too_deep_to_decode_and_carries_on() -> None:
    """The server encoded it; the child, decoding with less stack to spare, hit its recursion
    limit, died with a traceback in the server's log, and was started again for the next."""
    deep = '{"items": ' * 5000 + "{}" + "}" * 5000
    out = io.StringIO()
    _serve(io.StringIO(deep + "\n" + json.dumps({"type": "integr"}) + "\n"), out)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first == {"kind": "nested", "message": "nested too deeply", "where": ""}
    assert second["kind"] == "invalid"
