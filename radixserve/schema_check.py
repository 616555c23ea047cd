"""Whether a JSON Schema is valid under its meta-schema (draft 2020-12), checked out of the
server's way when it is large.

jsonschema's check is pure Python, and slow in the meta-schema's `$dynamicRef` resolution
(240 plain properties: 70 ms; 240 small objects using propertyNames/allOf/if: 450 ms). Run on
the server's threads it held the GIL against the engine's thread: four addresses sending 47 KB
tool schemas, every request refused anyway (its prompt over the context), made another
client's stream take 19 s instead of 1.6 s (profiled: 942 of 1,200 samples of the GIL held by
the checks, 12 by the engine). A schema of more than IN_PROCESS_CHARS characters is therefore
checked in a child process (`python -m radixserve.schema_check`: a plain subprocess, so a
library user's script is not imported again, as multiprocessing's spawn would), at a lower
CPU priority than the server's, one at a time (the callers' fair slots decide whose turn it
is); a small one, a millisecond or two, in the caller's thread.

This module imports nothing of radixserve's: the child runs it alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import jsonschema

IN_PROCESS_CHARS = 4096  # a schema this short is checked in the caller's thread (~1-2 ms)
CHILD_NICENESS = 10  # the checking process's niceness: the engine's threads come first


@dataclass(frozen=True)
class SchemaProblem:
    """Why a schema is not valid JSON Schema: `kind` is "invalid" (`where`: the path in the
    schema, e.g. "['properties']['a']"; `message`: jsonschema's), "pattern" (a pattern that
    cannot be compiled) or "nested" (nested past what the checker recurses through)."""

    kind: str
    message: str
    where: str = ""

    def describe(self, param: str) -> str:
        """The one-line error for the request field `param` that held the schema."""
        if self.kind == "invalid":
            return f"{param}: invalid JSON Schema at {self.where or 'the top'}: {self.message}"
        if self.kind == "pattern":
            return f"{param}: a pattern of the schema cannot be compiled: {self.message}"
        return f"{param}: the schema is nested too deeply"


def check(schema: Any) -> SchemaProblem | None:
    """The check itself, in this process: None if `schema` is valid, else why not."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in exc.path)
        return SchemaProblem("invalid", exc.message, where)
    except OverflowError as exc:  # re's answer to a repetition count past 2**32 - 1 in a pattern
        return SchemaProblem("pattern", str(exc))
    except RecursionError:
        return SchemaProblem("nested", "nested too deeply")
    return None


class _Checker:
    """The child process and the lock around one exchange with it (a line of schema JSON in,
    a line of SchemaProblem JSON or null out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None or process.poll() is not None else process.pid

    def run(self, source: str) -> SchemaProblem | None | bool:
        """The child's answer for `source` (one line of JSON), or False when it could not
        answer (it died: the next call starts another)."""
        with self._lock:
            try:
                process = self._started()
                assert process.stdin is not None and process.stdout is not None
                process.stdin.write(source + "\n")
                process.stdin.flush()
                answer = process.stdout.readline()
            except OSError:
                answer = ""
            if not answer:
                self._stop()
                return False
        value = json.loads(answer)
        return None if value is None else SchemaProblem(**value)

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "radixserve.schema_check"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, encoding="utf-8", bufsize=1)
            try:
                os.setpriority(os.PRIO_PROCESS, self._process.pid, CHILD_NICENESS)
            except OSError:
                pass  # (not allowed here: it runs at the server's priority)
        return self._process

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None


_CHECKER = _Checker()


def schema_problem(schema: Any, source: str) -> SchemaProblem | None:
    """None if `schema` (whose JSON text is `source`) is valid under the 2020-12 meta-schema,
    else why not; in the child process past IN_PROCESS_CHARS characters."""
    if len(source) <= IN_PROCESS_CHARS:
        return check(schema)
    answer = _CHECKER.run(source)
    return check(schema) if answer is False else answer  # type: ignore[return-value]


def checker_pid() -> int | None:
    """The checking child's pid while it runs (for tests and operators)."""
    return _CHECKER.pid


def _serve(lines: TextIO, out: TextIO) -> None:
    """The child: a schema per line in, its problem (or null) per line out, until EOF."""
    for line in lines:
        try:
            problem = check(json.loads(line))
        except RecursionError:  # decoding nests as deep as the server's encoding did, with less room
            problem = SchemaProblem("nested", "nested too deeply")
        out.write(json.dumps(None if problem is None else asdict(problem)) + "\n")
        out.flush()


if __name__ == "__main__":
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    _serve(sys.stdin, sys.stdout)
