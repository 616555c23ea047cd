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
about other tenants' completions. Memory is bounded by the number of token ids kept, shared
fairly between tenants: past the bound the least recently used completion of the tenant
holding the most goes first, so one tenant's flood of long answers does not push out another
tenant's turns (their next turns would be tokenized from text again, their cache hits ending
where the text splits differently). Without tenants' keys it is one LRU.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence

DEFAULT_MAX_TOKENS = 1 << 20  # 4 MiB of int32 ids, plus their texts
MIN_TOKENS = 2  # shorter completions gain nothing from the splice


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
        self._held: dict[Hashable, int] = {}  # token ids each tenant's entries hold
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tenant_of)

    @property
    def num_tokens(self) -> int:
        """Token ids held, over every remembered completion."""
        return self._tokens

    def held(self, tenant: Hashable) -> int:
        """Token ids `tenant`'s remembered completions hold."""
        return self._held.get(tenant, 0)

    def remember(self, scope: Hashable, text: str, token_ids: Sequence[int], tenant: Hashable = None) -> None:
        """Keeps `token_ids` as how `text` was generated in `scope`, one of `tenant`'s scopes
        (replacing an older entry)."""
        if len(token_ids) < MIN_TOKENS or len(token_ids) > self.max_tokens or not text:
            return
        ids = array("i", token_ids)
        key = (scope, text)
        with self._lock:
            self._drop(key)
            self._by_tenant.setdefault(tenant, OrderedDict())[key] = ids
            self._tenant_of[key] = tenant
            self._held[tenant] = self._held.get(tenant, 0) + len(ids)
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                largest = max(self._held, key=self._held.__getitem__)
                self._drop(next(iter(self._by_tenant[largest])))

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
        size = len(entries.pop(key))
        self._tokens -= size
        self._held[tenant] -= size
        if not entries:
            del self._by_tenant[tenant], self._held[tenant]


_NONE = object()  # no entry (None is a tenant: the single one)
