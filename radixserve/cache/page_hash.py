"""Page hashes: a 64-bit name for every cached page, computable from token ids alone.

A page's hash is a function of its namespace and of every token from the start of its
sequence to the end of the page, chained per page, so equal hashes mean equal prefixes (up to
64-bit collisions: this is an index key, not a cryptographic digest). The reuse history keys
its ghost list by it, and cache events name pages by it, so that an outside indexer or a
router can compute the hashes of a request's pages and look them up.

Spec, all arithmetic wrapping uint64, `mix` = splitmix64's finaliser, page size P, pages
k = 1, 2, ... counted from the start of the sequence, tokens t[k, 1..P] of page k:

    d_k = mix( sum_{j=1..P} mix(t[k, j] + 1) * mix(j) )         # the page's own digest
    S_k = S_{k-1} + d_k * mix(k * 0x9E3779B97F4A7C15),  S_0 = 0  # chained over the prefix
    h_k = mix(S_k + seed)

`seed` is 0 for the reuse history's unsalted use, and for cache events the namespace's seed:
the little-endian integer of blake2b(namespace_id, digest_size=8).

That is the *public* spec: anyone can hash candidate prompts and compare them with published
hashes, and since `mix` is invertible even an unknown seed cancels out of the difference of
two pages' hashes. A server that publishes hashes to clients it does not trust keys them with
a secret instead (`PageHashing`, given a secret): namespace ids and seeds become
blake2b(..., key=secret) and each published hash is h'_k = blake2b(le64(h_k), key=secret),
a keyed PRF of the public hash (itself a bijection of the chain state S_k + seed), so a hash can be tested only by someone holding the secret
(the server, and a cluster's router given the same one).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

_MIX_A = np.uint64(0xBF58476D1CE4E5B9)
_MIX_B = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MASK64 = 0xFFFFFFFFFFFFFFFF
# Namespaces a PageHashing remembers, the least recently named or looked up forgotten first:
# every client picks its own cache_salt, and each one ever named stayed (about 0.7 KB with a
# 256-character salt: 0.7 GB per million salts). At most about 45 MB.
MAX_NAMESPACES = 65_536


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX_A
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX_B
    return x ^ (x >> np.uint64(31))


def page_hashes(tokens: np.ndarray, page_size: int, seed: int = 0, state: int = 0,
                first_page: int = 0) -> tuple[np.ndarray, int]:
    """The hash of every full page of `tokens` and the chain state after the last one.

    To continue a chain, pass the `state` returned for the tokens before `tokens` and
    `first_page`, the number of pages those tokens held.
    """
    full = len(tokens) // page_size
    if full == 0:
        return np.empty(0, dtype=np.uint64), state
    pages = np.asarray(tokens[: full * page_size], dtype=np.uint64).reshape(full, page_size)
    columns = mix64(np.arange(1, page_size + 1, dtype=np.uint64))
    positions = mix64(np.arange(first_page + 1, first_page + full + 1, dtype=np.uint64) * _GOLDEN)
    with np.errstate(over="ignore"):
        digest = mix64((mix64(pages + np.uint64(1)) * columns).sum(axis=1, dtype=np.uint64))
        sums = np.cumsum(digest * positions, dtype=np.uint64) + np.uint64(state)
        return mix64(sums + np.uint64(seed)), int(sums[-1])


def state_hash(state: int, seed: int) -> int:
    """The hash of the page that leaves the chain at `state` (h = mix(S + seed))."""
    with np.errstate(over="ignore"):
        return int(mix64(np.array([state], dtype=np.uint64) + np.uint64(seed))[0])


def namespace_id(namespace: Hashable) -> str:
    """Opaque 16-hex-digit id of a cache namespace; it does not reveal a tenant's salt.

    The engine's namespaces are (model name, cache_salt): their id is
    blake2b(f"{model}\\x00{cache_salt or ''}", digest_size=8).hexdigest(). Other namespaces
    (tests, the simulator) use the same rule on their parts, None as "".
    """
    parts = namespace if isinstance(namespace, tuple) else (namespace,)
    text = "\x00".join("" if part is None else str(part) for part in parts)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def namespace_seed(ns_id: str) -> int:
    """The hash seed of the namespace whose id is `ns_id`."""
    return int.from_bytes(hashlib.blake2b(ns_id.encode(), digest_size=8).digest(), "little")


def secret_key(secret: str | bytes) -> bytes:
    """The 32-byte blake2b key made from an operator's secret (any length, any text)."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.blake2b(raw, digest_size=32, person=b"radixserve-key").digest()


class PageHashing:
    """The names cache pages and namespaces are published under: the public spec above
    (`secret=None`), or keyed with a server secret so that no published name can be tested
    offline. One per engine; the tree's event reporter, the cache views and a cluster's router
    all name pages through it (or through one with the same secret).

    It remembers which namespace each id it handed out names (`namespace_of_id`), so that the
    server can show a tenant only its own namespaces' events: the `max_namespaces` (default
    MAX_NAMESPACES) named or looked up most recently. Every event names its namespace as it is
    made, and a view or a reader's first snapshot names every namespace in the tree, so what a
    reader is shown was named shortly before; an id forgotten since reads as no one's (a
    tenant's stream leaves it out). Naming a namespace again gives the same id and seed.
    """

    def __init__(self, secret: str | bytes | None = None, max_namespaces: int | None = None) -> None:
        self.keyed = secret is not None
        key = secret_key(secret) if secret is not None else b""
        self._ids_key = key
        self._page_mac = hashlib.blake2b(key=key, digest_size=8, person=b"page") if self.keyed else None
        self.max_namespaces = MAX_NAMESPACES if max_namespaces is None else max_namespaces
        if self.max_namespaces < 1:
            raise ValueError(f"max_namespaces: must be >= 1, got {self.max_namespaces}")
        # Least recently used first. Named on the engine thread (events, views) and the event
        # loop (a cluster's router), looked up on the loop: the lock keeps the pair in step.
        self._named: OrderedDict[Hashable, tuple[str, int]] = OrderedDict()
        self._namespaces: dict[str, Hashable] = {}
        self._lock = threading.Lock()

    @classmethod
    def random(cls) -> PageHashing:
        """Keyed with a fresh random secret (a server that shares its hashes with no one)."""
        return cls(secrets.token_bytes(32))

    def namespace_id(self, namespace: Hashable) -> str:
        """The published id of `namespace` (16 hex digits)."""
        return self.named(namespace)[0]

    def named(self, namespace: Hashable) -> tuple[str, int]:
        """`namespace`'s published id and hash seed (cached)."""
        with self._lock:
            known = self._named.get(namespace)
            if known is not None:
                self._named.move_to_end(namespace)
                return known
        if self.keyed:
            parts = namespace if isinstance(namespace, tuple) else (namespace,)
            text = "\x00".join("" if part is None else str(part) for part in parts)
            ns_id = hashlib.blake2b(text.encode(), key=self._ids_key, digest_size=8, person=b"ns").hexdigest()
        else:
            ns_id = namespace_id(namespace)
        known = (ns_id, self.namespace_seed(ns_id))
        with self._lock:
            self._named[namespace] = known
            self._named.move_to_end(namespace)
            self._namespaces[ns_id] = namespace
            while len(self._named) > self.max_namespaces:
                old, (old_id, _) = self._named.popitem(last=False)
                if self._namespaces.get(old_id) == old:  # not a newer namespace with a colliding id
                    del self._namespaces[old_id]
        return known

    def namespace_of_id(self, ns_id: str) -> Hashable | None:
        """The namespace this object published as `ns_id` (None: none of the namespaces it
        remembers, see the class docstring)."""
        with self._lock:
            if ns_id not in self._namespaces:
                return None
            namespace = self._namespaces[ns_id]
            self._named.move_to_end(namespace)  # still asked about: kept
            return namespace

    def namespace_seed(self, ns_id: str) -> int:
        """The hash seed of the namespace whose id is `ns_id`."""
        if not self.keyed:
            return namespace_seed(ns_id)
        digest = hashlib.blake2b(ns_id.encode(), key=self._ids_key, digest_size=8, person=b"seed").digest()
        return int.from_bytes(digest, "little")

    def page_hashes(self, tokens: np.ndarray, page_size: int, seed: int = 0, state: int = 0,
                    first_page: int = 0) -> tuple[np.ndarray, int]:
        """As the module's `page_hashes`, each hash keyed when this object is."""
        hashes, end = page_hashes(tokens, page_size, seed, state, first_page)
        if not self.keyed or not len(hashes):
            return hashes, end
        # One keyed MAC per page: a Python loop, which for the few pages of an event costs
        # less than any vectorised keyed function would in numpy's per-call overhead.
        return np.fromiter((self._mac(int(h)) for h in hashes), dtype=np.uint64, count=len(hashes)), end

    def state_hash(self, state: int, seed: int) -> int:
        """As the module's `state_hash`, keyed when this object is."""
        public = state_hash(state, seed)
        return self._mac(public) if self.keyed else public

    def _mac(self, value: int) -> int:
        mac = self._page_mac.copy()
        mac.update(value.to_bytes(8, "little"))
        return int.from_bytes(mac.digest(), "little")
