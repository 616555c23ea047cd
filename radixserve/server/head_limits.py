"""A bound on a request head's size, which uvicorn's httptools protocol lacks.

httptools parses a head as it arrives and uvicorn keeps each header as a Python tuple, about
fourteen times its bytes, with no limit: one connection sending `X-A: b` lines until its head
deadline kept 3.4 GB and held the event loop for seconds at a time (every other client's
request waited). h11 bounds a head by itself (uvicorn answers 400 past
`h11_max_incomplete_event_size`, which `uvicorn_options` sets to MAX_HEAD_BYTES too).

`with_head_limits(base)` bounds a head twice over. The bytes read while a head is under way
are counted before the parser sees them, and the parser is fed no more than MAX_HEAD_BYTES of
one head: this bounds what httptools buffers itself (one endless header value, or target,
grows inside it unseen by any callback). And the fields the parser hands over are counted
from its callbacks, which see exactly where each head begins, even one pipelined in the same
read as the end of the request before it (which the first count, keyed to reads, misses).
A chunked body's trailer fields are a head of their own after the body: the fields count on
(the second count), and the bytes read in a body that are not body (framing, trailers) are
bounded the same (an endless trailer value grew inside httptools as a head's did, and held
the event loop for 20 s). Past MAX_HEAD_BYTES or MAX_HEAD_FIELDS the connection is answered
431 in OpenAI's error shape and closed (within a body only closed: its request is under way);
what was kept of the head is dropped at once, and nothing more of the connection reaches the
app.
"""

from __future__ import annotations

import asyncio
import logging

from radixserve.server.connection_limits import closing_error_response

logger = logging.getLogger("radixserve.server")

MAX_HEAD_BYTES = 64 * 1024  # request line and header lines (Go's default is 1 MiB, nginx's 32 KiB)
MAX_HEAD_FIELDS = 256       # header lines (Apache's default is 100)
FIELD_OVERHEAD = 4          # ": " and CRLF, not passed to the callbacks but sent


def head_refusal() -> bytes:
    """The whole HTTP response to a head over the bounds."""
    message = (f"the request head is too large: at most {MAX_HEAD_BYTES:,} bytes of target and header "
               f"fields, and {MAX_HEAD_FIELDS} fields")
    return closing_error_response(431, "Request Header Fields Too Large", message, "invalid_request_error",
                                  "request_header_fields_too_large")


REFUSAL = head_refusal()


def with_head_limits(base: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """`base` (uvicorn's httptools protocol, or one derived from it) refusing heads over the
    bounds. The callbacks it overrides are httptools' (h11 never calls them)."""

    class HeadLimited(base):  # type: ignore[valid-type, misc]
        """uvicorn's httptools protocol, answering 431 to a head over the bounds."""

        _head_bytes = 0    # read while this head is under way (the first count)
        _field_bytes = 0   # of the target and fields the parser handed over (the second)
        _head_fields = 0
        _in_head = True    # from the connection's start or a message's end to a head's end
        _heads_ended = 0
        _messages_ended = 0
        _body_bytes = 0      # of bodies, as the parser hands them over
        _framing_bytes = 0   # read past this head that were not body (chunk framing, trailers)
        _refused = False
        _logged = False  # the first refusal is logged, once per process

        def data_received(self, data: bytes) -> None:
            if self._refused:  # a refused connection's later bytes are dropped unread
                return
            if not self._in_head:
                self._read_in_body(data)
                return
            room = MAX_HEAD_BYTES - self._head_bytes
            self._head_bytes += min(len(data), room)
            if len(data) <= room:
                super().data_received(data)
                return
            heads_before = self._heads_ended
            super().data_received(data[:room])
            if self._heads_ended == heads_before:  # MAX_HEAD_BYTES read, and this head goes on
                self._refuse()
            else:  # it ended within them: the rest is its body, or requests pipelined behind it
                self.data_received(data[room:])

        def _read_in_body(self, data: bytes) -> None:
            """Bytes read past a head, until its message ends: what of them is not body (a
            chunked body's framing, and its trailer fields, which grow inside httptools like
            a head's) is counted against the same bound; past it the connection is closed."""
            messages, body = self._messages_ended, self._body_bytes
            super().data_received(data)
            if self._messages_ended != messages:  # the message ended in this read: its framing
                return                            # was bounded by the read, the next head is counted
            self._framing_bytes += len(data) - (self._body_bytes - body)
            if self._framing_bytes > MAX_HEAD_BYTES:
                self._refuse(mid_message=True)

        def on_message_begin(self) -> None:
            self._field_bytes = self._head_fields = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            if not self._over(len(url), 0):
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._over(len(name) + len(value) + FIELD_OVERHEAD, 1):
                super().on_header(name, value)

        # The parser goes on through the rest of the read it was fed: none of it is acted on.
        def on_headers_complete(self) -> None:
            self._in_head = False
            self._heads_ended += 1
            self._framing_bytes = 0
            if not self._refused:
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._in_head, self._head_bytes = True, 0  # the next head begins
            self._messages_ended += 1
            if not self._refused:
                super().on_message_complete()

        def _over(self, size: int, fields: int) -> bool:
            if self._refused:
                return True
            self._field_bytes += size
            self._head_fields += fields
            if self._field_bytes <= MAX_HEAD_BYTES and self._head_fields <= MAX_HEAD_FIELDS:
                return False
            self._refuse(mid_message=not self._in_head)  # trailers: after a body
            return True

        def _refuse(self, mid_message: bool = False) -> None:
            self._refused = True
            self.headers.clear()  # uvicorn's list (its scope's too): the memory goes now
            self.url = b""
            if not HeadLimited._logged:
                HeadLimited._logged = True
                logger.warning("a request head over %s bytes or %s fields from %s refused (431; logged once)",
                               f"{MAX_HEAD_BYTES:,}", MAX_HEAD_FIELDS, self.client)
            if mid_message:  # its request is under way: no answer can follow it cleanly
                self.transport.close()
            elif not self._answering():  # else after the answers to the requests before it
                self._answer_refusal()

        def _answering(self) -> bool:
            """A request before the refused head (pipelined) is being answered, or waits to be."""
            cycle = getattr(self, "cycle", None)
            return bool(self.pipeline) or (cycle is not None and not cycle.response_complete)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._refused and not self._answering():
                self._answer_refusal()

        def _answer_refusal(self) -> None:
            if not self.transport.is_closing():
                self.transport.write(REFUSAL)
                self.transport.close()

    HeadLimited.__name__ = HeadLimited.__qualname__ = f"HeadLimited{base.__name__}"
    return HeadLimited
