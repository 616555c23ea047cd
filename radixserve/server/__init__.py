"""The OpenAI-compatible HTTP server: `create_app(AsyncEngine(engine))` gives a Starlette app."""

from radixserve.server.app import create_app

__all__ = ["create_app"]
