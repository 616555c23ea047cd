"""The OpenAI-compatible HTTP app: Starlette routes over an AsyncEngine, SSE streaming.

The engine runs in its own thread (AsyncEngine), so the event loop only parses, tokenizes and
forwards deltas: /health answers during the longest generation.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from radixserve import AsyncEngine, StreamDelta
from radixserve.engine.event_stream import DEFAULT_CAPACITY
from radixserve.server.cache_routes import CacheRoutes
from radixserve.server.dashboard import Dashboard
from radixserve.server.errors import (
    APIError,
    engine_errors,
    error_from_decode,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
)
from radixserve.server.formatting import (
    ChatFormatter,
    ChoiceResult,
    CompletionFormatter,
    ResponseFormatter,
    ResponseIdentity,
    TokenNamer,
    UsageCounter,
)
from radixserve.server.metrics import RequestTimer, ServerMetrics
from radixserve.server.prompts import render_chat
from radixserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
)
from radixserve.server.translate import EngineCall, chat_call, completion_call

logger = logging.getLogger("radixserve.server")

MAX_BODY_BYTES = 4 * 2**20
RETRY_AFTER_S = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
_ENCODER = msgspec.json.Encoder()
_CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
_DONE = b"data: [DONE]\n\n"
_T = TypeVar("_T")


class OpenAIServer:
    """The route handlers and what they share: the engine, the metrics and the settings."""

    def __init__(self, engine: AsyncEngine, *, served_model_name: str | None = None,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.max_context_len = engine.engine.max_context_len
        self.max_sequence_len = engine.engine.max_sequence_len
        self.model_name = served_model_name or engine.engine.model_name
        self.accepted_model_names = {self.model_name, engine.engine.model_name}
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine.stats)

    # ------------------------------------------------------------------ routes
    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._counted("chat", self._chat, request)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._counted("completions", self._completion, request)

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the one model served."""
        self._authorize(request)
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_context_len)
        return _json(ModelList(data=[card]))

    async def close_session(self, request: Request) -> Response:
        """POST /v1/sessions/{session_id}/close: the session's pages become ordinary cache."""
        self._authorize(request)
        session_id = request.path_params["session_id"]
        if not await self.engine.close_session(session_id):
            raise APIError(404, f"No open session {session_id!r}", param="session_id",
                           code="session_not_found")
        return JSONResponse({"id": session_id, "object": "session", "closed": True})

    async def health(self, request: Request) -> Response:
        """GET /health: answers at once; the engine thread never blocks the event loop."""
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        """GET /metrics: Prometheus text exposition."""
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    # ------------------------------------------------------------------ generation
    async def _chat(self, request: Request) -> Response:
        self._authorize(request)
        timer = self.metrics.timer()
        body = _decode(await self._read_body(request), _CHAT_DECODER)
        self._check_model(body.model)
        # Tokenizing a large prompt takes seconds; the tokenizer releases the GIL, so a worker
        # thread keeps the event loop (and /health) responsive meanwhile.
        prompt_ids, system_tokens = await anyio.to_thread.run_sync(render_chat, self.tokenizer, body.messages)
        call = chat_call(body, prompt_ids, system_tokens, self.max_context_len, self.max_sequence_len)
        formatter = ChatFormatter(self._identity("chatcmpl", body.stream, body.stream_options),
                                  TokenNamer(self.tokenizer, body.return_tokens_as_token_ids))
        return await self._generate(request, call, formatter, body.stream, "messages", timer)

    async def _completion(self, request: Request) -> Response:
        self._authorize(request)
        timer = self.metrics.timer()
        body = _decode(await self._read_body(request), _COMPLETION_DECODER)
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = await anyio.to_thread.run_sync(self.tokenizer.encode, body.prompt)
        else:
            prompt_ids = body.prompt
        call = completion_call(body, prompt_ids, self.max_context_len, self.max_sequence_len)
        formatter = CompletionFormatter(self._identity("cmpl", body.stream, body.stream_options),
                                        TokenNamer(self.tokenizer, body.return_tokens_as_token_ids))
        return await self._generate(request, call, formatter, body.stream, "prompt", timer)

    async def _generate(self, request: Request, call: EngineCall, formatter: ResponseFormatter,
                        stream: bool, prompt_param: str, timer: RequestTimer) -> Response:
        request_id = formatter.identity.id
        deltas = self.engine.generate(
            call.prompt_ids, call.params, request_id=request_id, priority=call.priority,
            cache_salt=call.cache_salt, retention=call.retention,
            prefix_retention=call.prefix_retention, session_id=call.session_id)
        streaming = False
        try:
            # The engine reports bad input and a full queue on the first item: wait for it
            # before answering, so those become proper HTTP errors.
            with engine_errors(prompt_param, RETRY_AFTER_S):
                first = await _unless_disconnected(request, anext(deltas))
            if first is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            if stream:
                streaming = True  # from here the event generator owns `deltas` and closes it
                events = self._sse(deltas, first, formatter, call.params.n, timer)
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            response = await _unless_disconnected(
                request, self._collect(deltas, first, formatter, call.params.n, timer))
            return Response(status_code=CLIENT_CLOSED_REQUEST) if response is None else response
        finally:
            if not streaming:
                await _close(deltas)

    async def _collect(self, deltas: AsyncIterator[StreamDelta], first: StreamDelta,
                       formatter: ResponseFormatter, n: int, timer: RequestTimer) -> Response:
        choices = [ChoiceResult() for _ in range(n)]
        usage = UsageCounter()
        async with aclosing(_prepend(first, deltas)) as all_deltas:
            async for delta in all_deltas:
                timer.observe(delta)
                usage.add(delta)
                choice = choices[delta.index]
                choice.text += delta.text
                choice.token_ids.extend(delta.token_ids)
                choice.logprobs.extend(delta.logprobs or ())
                choice.finish_reason = delta.finish_reason or choice.finish_reason
        timer.finish()
        return _json(formatter.response(choices, usage.usage()))

    async def _sse(self, deltas: AsyncIterator[StreamDelta], first: StreamDelta,
                   formatter: ResponseFormatter, n: int, timer: RequestTimer) -> AsyncIterator[bytes]:
        usage = UsageCounter()
        try:
            for chunk in formatter.opening_chunks(n):
                yield _event(chunk)
            async with aclosing(_prepend(first, deltas)) as all_deltas:
                async for delta in all_deltas:
                    timer.observe(delta)
                    usage.add(delta)
                    chunk = formatter.chunk(delta)
                    if chunk is not None:
                        yield _event(chunk)
            timer.finish()
            if formatter.identity.include_usage:
                yield _event(formatter.usage_chunk(usage.usage()))
        except Exception as exc:
            # Headers are gone already: the client learns of the failure from an error event.
            logger.exception("request %s failed mid-stream", formatter.identity.id)
            yield _event({"error": ErrorBody(message=f"{type(exc).__name__}: {exc}", type="server_error",
                                             param=None, code="internal_error")})
        finally:
            # A client that went away cancels this generator; closing the engine's stream
            # aborts the request and frees its pages, even while the cancellation unwinds.
            await _close(deltas)
        yield _DONE

    # ------------------------------------------------------------------ checks
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Missing or invalid API key (Authorization: Bearer <key>)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_model_names:
            raise APIError(404, f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _read_body(self, request: Request) -> bytes:
        too_large = APIError(413, f"Request body exceeds {self.max_body_bytes} bytes", code="body_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > self.max_body_bytes:
                raise too_large
        return bytes(body)

    def _identity(self, prefix: str, stream: bool, stream_options: Any) -> ResponseIdentity:
        include_usage = bool(stream and stream_options is not None and stream_options.include_usage)
        return ResponseIdentity(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()),
                                model=self.model_name, include_usage=include_usage)

    async def _counted(self, endpoint: str, handler: Callable[[Request], Awaitable[Response]],
                       request: Request) -> Response:
        try:
            response = await handler(request)
        except APIError as exc:
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
        except Exception:
            self.metrics.requests.labels(endpoint, "500").inc()
            raise
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response


def create_app(engine: AsyncEngine, *, served_model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, expose_cache_tokens: bool = False,
               cache_event_buffer: int = DEFAULT_CAPACITY) -> Starlette:
    """The Starlette app serving `engine`; its lifespan starts and stops the engine's thread.

    `served_model_name` is the name /v1/models lists (default: the engine's model name; both
    are accepted in requests). With `api_key`, every /v1 route needs `Authorization: Bearer`.
    The /v1/cache routes and /dashboard come from cache_routes.py and dashboard.py;
    `expose_cache_tokens` lets their snapshots and events carry token ids and text, and
    `cache_event_buffer` bounds how far (in events) a /v1/cache/events reader may fall behind.
    """
    server = OpenAIServer(engine, served_model_name=served_model_name, api_key=api_key,
                          max_body_bytes=max_body_bytes)
    cache = CacheRoutes(engine, server.metrics, server._authorize, expose_tokens=expose_cache_tokens,
                        event_buffer=cache_event_buffer)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            cache.close()
            await engine.shutdown()

    routes = [
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/sessions/{session_id}/close", server.close_session, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
        *cache.routes(),
        *Dashboard().routes(),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        APIError: handle_api_error,
        HTTPException: handle_http_exception,
        Exception: handle_unexpected,
    })
    app.state.server = server
    return app


def _decode(body: bytes, decoder: msgspec.json.Decoder) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise error_from_decode(exc) from exc
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The body is not valid UTF-8: {exc.reason} at byte {exc.start}.",
                       code="invalid_json") from exc


def _json(value: Any) -> Response:
    return Response(_ENCODER.encode(value), media_type="application/json")


def _event(value: Any) -> bytes:
    return b"data: " + _ENCODER.encode(value) + b"\n\n"


async def _prepend(first: StreamDelta, rest: AsyncIterator[StreamDelta]) -> AsyncIterator[StreamDelta]:
    yield first
    async for delta in rest:
        yield delta


async def _close(deltas: AsyncIterator[StreamDelta]) -> None:
    with anyio.CancelScope(shield=True):
        await deltas.aclose()  # type: ignore[attr-defined]


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """Awaits `work` unless the client disconnects first (then cancels it, returns None).

    Starlette notices a disconnect only while streaming; this covers the time before the first
    token and non-streaming requests, so a client that leaves never keeps the engine busy.
    """
    result: list[_T] = []
    error: Exception | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result.append(await work)
        except Exception as exc:  # re-raised below, not wrapped in the group's ExceptionGroup
            error = exc
        group.cancel_scope.cancel()
    if error is not None:
        raise error
    return result[0] if result else None
