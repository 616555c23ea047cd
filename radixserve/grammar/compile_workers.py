"""Grammar compiles in child processes, so that one taking too long can be stopped.

xgrammar's compiler runs in C++ and a thread running it cannot be stopped. The static bounds
of spec.py (size, counted repetitions, optional properties) keep ordinary specs cheap, but the
compiler's cost depends on more than they measure: a JSON Schema `pattern` of nested optional
repetitions (`(.{0,30}){0,30}`: 9 s) or of optional wide atoms written out (`.?` 800 times:
71 s), or a set of strict tools each within the bounds, held a compile slot for minutes, and
four such requests held every slot while other tenants' schemas waited. Here each compile
runs in a worker process and is given `timeout_s` of CPU time (wall time would refuse ordinary
specs on a busy machine; 12 times it of wall time is a limit too): past it the worker is
killed (a new one starts for the next compile) and the spec is refused (CompileTimeout).
What a worker sends back is the compiled grammar's serialized form (xgrammar's own, a few
milliseconds each way for a small schema) when that form is small; otherwise only its size,
and the server compiles the spec again itself (`compile` returns None): xgrammar 0.2.9 writes
the grammar's whole state machine once per rule, so the serialized form grows with the square
of the rules while the grammar in memory grows with them (128 strict tools of 3 properties:
7 MB in memory, 413 MB serialized, 31 s and 6 GB to serialize; compiled in 0.6 s). The worker's
compile has shown by then that the spec compiles within the limits. Before that, the worker walks the grammar's
first steps (probe.py): one whose early fills already pass the engine's per-fill budget is
refused (CompileTooSlowToFollow) instead of stalling the engine thread at a request's step.

Workers start on first use, with the tokenizer's serialized TokenizerInfo, and are kept for
later compiles until idle for `idle_exit_s`; at most `workers` compile at once (more callers
wait for one to be free). Each is a fork of the pool's zygote (zygote.py), a process that has
imported xgrammar (and torch, which xgrammar imports) and built the compiler once: a worker is
ready in about 30 ms, not the 4 s of a fresh interpreter here (19-28 s in a Ray replica beside
a busy engine), and shares the zygote's pages (resident 190 MB, proportional share 100 MB,
against 250 MB of its own as a fresh interpreter). One worker, the *standby*, never ends for
being idle, so that a new schema after a quiet minute has nothing to wait for; only the pool's
first compile pays a start (the zygote's). The engines of one tokenizer in a process share one
pool (`shared_workers`).
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from radixserve.grammar import zygote

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_WORKERS = 4  # as many as the server's compile slots (server/grammar_compiles.py)
IDLE_EXIT_S = 60.0   # a worker with nothing to compile for this long ends
COMPILE_NICENESS = 10  # compiles yield the CPU to serving: the engine's steps, the event loop
POLL_S = 0.05  # how often a compile's CPU time is read
WALL_LIMIT_FACTOR = 12  # ... and past this many times the timeout of wall time it is refused anyway
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# A grammar cheap to compile can be large compiled (`root ::= r0 .. r2999`, `rJ ::= "a"?`: 60 KB
# of source, 37 MB in memory by xgrammar's measure): past these the worker is killed, or its
# grammar refused (the parent checks). Ordinary schemas are far below (100 optional properties:
# 0.35 MB on a 49k-token vocabulary; 128 tools under "required", 3.5 MB).
MAX_COMPILED_BYTES = 32 * 2**20
# A grammar is sent serialized when its rules times its size in memory, a bound on the
# serialized size (each rule's copy of the state machine is at most the whole grammar), and the
# serialized form itself are at most this; otherwise the server compiles it again (about the worker's compile time, where
# deserializing a large form took longer: 100 optional properties 118 ms against 12 ms).
MAX_SENT_BYTES = 32 * 2**20
MAX_WORKER_RSS_BYTES = 2**30  # a worker starts at about 190-250 MB (forked or not); a schema of 362 optional properties adds 240 MB
# A worker whose memory grew past this in a compile is ended after it, not kept: what its
# allocator freed stays its own (idle workers kept 1.9 GB each after the attack above).
RECYCLE_RSS_BYTES = 2**29
STARTUP_TIMEOUT_S = 120.0  # a worker imports xgrammar (and torch): seconds, longer on a busy machine


class CompileTimeout(Exception):
    """A compile did not finish within the timeout; its worker was killed."""


class CompileFailed(Exception):
    """The compiler refused the spec; the message is the library's."""


class CompileTooLarge(Exception):
    """The compile needed more memory than a worker may take, or its grammar takes more than
    MAX_COMPILED_BYTES of memory; its worker was killed, or its grammar dropped."""


class CompileTooSlowToFollow(Exception):
    """The compiled grammar's early steps took a fill or accept longer than the per-fill
    budget (probe.py); `seconds` is that step's CPU time."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"one of its first steps took {seconds * 1000:,.0f} ms of CPU")
        self.seconds = seconds


class CompileWorkerLost(Exception):
    """No worker could compile: one did not start, or ended on its own (the server's fault, not
    the spec's: not a RuntimeError, which Grammars takes for the library refusing a spec)."""


class CompileStarved(CompileWorkerLost):
    """A compile still under its CPU-time limit ran past WALL_LIMIT_FACTOR times it of wall
    time: the machine is too busy to give it the CPU, which says nothing of the spec (the
    server's fault: a retry may succeed, so the spec is not remembered as refused)."""


class _Worker:
    """One child process and the parent's ends of its two pipes (the others are passed to it
    alone). The process is a fork of the pool's zygote (zygote.py) where there is one, else
    `python -c _CHILD`: a fresh interpreter, not a fork of this threaded, torch-loaded one,
    nor multiprocessing's spawn, which would run the caller's main script again."""

    def __init__(self, setup_fd: int, idle_exit_s: float, parent: zygote.Zygote | None) -> None:
        child_reads, to_child = os.pipe()
        from_child, child_writes = os.pipe()
        try:
            if parent is not None:
                self.process: subprocess.Popen[bytes] | zygote.ForkedProcess = parent.fork(
                    child_reads, child_writes, idle_exit_s)
            else:  # never blocks: the child reads the setup (megabytes) from a file, not the pipe
                self.process = subprocess.Popen(
                    [sys.executable, "-c", _CHILD, str(child_reads), str(child_writes), str(setup_fd),
                     repr(idle_exit_s)],
                    pass_fds=(child_reads, child_writes, setup_fd), stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            os.close(to_child)
            os.close(from_child)
            raise
        finally:
            os.close(child_reads)
            os.close(child_writes)
        self.sender = Connection(to_child, readable=False)
        self.conn = Connection(from_child, writable=False)
        self.ready = False
        self.last_used = time.monotonic()

    def send(self, job: tuple[str, str]) -> None:
        """Sends `job` once the worker is ready (its start is not the job's time: the timeout
        runs from here). OSError when the worker has ended, or did not start."""
        if not self.ready:
            if not self.conn.poll(STARTUP_TIMEOUT_S) or self.conn.recv() != "ready":
                raise OSError("the compile worker did not start")
            self.ready = True
        self.sender.send(job)

    def cpu_seconds(self) -> float | None:
        """The worker process's CPU time so far (user and system), or None where /proc is not."""
        return zygote.process_cpu_seconds(self.process.pid)

    def rss_bytes(self) -> int | None:
        """The worker process's resident memory, or None where /proc is not."""
        try:
            with open(f"/proc/{self.process.pid}/statm", "rb") as statm:
                return int(statm.read().split()[1]) * PAGE_BYTES
        except (OSError, IndexError, ValueError):
            return None

    def kill(self) -> None:
        self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:  # killed, not yet reaped (a large process, a loaded
            pass  # machine): left to its parent to reap; its pipes close now all the same
        self.sender.close()
        self.conn.close()


class CompileWorkers:
    """A pool of at most `workers` compile processes for one tokenizer (see the module)."""

    def __init__(self, tokenizer_info: str, *, workers: int = DEFAULT_WORKERS,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, idle_exit_s: float = IDLE_EXIT_S) -> None:
        if timeout_s <= 0 or workers < 1 or idle_exit_s <= 0:
            raise ValueError(f"CompileWorkers: timeout_s > 0, workers >= 1 and idle_exit_s > 0, "
                             f"got {timeout_s}, {workers}, {idle_exit_s}")
        self.timeout_s = timeout_s
        self.idle_exit_s = idle_exit_s
        # The workers' setup, in a file with no name (unlinked at once: nothing is left behind
        # however this process ends), which each worker reads through the descriptor it is passed.
        descriptor, path = tempfile.mkstemp(prefix="radixserve-grammar-")
        os.unlink(path)
        with os.fdopen(os.dup(descriptor), "wb") as setup:  # writes it whole
            pickle.dump(tokenizer_info, setup)
        self._setup_fd = descriptor
        weakref.finalize(self, os.close, descriptor)
        self._idle: list[_Worker] = []
        self.standby: _Worker | None = None  # the worker kept however long it idles
        self._lock = threading.Lock()
        self._turns = threading.BoundedSemaphore(workers)
        self._workers = workers
        self._busy = 0  # compiles under way
        self._zygote: zygote.Zygote | None = None  # what forks the workers, from the first on
        self.timeouts = 0  # workers killed for running past the timeout

    def compile(self, kind: str, source: str) -> str | None:
        """The serialized compiled grammar of a spec's `kind` and `source`, or None where the
        caller should compile it itself (its serialized form would be large; it compiles
        within the limits); CompileTimeout past the timeout, CompileFailed when the compiler
        refuses it, CompileTooLarge past MAX_COMPILED_BYTES in memory."""
        with self._turns, self._counted_busy():
            with self._lock:
                worker, retired = self._take_idle()
            for old in retired:
                old.kill()
            if self._busy > 1:  # other compiles under way: the next may find none idle
                self._start_a_spare()
            try:
                worker = self._send(worker, (kind, source))
            except (EOFError, OSError) as exc:
                raise CompileWorkerLost(f"no compiling process: {exc}") from None
            try:
                overrun = self._overrun(worker)
                if overrun is not None:
                    self.timeouts += overrun == "time"
                    worker.kill()
                    self._start_a_spare()  # its replacement starts now, not in the next compile's time
                    if overrun == "time":
                        raise CompileTimeout(f"compiling took more than {self.timeout_s:g} s of CPU time")
                    if overrun == "wall":
                        raise CompileStarved(f"a compile got less than {self.timeout_s:g} s of CPU in "
                                             f"{WALL_LIMIT_FACTOR * self.timeout_s:g} s: the server is busy")
                    raise CompileTooLarge(f"compiling took more than {MAX_WORKER_RSS_BYTES // 2**20:,} MB of memory")
                outcome, payload = worker.conn.recv()
            except (EOFError, OSError) as exc:  # the worker ended on its own (killed by the system, say)
                worker.kill()
                self._start_a_spare()
                raise CompileWorkerLost(f"the compiling process ended: {exc or type(exc).__name__}") from None
            worker.last_used = time.monotonic()
            if (worker.rss_bytes() or 0) > RECYCLE_RSS_BYTES:  # freed memory stays the process's
                worker.kill()
                self._start_a_spare()
            else:
                with self._lock:
                    self._idle.append(worker)
        if outcome == "error":
            raise CompileFailed(payload)
        if outcome == "too_slow":
            raise CompileTooSlowToFollow(payload)
        serialized, memory_bytes = payload
        if memory_bytes > MAX_COMPILED_BYTES:
            raise CompileTooLarge(f"the compiled grammar takes {memory_bytes / 2**20:,.1f} MB of memory, "
                                  f"more than {MAX_COMPILED_BYTES / 2**20:g} MB")
        return serialized

    @contextlib.contextmanager
    def _counted_busy(self) -> Iterator[None]:
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def _overrun(self, worker: _Worker) -> str | None:
        """Waits for `worker`'s answer while its compile has used less than `timeout_s` of CPU
        time (and less than WALL_LIMIT_FACTOR times that of wall time) and the worker less
        than MAX_WORKER_RSS_BYTES of memory: None once it answered, else "time", "wall" or "memory".
        CPU time, not wall time: on a busy machine (and the workers are niced) an ordinary
        compile may wait long for the CPU, and must not be refused for the machine's load."""
        started_cpu, started = worker.cpu_seconds(), time.monotonic()
        wall_limit = WALL_LIMIT_FACTOR * self.timeout_s
        while True:
            # Memory first, also before the first wait: checked only after one, a compile that
            # answered within it was never measured (the tests' limit of 1 byte passed or not
            # with the machine's load).
            if (worker.rss_bytes() or 0) > MAX_WORKER_RSS_BYTES:
                return "memory"
            if worker.conn.poll(min(POLL_S, self.timeout_s)):
                return None
            used = worker.cpu_seconds()
            if used is None:  # no /proc: wall time it is
                used = time.monotonic() - started
            elif started_cpu is not None:
                used -= started_cpu
            if used > self.timeout_s:
                return "time"
            if time.monotonic() - started > wall_limit:
                return "wall"

    def _take_idle(self) -> tuple[_Worker | None, list[_Worker]]:
        """The idle worker a compile goes to (the one used last), and the idle ones passed
        over to retire: past half of `idle_exit_s` a worker may be ending by itself as the job
        is sent (never the standby). Under the lock."""
        retired = []
        while self._idle:
            worker = self._idle.pop()
            if worker.process.poll() is None and \
                    (worker is self.standby or time.monotonic() - worker.last_used <= self.idle_exit_s / 2):
                return worker, retired
            retired.append(worker)  # (one that ended idle is reaped here)
        return None, retired

    def _start_a_spare(self) -> None:
        """Starts the standby's successor when it ended (killed past a limit, recycled), and
        otherwise a worker for the next compile when none is idle, up to the pool's size (each
        compile under way has one): a start takes tens of milliseconds (seconds where there is
        no zygote, or it has to start again), and while slow compiles hold the others, the next
        compile should not wait for that. Not beside a compile alone:
        the standby takes the next one, and a start beside it takes its CPU (SmolLM2, 2 cores:
        a new schema after a quiet minute answered in 2.0 s with a spare starting, 0.45 s
        without; 3.1-3.6 s when the worker itself had to start)."""
        with self._lock:
            try:
                if self.standby is not None and self.standby.process.poll() is not None:
                    self._idle.append(self._new_worker())  # its successor, though others idle: they end
                elif not self._idle and self._busy < self._workers:
                    self._idle.append(self._new_worker())
            except OSError:
                pass  # none can start now: the next compile tries again, or reports the loss

    def _new_worker(self) -> _Worker:
        """A worker process starting; the standby when there is none (or it has ended:
        killed past a limit, recycled, or by the system). OSError when none can start. Under
        the lock (the zygote's first start, seconds, holds it: every caller waits for a worker
        then anyway)."""
        if zygote.SUPPORTED and (self._zygote is None or not self._zygote.alive()):
            if self._zygote is not None:
                self._zygote.close()
            self._zygote = zygote.Zygote(self._setup_fd, STARTUP_TIMEOUT_S)
        if self.standby is None or self.standby.process.poll() is not None:
            self.standby = _Worker(self._setup_fd, math.inf, self._zygote)
            return self.standby
        return _Worker(self._setup_fd, self.idle_exit_s, self._zygote)

    def _send(self, worker: _Worker | None, job: tuple[str, str]) -> _Worker:
        """Sends `job` to `worker`, or to a new one where it has ended (idle too long)."""
        if worker is not None:
            try:
                worker.send(job)
                return worker
            except (OSError, EOFError):
                worker.kill()
        with self._lock:
            worker = self._new_worker()
        try:
            worker.send(job)
        except (OSError, EOFError):
            worker.kill()
            raise
        return worker


class PreparedCompiler(NamedTuple):
    """What a worker compiles with, built once: in the zygote before any fork (zygote.py), or
    in a worker started as a fresh interpreter."""

    compiler: Any  # xgrammar.GrammarCompiler (xgrammar is imported in worker processes only)
    token_lengths: Any  # numpy array: each token's length in bytes, for the probe


def prepare_compiler(setup_fd: int) -> PreparedCompiler:
    """Lowers this process's priority, imports xgrammar and builds the compiler for the
    TokenizerInfo in `setup_fd` (closed after)."""
    os.nice(COMPILE_NICENESS)
    import xgrammar

    from radixserve.grammar.probe import token_lengths

    # pread, at offset 0: the descriptor's position is shared with every other worker's
    size = os.fstat(setup_fd).st_size
    tokenizer_info = pickle.loads(os.pread(setup_fd, size, 0))
    os.close(setup_fd)
    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return PreparedCompiler(compiler, token_lengths(info))


def serve_jobs(jobs: Connection, replies: Connection, prepared: PreparedCompiler, idle_exit_s: float) -> None:
    """The worker's loop: "ready", then (kind, source) in and ("ok", (serialized or None,
    bytes in memory)), ("too_slow", seconds) or ("error", message) out, until the parent closes
    its end or nothing comes for `idle_exit_s` (inf: the standby)."""
    from radixserve.grammar.compiled import compile_spec
    from radixserve.grammar.matcher import FILL_BUDGET_S
    from radixserve.grammar.probe import first_slow_step

    replies.send("ready")
    while True:
        try:
            if not jobs.poll(None if math.isinf(idle_exit_s) else idle_exit_s):
                return  # idle: the parent starts another when it needs one
            kind, source = jobs.recv()
        except (EOFError, OSError):
            return  # the parent closed its end
        reply: tuple[str, Any]
        try:
            compiled = compile_spec(prepared.compiler, kind, source)
            memory_bytes = compiled.memory_size_bytes
            if memory_bytes > MAX_COMPILED_BYTES:
                reply = ("ok", (None, memory_bytes))  # refused by the parent (which a test can set)
            elif (slow := first_slow_step(compiled, prepared.token_lengths, FILL_BUDGET_S)) is not None:
                reply = ("too_slow", slow)  # (under the CPU limit too)
            elif rule_count(compiled) * memory_bytes > MAX_SENT_BYTES:
                reply = ("ok", (None, memory_bytes))
            else:
                serialized = compiled.serialize_json()
                reply = ("ok", (serialized if len(serialized) <= MAX_SENT_BYTES else None, memory_bytes))
        except (RuntimeError, ValueError) as exc:  # the library reports bad input as either
            reply = ("error", str(exc).strip() or type(exc).__name__)
        replies.send(reply)


def rule_count(compiled: Any) -> int:
    """The rules of a compiled grammar (its text writes one per line)."""
    return str(compiled.grammar).count("\n") + 1


_shared: dict[tuple[str, float], CompileWorkers] = {}
_shared_lock = threading.Lock()


def shared_workers(tokenizer_info: str, timeout_s: float) -> CompileWorkers:
    """The process's pool for this tokenizer (its serialized TokenizerInfo, stop tokens
    included) and timeout: engines of one model in one process, tests' many engines above
    all, share its workers."""
    key = (tokenizer_info, timeout_s)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = CompileWorkers(tokenizer_info, timeout_s=timeout_s)
        return _shared[key]


def serve_jobs_fds(jobs_fd: int, replies_fd: int, prepared: PreparedCompiler, idle_exit_s: float) -> None:
    """`serve_jobs` over the two pipe ends a worker was passed."""
    serve_jobs(Connection(jobs_fd, writable=False), Connection(replies_fd, readable=False), prepared, idle_exit_s)


def serve_fds(jobs_fd: int, replies_fd: int, setup_fd: int, idle_exit_s: float) -> None:
    """The entry of a worker started as a fresh interpreter (_CHILD, where there is no zygote)."""
    serve_jobs_fds(jobs_fd, replies_fd, prepare_compiler(setup_fd), idle_exit_s)


_CHILD = ("import sys; from radixserve.grammar.compile_workers import serve_fds; "
          "serve_fds(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))")
