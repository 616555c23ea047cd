"""The token ids of recent completions, so that a conversation's history is tokenized as the
model generated it.

A chat client sends each turn's history back as text. Re-encoding that text often splits it
differently from the tokens the model emitted (BPE merges "\\n\\n" into one token when it
encodes, a model may emit it as two, or the reverse), and the prefix cache can match only
identical token ids: the match would stop at the first such split, inside the previous answer.
`GeneratedTurns` keeps the ids of finished completions, keyed by the text they decode to and
by the cache scope of the request that made them; the chat renderer (prompts.py) splices those
ids in where an assistant message of a later request in the same scope carries exactly that
text.

The scope is the request's cache namespace (its tenant and its `cache_salt`; app.py): ids learnt in one namespace are
never used in another, so how a prompt is tokenized (and so its `prompt_tokens`) tells nothing
about other tenants' completions. Memory is bounded in 4-byte units (an id's size): each
completion is charged its ids and what keeping it costs besides (its text, its scope's strings,
the key and the maps' entries: about 560 bytes; counting ids alone let a flood of 2-id answers
under long salts take 349 MiB of a bound meant as 4 MiB), shared fairly between tenants: past the bound the least recently used completion of the tenant
holding the most goes first, so one tenant's flood of long answers does not push out another
tenant's turns (their next turns would be tokenized from text again, their cache hits ending
where the text splits differently). Without tenants' keys it is one LRU.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence

DEFAULT_MAX_TOKENS = 1 << 20  # 4 MiB, in 4-byte units
MIN_TOKENS = 2  # shorter completions gain nothing from the splice
# What an entry holds besides its ids, its text and its scope's strings (measured with
# tracemalloc: the key tuple, the three maps' entries, the array's header; 2-id answers).
ENTRY_OVERHEAD_BYTES = 560
UNIT_BYTES = 4  # an int32 id


def entry_units(scope: Hashable, text: str, token_ids: Sequence[int]) -> int:
    """What remembering `token_ids` for `text` in `scope` costs, in 4-byte units."""
    extra = ENTRY_OVERHEAD_BYTES + sys.getsizeof(text)
    for part in scope if isinstance(scope, tuple) else (scope,):
        if isinstance(part, str):  # a salt (each request's own string object) or a tenant's name
            extra += sys.getsizeof(part)
    return len(token_ids) + -(-extra // UNIT_BYTES)


class GeneratedTurns:
    """A bounded map (scope, completion text) -> the token ids the model generated, shared
    fairly between tenants (each tenant's entries least recently used first).

    Thread-safe: the event loop records completions while worker threads render prompts.
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens: must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._by_tenant: dict[Hashable, OrderedDict[tuple[Hashable, str], array]] = {}
        self._tenant_of: dict[tuple[Hashable, str], Hashable] = {}
        self._held: dict[Hashable, int] = {}  # units each tenant's entries are charged (entry_units)
        self._units: dict[tuple[Hashable, str], int] = {}  # each entry's charge
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tenant_of)

    @property
    def num_tokens(self) -> int:
        """Units charged (entry_units), over every remembered completion."""
        return self._tokens

    def held(self, tenant: Hashable) -> int:
        """Units `tenant`'s remembered completions are charged."""
        return self._held.get(tenant, 0)

    def remember(self, scope: Hashable, text: str, token_ids: Sequence[int], tenant: Hashable = None) -> None:
        """Keeps `token_ids` as how `text` was generated in `scope`, one of `tenant`'s scopes
        (replacing an older entry)."""
        if len(token_ids) < MIN_TOKENS or not text:
            return
        units = entry_units(scope, text, token_ids)
        if units > self.max_tokens:
            return
        ids = array("i", token_ids)
        key = (scope, text)
        with self._lock:
            self._drop(key)
            self._by_tenant.setdefault(tenant, OrderedDict())[key] = ids
            self._tenant_of[key] = tenant
            self._units[key] = units
            self._held[tenant] = self._held.get(tenant, 0) + units
            self._tokens += units
            while self._tokens > self.max_tokens:
                largest = max(self._held, key=self._held.__getitem__)
                self._drop(next(iter(self._by_tenant[largest])))

    def clear(self) -> None:
        """Forgets every completion (an admin's cache flush)."""
        with self._lock:
            self._by_tenant.clear()
            self._tenant_of.clear()
            self._held.clear()
            self._units.clear()
            self._tokens = 0

    def recall(self, scope: Hashable, text: str) -> list[int] | None:
        """The ids `text` was generated as in `scope`, or None; a hit counts as a use."""
        key = (scope, text)
        with self._lock:
            tenant = self._tenant_of.get(key, _NONE)
            if tenant is _NONE:
                return None
            entries = self._by_tenant[tenant]
            entries.move_to_end(key)
            return entries[key].tolist()

    def _drop(self, key: tuple[Hashable, str]) -> None:
        tenant = self._tenant_of.pop(key, _NONE)
        if tenant is _NONE:
            return
        entries = self._by_tenant[tenant]
        del entries[key]
        size = self._units.pop(key)
        self._tokens -= size
        self._held[tenant] -= size
        if not entries:
            del self._by_tenant[tenant], self._held[tenant]


_NONE = object()  # no entry (None is a tenant: the single one)
