"""A preloaded parent that forks compile workers (compile_workers.py), so that a worker starts
in milliseconds instead of seconds.

A fresh interpreter needs 4.3 s of CPU before it can compile (xgrammar imports torch and
transformers; 19-28 s of wall time in a Ray replica beside a busy engine), and a pool pays
that for every worker it starts: its first, each replacement of one killed past a limit, each
spare. So each pool starts one *zygote* (a fresh interpreter, so never a fork of the serving
process with its threads and its model), which imports xgrammar, builds the compiler for the
pool's tokenizer and then only forks: each worker is a copy of it, ready at once (a fork of
the 250 MB zygote: about 20 ms; the pages are shared until written).

The zygote reaps a worker only when the pool asks (`poll`), as a parent would: until then its
pid cannot be reused, so signals sent to it (the pool's kill, a test's SIGSTOP) reach the worker
and nothing else. Workers die with the zygote (PR_SET_PDEATHSIG), and the zygote ends, killing
its workers, when the pool's end of its socket closes (the pool garbage collected, the server
ended or killed). A zygote that does not answer a request within REQUEST_TIMEOUT_S (stopped,
say) is killed and the next start gets a new one. Linux only (a SOCK_SEQPACKET socket pair
and prctl); elsewhere the pool starts each worker as a fresh interpreter.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

SUPPORTED = sys.platform == "linux"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
MESSAGE_BYTES = 4096
REQUEST_TIMEOUT_S = 30.0  # a fork, a poll or a kill takes milliseconds: past this the zygote is stuck
# The zygote forks with one thread: numpy's BLAS would otherwise start a thread per core at import.
SINGLE_THREADED_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Zygote:
    """The pool's side of its zygote: starts it, and asks it over a socket pair to fork a
    worker, to poll one (reaping it once ended) or to kill one. Thread-safe."""

    def __init__(self, setup_fd: int, startup_timeout_s: float) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE, str(theirs.fileno()), str(setup_fd)],
                pass_fds=(theirs.fileno(), setup_fd), stdin=subprocess.DEVNULL, close_fds=True,
                env={**os.environ, **SINGLE_THREADED_ENV})
        self._socket = ours
        self._startup_timeout_s = startup_timeout_s
        self._cpu_at_last_wait: float | None = None  # its CPU time when a wait for its start last ran out
        self._ready = False
        self._lost = False  # a request failed: never asked again
        self._lock = threading.Lock()

    def alive(self) -> bool:
        """Whether it can still fork: running, and no request to it has failed."""
        return not self._lost and self.process.poll() is None

    def fork(self, jobs_fd: int, replies_fd: int, idle_exit_s: float) -> ForkedProcess:
        """A worker reading jobs from `jobs_fd` and answering on `replies_fd` (the pool closes
        its copies after), ending after `idle_exit_s` idle. OSError when the zygote did not
        start or has ended."""
        pid = self._ask(["fork", idle_exit_s], (jobs_fd, replies_fd))
        return ForkedProcess(self, pid)

    def _ask(self, request: list[Any], fds: tuple[int, ...] = ()) -> Any:
        with self._lock:
            if self._lost:
                raise OSError("the compile zygote was lost")
            try:
                reply = self._exchange(request, fds)
            except ZygoteStarting:
                raise  # not lost: the next request waits for its "ready" again
            except OSError:
                self._lost = True  # (a stuck one was killed: its workers end with it)
                raise
        outcome, value = json.loads(reply)
        if outcome == "error":
            raise OSError(value)
        return value

    def _exchange(self, request: list[Any], fds: tuple[int, ...]) -> bytes:
        """Sends one request and reads its reply (under the lock). OSError when the zygote did
        not start, has ended or stopped answering."""
        if not self._ready:  # the zygote's imports: seconds
            self._socket.settimeout(self._startup_timeout_s)
            try:
                ready = self._socket.recv(MESSAGE_BYTES)
            except TimeoutError:
                # Still importing, niced, on a loaded machine: kept, so that its work so far
                # counts (a new zygote would start its imports over, every time); but one that
                # made no progress since the last wait (stopped, blocked) is killed and lost.
                cpu = process_cpu_seconds(self.process.pid)
                if cpu is not None and self._cpu_at_last_wait is not None and cpu <= self._cpu_at_last_wait:
                    self.process.kill()
                    raise OSError("the compile zygote did not start: no progress in its last "
                                  f"{self._startup_timeout_s:g} s") from None
                self._cpu_at_last_wait = cpu
                raise ZygoteStarting(f"the compile zygote has not started within {self._startup_timeout_s:g} s; "
                                     "it is still starting") from None
            if ready != b"ready":
                raise OSError("the compile zygote did not start")
            self._ready = True
        self._socket.settimeout(REQUEST_TIMEOUT_S)
        try:
            socket.send_fds(self._socket, [json.dumps(request).encode()], list(fds))
            reply = self._socket.recv(MESSAGE_BYTES)
        except TimeoutError:  # stopped, or starved: killed, so that it cannot fork again
            self.process.kill()
            raise OSError("the compile zygote stopped answering") from None
        if not reply:
            raise OSError("the compile zygote ended")
        return reply

    def close(self) -> None:
        """Ends the zygote at once, and its workers with it (PR_SET_PDEATHSIG)."""
        with self._lock:
            self._lost = True
            self._socket.close()
        self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:  # in uninterruptible sleep: it ends with its kill,
            pass  # reaped by subprocess later, not waited for under the pool's lock


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """A process's CPU time so far (user and system), or None where /proc is not (or it ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)


class ZygoteStarting(OSError):
    """The zygote has not finished its start within the wait: it is kept, not lost."""


class ForkedProcess:
    """A worker forked by a zygote, seen as the few parts of subprocess.Popen the pool uses.
    Once the zygote is gone, so is the worker (PR_SET_PDEATHSIG): it reads as killed."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.zygote._ask(["poll", self.pid])
            except OSError:
                self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                self.zygote._ask(["kill", self.pid])
            except OSError:
                pass  # the zygote has ended, and its workers with it

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"compile worker {self.pid}", timeout)
            time.sleep(0.002)
        return code


def serve(control_fd: int, setup_fd: int) -> None:
    """The zygote's loop (_ZYGOTE): prepares a compiler from the setup in `setup_fd`, then
    answers the pool's requests on `control_fd` until the pool closes its end."""
    from radixserve.grammar.compile_workers import prepare_compiler

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the server's to handle; the zygote ends with it
    prepared = prepare_compiler(setup_fd)
    control = socket.socket(fileno=control_fd)
    try:
        control.send(b"ready")
    except OSError:  # the server ended while this imported: nothing to serve, nothing to say
        return
    zygote_pid = os.getpid()
    children: set[int] = set()
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 2)
        except OSError:
            break
        if not data:
            break  # the pool's end closed
        operation, argument = json.loads(data)
        reply: list[Any]
        if operation == "fork":
            try:
                pid = os.fork()
            except OSError as exc:
                reply = ["error", f"could not start a compile worker: {exc}"]
            else:
                if pid == 0:
                    _run_worker(control, zygote_pid, fds, prepared, argument)
                children.add(pid)
                reply = ["ok", pid]
            for fd in fds:
                os.close(fd)
        elif operation == "poll" and argument in children:
            ended, status = os.waitpid(argument, os.WNOHANG)
            if ended:
                children.discard(argument)
            reply = ["ok", os.waitstatus_to_exitcode(status) if ended else None]
        elif operation == "kill" and argument in children:
            os.kill(argument, signal.SIGKILL)  # not reaped yet: still this worker's pid
            reply = ["ok", None]
        else:
            reply = ["error", f"not a request for this zygote: {operation} {argument}"]
        control.send(json.dumps(reply).encode())
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _run_worker(control: socket.socket, zygote_pid: int, fds: list[int], prepared: Any, idle_exit_s: float) -> None:
    """A forked worker's life: never returns to the zygote's loop."""
    code = 1
    try:
        control.close()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote_pid:  # the zygote ended before the line above
            os._exit(code)
        from radixserve.grammar.compile_workers import serve_jobs_fds

        serve_jobs_fds(fds[0], fds[1], prepared, idle_exit_s)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


_ZYGOTE = ("import sys; from radixserve.grammar.zygote import serve; "
           "serve(int(sys.argv[1]), int(sys.argv[2]))")
