"""GET /dashboard: one page, served by the server itself, that draws the cache live.

The page (static/dashboard.html, .js, .css and its icon; no library, no CDN, no build step) polls
/v1/cache/stats and /v1/cache/tree with the browser's fetch and draws with SVG. The page itself
holds no data, so it needs no key; its API calls carry the key the operator gives it once (the
form, or the URL fragment `#key=...`, which the browser keeps in its history; see docs/server.md).
"""

from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.server.errors import APIError

_STATIC = files("radixserve.server") / "static"
_MEDIA_TYPES = {"dashboard.html": "text/html; charset=utf-8",
                "dashboard.js": "text/javascript; charset=utf-8",
                "dashboard.css": "text/css; charset=utf-8",
                "favicon.svg": "image/svg+xml"}
# Everything comes from this origin; no inline script, so injected markup could not run.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class Dashboard:
    """Serves the dashboard's files (page, script, style, icon), read once."""

    def __init__(self) -> None:
        self.files = {name: (_STATIC / name).read_bytes() for name in _MEDIA_TYPES}

    def routes(self) -> list[Route]:
        """The routes to append to the app's."""
        return [Route("/dashboard", self.page, methods=["GET"]),
                Route("/dashboard/{name}", self.asset, methods=["GET"])]

    async def page(self, request: Request) -> Response:
        """GET /dashboard."""
        return self._file("dashboard.html")

    async def asset(self, request: Request) -> Response:
        """GET /dashboard/dashboard.js, /dashboard/dashboard.css and /dashboard/favicon.svg."""
        name = request.path_params["name"]
        if name not in self.files or name == "dashboard.html":
            raise APIError(404, f"No dashboard file {name!r}", code="not_found")
        return self._file(name)

    def _file(self, name: str) -> Response:
        return Response(self.files[name], media_type=_MEDIA_TYPES[name], headers=_HEADERS)
