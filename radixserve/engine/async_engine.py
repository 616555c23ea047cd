"""The asyncio face of the engine: a step loop in its own thread, streams per request."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any, TypeVar

from radixserve.cache.radix import PagesFreed, Retention
from radixserve.engine.engine import Engine
from radixserve.engine.output_buffer import OutputBuffer
from radixserve.engine.params import SamplingParams, StreamDelta
from radixserve.engine.sliced_work import (
    DEFAULT_BUDGET_S,
    SlicedGenerator,
    SlicedTask,
    SlicedWork,
)
from radixserve.native.openmp import release_thread_workers

logger = logging.getLogger(__name__)
_R = TypeVar("_R")

DEFAULT_STALL_TIMEOUT_S = 120.0  # a step on a CPU with a large model may take tens of seconds
DEFAULT_STOP_TIMEOUT_S = 5.0
MAX_REQUEST_ID_CHARS = 256
IDLE_WAKEUP_S = 0.5
# While steps run back to back, stats are rebuilt at most this often unless a stream ended or
# the engine's load moved (building them costs about 0.1 ms, 1% of a small model's decode step).
STATS_PERIOD_S = 0.05
DEFAULT_STREAM_BUFFER_TOKENS = 1024  # per request: delivered, not yet read by its client
DEFAULT_STREAM_READ_TIMEOUT_S = 300.0  # a paused request whose client reads nothing is aborted
# The message to cancel a `generate` stream's wait with when the caller gives it up because
# another request of its batch was refused (`task.cancel(REFUSED_BATCH)`): its request is
# then aborted as refused (Engine.abort's `refused`: counted apart, no prompt tokens).
REFUSED_BATCH = "radixserve: another prompt of the batch was refused"


class AsyncEngine:
    """Runs Engine's step loop in a background thread; the asyncio loop never waits on a step.

    Every engine call is a command handed to that thread, so the engine's state has one owner.
    Deltas come back to each request's asyncio.Queue through `call_soon_threadsafe`.

    Watchdog: the loop is *stalled* when it has had work pending (requests, commands) for
    longer than `stall_timeout_s` without completing a step — a step stuck, the loop paused,
    or the thread gone. `health()` says so and why; `stats()` carries
    `seconds_since_last_step` and `stalled`. `shutdown()` waits at most `timeout_s` for the
    thread, so a stuck step cannot keep the process alive.

    `step_hook`, if given, runs on the engine thread before every step: tests and debuggers
    use it to hold the loop inside a step. `pause()` / `resume()` stop and restart stepping
    while commands (new requests, aborts) are still taken.

    Backpressure: each request's output waits for its reader in an OutputBuffer of
    `stream_buffer_tokens` tokens; past it the request is paused (preempted and held,
    engine/paused.py) until its reader catches up, and aborted if the reader takes nothing
    for `stream_read_timeout_s` seconds (output_buffer.py).

    Views of the cache run as sliced work (`run_sliced`): pieces between steps, at most
    `view_budget_s` of engine-thread time per step for all of them together.
    """

    def __init__(self, engine: Engine, *, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                 step_hook: Callable[[], None] | None = None,
                 stream_buffer_tokens: int = DEFAULT_STREAM_BUFFER_TOKENS,
                 stream_read_timeout_s: float = DEFAULT_STREAM_READ_TIMEOUT_S,
                 view_budget_s: float = DEFAULT_BUDGET_S) -> None:
        for name, value in (("stall_timeout_s", stall_timeout_s), ("stream_buffer_tokens", stream_buffer_tokens),
                            ("stream_read_timeout_s", stream_read_timeout_s), ("view_budget_s", view_budget_s)):
            if value <= 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        self.stream_buffer_tokens = stream_buffer_tokens
        self.stream_read_timeout_s = stream_read_timeout_s
        self._sliced = SlicedWork(view_budget_s)
        self._read_timeouts = 0
        self._paused_streams: set[str] = set()  # ids of requests paused for their readers
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.step_hook = step_hook
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, OutputBuffer] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._paused = False
        self._stats: dict[str, Any] = engine.stats()
        self._stats_lock = threading.Lock()
        self._stats_at = 0.0  # monotonic time of the last publication
        self._stats_load: tuple[int, int, int] = (0, 0, 0)  # engine.load_counts() then
        self._stats_stale = False  # a step since the last publication was not published
        # Written by the engine thread only; read anywhere (a float or None: atomic).
        self._pending_since: float | None = None  # work waiting for a step since then
        self._last_step_at = time.monotonic()

    async def start(self) -> None:
        """Starts the engine thread. The calling thread is taken to be the one that built the
        engine: its OpenMP workers are released so that the engine thread's are the only
        ones (native/openmp.py says why that matters for every step)."""
        release_thread_workers()
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._last_step_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout_s: float | None = DEFAULT_STOP_TIMEOUT_S) -> bool:
        """Aborts what is left and stops the thread.

        Returns False when the thread did not stop within `timeout_s` (a step is stuck): it is
        a daemon thread, left behind so that the process can still exit.
        """
        self._stopping = True
        self._wakeup.set()
        thread = self._thread
        if thread is None:
            return True
        await asyncio.to_thread(thread.join, timeout_s)
        if thread.is_alive():
            logger.error("the engine thread did not stop within %s s (a step is stuck); leaving it behind",
                         timeout_s)
            return False
        self._thread = None
        return True

    def pause(self) -> None:
        """Stops running steps (commands are still taken) until resume(); thread-safe."""
        self._paused = True

    def resume(self) -> None:
        """Lets the loop step again; thread-safe."""
        self._paused = False
        self._wakeup.set()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while not self._stopping:
            if self._pending_since is None:
                self._pending_since = time.monotonic()
            self._drain_commands()
            if self.engine.has_work() and not self._paused:
                if self.step_hook is not None:
                    self.step_hook()
                try:
                    deltas = self.engine.step()
                except Exception:  # the engine ended that step's requests; the loop carries on
                    logger.exception("engine step failed; its requests were ended with finish_reason 'error'")
                    deltas = self.engine.take_deltas()
                self._last_step_at = self._pending_since = now = time.monotonic()
                if self._stats_due(deltas, now):  # first: a client reading stats on a delta sees its step
                    self._publish_stats()
                self._deliver(deltas)
                if self._sliced:
                    self._sliced.run()
            elif self._sliced:  # no step to run: views take their pieces back to back
                if not self.engine.has_work():
                    self._pending_since = None
                if self._stats_stale:
                    self._publish_stats()
                self._sliced.run()
            else:
                if not self.engine.has_work():
                    self._pending_since = None  # idle: nothing is waiting for a step
                self._publish_stats()
                self._wakeup.wait(timeout=IDLE_WAKEUP_S)
                self._wakeup.clear()
        self._drain_commands()
        for request_id in list(self._streams):
            self.engine.abort(request_id)
        self._deliver(self.engine.step())  # the abort deltas: every open stream ends
        self._publish_stats()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, deltas: dict[str, list[StreamDelta]]) -> None:
        assert self._loop is not None
        for request_id, items in deltas.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                self._loop.call_soon_threadsafe(stream.put, items)

    def _stats_due(self, deltas: dict[str, list[StreamDelta]], now: float) -> bool:
        """Whether to publish after a step: when a stream finished or the engine's load (its
        sequences waiting and running, its free pages) moved since the last publication, else
        once every STATS_PERIOD_S. A skipped step leaves the stats stale until the next."""
        due = (now - self._stats_at >= STATS_PERIOD_S or self.engine.load_counts() != self._stats_load
               or any(item.finish_reason is not None for items in deltas.values() for item in items))
        self._stats_stale = not due
        return due

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        self._stats_at, self._stats_load, self._stats_stale = time.monotonic(), self.engine.load_counts(), False
        with self._stats_lock:
            self._stats = stats

    def _call(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Runs `fn` on the engine thread; the future resolves with its result or error."""
        assert self._loop is not None, "AsyncEngine.start() first"
        future: asyncio.Future[Any] = self._loop.create_future()
        loop = self._loop

        def command() -> None:
            try:
                result = fn()
                self._publish_stats()  # so the caller's next stats() already shows the effect
            except BaseException as error:  # handed back to the caller, not lost in the thread
                loop.call_soon_threadsafe(_set_exception, future, error)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(command)
        self._wakeup.set()
        return future

    # ------------------------------------------------------------------ the asyncio side
    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                       priority: int = 0, cache_salt: str | None = None,
                       retention: Retention | None = None,
                       prefix_retention: tuple[int, Retention] | None = None,
                       session_id: str | None = None, tenant: str | None = None,
                       admin: bool = False, client: Hashable = None) -> AsyncIterator[StreamDelta]:
        """Streams a request's deltas; raises QueueFull / PromptTooLong / ValueError up front.

        Closing the iterator early (a client that went away) aborts the request, which frees
        its pages. A wait cancelled with the message REFUSED_BATCH aborts it as refused.
        """
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        assert self._loop is not None, "AsyncEngine.start() first"
        stream = OutputBuffer(
            self._loop, limit=self.stream_buffer_tokens, read_timeout_s=self.stream_read_timeout_s,
            pause=lambda: self._pause_stream(request_id), resume=lambda: self._resume_stream(request_id),
            on_timeout=lambda: self._read_timed_out(request_id))
        self._streams[request_id] = stream  # before the add: the first deltas may follow at once
        try:
            await self._call(lambda: self.engine.add_request(
                prompt_ids, params, request_id=request_id, priority=priority, cache_salt=cache_salt,
                retention=retention, prefix_retention=prefix_retention, session_id=session_id,
                tenant=tenant, admin=admin, client=client))
        except asyncio.CancelledError as exc:
            # The caller left while the add was queued: it still runs, so abort it after.
            self._streams.pop(request_id, None)
            self.abort(request_id, refused=_refused(exc))
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        open_samples = params.n
        refused = False
        try:
            while open_samples:
                for delta in await stream.get():
                    if delta.finish_reason is not None:
                        open_samples -= 1
                    yield delta
        except asyncio.CancelledError as exc:
            refused = _refused(exc)
            raise
        finally:
            stream.close()
            self._streams.pop(request_id, None)
            self._paused_streams.discard(request_id)
            if open_samples:
                self.abort(request_id, refused=refused)

    @property
    def max_queue(self) -> int | None:
        """The engine's waiting-queue bound (Engine.max_queue; None: unbounded)."""
        return self.engine.max_queue

    def abort(self, request_id: str, *, refused: bool = False) -> None:
        """Aborts a request (a no-op if it already finished). `refused`: it is given up
        because another request of its batch was refused (Engine.abort's `refused`)."""
        self._command(lambda: self.engine.abort(request_id, refused=refused))

    def abort_all(self) -> None:
        """Aborts every request, their ends delivered at once (the server is stopping: its
        streams must end before their connections are cut)."""
        self._end_now(self.engine.abort_all)

    def _end_now(self, end: Callable[[], Any]) -> None:
        """Runs `end` (aborts) on the engine thread and delivers the ends it made at once, not
        with a next step, which may never come."""
        def end_and_tell() -> None:
            end()
            self._deliver(self.engine.take_deltas())

        self._command(end_and_tell)

    def _command(self, command: Callable[[], Any]) -> None:
        """Runs `command` on the engine thread, not waiting for it."""
        self._commands.put(command)
        self._wakeup.set()

    def _pause_stream(self, request_id: str) -> None:
        self._paused_streams.add(request_id)
        self._command(lambda: self.engine.pause_request(request_id))

    def _resume_stream(self, request_id: str) -> None:
        self._paused_streams.discard(request_id)
        self._command(lambda: self.engine.resume_request(request_id))

    def _read_timed_out(self, request_id: str) -> None:
        logger.warning("request %s is aborted: its client read nothing for %g s", request_id,
                       self.stream_read_timeout_s)
        self._read_timeouts += 1

        self._end_now(lambda: self.engine.abort(request_id))  # its reader may come back for the end

    def run_sliced(self, make_work: Callable[[], SlicedGenerator]) -> asyncio.Future[Any]:
        """Runs the generator `make_work()` makes on the engine thread, a piece between steps
        (sliced_work.py); the future resolves with its return value or error. Cancelling the
        future drops the work before its next piece."""
        assert self._loop is not None, "AsyncEngine.start() first"
        loop = self._loop
        future: asyncio.Future[Any] = loop.create_future()
        cancelled = threading.Event()
        future.add_done_callback(lambda f: cancelled.set() if f.cancelled() else None)

        def done(result: Any, error: BaseException | None) -> None:
            if error is not None:
                loop.call_soon_threadsafe(_set_exception, future, error)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._command(lambda: self._sliced.add(SlicedTask(make_work(), done, cancelled.is_set)))
        return future

    async def close_session(self, session_id: str, tenant: str | None = None) -> bool:
        """Ends `tenant`'s session `session_id` (Engine.close_session)."""
        return await self._call(lambda: self.engine.close_session(session_id, tenant))

    async def flush_cache(self) -> PagesFreed:
        return await self._call(self.engine.flush_cache)

    def call(self, fn: Callable[[], _R]) -> asyncio.Future[_R]:
        """Runs `fn` on the engine thread between two steps (so it never sees one half done,
        e.g. to read the tree); the future resolves with its result or error."""
        return self._call(fn)

    def fault(self) -> str | None:
        """Why the engine can no longer run steps at all (Engine.fault: a tensor-parallel
        worker died or hangs), or None; unlike `health`, a stall that may pass is not one."""
        return self.engine.fault()

    def health(self) -> str | None:
        """None while the loop is healthy; else why not (what GET /health reports with a 503)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return "the engine thread is not running"
        fault = self.engine.fault()
        if fault is not None:
            return fault
        waited = self._pending_for()
        if waited > self.stall_timeout_s:
            return (f"the engine loop has not completed a step for {waited:.1f} s while work is "
                    f"pending (bound: {self.stall_timeout_s:g} s)")
        return None

    def stats(self) -> dict[str, Any]:
        """The snapshot published after the latest step, plus the watchdog's live figures:
        `seconds_since_last_step` and `stalled` (1 while health() reports a stall). Never
        waits for a step."""
        with self._stats_lock:
            stats = dict(self._stats)
        stats["seconds_since_last_step"] = time.monotonic() - self._last_step_at
        stats["stalled"] = int(self._pending_for() > self.stall_timeout_s)
        stats["streams_paused"] = len(self._paused_streams)
        stats["stream_read_timeouts"] = self._read_timeouts
        stats["view_pieces"] = self._sliced.pieces
        return stats

    def _pending_for(self) -> float:
        since = self._pending_since
        return 0.0 if since is None else time.monotonic() - since


def _refused(cancelled: asyncio.CancelledError) -> bool:
    """Whether a wait was cancelled with the message REFUSED_BATCH."""
    return cancelled.args[:1] == (REFUSED_BATCH,)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
