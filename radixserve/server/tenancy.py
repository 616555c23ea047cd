"""Who a request comes from: the seam between the server's API-key check and the engine.

The engine knows tenants only by name (`Request.tenant`, which picks the cache namespaces a
request may share); what a key may see and do is decided here, in the server.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """The tenant behind a request's API key, and whether that key is an admin's.

    `tenant=None` is the single-tenant server's one tenant (no key, or the one `--api-key`):
    its namespaces are the plain (model, salt) ones. An admin sees the whole cache, and its
    `priority` orders requests across tenants; anyone else's only within its own tenant.
    """

    tenant: str | None
    admin: bool


SINGLE_TENANT = Caller(tenant=None, admin=True)
