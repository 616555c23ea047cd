"""A tree view with text on a real server (`--expose-cache-tokens`, the dashboard's query with
top_k=100) over long prompts: every piece the engine thread runs for it decodes a bounded
number of tokens. Counted per piece, in the engine's own SlicedWork, not timed.

Before, one piece decoded 64 whole edges, or every top prefix whole: with 4,000-token prompts
a view held each stream's next step up by 100-250 ms, and any key could ask for it."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import httpx
import numpy as np
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.engine.sliced_work import SlicedTask, SlicedWork
from radixserve.server import create_app

PROMPTS = 30
LENGTH = 2000
PIECE_BOUND = 4096  # tokens decoded per piece: the budget (2048) plus one node's text (256)


class CountedSlices(SlicedWork):
    """The engine's SlicedWork, noting what `decoded` grew by in each piece of each task."""

    def __init__(self, budget_s: float, decoded: list[int]) -> None:
        super().__init__(budget_s)
        self.decoded = decoded
        self.per_piece: list[int] = []

    def add(self, task: SlicedTask) -> None:
        task.work = self._counted(task.work)
        super().add(task)

    def _counted(self, work: Generator[None, None, Any]) -> Generator[None, None, Any]:
        while True:
            before = self.decoded[0]
            try:
                next(work)
            except StopIteration as stop:
                self.per_piece.append(self.decoded[0] - before)
                return stop.value
            self.per_piece.append(self.decoded[0] - before)
            yield


def test_every_piece_of_a_view_with_text_decodes_a_bounded_share() -> None:
    engine = Engine(model="demo", page_size=16, num_pages=PROMPTS * LENGTH // 16 + 64, eviction_policy="lru")
    rng = np.random.default_rng(0)
    namespace = (engine.model_name, None)
    for i in range(PROMPTS):  # cached before the engine thread runs, each hit once: all top prefixes
        tokens = np.concatenate([[i, 7], rng.integers(0, 200, LENGTH - 2)])
        pages = engine.pool.allocate(LENGTH // 16)
        engine.tree.insert(tokens, pages, namespace)
        engine.pool.decref(pages)
        engine.tree.match(tokens, namespace)
    decoded = [0]
    decode = engine.tokenizer.decode

    def counting_decode(ids: list[int], *args: Any, **kwargs: Any) -> str:
        decoded[0] += len(ids)
        return decode(ids, *args, **kwargs)

    engine.tokenizer.decode = counting_decode
    async_engine = AsyncEngine(engine)
    slices = async_engine._sliced = CountedSlices(async_engine._sliced.budget_s, decoded)
    with running_server(create_app(async_engine, expose_cache_tokens=True)) as url:
        response = httpx.get(f"{url}/v1/cache/tree?max_nodes=2000&max_depth=32&top_k=100&hashes=true&tokens=true",
                             timeout=120)
    assert response.status_code == 200, response.text
    assert max(slices.per_piece) <= PIECE_BOUND, sorted(slices.per_piece)[-5:]
    # All the text was decoded (each node's and each prefix's 256 tokens), a bounded share a piece.
    tree = response.json()
    assert len(tree["top_prefixes"]) == PROMPTS
    assert all(p["text_truncated"] for p in tree["top_prefixes"])
    assert decoded[0] == 2 * PROMPTS * 256
