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
about other tenants' completions. Memory is bounded by the number of token ids kept; the
least recently used completions are forgotten first.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence

DEFAULT_MAX_TOKENS = 1 << 20  # 4 MiB of int32 ids, plus their texts
MIN_TOKENS = 2  # shorter completions gain nothing from the splice


class GeneratedTurns:
    """A bounded LRU map (scope, completion text) -> the token ids the model generated.

    Thread-safe: the event loop records completions while worker threads render prompts.
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens: must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._turns: OrderedDict[tuple[Hashable, str], array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    @property
    def num_tokens(self) -> int:
        """Token ids held, over every remembered completion."""
        return self._tokens

    def remember(self, scope: Hashable, text: str, token_ids: Sequence[int]) -> None:
        """Keeps `token_ids` as how `text` was generated in `scope` (replacing an older entry)."""
        if len(token_ids) < MIN_TOKENS or len(token_ids) > self.max_tokens or not text:
            return
        ids = array("i", token_ids)
        key = (scope, text)
        with self._lock:
            old = self._turns.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._turns[key] = ids
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                _, dropped = self._turns.popitem(last=False)
                self._tokens -= len(dropped)

    def recall(self, scope: Hashable, text: str) -> list[int] | None:
        """The ids `text` was generated as in `scope`, or None; a hit counts as a use."""
        key = (scope, text)
        with self._lock:
            ids = self._turns.get(key)
            if ids is None:
                return None
            self._turns.move_to_end(key)
            return ids.tolist()
