"""The OpenAI-compatible HTTP server: `create_app(AsyncEngine(engine))` gives a Starlette app.

`create_app` is imported on first use: the app pulls in the engine (torch, the model code), and
the command line reads light parts of this package (the host check's names, the keys) before
it decides to serve, e.g. `serve --replicas` refusing a busy port before Ray or torch loads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.server.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from radixserve.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
