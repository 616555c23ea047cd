"""OpenAI-shaped errors: one exception type, one JSON body, one mapping from decode failures."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from radixserve import PromptTooLong, QueueFull, StreamDelta
from radixserve.server.protocol import ErrorBody, ErrorResponse

_ENCODER = msgspec.json.Encoder()

# msgspec ends a validation message with " - at `$.messages[0].role`"; the path names the field.
_PATH_SUFFIX = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")
# A high surrogate escape not followed by a low one. msgspec reports one with fewer than 6
# bytes after it (`"\ud800"}]}` closing a chat) as "Input data was truncated", so only the
# body's last bytes are searched; elsewhere msgspec names the surrogate itself.
_LONE_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
_SURROGATE_TAIL_BYTES = 16
_BACKSLASH_RUN_BYTES = 4096

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # OpenAI's type for an unknown model or route too
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_overloaded",
}


class APIError(Exception):
    """An error the client is told about: status, message and the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers = headers or {}


def error_response(error: APIError) -> Response:
    """The JSON response {"error": {"message", "type", "param", "code"}} for `error`."""
    body = ErrorResponse(error=ErrorBody(message=error.message, type=error.error_type,
                                         param=error.param, code=error.code))
    return Response(_ENCODER.encode(body), status_code=error.status, headers=error.headers,
                    media_type="application/json")


def error_from_decode(exc: msgspec.DecodeError | RecursionError, body: bytes = b"") -> APIError:
    """Maps a msgspec decode failure of `body` to a 400 naming the offending field.

    A missing field is named by its full path (`messages[0].role`), a wrong type or value by
    the path msgspec reports; malformed JSON names no field.
    """
    if isinstance(exc, RecursionError):  # msgspec's decoder recurses once per nesting level
        return APIError(400, "Request body is nested too deeply", code="invalid_json")
    if not isinstance(exc, msgspec.ValidationError):
        at = _lone_high_surrogate(body) if str(exc) == "Input data was truncated" else None
        if at is not None:
            return APIError(400, "Request body is not valid JSON: invalid utf-16 surrogate pair (a high "
                                 f"surrogate escape with no low one after it, byte {at})", code="invalid_json")
        return APIError(400, f"Request body is not valid JSON: {exc}", code="invalid_json")
    message = str(exc)
    path_match = _PATH_SUFFIX.search(message)
    path = path_match.group("path") if path_match else ""
    missing = _MISSING_FIELD.match(message)
    if missing:
        field = missing.group("field")
        param = f"{path}.{field}" if path else field
        return APIError(400, message, param=param, code="missing_field")
    return APIError(400, message, param=path or None, code="invalid_value")


def _lone_high_surrogate(body: bytes) -> int | None:
    """Where a lone high surrogate escape starts in the last bytes of `body`, or None. Its
    backslash must not be escaped itself: an even number of backslashes comes before it,
    counted over at most _BACKSLASH_RUN_BYTES (a longer run gets msgspec's own message: the
    body is refused either way, and counting megabytes of backslashes would hold the loop)."""
    for found in _LONE_HIGH_SURROGATE.finditer(body, max(0, len(body) - _SURROGATE_TAIL_BYTES)):
        start = found.start()
        before = body[max(0, start - _BACKSLASH_RUN_BYTES):start]
        run = len(before) - len(before.rstrip(b"\\"))
        if run == _BACKSLASH_RUN_BYTES:
            return None
        if run % 2 == 0:
            return start
    return None


def error_from_value_error(exc: ValueError, default_param: str | None = None) -> APIError:
    """Maps the engine's ValueError("<field>: why") to a 400 naming that field."""
    message = str(exc)
    field, sep, _ = message.partition(":")
    param = field.strip() if sep and field.strip().isidentifier() else default_param
    return APIError(400, message, param=param, code="invalid_value")


@contextmanager
def engine_errors(prompt_param: str, max_tokens_param: str = "max_tokens",
                  retry_after_s: int = 1) -> Iterator[None]:
    """Maps what AsyncEngine.generate raises up front to HTTP errors.

    QueueFull → 503 with Retry-After; PromptTooLong → 400 on `prompt_param` ("messages",
    "prompt" or "prompt[i]") when the prompt alone is too long, else on `max_tokens_param`;
    the engine's ValueError("<field>: why") → 400 on that field.
    """
    try:
        yield
    except QueueFull as exc:
        raise APIError(503, f"The server is busy: {exc}", code="queue_full",
                       headers={"Retry-After": str(retry_after_s)}) from exc
    except PromptTooLong as exc:
        param = max_tokens_param if exc.param == "max_tokens" else prompt_param
        raise APIError(400, _batch_prompt(str(exc), prompt_param), param=param,
                       code="context_length_exceeded") from exc
    except ValueError as exc:
        error = error_from_value_error(exc)
        if error.param == "prompt":
            error.param = prompt_param
            error.message = _batch_prompt(error.message, prompt_param)
        raise error from exc


def _batch_prompt(message: str, prompt_param: str) -> str:
    """The engine's message, which names "prompt" (it knows of no batch), naming the batch's
    prompt it is about ("prompt[7]: token ids must be in ...") as the error's param does."""
    if prompt_param.startswith("prompt[") and message.startswith("prompt"):
        return prompt_param + message.removeprefix("prompt")
    return message


def engine_failure() -> APIError:
    """The 500 of a request the engine ended with finish_reason "error" (a failed step)."""
    return APIError(500, "The engine failed while generating this request; the failure is in the "
                         "server log. Other requests are not affected; retrying may succeed.",
                    code="engine_error")


def engine_unavailable(fault: str) -> APIError:
    """The 503 of a request to an engine that can no longer run steps (`Engine.fault`: a
    tensor-parallel worker died or hangs): nothing succeeds until the server is restarted,
    which the 500 of a failed step ("retrying may succeed") did not say."""
    return APIError(503, f"The engine cannot run: {fault}. Nothing will succeed on this server until it "
                         "is restarted; send the request to another.", code="engine_unavailable",
                    error_type="server_error")


def server_stopping() -> APIError:
    """The 503 of a request the server ended unfinished because it is stopping (its grace
    after Ctrl-C or SIGTERM ran out)."""
    return APIError(503, "The server is shutting down and ended this request before it finished; "
                         "retry it once the server is back, or on another.", code="server_shutting_down",
                    error_type="server_error")


def request_failure(delta: StreamDelta, grammar_param: str) -> APIError:
    """Why the engine ended a request with finish_reason "error": a 400 on the grammar's field
    when the request's own grammar was at fault (too slow to follow, or a dead end: the
    delta's `fault`), else the server's failure (engine_failure)."""
    if delta.fault is None:
        return engine_failure()
    return APIError(400, f"{grammar_param}: {delta.fault}", param=grammar_param, code="invalid_value")


async def handle_api_error(request: Request, exc: Exception) -> Response:
    """Starlette exception handler for APIError."""
    assert isinstance(exc, APIError)
    return error_response(exc)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method) in the same JSON shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"No route for {request.method} {request.url.path}"
    else:
        message = exc.detail
    return error_response(APIError(exc.status_code, message, code=_code_for_status(exc.status_code),
                                   headers=dict(exc.headers or {})))


def unexpected_error(exc: BaseException) -> APIError:
    """Any other exception: a 500 in the same shape."""
    return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}", code="internal_error")


def _code_for_status(status: int) -> str:
    return {404: "not_found", 405: "method_not_allowed"}.get(status, f"http_{status}")
