"""Whether a JSON Schema is valid under its meta-schema (draft 2020-12), checked out of the
server's way.

jsonschema's check is pure Python, and slow in the meta-schema's `$dynamicRef` resolution
(240 plain properties: 70 ms; 240 small objects using propertyNames/allOf/if: 450 ms; an
`allOf` of a thousand empty schemas, 4 KiB of text: 180 ms). Run on the server's threads it
held the GIL against the engine's thread: four addresses sending 47 KB tool schemas made
another client's stream take 19 s instead of 1.6 s, and, once only schemas past 4 KiB went
to a child, 64 tools of 4 KiB each (11 s of checks a request) made it 6x slower. Every schema
is therefore checked in a child process (`python -m radixserve.schema_check`: a plain
subprocess, so a library user's script is not imported again, as multiprocessing's spawn
would) at a lower CPU priority than the server's, one schema at a time:

- the next schema is the waiting one of the caller (the server passes the request's tenant,
  or client address: `checking_for`) that has used the least of the child's CPU time lately
  (halved every USAGE_HALF_LIFE_S), round-robin among equals: another client's cheap schema
  waits for the one being checked, not for a queue of slow ones (four addresses with 64 KiB
  schemas kept another client's 6 KB schema waiting 86 s behind a lock);
- a request's schemas get REQUEST_CPU_S seconds of the child's CPU time together, one
  schema at most CHECK_CPU_S: past that the check gives up (kind "costly": the request is
  refused). A request holds one of the server's slots for starting requests while it is
  checked (`--tenant-starts`), and four addresses sending 64 tools of those 4 KiB schemas (11 s
  of checks a request) kept another client's plain chat from starting for 40 s;
- a verdict is remembered per caller and schema (VERDICTS of them): an agent sends the same
  tools every turn. Per caller: no client learns from its timing what another has sent.

The server waits for the answer in a worker thread, which holds no GIL while it waits. Where
no child can be started, the check runs in the caller's thread.

This module imports nothing of radixserve's: the child runs it alone.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO, TypeVar

import jsonschema

# The child's CPU seconds for one schema, and for all of a request's, before it gives up
# (kind "costly"). A 63 KiB schema of 600 plain properties takes 0.11 s; 128 such tools,
# more than a request may carry (256 KiB of schemas), about 0.45 s.
CHECK_CPU_S = 1.0
REQUEST_CPU_S = 2.0
CHILD_NICENESS = 10  # the checking process's niceness: the engine's threads come first
VERDICTS = 4096  # (caller, schema) verdicts remembered, least recently used forgotten first
USAGE_HALF_LIFE_S = 30.0  # how fast a caller's use of the child's CPU is forgotten
USAGE_CALLERS = 4096  # callers whose use is remembered (the least used forgotten first)

T = TypeVar("T")


@dataclass
class CheckBudget:
    """A request's schema checks: whose they are (`key`: the server's tenant or client address)
    and the child's CPU seconds they may take together (`left_s` of `budget_s`)."""

    key: Hashable = None
    budget_s: float = REQUEST_CPU_S

    def __post_init__(self) -> None:
        self.left_s = self.budget_s


_budget: contextvars.ContextVar[CheckBudget | None] = contextvars.ContextVar("schema_check_budget", default=None)


@dataclass(frozen=True)
class SchemaProblem:
    """Why a schema is not valid JSON Schema: `kind` is "invalid" (`where`: the path in the
    schema, e.g. "['properties']['a']"; `message`: jsonschema's), "pattern" (a pattern that
    cannot be compiled), "nested" (nested past what the checker recurses through) or "costly"
    (the check took more of the child's CPU than the schema, or its request, had left)."""

    kind: str
    message: str
    where: str = ""

    def describe(self, param: str) -> str:
        """The one-line error for the request field `param` that held the schema."""
        if self.kind == "invalid":
            return f"{param}: invalid JSON Schema at {self.where or 'the top'}: {self.message}"
        if self.kind == "pattern":
            return f"{param}: a pattern of the schema cannot be compiled: {self.message}"
        if self.kind == "costly":
            return f"{param}: the schema takes too long to check ({self.message})"
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


@dataclass
class _Job:
    """One schema waiting for the child, and its answer once `done` is set."""

    source: str
    cpu_s: float  # the child's CPU time it may take
    done: threading.Event = field(default_factory=threading.Event)
    answer: SchemaProblem | None | bool = False
    used_s: float = 0.0  # the child's CPU time it took


class _Checker:
    """The child process and the thread that feeds it (a line of the CPU seconds allowed and
    the schema's JSON in, a line of its problem and the time taken out: `_serve`), the next
    schema the least-served caller's (module docstring)."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._queues: OrderedDict[Hashable, deque[_Job]] = OrderedDict()  # the next caller first
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen[str] | None = None
        self._owner = os.getpid()  # a forked server process starts its own child and thread
        self._used: dict[Hashable, tuple[float, float]] = {}  # caller -> (child CPU s, when): decaying
        self.answers = 0  # schemas the child answered
        self.answered: deque[Hashable] = deque(maxlen=64)  # the callers of the last answers, in order

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None or process.poll() is not None else process.pid

    def run(self, source: str, caller: Hashable, cpu_s: float) -> tuple[SchemaProblem | None | bool, float]:
        """The child's answer for `source` (one line of JSON), checked within `cpu_s` of its
        CPU time, and the time it took; False when it could not answer (none could be
        started, or it died on this schema: the next gets another)."""
        job = _Job(source, cpu_s)
        with self._ready:
            if os.getpid() != self._owner:  # forked: the parent's child and thread are not ours
                self._queues, self._thread, self._process = OrderedDict(), None, None
                self._owner = os.getpid()
            self._queues.setdefault(caller, deque()).append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._feed, name="schema-check", daemon=True)
                self._thread.start()
            self._ready.notify()
        job.done.wait()
        return job.answer, job.used_s

    def _usage(self, caller: Hashable, now: float) -> float:
        """`caller`'s use of the child's CPU, halved every USAGE_HALF_LIFE_S."""
        used, when = self._used.get(caller, (0.0, now))
        return used * 0.5 ** ((now - when) / USAGE_HALF_LIFE_S)

    def _feed(self) -> None:
        """The feeding thread: the oldest schema of the caller that has used the child least
        (the first such in the queue order), then that caller goes last among equals."""
        while True:
            with self._ready:
                while not self._queues:
                    self._ready.wait()
                now = time.monotonic()
                caller = min(self._queues, key=lambda c: self._usage(c, now))
                queue = self._queues.pop(caller)
                job = queue.popleft()
                if queue:
                    self._queues[caller] = queue
            try:
                try:
                    job.answer, job.used_s = self._exchange(job)
                except Exception:  # (the thread must not die: callers queued behind would wait)
                    self._stop()
                    job.answer, job.used_s = False, 0.0
                with self._ready:
                    now = time.monotonic()
                    self._used[caller] = (self._usage(caller, now) + job.used_s, now)
                    if len(self._used) > USAGE_CALLERS:
                        del self._used[min(self._used, key=lambda c: self._usage(c, now))]
                if job.answer is not False:
                    self.answers += 1
                    self.answered.append(caller)
            finally:
                job.done.set()

    @property
    def waiting(self) -> int:
        """Schemas queued for the child (not counting the one it is checking)."""
        with self._ready:
            return sum(len(queue) for queue in self._queues.values())

    def _exchange(self, job: _Job) -> tuple[SchemaProblem | None | bool, float]:
        try:
            process = self._started()
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(f"{job.cpu_s!r} {job.source}\n")
            process.stdin.flush()
            answer = process.stdout.readline()
        except (OSError, ValueError):  # (ValueError: text the pipe cannot encode, a lone surrogate)
            answer = ""
        try:
            value = json.loads(answer)
            problem = value["problem"]
            return (None if problem is None else SchemaProblem(**problem)), float(value["cpu_s"])
        except (ValueError, KeyError, TypeError):  # none (it died), or not its answer: a new child
            self._stop()
            return False, 0.0

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


class _Verdicts:
    """The last VERDICTS answers, by caller and schema text (a digest of it)."""

    def __init__(self, size: int = VERDICTS) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._known: OrderedDict[tuple[Hashable, bytes], SchemaProblem | None] = OrderedDict()

    @staticmethod
    def key(caller: Hashable, source: str) -> tuple[Hashable, bytes]:
        return caller, hashlib.blake2b(source.encode(), digest_size=16).digest()

    def get(self, key: tuple[Hashable, bytes]) -> SchemaProblem | None | bool:
        """The verdict, or False when there is none."""
        with self._lock:
            if key not in self._known:
                return False
            self._known.move_to_end(key)
            return self._known[key]

    def put(self, key: tuple[Hashable, bytes], verdict: SchemaProblem | None) -> None:
        with self._lock:
            self._known[key] = verdict
            self._known.move_to_end(key)
            while len(self._known) > self._size:
                self._known.popitem(last=False)


_CHECKER = _Checker()
_VERDICTS = _Verdicts()


def checking_for(budget: CheckBudget, work: Callable[[], T]) -> T:
    """Runs `work` (some of a request's checks: the server makes two for a chat), whose schema
    checks go round with other callers' as `budget.key`'s, take the child's CPU time out of
    `budget`, and whose verdicts are remembered for that key alone."""
    token = _budget.set(budget)
    try:
        return work()
    finally:
        _budget.reset(token)


def schema_problem(schema: Any, source: str) -> SchemaProblem | None:
    """None if `schema` (whose JSON text is `source`) is valid under the 2020-12 meta-schema,
    else why not: the child's answer (module docstring), or this thread's if no child runs."""
    caller = _budget.get() or CheckBudget(budget_s=math.inf)
    key = _Verdicts.key(caller.key, source)
    known = _VERDICTS.get(key)
    if known is not False:
        return known  # type: ignore[return-value]
    cpu_s = min(CHECK_CPU_S, caller.left_s)
    spent = SchemaProblem("costly", f"the request's schemas, more than {caller.budget_s:g} s")
    if cpu_s <= 0:
        return spent
    answer, used = _CHECKER.run(source, caller.key, cpu_s)
    if answer is False:  # the child died on it, or none could be started: once more, then here
        answer, used = _CHECKER.run(source, caller.key, cpu_s)
    verdict = check(schema) if answer is False else answer
    costly = isinstance(verdict, SchemaProblem) and verdict.kind == "costly"
    caller.left_s -= cpu_s if costly else used  # (the timer ticks coarser than the clock reads)
    if costly and cpu_s < CHECK_CPU_S:  # what ran out was the request's time, not the schema's
        return spent
    if not costly:  # (that one depends on the time left)
        _VERDICTS.put(key, verdict)  # type: ignore[arg-type]
    return verdict  # type: ignore[return-value]


def checker_pid() -> int | None:
    """The checking child's pid while it runs (for tests and operators)."""
    return _CHECKER.pid


class _TooCostly(BaseException):
    """Raised in the child when a schema's check has used its CPU time (a BaseException: no
    `except Exception` in the validator swallows it)."""


def _over_budget(signum: int, frame: object) -> None:
    raise _TooCostly


def _serve(lines: TextIO, out: TextIO) -> None:
    """The child: per line, the CPU seconds the check may take and a schema (`1.0 {...}`) in;
    per line `{"problem": its SchemaProblem or null, "cpu_s": the time it took}` out, until
    EOF. The time is this process's CPU time (a timer on it, not on the clock: a loaded
    machine slows the check down, it does not refuse the schema)."""
    previous = signal.signal(signal.SIGVTALRM, _over_budget)
    try:
        for line in lines:
            budget, _, source = line.partition(" ")
            started = time.process_time()
            try:
                signal.setitimer(signal.ITIMER_VIRTUAL, float(budget))
                try:
                    problem = check(json.loads(source))
                finally:
                    signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            except RecursionError:  # decoding nests as deep as the server's encoding did, with less room
                problem = SchemaProblem("nested", "nested too deeply")
            except _TooCostly:
                problem = SchemaProblem("costly", f"more than {float(budget):g} s")
            answer = {"problem": None if problem is None else asdict(problem), "cpu_s": time.process_time() - started}
            out.write(json.dumps(answer) + "\n")
            out.flush()
    finally:
        signal.signal(signal.SIGVTALRM, previous)


if __name__ == "__main__":
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    _serve(sys.stdin, sys.stdout)
