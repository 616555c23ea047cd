"""The streamed side of an OpenAI-compatible request, shared by `bench serve` and `bench peers`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx


class StreamFailed(Exception):
    """The server answered with an error status, or sent an error chunk mid-stream; the message
    says which ("HTTP 401: ...", "stream error: ...")."""


async def stream_chunks(client: httpx.AsyncClient, url: str, payload: dict[str, object]) -> AsyncIterator[dict]:
    """POSTs `payload` to `url` and yields each JSON chunk of the SSE stream up to `[DONE]`.

    Raises StreamFailed on a non-200 answer or an `error` chunk; httpx and JSON errors pass
    through unchanged."""
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise StreamFailed(f"HTTP {response.status_code}: {body[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:  # the server failed after the headers went out
                error = chunk["error"]
                raise StreamFailed(f"stream error: {error.get('message', error) if isinstance(error, dict) else error}")
            yield chunk
