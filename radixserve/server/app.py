"""The OpenAI-compatible HTTP app: Starlette routes over an AsyncEngine, SSE streaming.

The engine runs in its own thread (AsyncEngine), so the event loop only parses, tokenizes and
forwards deltas: /health answers during the longest generation.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from radixserve import AsyncEngine, StreamDelta
from radixserve.engine.async_engine import DEFAULT_STOP_TIMEOUT_S
from radixserve.engine.event_stream import DEFAULT_CAPACITY
from radixserve.grammar import GrammarError
from radixserve.grammar.compile_workers import CompileWorkerLost
from radixserve.schema_check import CheckBudget, checking_for
from radixserve.server.cache_routes import DEFAULT_EVENTS_IDLE_TIMEOUT_S, CacheRoutes
from radixserve.server.connection_limits import address_key
from radixserve.server.dashboard import Dashboard
from radixserve.server.errors import (
    APIError,
    engine_errors,
    engine_unavailable,
    error_from_decode,
    handle_api_error,
    handle_http_exception,
    request_failure,
    server_stopping,
)
from radixserve.server.fair_slots import FairSlots
from radixserve.server.formatting import (
    ChatFormatter,
    ChoiceResult,
    CompletionFormatter,
    ResponseFormatter,
    ResponseIdentity,
    TokenNamer,
    UsageCounter,
    vocab_bytes,
)
from radixserve.server.grammar_compiles import GrammarCompiles
from radixserve.server.guard import RequestGuard
from radixserve.server.host_check import HostCheck, SameOriginPosts
from radixserve.server.metrics import RequestTimer, ServerMetrics
from radixserve.server.prompt_work import PromptWork, refuse_by_prefix
from radixserve.server.prompts import ChatRenderer, rendered_chars
from radixserve.server.protocol import (
    MAX_ID_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
)
from radixserve.server.refusal_pacing import RefusalPacer
from radixserve.server.start_shares import (
    SLOT_SCOPE_KEY,
    LeaveAtResponseEnd,
    StartShares,
    default_tenant_starts,
)
from radixserve.server.streams import (
    ClientLeft,
    close,
    first_of_each,
    merge_batch,
    prepend,
    unless_disconnected,
    while_connected,
)
from radixserve.server.structured import carries_constraint, grammar_error
from radixserve.server.tenancy import SINGLE_TENANT, ApiKeys, Caller, admin_only
from radixserve.server.tool_parsers import parser_for_template
from radixserve.server.tools import parser_template_mismatch, plan_tools
from radixserve.server.translate import (
    EngineCall,
    chat_call,
    completion_calls,
    completion_prompts,
)
from radixserve.server.turns import DEFAULT_MAX_TOKENS as DEFAULT_TURN_TOKENS
from radixserve.server.turns import GeneratedTurns
from radixserve.server.work_limit import DEFAULT_MAX_REQUEST_TOKENS, WorkLimit

logger = logging.getLogger("radixserve.server")

MAX_BODY_BYTES = 4 * 2**20
DECODE_IN_THREAD_BYTES = 64 * 2**10
# A whole response is formatted and encoded in a worker thread past this many tokens and
# logprob alternatives (a few milliseconds' work): 64 prompts x n=16 x 64 tokens with 20
# alternatives each is a 36 MB body, 3 s on the event loop, every other client's stream stalled.
OFFLOAD_RESPONSE_ENTRIES = 4096
BODY_TIMEOUT_S = 30.0  # a request body must arrive within this (docs/server.md)
RETRY_AFTER_S = 1
# Requests whose schemas are checked at once (`OpenAIServer._check`). Their threads mostly wait
# for the checking process (schema_check.py), which takes the least-served caller's next: with
# 2, four addresses' requests of slow schemas held both and another client's cheap one waited
# for one of them to end.
REQUEST_CHECKS = 4
_Checked = TypeVar("_Checked")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
GENERATION_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_ENCODER = msgspec.json.Encoder()
_CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
_DONE = b"data: [DONE]\n\n"
Remember = Callable[[Sequence[ChoiceResult]], Awaitable[None]]  # a request's finished choices


class OpenAIServer:
    """The route handlers and what they share: the engine, the metrics and the settings."""

    def __init__(self, engine: AsyncEngine, *, served_model_name: str | None = None,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 turn_memory_tokens: int = DEFAULT_TURN_TOKENS, body_timeout_s: float = BODY_TIMEOUT_S,
                 tool_call_parser: str | None = None, keys: ApiKeys | None = None,
                 max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS, tenant_starts: int = 0) -> None:
        self.engine = engine
        self.max_request_tokens = max_request_tokens
        self.body_timeout_s = body_timeout_s
        self.tokenizer = engine.engine.tokenizer
        if tool_call_parser and (mismatch := parser_template_mismatch(tool_call_parser, self.tokenizer)):
            raise ValueError(mismatch)
        self.tool_call_parser = tool_call_parser or parser_for_template(getattr(self.tokenizer, "chat_template", None))
        self.turns = GeneratedTurns(turn_memory_tokens) if turn_memory_tokens else None
        self._special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        self.max_context_len = engine.engine.max_context_len
        self.renderer = ChatRenderer(self.tokenizer, self.turns, max_prompt_tokens=self.max_context_len)
        self.max_sequence_len = engine.engine.max_sequence_len
        self.sampling_defaults = engine.engine.sampling_defaults  # the checkpoint's, for unset fields
        self.model_name = served_model_name or engine.engine.model_name
        self.accepted_model_names = {self.model_name, engine.engine.model_name}
        self.api_key = api_key
        self.keys = keys if keys is not None else ApiKeys.of(api_key=api_key)
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine.stats)
        self.grammar_compiles = GrammarCompiles()
        self.request_checks = FairSlots(REQUEST_CHECKS)
        self.starts = StartShares(tenant_starts)
        self.prompt_work = PromptWork(self.tokenizer, self.max_context_len)
        self._token_bytes: list[bytes] | None = None  # each token's bytes: built on first use
        self.stopping = False  # end_requests was called: an aborted request was ended by the server

    def end_requests(self) -> None:
        """Ends every request the engine holds, answered with a 503 (server_stopping): the
        seam through which a stopping server (cli_serve.BoundedServer) ends what would
        otherwise be cancelled mid-response when its grace runs out."""
        self.stopping = True
        self.engine.abort_all()

    # ------------------------------------------------------------------ routes
    async def models(self, request: Request) -> Response:
        """GET /v1/models: the one model served."""
        self._authorize(request)
        return _json(ModelList(data=[self._model_card(self.model_name)]))

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model_id}: the served model under either of its names, else 404."""
        self._authorize(request)
        model_id = request.path_params["model_id"]
        self._check_model(model_id)
        return _json(self._model_card(model_id))

    async def close_session(self, request: Request) -> Response:
        """POST /v1/sessions/{session_id}/close: the session's pages become ordinary cache.
        Sessions are the caller's tenant's own: another tenant's session id is answered as
        an unknown one (the same 404), so the route tells nobody which ids exist elsewhere."""
        caller = self._authorize(request)
        session_id = request.path_params["session_id"]
        if len(session_id) > MAX_ID_CHARS:
            raise APIError(400, f"session_id: at most {MAX_ID_CHARS} characters", param="session_id",
                           code="invalid_value")
        if not await self.engine.close_session(session_id, caller.tenant):
            raise APIError(404, f"No open session {session_id!r}", param="session_id",
                           code="session_not_found")
        return JSONResponse({"id": session_id, "object": "session", "closed": True})

    async def health(self, request: Request) -> Response:
        """GET /health: 200 at once, or 503 with the reason when the engine loop is stalled."""
        problem = self.engine.health()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        """GET /metrics: Prometheus text exposition. On a server with keys, an admin's key
        (or the single --api-key): the pool-wide counters, read before and after another
        tenant's request, tell its prompt's length and cached prefix."""
        if self.keys is not None:
            admin_only(self._authorize(request))
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    # ------------------------------------------------------------------ generation
    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        caller = self._authorize(request)
        timer = self.metrics.timer()
        share = share_key(caller, request)
        raw = await self._read_body(request)
        if not await self._may_start(request, share):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = await _decode(raw, _CHAT_DECODER)
        self._check_model(body.model)
        # Tokenizing a large prompt takes seconds; the tokenizer releases the GIL, so a worker
        # thread keeps the event loop (and /health) responsive meanwhile.
        # The scope of generated turns: the tenant and the salt ("" is no salt). Generated turns
        # are kept per scope, so no tenant's prompt is tokenized by another's answers (its
        # prompt_tokens would tell which answers another tenant was given).
        salt = body.cache_salt or None
        scope = salt if caller.tenant is None else (caller.tenant, salt)
        schemas = bool(body.tools) or carries_constraint(body)
        tools = await self._check(request, share, schemas, lambda: plan_tools(body, self.tool_call_parser))
        chars = rendered_chars(body)
        self.prompt_work.check_size(chars, "messages")
        try:
            # (`chars` counts each message's and tool call's markup: a crowd of tiny ones is large)
            prompt_ids, system_tokens = await while_connected(request, self.prompt_work.run(
                share, chars,
                lambda: self.renderer.render(body.messages, scope, tools.tools)))
        except RecursionError:  # the template recursed into something nested: the request's doing
            raise APIError(400, "messages: too deeply nested to render with the chat template (a tool's "
                                "parameters or a tool call's arguments)", param="messages",
                           code="invalid_value") from None
        call = await self._check(request, share, schemas, lambda: chat_call(
            body, prompt_ids, system_tokens, self.max_context_len, self.max_sequence_len, self.sampling_defaults,
            tools.grammar, WorkLimit(self.max_request_tokens), tools.auto_calls))
        _as_caller([call], caller, share)
        await self._compile_grammar(request, [call], share)
        formatter = ChatFormatter(self._identity("chatcmpl", bool(body.stream), body.stream_options),
                                  TokenNamer(self.tokenizer, body.return_tokens_as_token_ids,
                                             await self._vocab_bytes() if body.logprobs else None), tools.parser,
                                  logprobs=bool(body.logprobs))
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        remember = ((lambda results: self._remember_turns(scope, caller.tenant, results)) if self.turns is not None
                    else None)
        return await self._generate(request, [call], formatter, bool(body.stream), ["messages"], max_tokens_param,
                                    timer, remember)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions: one prompt, or a batch of them (n choices per prompt)."""
        caller = self._authorize(request)
        timer = self.metrics.timer()
        share = share_key(caller, request)
        raw = await self._read_body(request)
        if not await self._may_start(request, share):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = await _decode(raw, _COMPLETION_DECODER)
        self._check_model(body.model)
        prompts, batch = completion_prompts(body)
        max_queue = self.engine.max_queue  # (a cluster's: its live replicas' together)
        if max_queue is not None and len(prompts) > max_queue:
            # Its prompts are queued together: a 503 would have the client retry it for good.
            raise APIError(400, f"A batch of {len(prompts)} prompts cannot fit this server's waiting queue "
                                f"of {max_queue} requests (--max-queue): send at most {max_queue} per request",
                           param="prompt", code="request_too_large")
        params = [f"prompt[{i}]" for i in range(len(prompts))] if batch else ["prompt"]
        tokenizer = self.tokenizer
        for prompt, param in zip(prompts, params):
            if isinstance(prompt, str):
                self.prompt_work.check_size(len(prompt), param)

        def encode() -> list[list[int]]:
            for prompt, param in zip(prompts, params):
                if isinstance(prompt, str):
                    refuse_by_prefix(tokenizer.encode, prompt, self.max_context_len, param)
            return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]

        prompt_ids = await while_connected(request, self.prompt_work.run(
            share, sum(len(p) for p in prompts if isinstance(p, str)), encode))
        limit = WorkLimit(self.max_request_tokens, len(prompts))
        calls = await self._check(request, share, carries_constraint(body), lambda: completion_calls(
            body, prompt_ids, params, self.max_context_len, self.max_sequence_len, self.sampling_defaults, limit))
        _as_caller(calls, caller, share)
        await self._compile_grammar(request, calls, share)  # one spec for the whole batch
        formatter = CompletionFormatter(self._identity("cmpl", bool(body.stream), body.stream_options),
                                        TokenNamer(self.tokenizer, body.return_tokens_as_token_ids,
                                                   await self._vocab_bytes() if body.logprobs is not None else None))
        return await self._generate(request, calls, formatter, bool(body.stream), params, "max_tokens", timer)

    async def _may_start(self, request: Request, share: Hashable) -> bool:
        """Waits for a start among `share`'s requests (start_shares.py), once its body is in (so
        a disconnect can be seen meanwhile without reading it); False: its client left. The
        slot is left at the response's end (`LeaveAtResponseEnd`), and stops counting as
        starting once the request's first outputs are in (`_generate`)."""
        slot = self.starts.join(share)
        request.scope[SLOT_SCOPE_KEY] = slot
        return slot.granted or await unless_disconnected(request, slot.wait()) is not None

    async def _vocab_bytes(self) -> list[bytes] | None:
        """Each token's bytes (chat logprobs' `bytes`), read from the tokenizer once, in a
        worker thread (half a second for a 49k-token vocabulary), on the first request asking."""
        if self._token_bytes is None:
            self._token_bytes = await anyio.to_thread.run_sync(vocab_bytes, self.tokenizer)
        return self._token_bytes

    async def _check(self, request: Request, share: Hashable, schemas: bool,
                     check: Callable[[], _Checked]) -> _Checked:
        """Runs a request's checks: inline when it carries no schema (they take microseconds),
        else in a worker thread, in one of REQUEST_CHECKS slots shared fairly (`share_key`).
        Checking JSON Schemas (tools', the reply's) takes time in proportion to their size in
        the validator's pure Python: on the event loop a megabyte of them froze every stream
        for seconds, and in unbounded threads a crowd of them would starve the event loop and
        the engine thread of the GIL."""
        if not schemas:
            return check()
        # Its JSON Schemas go round with other callers' in the checking process as `share`'s,
        # within one budget of its CPU for all of the request's checks (schema_check.py).
        budget = getattr(request.state, "schema_budget", None)
        if budget is None:
            budget = request.state.schema_budget = CheckBudget(share)
        return await while_connected(request, self._check_in_thread(share, budget, check))

    async def _check_in_thread(self, share: Hashable, budget: CheckBudget, check: Callable[[], _Checked]) -> _Checked:
        async with self.request_checks.hold(share):
            return await anyio.to_thread.run_sync(functools.partial(checking_for, budget, check))

    async def _compile_grammar(self, request: Request, calls: list[EngineCall], share: Hashable) -> None:
        """Compiles the calls' grammar (one spec for all of them, cached by spec) in a worker
        thread, so that a large schema neither holds the event loop nor stalls the engine's
        step; a 400 naming the field when it cannot be compiled. The spec is scoped to the
        tenant and cache salt first (`GrammarSpec.scope`): no tenant reuses, or can time,
        another's compiles. A spec compiled already takes no slot, and the slots go round
        (`share_key`): one tenant's flood of slow schemas delays another's by one compile.
        ClientLeft when the client leaves meanwhile (its wait for a slot ends then; a compile
        that runs already finishes into the cache)."""
        call = calls[0]
        if call.params.grammar is None:
            return
        spec = replace(call.params.grammar, scope=(call.tenant, call.cache_salt or None))  # "" is no salt
        for each in calls:
            each.params.grammar = spec
        grammars = getattr(self.engine.engine, "grammars", None)
        if grammars is None:  # a cluster's ingress: the replica compiles it when it takes the request
            return
        try:
            compiled = await while_connected(request, self.grammar_compiles.compile(
                grammars, spec, call.grammar_param or "response_format", share))
        except GrammarError as exc:
            raise grammar_error(exc) from exc
        except CompileWorkerLost as exc:  # the server's fault (lost or starved of CPU), not the request's
            logger.error("grammar compile failed: %s", exc)
            raise APIError(503, "the grammar compiler is unavailable; retry", code="grammar_compiler_unavailable",
                           error_type="server_error", headers={"Retry-After": "1"}) from exc
        for each in calls:
            each.compiled_grammar = compiled

    async def _generate(self, request: Request, calls: list[EngineCall], formatter: ResponseFormatter,
                        stream: bool, prompt_params: list[str], max_tokens_param: str,
                        timer: RequestTimer, remember: Remember | None = None) -> Response:
        """Runs one engine request per call (one per prompt of a batch) and answers with their
        choices: prompt i's choice j has index i * n + j. `remember` sees the choices once they
        all finished (a chat completion's generated turns), before the response ends."""
        if self.stopping:  # it waited (a compile, the prompt's tokenizing) past end_requests
            raise server_stopping()
        fault = self.engine.fault()
        if fault is not None:
            raise engine_unavailable(fault)
        request_id = formatter.identity.id
        n = calls[0].params.n
        request_ids = [request_id] if len(calls) == 1 else [f"{request_id}-{i}" for i in range(len(calls))]
        streams = [self.engine.generate(
            call.prompt_ids, call.params, request_id=engine_request_id,
            priority=call.priority, cache_salt=call.cache_salt, retention=call.retention,
            prefix_retention=call.prefix_retention, session_id=call.session_id, tenant=call.tenant,
            admin=call.admin, client=call.client)
            for engine_request_id, call in zip(request_ids, calls)]
        handed_over = False
        try:
            # The engine reports bad input and a full queue on the first item: wait for every
            # prompt's before answering, so those become proper HTTP errors.
            firsts = await unless_disconnected(request, first_of_each(streams))
            slot = request.scope.get(SLOT_SCOPE_KEY)
            if slot is not None:
                slot.started()
            if firsts is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            for param, first in zip(prompt_params, firsts):
                if isinstance(first, BaseException):
                    # The batch's prompts that started are given up as refused (before the
                    # streams close, which would abort them as their client's leaving).
                    for started, engine_request_id in zip(firsts, request_ids):
                        if started is not None and not isinstance(started, BaseException):
                            self.engine.abort(engine_request_id, refused=True)
                    with engine_errors(param, max_tokens_param, RETRY_AFTER_S):
                        raise first
            grammar_param = calls[0].grammar_param or "response_format"
            failure = next(filter(None, (self._failure(first, grammar_param) for first in firsts)), None)
            if failure is not None:  # before any token: a plain 4xx, 500 or 503, streaming or not
                raise failure
            deltas = merge_batch([prepend(first, rest) for first, rest in zip(firsts, streams)], n)
            handed_over = True  # from here `deltas` owns the engine streams and closes them
            choices = n * len(calls)
            if stream:
                events = self._sse(deltas, formatter, choices, n, timer, remember, grammar_param)
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            try:
                response = await unless_disconnected(request, self._collect(deltas, formatter, choices, n, timer,
                                                                             remember, grammar_param))
            finally:
                await close(deltas)
            return Response(status_code=CLIENT_CLOSED_REQUEST) if response is None else response
        finally:
            if not handed_over:
                for engine_stream in streams:
                    await close(engine_stream)

    async def _collect(self, deltas: AsyncIterator[StreamDelta], formatter: ResponseFormatter,
                       choices: int, n: int, timer: RequestTimer, remember: Remember | None,
                       grammar_param: str) -> Response:
        results = [ChoiceResult() for _ in range(choices)]
        usage = UsageCounter(n)
        async with aclosing(deltas):
            async for delta in deltas:
                failure = self._failure(delta, grammar_param)
                if failure is not None:
                    raise failure
                timer.observe(delta)
                usage.add(delta)
                results[delta.index].add(delta)
        timer.finish()
        if remember is not None:
            await remember(results)
        totals = usage.usage()
        if _response_entries(results) <= OFFLOAD_RESPONSE_ENTRIES:
            return _json(formatter.response(results, totals))
        return await anyio.to_thread.run_sync(lambda: _json(formatter.response(results, totals)))

    async def _sse(self, deltas: AsyncIterator[StreamDelta], formatter: ResponseFormatter, choices: int,
                   n: int, timer: RequestTimer, remember: Remember | None,
                   grammar_param: str) -> AsyncIterator[bytes]:
        usage = UsageCounter(n)
        results = [ChoiceResult() for _ in range(choices)] if remember is not None else None
        try:
            for chunk in formatter.opening_chunks(choices):
                yield _event(chunk)
            async for delta in deltas:
                failure = self._failure(delta, grammar_param)
                if failure is not None:  # the rest is aborted
                    yield _event(_error_event(failure))
                    break
                timer.observe(delta)
                usage.add(delta)
                if results is not None:
                    results[delta.index].add(delta)
                for chunk in formatter.chunks(delta):
                    yield _event(chunk)
            else:
                timer.finish()
                if remember is not None and results is not None:
                    await remember(results)
                if formatter.identity.include_usage:
                    yield _event(formatter.usage_chunk(usage.usage()))
        except Exception as exc:
            # Headers are gone already: the client learns of the failure from an error event.
            logger.exception("request %s failed mid-stream", formatter.identity.id)
            yield _event(_error_event(APIError(500, f"{type(exc).__name__}: {exc}", code="internal_error")))
        finally:
            # A client that went away cancels this generator; closing the engine's streams
            # aborts the requests and frees their pages, even while the cancellation unwinds.
            await close(deltas)
        yield _DONE

    def _failure(self, delta: StreamDelta, grammar_param: str) -> APIError | None:
        """The error of a request the engine ended unfinished, or None: its step failed or its
        grammar could not be followed ("error"), or the stopping server ended it ("abort"
        after end_requests; otherwise an abort is its reader's timeout and ends it as usual)."""
        if delta.finish_reason == "error":
            fault = self.engine.fault()
            return request_failure(delta, grammar_param) if fault is None else engine_unavailable(fault)
        if delta.finish_reason == "abort" and self.stopping:
            return server_stopping()
        return None

    async def _remember_turns(self, scope: Hashable, tenant: Hashable, results: Sequence[ChoiceResult]) -> None:
        """Remembers a request's finished choices in a worker thread: decoding a long answer
        would hold the event loop (and every other stream). Awaited before the response ends,
        so a later turn of the conversation finds this one remembered."""
        def remember_each() -> None:
            for result in results:
                self._remember_turn(scope, tenant, result)

        await anyio.to_thread.run_sync(remember_each)

    def _remember_turn(self, scope: Hashable, tenant: Hashable, result: ChoiceResult) -> None:
        """Keeps a finished choice's token ids for later turns that send its text back, when
        they decode to exactly that text (not when a stop string cut it short)."""
        if result.finish_reason not in ("stop", "length"):
            return
        ids = result.token_ids
        end = len(ids)
        while end and ids[end - 1] in self._special_ids:  # the end token is not in the text
            end -= 1
        if end and self.tokenizer.decode(ids[:end], skip_special_tokens=False) == result.text:
            self.turns.remember(scope, result.text, ids[:end], tenant)

    # ------------------------------------------------------------------ checks
    def _authorize(self, request: Request) -> Caller:
        """The request's caller (the tenant its key names), or a 401 when its key is missing
        or unknown. With no key configured every caller is the single tenant."""
        if self.keys is None:
            return SINGLE_TENANT
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        caller = self.keys.caller(token) if scheme.lower() == "bearer" and token else None
        if caller is None:
            raise APIError(401, "Missing or invalid API key (Authorization: Bearer <key>)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return caller

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_model_names:
            shown = model if len(model) <= MAX_ID_CHARS else model[:MAX_ID_CHARS] + "..."
            raise APIError(404, f"The model {shown!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _model_card(self, model_id: str) -> ModelCard:
        return ModelCard(id=model_id, created=self.created, max_model_len=self.max_context_len)

    async def _read_body(self, request: Request) -> bytes:
        """The whole body, within the size cap and the deadline (413, 408: a client that sends
        its body slowly must not hold a connection and a handler for as long as it likes)."""
        # Closed after the answer: the rest of the body is not read (a chunked body sent on and
        # on was read and dropped for seconds after its 413: 3.1 GB in 4 s).
        too_large = APIError(413, f"Request body exceeds {self.max_body_bytes} bytes", code="body_too_large",
                             headers={"Connection": "close"})
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        body = bytearray()
        try:
            with anyio.fail_after(self.body_timeout_s):
                async for piece in request.stream():
                    body += piece
                    if len(body) > self.max_body_bytes:
                        raise too_large
        except TimeoutError:
            raise APIError(408, f"The request body did not arrive within {self.body_timeout_s:g} s",
                           code="request_timeout", error_type="invalid_request_error",
                           headers={"Connection": "close"}) from None
        return bytes(body)

    def _identity(self, prefix: str, stream: bool, stream_options: Any) -> ResponseIdentity:
        include_usage = bool(stream and stream_options is not None and stream_options.include_usage)
        return ResponseIdentity(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()),
                                model=self.model_name, include_usage=include_usage)


def create_app(engine: AsyncEngine, *, served_model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, expose_cache_tokens: bool = False,
               cache_event_buffer: int = DEFAULT_CAPACITY,
               cache_events_idle_timeout_s: float = DEFAULT_EVENTS_IDLE_TIMEOUT_S,
               engine_stop_timeout_s: float | None = DEFAULT_STOP_TIMEOUT_S,
               turn_memory_tokens: int = DEFAULT_TURN_TOKENS, body_timeout_s: float = BODY_TIMEOUT_S,
               tool_call_parser: str | None = None, admin_api_key: str | None = None,
               tenant_keys: dict[str, Caller] | None = None,
               max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
               refusal_pacer: RefusalPacer | None = None, tenant_starts: int | None = None,
               allowed_hosts: frozenset[str] | None = None) -> Starlette:
    """The Starlette app serving `engine`; its lifespan starts and stops the engine's thread.

    `served_model_name` is the name /v1/models lists (default: the engine's model name; both
    are accepted in requests). With `api_key`, every /v1 route needs `Authorization: Bearer`.
    `tenant_keys` (tenancy.py: a keys file's) maps more keys to their tenants, and
    `admin_api_key` is a key that sees the whole cache; with any key, every /v1 route needs one.
    The single `api_key` is the single-tenant server's (it sees the whole cache, as an admin).
    The /v1/cache routes and /dashboard come from cache_routes.py and dashboard.py;
    `expose_cache_tokens` lets their snapshots and events carry token ids and text, and
    `cache_event_buffer` bounds how far (in events) a /v1/cache/events reader may fall behind;
    `cache_events_idle_timeout_s` closes an event stream that has sent no event for that long.
    At shutdown the engine thread gets `engine_stop_timeout_s` to stop; a thread stuck in a
    step is left behind (`app.state.engine_stopped` is then False). `turn_memory_tokens`
    bounds the token ids of generated turns kept for later turns' prompts (0: none; turns.py).
    A request body must arrive within `body_timeout_s` (else 408); the request head's
    deadline is the connection's (connections.py, given to uvicorn). `tool_call_parser` names
    the model's tool-call format (tool_parsers.py; default: chosen from the chat template).
    `max_request_tokens` bounds the tokens one request may ask to generate (work_limit.py).
    `refusal_pacer` counts every 4xx against its client's address; the HTTP protocol given
    the same pacer holds the addresses in debt (refusal_pacing.py). While several tenants
    have requests in flight, each may be starting `tenant_starts` // tenants of them at once
    (start_shares.py; 0: no limit; None: `default_tenant_starts`). With `allowed_hosts`, a
    request must name a loopback host or one of them in its Host header (host_check.py).
    """
    server = OpenAIServer(engine, served_model_name=served_model_name, api_key=api_key,
                          max_body_bytes=max_body_bytes, turn_memory_tokens=turn_memory_tokens,
                          body_timeout_s=body_timeout_s, tool_call_parser=tool_call_parser,
                          keys=ApiKeys.of(api_key=api_key, admin_api_key=admin_api_key, tenant_keys=tenant_keys),
                          max_request_tokens=max_request_tokens,
                          tenant_starts=default_tenant_starts(engine) if tenant_starts is None else tenant_starts)
    cache = CacheRoutes(engine, server.metrics, server._authorize, expose_tokens=expose_cache_tokens,
                        event_buffer=cache_event_buffer, events_idle_timeout_s=cache_events_idle_timeout_s,
                        on_flush=server.turns.clear if server.turns is not None else None)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            cache.close()
            app.state.engine_stopped = await engine.shutdown(engine_stop_timeout_s)

    routes = [
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        # (any id closes: one holding "/", sent as is or as %2F, which is decoded before routing)
        Route("/v1/sessions/{session_id:path}/close", server.close_session, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
        *cache.routes(),
        *Dashboard().routes(),
    ]
    # Exceptions no handler maps are answered by RequestGuard (a 500 that keeps the connection).
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[*([Middleware(HostCheck, names=allowed_hosts)] if allowed_hosts is not None else []),
                                *([Middleware(SameOriginPosts)] if server.keys is None else []),
                                Middleware(RequestGuard, metrics=server.metrics, endpoints=GENERATION_ENDPOINTS,
                                           pacer=refusal_pacer),
                                Middleware(LeaveAtResponseEnd)],
                    exception_handlers={APIError: handle_api_error, HTTPException: handle_http_exception,
                                        ClientLeft: _client_left})
    if refusal_pacer is not None:
        server.metrics.watch_refusal_pacing(refusal_pacer)
    server.metrics.watch_start_shares(server.starts)
    app.state.server = server
    app.state.engine_stopped = None
    return app


async def _client_left(request: Request, exc: Exception) -> Response:
    """The answer to a request whose client left while it waited (ClientLeft): for nobody."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _decode(body: bytes, decoder: msgspec.json.Decoder) -> Any:
    """The validated request; a large body is decoded in a worker thread, so that clients
    sending megabytes of JSON cannot hold the event loop (and every other stream) meanwhile."""
    try:
        if len(body) > DECODE_IN_THREAD_BYTES:
            return await anyio.to_thread.run_sync(decoder.decode, body)
        return decoder.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise error_from_decode(exc, body) from exc
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The body is not valid UTF-8: {exc.reason} at byte {exc.start}.",
                       code="invalid_json") from exc


def share_key(caller: Caller, request: Request) -> Hashable:
    """Whom the server's bounded slots (request checks, prompt work, grammar compiles) go round:
    the caller's tenant; on a server without tenants each client's address (connection_limits'
    `address_key`: an IPv4 address, a global IPv6 /64), so that there too one client's flood of
    slow work delays another's by one job, not by the flood (behind a proxy, one address)."""
    if caller.tenant is not None:
        return caller.tenant
    return ("address", address_key(tuple(request.client) if request.client else None))


def _as_caller(calls: list[EngineCall], caller: Caller, share: Hashable) -> None:
    """The calls run as `caller`'s: its tenant, and whether an admin sent them (whose priority
    orders every tenant's requests and whose raised retention is not held to a share); and
    `share` is whom the engine's fair share counts them as (on a server without tenants'
    keys, the client's address: one client's flood is then shared fairly with the others)."""
    for call in calls:
        call.tenant, call.admin, call.client = caller.tenant, caller.admin, share


def _response_entries(results: list[ChoiceResult]) -> int:
    """What formatting and encoding a whole response costs, in tokens and logprob entries."""
    return sum(len(result.token_ids) + sum(len(entry.top) for entry in result.logprobs) for result in results)


def _json(value: Any) -> Response:
    return Response(_ENCODER.encode(value), media_type="application/json")


def _event(value: Any) -> bytes:
    return b"data: " + _ENCODER.encode(value) + b"\n\n"


def _error_event(error: APIError) -> dict[str, ErrorBody]:
    """The SSE payload of a failure after the headers went out: OpenAI's error shape."""
    return {"error": ErrorBody(message=error.message, type=error.error_type, param=error.param, code=error.code)}
