"""The app's outer layer: every request gets one answer and is counted once, as it is logged.

Two failures it exists to prevent:

- An exception that escapes an ASGI app makes uvicorn log it and close the connection after
  the response, without a `Connection: close` header: a client reusing that keep-alive
  connection then has its next request reset with no answer. Here such an exception becomes
  a 500 in OpenAI's shape and the connection stays usable.
- Counting a request by what its handler raised disagrees with the access log, which uvicorn
  writes when a response *starts* and never for a client that has gone. Here a generation
  request is counted when its response starts, under that status, or as a disconnect when
  its client left first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.connection_limits import address_key
from radixserve.server.errors import error_response, unexpected_error
from radixserve.server.metrics import ServerMetrics
from radixserve.server.refusal_pacing import RefusalPacer

logger = logging.getLogger("radixserve.server")


class RequestGuard:
    """ASGI middleware: catch-all 500s and `radixserve_http_requests_total` counting.

    `endpoints` maps a path to its metric label (only those paths are counted). With a
    `pacer`, every 4xx answered on any path is counted against its client's address
    (refusal_pacing.py).
    """

    def __init__(self, app: ASGIApp, *, metrics: ServerMetrics, endpoints: Mapping[str, str],
                 pacer: RefusalPacer | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = dict(endpoints)
        self.pacer = pacer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = self.endpoints.get(scope["path"])
        client_gone = False
        started = False
        send_failed = False

        async def watched_receive() -> Message:
            nonlocal client_gone
            message = await receive()
            if message["type"] == "http.disconnect":
                client_gone = True
            return message

        async def counted_send(message: Message) -> None:
            nonlocal started, send_failed
            if message["type"] == "http.response.start" and not started:
                started = True
                # A client that left was not refused (the 499 is written for nobody): its own
                # timeouts, or a server too slow to start its requests, must not hold its address.
                if self.pacer is not None and 400 <= message["status"] < 500 and not client_gone:
                    client = scope.get("client")
                    self.pacer.refused(address_key(tuple(client)) if client else None)
                if endpoint is not None:
                    # uvicorn writes nothing (no access-log line) for a client that has gone.
                    if client_gone:
                        self.metrics.disconnects.labels(endpoint).inc()
                    else:
                        self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            try:
                await send(message)
            except Exception:
                send_failed = True
                raise

        try:
            await self.app(scope, watched_receive, counted_send)
        except ClientDisconnect:  # the client left while sending its body: nobody to answer
            client_gone = True
        except Exception as exc:
            if send_failed:
                # The connection failed under a write (a client that left mid-pipeline: uvloop
                # raises on its closed transport): the client's doing, not a bug worth a traceback.
                logger.warning("response to %s not sent: its connection failed (%s)", scope["path"], exc)
            elif started:
                # A response cut short: returning lets uvicorn close the connection, as it must.
                logger.error("request to %s failed after its response started", scope["path"], exc_info=exc)
            else:
                logger.error("request to %s failed", scope["path"], exc_info=exc)
                await error_response(unexpected_error(exc))(scope, watched_receive, counted_send)
        if not started and endpoint is not None:
            self.metrics.disconnects.labels(endpoint).inc()
