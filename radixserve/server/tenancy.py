"""Who a request comes from: the seam between the server's API-key check and the engine.

The engine knows tenants only by name (`Request.tenant`, which picks the cache namespaces a
request may share); what a key may see and do is decided here, in the server.

Keys (`ApiKeys`): the one `--api-key` (the single-tenant server's, as before), `--admin-api-key`
and a keys file or environment variable naming a tenant per key. The keys file is either JSON,

    {"keys": [{"key": "sk-a", "tenant": "acme"}, {"key": "sk-ops", "tenant": "ops", "admin": true}]}

(or the bare list), or text with one key a line, `key tenant [admin]`, blank lines and lines
starting with `#` ignored. The environment variable holds the text form, entries separated by
newlines or `;`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

from radixserve.engine.request import tenant_of
from radixserve.server.errors import APIError

KEYS_ENV = "RADIXSERVE_API_KEYS"
_TENANT_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,64}")


@dataclass(frozen=True)
class Caller:
    """The tenant behind a request's API key, and whether that key is an admin's.

    `tenant=None` is the single-tenant server's one tenant (no key, or the one `--api-key`):
    its namespaces are the plain (model, salt) ones. An admin sees the whole cache, and its
    `priority` orders requests across tenants; anyone else's only within its own tenant.
    """

    tenant: str | None
    admin: bool

    def sees(self, namespace: Hashable) -> bool:
        """Whether this caller may see the cache namespace `namespace` (events, tree, stats):
        an admin sees every one, a tenant only its own."""
        return self.admin or (self.tenant is not None and tenant_of(namespace) == self.tenant)


SINGLE_TENANT = Caller(tenant=None, admin=True)


def admin_only(caller: Caller) -> Caller:
    """`caller`, or a 403 when it is not an admin (what only an admin may see or do)."""
    if not caller.admin:
        raise APIError(403, "Only an admin key may do this", code="admin_only", error_type="permission_error")
    return caller


class ApiKeys:
    """The server's keys and the caller each stands for; `caller(token)` checks a presented
    key against every one in constant time (no early exit, digests of equal length)."""

    def __init__(self, keys: dict[str, Caller]) -> None:
        self._digests = [(_digest(key), caller) for key, caller in keys.items()]

    @classmethod
    def of(cls, *, api_key: str | None = None, admin_api_key: str | None = None,
           tenant_keys: dict[str, Caller] | None = None) -> ApiKeys | None:
        """The keys the server's options name; None when there are none (no key needed)."""
        keys: dict[str, Caller] = {}
        for key, caller in (tenant_keys or {}).items():
            _add(keys, key, caller)
        if api_key is not None:
            _add(keys, api_key, SINGLE_TENANT)
        if admin_api_key is not None:
            _add(keys, admin_api_key, Caller(tenant=None, admin=True))
        return cls(keys) if keys else None

    def caller(self, token: str) -> Caller | None:
        """The caller `token` is the key of; None for an unknown key."""
        presented = _digest(token)
        found = None
        for digest, caller in self._digests:
            if hmac.compare_digest(presented, digest):
                found = caller
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _add(keys: dict[str, Caller], key: str, caller: Caller) -> None:
    if not key.strip():  # an empty key would make an empty bearer token (or none at all) a key
        raise ValueError("an API key must not be empty")
    if key in keys and keys[key] != caller:
        raise ValueError("the same API key is given twice, for different tenants")
    keys[key] = caller


def parse_keys(text: str, source: str) -> dict[str, Caller]:
    """The keys in `text` (the keys file's JSON or `key tenant [admin]` form; see the module
    docstring); ValueError naming `source` and the entry for anything malformed."""
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON: {exc}") from None
        entries = data.get("keys") if isinstance(data, dict) else data
        if not isinstance(entries, list):
            raise ValueError(f'{source}: expected {{"keys": [...]}} or a list of keys')
        rows = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) \
                    or not isinstance(entry.get("tenant"), str) or not isinstance(entry.get("admin", False), bool):
                raise ValueError(f'{source}: entry {i}: expected {{"key": str, "tenant": str, "admin": bool}}')
            rows.append((entry["key"], entry["tenant"], entry.get("admin", False), f"entry {i}"))
    else:
        rows = []
        for number, line in enumerate(re.split(r"[\n;]", text), 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) not in (2, 3) or (len(words) == 3 and words[2] != "admin"):
                raise ValueError(f"{source}: entry {number}: expected 'key tenant [admin]'")
            rows.append((words[0], words[1], len(words) == 3, f"entry {number}"))
    return _callers(rows, source)


def _callers(rows: Iterable[tuple[str, str, bool, str]], source: str) -> dict[str, Caller]:
    keys: dict[str, Caller] = {}
    for key, tenant, admin, where in rows:
        if not key:
            raise ValueError(f"{source}: {where}: an API key must not be empty")
        if not _TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{source}: {where}: a tenant name is 1-64 of A-Z a-z 0-9 . _ : @ -")
        try:
            _add(keys, key, Caller(tenant=tenant, admin=admin))
        except ValueError as exc:
            raise ValueError(f"{source}: {where}: {exc}") from None
    return keys


def load_keys(path: str | None, environ: dict[str, str]) -> dict[str, Caller]:
    """The tenant keys of the keys file at `path` and of the RADIXSERVE_API_KEYS variable."""
    keys: dict[str, Caller] = {}
    if path is not None:
        keys.update(parse_keys(Path(path).read_text(), path))
    if environ.get(KEYS_ENV):
        for key, caller in parse_keys(environ[KEYS_ENV], KEYS_ENV).items():
            _add(keys, key, caller)
    return keys
